"""Draw a trace as a plotly timeline (one lane per rank and thread), beside labkit's own clock.

    from labkit.profiling import plot, read
    traces = read.load_folder("traces/ddp")
    plot.trace_figure(traces).show()
    plot.side_by_side(traces, [r["timeline"] for r in per_rank]).show()

Lanes of a trace: per rank, "compute" (the compute labels: forward, backward, optimizer, F/B/W),
"calls" (the other labels on the caller's thread: a bucket's all-reduce being queued, a ZeRO-3
gather), one lane per Gloo thread (gloo:* events: the collective running) and "p2p" (gloo:send,
gloo:recv on the caller's thread, posted to completed). Times in ms from the first event drawn.
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.profiling import read

COLORS = {"forward": "#4C78A8", "backward": "#F58518", "optimizer": "#54A24B", "F": "#4C78A8",
          "B": "#F58518", "W": "#B279A2", "comm": "#E45756", "call": "#9D755D", "wait": "#BAB0AC"}


def _color(name: str) -> str:
    if name in COLORS:
        return COLORS[name]
    if name[:1] in "FBW" and name[1:2].isdigit():
        return COLORS[name[0]]
    if name.startswith(("gloo:", "all_", "reduce_", "broadcast", "nccl")):
        return COLORS["comm"]
    return COLORS["call"]


def trace_spans(traces: list) -> list:
    """Spans {lane, name, start, end} in ms, all ranks on the trace's one clock (a machine's
    processes share it), from the first drawn event."""
    out = []
    for i, tr in enumerate(traces):
        rank = tr.rank if tr.rank is not None else i
        runloops = sorted({e["tid"] for e in tr.events if e["name"].startswith("gloo:")
                           and "runloop" in tr.threads.get(e["tid"], "")})
        for e in read.labels(tr):
            lane = "compute" if read.COMPUTE_LABEL.match(e["name"]) else "calls"
            out.append(dict(lane=f"rank {rank} {lane}", name=e["name"], ts=e["ts"], dur=e["dur"]))
        for e in read.comm_events(tr):
            lane = (f"gloo thread {runloops.index(e['tid'])}" if e["tid"] in runloops
                    else "p2p" if e["name"] in ("gloo:send", "gloo:recv") else "comm")
            out.append(dict(lane=f"rank {rank} {lane}", name=e["name"], ts=e["ts"], dur=e["dur"]))
    t0 = min((s["ts"] for s in out), default=0.0)
    return [dict(lane=s["lane"], name=s["name"], start=(s["ts"] - t0) / 1e3,
                 end=(s["ts"] + s["dur"] - t0) / 1e3) for s in out]


def own_spans(per_rank: list) -> list:
    """labkit's own timelines (one list of {name, lane, start, end} seconds per rank) as spans
    in ms from the earliest start."""
    starts = [s["start"] for tl in per_rank for s in tl]
    t0 = min(starts) if starts else 0.0
    return [dict(lane=f"rank {r} {s.get('lane', 'compute')}", name=s["name"],
                 start=(s["start"] - t0) * 1e3, end=((s["end"] or s["start"]) - t0) * 1e3)
            for r, tl in enumerate(per_rank) for s in tl]


def _add_bars(fig, spans, row=None):
    lanes = list(dict.fromkeys(s["lane"] for s in spans))
    by_color = {}
    for s in spans:
        by_color.setdefault(_color(s["name"]), []).append(s)
    for color, group in by_color.items():
        fig.add_trace(go.Bar(
            base=[s["start"] for s in group], x=[max(s["end"] - s["start"], 1e-3) for s in group],
            y=[s["lane"] for s in group], orientation="h", marker_color=color, opacity=0.75,
            text=[s["name"] for s in group], hovertemplate="%{text}<br>%{base:.2f} ms, "
            "%{x:.2f} ms long<extra></extra>", showlegend=False), row=row, col=1 if row else None)
    axis = dict(categoryorder="array", categoryarray=lanes[::-1], type="category")
    if row:
        fig.update_yaxes(**axis, row=row, col=1)
    else:
        fig.update_yaxes(**axis)
    return len(lanes)


def trace_figure(traces: list, title: str = "the profiler's trace, per rank and thread"):
    spans = trace_spans(traces)
    fig = go.Figure()
    n = _add_bars(fig, spans)
    fig.update_layout(barmode="overlay", title=title, xaxis_title="ms (the trace's timestamps)",
                      height=140 + 28 * n, margin=dict(l=10, r=10, t=40, b=40))
    return fig


def side_by_side(traces: list, per_rank_timelines: list, title: str = ""):
    """Top: the trace file; bottom: labkit's own timeline of the same step. Each from its own
    first event; both in ms."""
    top, bottom = trace_spans(traces), own_spans(per_rank_timelines)
    n_top = len({s["lane"] for s in top})
    n_bottom = len({s["lane"] for s in bottom})
    fig = make_subplots(rows=2, cols=1, shared_xaxes=False, vertical_spacing=0.12,
                        row_heights=[max(n_top, 1), max(n_bottom, 1)],
                        subplot_titles=("torch.profiler's trace (read from the file)",
                                        "labkit's own timeline (labkit.timing's clock)"))
    _add_bars(fig, top, row=1)
    _add_bars(fig, bottom, row=2)
    fig.update_layout(barmode="overlay", title=title, height=200 + 26 * (n_top + n_bottom),
                      margin=dict(l=10, r=10, t=60, b=40))
    fig.update_xaxes(title_text="ms", row=2, col=1)
    return fig
