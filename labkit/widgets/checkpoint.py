"""Chapter 06's checkpoint calculator: size, save time, and how often to save.

    from labkit.widgets import checkpoint as cw
    cw.calculator()                                  # ipywidgets: model, recipe, storage, MTBF
    cw.waste_figure(save_s=60, mtbf_s=20 * 3600)     # wasted fraction vs interval, Young/Daly
    cw.activation_figure(measured)                   # labkit.checkpoint.activation.measure()

Every number comes from labkit.costs.checkpoint, like the worked answers in the chapter.
"""
from __future__ import annotations

from labkit.costs import checkpoint as ck
from labkit.costs.plan_inputs import LLAMA3_GPU_MTBF_H
from labkit.widgets.controls import build, logrng, rng, sel, values

# The default node: 8 GPUs failing at Llama 3's measured rate (the planner's figure, chapter 10).
NODE_MTBF_H = LLAMA3_GPU_MTBF_H / 8


def plan(n_params_b: float, recipe: str, writers: int, per_writer_GBps: float,
         storage_GBps: float, node_mtbf_h: float, nodes: int, restart_min: float,
         interval_min: float) -> dict:
    """The calculator's numbers (seconds, bytes) for one setting."""
    size = ck.checkpoint_bytes(n_params_b * 1e9, recipe)
    save = ck.save_time(size, writers, per_writer_GBps, storage_GBps)
    mtbf = ck.cluster_mtbf_hours(node_mtbf_h, nodes) * 3600
    restart = restart_min * 60
    interval = interval_min * 60
    return {"bytes": size, "save_s": save, "mtbf_s": mtbf, "restart_s": restart,
            "young_s": ck.young_interval(save, mtbf), "daly_s": ck.daly_interval(save, mtbf),
            "interval_s": interval, "waste": ck.waste_fraction(interval, save, mtbf, restart),
            "lost_per_failure_s": ck.expected_lost_work_s(interval)}


def plan_table(p: dict) -> str:
    return "\n".join([
        f"checkpoint size          {p['bytes'] / 1e9:10.1f} GB (1 GB = 1e9 bytes)",
        f"save time                {p['save_s']:10.1f} s",
        f"cluster MTBF             {p['mtbf_s'] / 3600:10.2f} h",
        f"Young interval           {p['young_s'] / 60:10.1f} min   sqrt(2 delta M)",
        f"Daly interval            {p['daly_s'] / 60:10.1f} min",
        f"your interval            {p['interval_s'] / 60:10.1f} min",
        f"work lost per failure    {p['lost_per_failure_s'] / 60:10.1f} min (half an interval)",
        f"time wasted              {100 * p['waste']:10.2f} %  (saving + redoing + restarting)"])


def waste_figure(save_s: float, mtbf_s: float, restart_s: float = 0.0, mark_s: float | None = None):
    """Wasted fraction of time vs checkpoint interval (log axis), with both optima marked."""
    import numpy as np
    import plotly.graph_objects as go

    young = ck.young_interval(save_s, mtbf_s)
    xs = np.geomspace(max(save_s, 1.0) / 4, min(mtbf_s, young * 30), 200)
    ys = [100 * ck.waste_fraction(x, save_s, mtbf_s, restart_s) for x in xs]
    fig = go.Figure()
    fig.add_scatter(x=xs / 60, y=ys, name="saving + lost work", mode="lines")
    fig.add_scatter(x=xs / 60, y=[100 * save_s / x for x in xs], name="saving only",
                    line_dash="dot")
    fig.add_scatter(x=xs / 60, y=[100 * (x / 2 + restart_s) / mtbf_s for x in xs],
                    name="lost work + restart", line_dash="dot")
    # On a log axis plotly places annotations at log10(x) but shapes at x: label by hand, or the
    # labels land at 10**x and the autorange runs off to 1e56.
    marks = [(young, "Young", "dash", None),
             (ck.daly_interval(save_s, mtbf_s), "Daly", "dot", None)]
    if mark_s:
        marks.append((mark_s, "yours", "solid", "red"))
    for i, (x, label, dash, color) in enumerate(marks):
        fig.add_vline(x=x / 60, line_dash=dash, line_color=color)
        fig.add_annotation(x=float(np.log10(x / 60)), y=1 - 0.07 * i, yref="paper", text=label,
                           showarrow=False, xanchor="left", font_color=color)
    fig.update_layout(xaxis_type="log", xaxis_title="checkpoint interval (minutes)",
                      xaxis_range=[float(np.log10(xs[0] / 60)), float(np.log10(xs[-1] / 60))],
                      yaxis_title="time wasted (%)", height=380,
                      yaxis_range=[0, min(100, 4 * max(min(ys), 0.5))],
                      title=f"save {save_s:.0f} s, cluster MTBF {mtbf_s / 3600:.1f} h")
    return fig


