"""Chapter 02 views: per-rank timelines of a DDP step, the bucket sweep, the scaling calculator.

    from labkit.widgets import ddp as view
    view.gantt(events)                 # measured spans from labkit.labs.ddp.timing.trace_step
    view.ideal_timeline()              # the idea: naive vs bucketed with overlap (a picture)
    view.calculator()                  # sliders over labkit.costs.scaling
"""
from __future__ import annotations

from labkit.costs import scaling
from labkit.widgets.controls import build, rng
from labkit.widgets.layout import fits_a_phone

COLOURS = {"forward": "#4C78A8", "backward": "#F58518", "wait": "#BAB0AC",
           "optimizer": "#54A24B", "comm": "#E45756", "pack": "#B279A2", "unpack": "#9D755D"}


def gantt(events, title: str = "one DDP step, per rank"):
    """Horizontal bars: one row per (version, rank, lane); x in milliseconds."""
    import plotly.graph_objects as go

    fig = go.Figure()
    seen = set()
    for e in events:
        row = f"{e.get('version', '')} r{e['rank']} {'comm' if e['lane'] == 'comm' else 'compute'}"
        key = "comm" if e["lane"] == "comm" else e["name"]
        fig.add_trace(go.Bar(
            y=[row], x=[max(e["end"] - e["start"], 1e-3)], base=[e["start"]], orientation="h",
            marker_color=COLOURS.get(key, "#72B7B2"), marker_line_width=0.5,
            name="all-reduce" if key == "comm" else key, legendgroup=key,
            showlegend=key not in seen,
            hovertext=f"{e['name']}: {e['start']:.2f}-{e['end']:.2f} ms"))
        seen.add(key)
    rows = list(dict.fromkeys(f"{e.get('version', '')} r{e['rank']} "
                              f"{'comm' if e['lane'] == 'comm' else 'compute'}" for e in events))
    fig.update_layout(barmode="overlay", title=title, xaxis_title="ms since the step began",
                      height=120 + 28 * len(rows), yaxis=dict(categoryorder="array",
                                                               categoryarray=rows[::-1],
                                                               automargin=True))
    fits_a_phone(fig, 60)
    return fig


def ideal_events(compute: float = 10.0, comm: float = 6.0, n_buckets: int = 3) -> list:
    """A schematic step (not measured): forward, backward producing n_buckets gradient buckets
    evenly, and each bucket's all-reduce either after backward (naive) or as it becomes ready."""
    fwd, bwd = compute / 3, 2 * compute / 3
    out = []
    for version in ("naive", "bucketed+overlap"):
        out += [{"version": version, "rank": 0, "lane": "compute", "name": "forward",
                 "start": 0.0, "end": fwd},
                {"version": version, "rank": 0, "lane": "compute", "name": "backward",
                 "start": fwd, "end": fwd + bwd}]
        free = fwd + bwd if version == "naive" else 0.0
        for b in range(n_buckets):
            ready = fwd + bwd * (b + 1) / n_buckets
            start = max(free, ready if version != "naive" else free)
            free = start + comm / n_buckets
            out.append({"version": version, "rank": 0, "lane": "comm", "name": f"bucket {b}",
                        "start": start, "end": free})
        out.append({"version": version, "rank": 0, "lane": "compute", "name": "optimizer",
                    "start": max(free, fwd + bwd), "end": max(free, fwd + bwd) + 0.5})
    return out


def ideal_timeline():
    return gantt(ideal_events(), title="The idea: start each bucket's all-reduce when its "
                                       "gradients are ready (schematic)")


