"""Chapter 04 views: the split picture, measured vs predicted bytes, and where TP stops scaling.

    from labkit.widgets import tp as view
    view.split_picture()                    # column vs row split of W in Y = X W (schematic)
    view.bytes_figure(rows)                 # logged bytes of each all-reduce vs the formula
    view.wire_figure(wire_rows)             # bytes sent, counted by the kernel, vs labkit.costs
    view.scaling_figure(b, s, h, links)     # alpha-beta layer time vs TP per interconnect
    view.calculator()                       # sliders over labkit.costs.tensor_parallel
"""
from __future__ import annotations

from labkit.costs import comm
from labkit.costs import tensor_parallel as tpc
from labkit.widgets.controls import live, rng, sel
from labkit.widgets.layout import fits_a_phone

COLOURS = ["#4C78A8", "#F58518", "#54A24B", "#E45756"]


def split_picture(tp: int = 4):
    """Y = X W with W cut by columns (each rank: its Y slice) or by rows (each rank: a partial
    Y)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(1, 2, subplot_titles=(
        "column parallel: W = [W1 | W2 | ...]  ->  Y_i = X W_i (no sum)",
        "row parallel: W = [W1; W2; ...], X = [X1 | X2 | ...]  ->  Y = sum_i X_i W_i (all-reduce)"))
    for col, by_cols in ((1, True), (2, False)):
        for r in range(tp):
            x0, x1 = (r / tp, (r + 1) / tp) if by_cols else (0, 1)
            y0, y1 = (0, 1) if by_cols else (1 - (r + 1) / tp, 1 - r / tp)
            fig.add_trace(go.Scatter(x=[x0, x1, x1, x0, x0], y=[y0, y0, y1, y1, y0], fill="toself",
                                     mode="lines", line_color="white",
                                     fillcolor=COLOURS[r % 4], name=f"rank {r}",
                                     showlegend=col == 1), 1, col)
            fig.add_annotation(x=(x0 + x1) / 2, y=(y0 + y1) / 2, text=f"W{r + 1}",
                               showarrow=False, font_color="white", row=1, col=col)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False, scaleanchor="x")
    fig.update_layout(height=330, title=f"the weight W (in x out) split over {tp} ranks")
    return fig


def bytes_figure(rows, title: str = "bytes of every TP all-reduce: logged vs formula"):
    """rows from labkit.labs.tp.measure.count_layer_comm (several tp): bars the comm log's
    payload of each call (what the operator asked for), markers the formula."""
    import plotly.graph_objects as go

    labels = [f"TP={r['tp']} {r['phase'][:3]} #{i}" for i, r in enumerate(rows)]
    fig = go.Figure([
        go.Bar(x=labels, y=[r["measured_bytes"] for r in rows], name="logged (observe.commlog)",
               marker_color=COLOURS[0]),
        go.Scatter(x=labels, y=[r["predicted_bytes"] for r in rows], mode="markers",
                   marker=dict(symbol="x", size=12, color=COLOURS[3]),
                   name="formula b*s*h*4 bytes")])
    fig.update_layout(title=title, yaxis_title="bytes per all-reduce", height=380)
    fits_a_phone(fig, 40)
    return fig


def wire_figure(rows, title: str = "bytes each rank sent in one TP forward + backward"):
    """rows from labkit.labs.tp.measure.count_wire: bars the kernel's count (observe.netcount),
    markers labkit.costs' ring prediction n_layer * 4 * 2(tp-1)/tp * b*s*h*4."""
    import plotly.graph_objects as go

    rows = [r for r in rows if r["sent"] is not None]
    labels = [f"TP={r['tp']}" for r in rows]
    fig = go.Figure([
        go.Bar(x=labels, y=[r["sent"] for r in rows], name="counted by the kernel",
               marker_color=COLOURS[0]),
        go.Scatter(x=labels, y=[r["predicted"] for r in rows], mode="markers",
                   marker=dict(symbol="line-ew-open", size=40, line_width=3, color="black"),
                   name="labkit.costs (ring)")])
    fig.update_layout(title=title, yaxis_title="bytes sent per rank", height=360)
    fits_a_phone(fig, 40)
    return fig


def scaling_figure(b: int, s: int, h: int, links=("NVLink 4 (H100 SXM)", "InfiniBand NDR 400 Gb/s"),
                   flops_per_s: float = 400e12, tps=(1, 2, 4, 8, 16, 32),
                   bytes_per_element: int = 2):
    """Predicted fwd+bwd time of one layer vs TP: compute/tp + 4 ring all-reduces, per link."""
    import plotly.graph_objects as go

    fig = go.Figure()
    compute = [tpc.layer_compute_time(b, s, h, t, flops_per_s) * 1e3 for t in tps]
    fig.add_trace(go.Scatter(x=list(tps), y=compute, name="compute only (ideal)",
                             line=dict(dash="dot", color="grey")))
    for i, name in enumerate(links):
        link = comm.LINKS[name]
        total = [tpc.layer_time(b, s, h, t, link, flops_per_s, bytes_per_element)["total"] * 1e3
                 for t in tps]
        fig.add_trace(go.Scatter(x=list(tps), y=total, name=name, mode="lines+markers",
                                 line_color=COLOURS[i % 4]))
    fig.update_layout(title=f"one layer, fwd+bwd: b={b} s={s} h={h}, {flops_per_s / 1e12:g} "
                            "TFLOP/s sustained (alpha-beta model)",
                      xaxis=dict(title="TP degree", type="log", tickvals=list(tps)),
                      yaxis=dict(title="ms per layer", type="log"), height=420)
    fits_a_phone(fig, 60)
    return fig


def summary(b: int, s: int, h: int, tp: int, link: str) -> str:
    """The calculator's text: bytes per all-reduce, the layer's weights, the time split."""
    t = tpc.layer_time(b, s, h, tp, comm.LINKS[link], 400e12)
    return "\n".join([
        f"one all-reduce: {tpc.allreduce_bytes(b, s, h) / 1e6:.1f} MB (bf16 activations b*s*h), "
        f"4 per layer",
        f"weights of the layer (not sent): {tpc.weight_elements_per_layer(h) * 2 / 1e6:.1f} MB",
        f"per layer: compute {t['compute'] * 1e3:.3f} ms, TP comm {t['comm'] * 1e3:.3f} ms"
        f" ({100 * t['comm_fraction']:.0f}% of the layer)"])


CONTROLS = [rng("b", "b", 1, 32, 1, 1),
            rng("s", "s", 256, 32768, 256, 4096),
            rng("h", "h", 1024, 16384, 1024, 8192),
            sel("tp", "TP", [1, 2, 4, 8, 16], 8),
            sel("link", "link", list(comm.LINKS), "NVLink 4 (H100 SXM)")]


def calculator():
    """Sliders: b, s, h, TP, link -> bytes per all-reduce, per layer, and the time split."""
    from IPython.display import display  # only in a notebook: the website imports this module

    display(live(CONTROLS, lambda **v: print(summary(**v))))