def activation_figure(m: dict, timed: dict | None = None):
    """Saved activation bytes per block (measured vs predicted: the block input only), and the
    recompute factor: FLOPs and operator calls counted by torch, fwd+bwd time measured (of `m`
    and, if given, of a larger model `timed`), against (f+b+f)/(f+b) = 4/3."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "activation bytes kept per block (KB)", "recompute / plain"))
    modes = ["plain", "recompute"]
    fig.add_bar(x=modes, y=[m[k]["per_block_bytes"] / 1e3 for k in modes], name="measured",
                marker_color="#4C78A8", row=1, col=1)
    fig.add_scatter(x=["recompute"], y=[m["predicted_block_bytes_recompute"] / 1e3],
                    mode="markers", marker_symbol="line-ew-open", marker_size=40,
                    marker_line_width=3, name="predicted: B*T*h*4 bytes", row=1, col=1)
    bars = [("FLOPs (counted)", m["flops_factor"]), ("op calls (counted)", m["ops_factor"]),
            ("time, small model", m["time_factor"])]
    if timed is not None:
        bars.append(("time, larger model", timed["time_factor"]))
    fig.add_bar(x=[b[0] for b in bars], y=[b[1] for b in bars], name="recompute / plain",
                marker_color="#F58518", row=1, col=2)
    fig.add_hline(y=m["predicted_factor"], line_dash="dash", row=1, col=2,
                  annotation_text="(f+b+f)/(f+b) = 4/3")
    fig.update_layout(height=380, legend_orientation="h", legend_y=-0.25)
    return fig


CONTROLS = [logrng("n_params_b", "params (B)", -1, 3, 0.1, 70),
            sel("recipe", "recipe", list(ck.RECIPES), "mixed"),
            rng("writers", "writers", 1, 1024, 1, 64),
            rng("per_writer_GBps", "GB/s each", 0.1, 25, 0.1, 2.0),
            rng("storage_GBps", "storage GB/s", 1, 2000, 1, 100),
            logrng("node_mtbf_h", "node MTBF h", 2, 6, 0.1, round(NODE_MTBF_H)),
            rng("nodes", "nodes", 1, 4096, 1, 256),
            rng("restart_min", "restart min", 0, 60, 0.1, 10),
            rng("interval_min", "interval min", 1, 600, 0.1, 30)]


def calculator():
    """Sliders over plan(): size, save time, Young/Daly intervals, waste, with the waste curve."""
    import ipywidgets as w
    from IPython.display import display

    out = w.Output()
    controls = build(CONTROLS)

    def update(**kw):
        p = plan(**kw)
        out.clear_output(wait=True)
        with out:
            print(plan_table(p))
            waste_figure(p["save_s"], p["mtbf_s"], p["restart_s"], p["interval_s"]).show()

    ui = w.interactive(update, **controls)
    display(w.VBox([w.HBox([w.VBox(list(ui.children[:5])), w.VBox(list(ui.children[5:-1]))]),
                    out]))
    update(**values(controls))


def timeline_figure(interval: float = 4, save: float = 0.6, fail_at: float = 10.3,
                    restart: float = 1.5, end: float = 18):
    """The idea in one picture: work, checkpoints, a failure, the work lost since the last
    checkpoint, the restart, and the resumed run redoing that work (units: arbitrary time)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    t, spans = 0.0, []
    while t + interval <= fail_at:  # work + save cycles until the failure
        spans.append(("work", t, t + interval - save))
        spans.append(("save", t + interval - save, t + interval))
        t += interval
    last_ckpt = t
    spans.append(("lost", last_ckpt, fail_at))
    spans.append(("restart", fail_at, fail_at + restart))
    spans.append(("redo", fail_at + restart, fail_at + restart + (fail_at - last_ckpt)))
    spans.append(("work", fail_at + restart + (fail_at - last_ckpt), end))
    colors = {"work": "#4C78A8", "save": "#54A24B", "lost": "#E45756", "restart": "#BAB0AC",
              "redo": "#F58518"}
    shown = set()
    for kind, a, b in spans:
        fig.add_bar(x=[b - a], base=[a], y=["run"], orientation="h", marker_color=colors[kind],
                    name=kind, showlegend=kind not in shown, width=0.5)
        shown.add(kind)
    fig.add_scatter(x=[fail_at], y=["run"], mode="markers+text", text=["failure"],
                    textposition="top center", marker=dict(symbol="x", size=16, color="black"),
                    showlegend=False)
    fig.update_layout(barmode="overlay", height=220, xaxis_title="time",
                      title="work since the last checkpoint is lost; on average half an interval",
                      legend_orientation="h", legend_y=-0.6)
    return fig