def sweep_figure(rows, predicted=None):
    """Measured step time vs bucket size (log x), torch DDP and naive as lines, and the two
    no-overlap predictions (predicted: rows of bucket_mb, model_ms, textbook_ms)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    b = [r for r in rows if r["version"] == "bucketed"]
    fig.add_trace(go.Scatter(x=[r["bucket_mb"] for r in b], y=[r["step_ms"] for r in b],
                             mode="lines+markers", name="labkit BucketedDDP (measured)",
                             text=[f"{r['messages']:.0f} buckets" for r in b]))
    if predicted:
        fig.add_trace(go.Scatter(x=[p["bucket_mb"] for p in predicted],
                                 y=[p["model_ms"] for p in predicted], mode="lines+markers",
                                 line_dash="dash", name="model: measured pieces, no overlap"))
        fig.add_trace(go.Scatter(x=[p["bucket_mb"] for p in predicted],
                                 y=[p["textbook_ms"] for p in predicted], mode="lines",
                                 line_dash="dot", name="textbook: compute + b*alpha + D/bw"))
    for r in rows:
        if r["version"] in ("torch", "naive", "overlap"):
            fig.add_hline(y=r["step_ms"], line_dash="dot", annotation_text=r["version"])
    fig.update_layout(xaxis_type="log", xaxis_title="bucket size (MiB)",
                      yaxis_title="step time (ms)", title="Bucket-size sweep (measured, 2 ranks)",
                      height=420)
    fits_a_phone(fig, 60)
    return fig


def scaling_figure(compute: float = 100.0, comm: float = 10.0, overlap: float = 0.0,
                   ns=(1, 2, 4, 8, 16, 32, 64), accum: int = 1, slowdown: float = 0.0):
    """Efficiency vs N: no overlap; the chosen overlap as if free; and, when slowdown > 0, the
    same overlap paying for contention (labkit.costs.scaling)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    curves = [(0.0, 0.0, "no overlap"), (overlap, 0.0, f"{overlap:.0%} of comm hidden, free")]
    if slowdown > 0 and overlap > 0:
        curves.append((overlap, slowdown, f"{overlap:.0%} hidden, compute {slowdown:.0%} slower"))
    for f, s, name in curves:
        rows = scaling.table(compute, comm, ns, f, accum, s)
        fig.add_trace(go.Scatter(x=[r["n"] for r in rows], y=[r["efficiency"] for r in rows],
                                 mode="lines+markers", name=name))
    fig.update_layout(xaxis_type="log", xaxis_title="GPUs (N)", yaxis_title="scaling efficiency",
                      yaxis_range=[0, 1.05], height=380,
                      title=f"compute {compute:g} ms, comm {comm:g} ms per step")
    fits_a_phone(fig, 60)
    return fig


def summary(compute_ms, comm_ms, n, overlap, accum, slowdown) -> str:
    """The calculator's text: step time, efficiency and speedup, without and with the slowdown."""
    lines = []
    for s, label in ((0.0, "overlap free"),
                     (slowdown, f"overlapped compute {slowdown:.0%} slower")):
        args = (compute_ms, comm_ms, n, overlap, accum, s)
        lines.append(f"N={n}, {label}: step {scaling.step_time(*args):.1f} ms, efficiency "
                     f"{scaling.efficiency(*args):.1%}, speedup {scaling.speedup(*args):.2f}x")
    return "\n".join(lines)


CONTROLS = [rng("compute_ms", "compute ms", 5, 500, 5, 100),
            rng("comm_ms", "comm ms", 0, 200, 1, 10),
            rng("n", "GPUs N", 1, 256, 1, 8),
            rng("overlap", "overlap", 0, 1, 0.05, 0.0),
            rng("accum", "accumulation", 1, 16, 1, 1),
            rng("slowdown", "slowdown s", 0, 0.5, 0.01, scaling.OVERLAP_SLOWDOWN)]


def calculator():
    """Sliders: compute ms, comm ms, N, overlap fraction, accumulation, and the slowdown of
    overlapped compute (default: Lee et al.'s measured average) -> efficiency, speedup."""
    import ipywidgets as w
    from IPython.display import display

    def show(compute_ms, comm_ms, n, overlap, accum, slowdown):
        display(scaling_figure(compute_ms, comm_ms, overlap, accum=accum, slowdown=slowdown))
        print(summary(compute_ms, comm_ms, n, overlap, accum, slowdown))

    return w.interactive(show, **build(CONTROLS))
