"""Chapter 05's pictures and the bubble calculator: Gantt charts of pipeline schedules.

    from labkit.widgets import pipeline
    pipeline.gantt(schedule="1f1b", P=4, K=8)          # simulated Gantt chart (plotly)
    pipeline.timeline_figure(rows[0]["timeline"], 4)    # the same chart for a measured run
    pipeline.calculator()                               # schedule, P, K, v, t_f, t_b sliders

The chart comes from labkit.pipeline.simulate, the formula next to it from labkit.costs.pipeline,
so the calculator, the text's worked answers and the checker can never disagree.
"""
from __future__ import annotations

from labkit import costs
from labkit.pipeline import schedules
from labkit.pipeline.simulate import simulate, steady_state
from labkit.widgets.controls import build, rng, sel

COLORS = {"F": "#4C78A8", "B": "#F58518", "W": "#54A24B"}
NAMES = {"F": "forward", "B": "backward", "W": "weight gradient (W)"}
ALL_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v")


def timeline_figure(timeline, P: int, title: str = "", unit: str = "time"):
    """Gantt chart of a timeline (dicts: stage, kind, mb, chunk, start, end), simulated or measured.

    Stage 0 is at the top; each bar is one action labelled with its micro-batch (.chunk)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    split = any(e["kind"] == "W" for e in timeline)
    for kind in "FBW":
        ev = [e for e in timeline if e["kind"] == kind]
        if not ev:
            continue
        chunked = any(e["chunk"] for e in timeline)
        labels = [f"{e['mb']}" + (f".{e['chunk']}" if chunked else "") for e in ev]
        fig.add_bar(y=[f"stage {e['stage']}" for e in ev], x=[e["end"] - e["start"] for e in ev],
                    base=[e["start"] for e in ev], orientation="h",
                    name="input gradient (B)" if kind == "B" and split else NAMES[kind],
                    marker_color=COLORS[kind], marker_line_width=1, marker_line_color="white",
                    marker_opacity=[1.0 if e["chunk"] % 2 == 0 else 0.6 for e in ev],
                    text=labels, textposition="inside", insidetextanchor="middle",
                    hovertemplate="%{y} " + kind + "%{text}: %{base:.3g} + %{x:.3g}<extra></extra>")
    fig.update_layout(barmode="overlay", height=90 + 40 * P, title=title, xaxis_title=unit,
                      yaxis=dict(categoryorder="array",
                                 categoryarray=[f"stage {p}" for p in reversed(range(P))]),
                      legend_orientation="h", margin=dict(l=10, r=10, t=50, b=10))
    return fig


def gantt(schedule: str = "1f1b", P: int = 4, K: int = 8, v: int = 1, t_f: float = 1.0,
          t_b: float = 2.0, t_p2p: float = 0.0, t_w: float = None):
    """Simulated Gantt chart with the bubble (simulated and formula) in the title. Zero-bubble
    schedules split t_b into B = t_b - t_w and W = t_w (default t_b / 2)."""
    s = schedule if isinstance(schedule, schedules.Schedule) else schedules.make(schedule, P, K, v)
    name = s.name
    r = simulate(s, t_f, t_b, t_p2p, t_w=t_w)
    t_w = t_b / 2 if t_w is None else t_w
    f = (costs.pipeline.schedule_bubble(name, P, K, s.v, t_f, t_b, t_w)
         if name in ALL_SCHEDULES else None)
    title = (f"{name}, P={P}, K={K}" + (f", v={v}" if s.v > 1 else "")
             + f": bubble {r.bubble:.1%} simulated"
             + (f", {f:.1%} formula" if f is not None else ", no closed form"))
    return timeline_figure(r.timeline, P, title, unit="time (units of t_f)")


def bubble_figure(Ps=(2, 4, 8), K_max: int = 32, measured=None, v: int = 1):
    """Formula bubble vs K for several P (lines); measured rows (dicts P, K, bubble) as markers."""
    import plotly.graph_objects as go

    fig = go.Figure()
    Ks = list(range(1, K_max + 1))
    for P in Ps:
        fig.add_scatter(x=Ks, y=[costs.pipeline.bubble_fraction(P, K, v) for K in Ks],
                        mode="lines", name=f"formula P={P}")
    for row_P in sorted({r["P"] for r in measured or []}):
        for name in sorted({r["schedule"] for r in measured if r["P"] == row_P}):
            rs = [r for r in measured if r["P"] == row_P and r["schedule"] == name]
            fig.add_scatter(x=[r["K"] for r in rs], y=[r["bubble"] for r in rs],
                            mode="markers", name=f"measured {name} P={row_P}",
                            marker_symbol="circle" if name == "1f1b" else "x", marker_size=9)
    fig.update_layout(height=380, xaxis_title="micro-batches K", yaxis_title="bubble (idle share)",
                      yaxis_tickformat=".0%", title="Bubble (P-1)/(K+P-1): formula and measured",
                      legend_orientation="h")
    return fig


def peak_figure(P: int = 4, K: int = 8, v: int = 2, measured=None):
    """Micro-batches held per stage: GPipe (K), 1F1B (P - p), interleaved; bars per stage."""
    import plotly.graph_objects as go

    fig = go.Figure()
    stages = [f"stage {p}" for p in range(P)]
    for name, vv in (("gpipe", 1), ("1f1b", 1), ("interleaved", v)):
        if name == "interleaved" and K % P:
            continue
        fig.add_bar(x=stages,
                    y=[costs.pipeline.peak_in_flight(name, P, K, p, vv) for p in range(P)],
                    name=f"{name} (formula)")
    for name, peaks in (measured or {}).items():
        fig.add_scatter(x=stages, y=peaks, mode="markers", marker_size=12, marker_symbol="diamond",
                        name=f"{name} (measured)")
    fig.update_layout(height=340, barmode="group", yaxis_title="micro-batches held",
                      title=f"Peak activations per stage, P={P}, K={K}", legend_orientation="h")
    return fig


def summary(schedule, P, K, v, t_f, t_b) -> str:
    """The calculator's text: bubble simulated and by formula, step time, peak micro-batches.
    Raises ValueError for a schedule that cannot be built (e.g. interleaved, K not a multiple)."""
    vv = v if schedule == "interleaved" else 2 if schedule == "zb-v" else 1  # ZB-V: a V of 2
    s = schedules.make(schedule, P, K, vv)
    r = simulate(s, t_f, t_b)
    f = costs.pipeline.schedule_bubble(schedule, P, K, vv, t_f, t_b, t_b / 2)
    lines = [f"bubble: {r.bubble:.1%} simulated, "
             + (f"{f:.1%} formula" if f is not None else "no closed form")
             + f"   step: {r.makespan:.3g} (vs {K * (t_f + t_b):.3g} of work)   "
             f"peak micro-batches held per stage: " + ", ".join(f"{x:g}" for x in r.peak_in_flight)
             + ("   (W = t_b / 2)" if s.split else "")]
    if s.split:  # zero-bubble schedules: what the flush between steps costs
        ss = steady_state(s, t_f, t_b)
        f = costs.pipeline.schedule_bubble(schedule, P, K, vv, t_f, t_b, t_b / 2, flush=False)
        lines.append(f"steps back to back (optimizer post-validation, no flush): "
                     f"{ss['bubble']:.1%} "
                     f"simulated" + (f", {f:.1%} formula" if f is not None else ""))
    return "\n".join(lines)


CONTROLS = [sel("schedule", "schedule", list(ALL_SCHEDULES), "1f1b"),
            rng("P", "stages P", 1, 8, 1, 4),
            rng("K", "micro-batches K", 1, 32, 1, 8),
            rng("v", "chunks v", 1, 4, 1, 2),
            rng("t_f", "t_f", 0.25, 4.0, 0.25, 1.0),
            rng("t_b", "t_b", 0.25, 8.0, 0.25, 2.0)]


def calculator():
    """The bubble calculator: schedule, P, K, v, t_f, t_b -> Gantt chart, bubble, peak
    activations."""
    import ipywidgets as w
    from IPython.display import display

    def show(schedule, P, K, v, t_f, t_b):
        vv = v if schedule == "interleaved" else 2 if schedule == "zb-v" else 1  # ZB-V: a V of 2
        try:
            s = schedules.make(schedule, P, K, vv)
        except ValueError as e:  # e.g. interleaved with K that no round size divides
            print(e)
            return
        display(gantt(s, P, K, vv, t_f, t_b))
        print(summary(schedule, P, K, v, t_f, t_b))

    return w.interactive(show, **build(CONTROLS))
