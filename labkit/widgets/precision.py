"""Chapter 09's pictures: formats on a number line, gradient exponents, the loss scale over a
run, loss curves, and bytes per parameter by recipe (a calculator over labkit.costs.precision).

Log axes are labelled in one notation, powers of ten (plotly's default mixes SI prefixes such as
1f and 100p with exponents); legends sit in a row under the plot, where they wrap instead of
scrolling. plotly and labkit.precision.formats (torch) are imported inside the figure functions:
the website's calculator imports bytes_text in Pyodide, where neither exists.
"""
from __future__ import annotations

import math

from labkit.costs import precision as cp
from labkit.widgets.controls import build, check, logrng, on_change, sel, values

POWERS = {"exponentformat": "power", "showexponent": "all"}  # 10^-20 everywhere, never 1f or 1e-20
LEGEND_BELOW = {"orientation": "h", "yanchor": "top", "y": -0.22, "x": 0}


def spacing_figure(names=("fp32", "tf32", "bf16", "fp16", "e4m3", "e5m2")):
    """ulp(x) against x, log-log, each format over its own normal and subnormal range."""
    import plotly.graph_objects as go

    # here: the website's Pyodide has no torch; only the notebook path needs it
    from labkit.precision import formats

    fig = go.Figure()
    for n in names:
        f = formats.info(n)
        lo, hi = math.log2(f.smallest), math.log2(f.max)
        xs = [2.0 ** (lo + (hi - lo) * i / 400) for i in range(401)]
        lo_plot = [x for x in xs if x >= 2.0**-40 and x <= 1e6]
        fig.add_scatter(x=lo_plot, y=formats.spacing(lo_plot, n).tolist(), name=n, mode="lines")
    fig.update_layout(xaxis_type="log", yaxis_type="log", height=420, xaxis=POWERS, yaxis=POWERS,
                      title="Spacing of representable numbers (ulp) at x", legend=LEGEND_BELOW,
                      xaxis_title="x", yaxis_title="gap to the next number")
    return fig


def fp8_values_figure():
    """Every positive finite e4m3 and e5m2 value: dense near 0, sparse near max."""
    import plotly.graph_objects as go

    # here: the website's Pyodide has no torch; only the notebook path needs it
    from labkit.precision import formats

    fig = go.Figure()
    for i, n in enumerate(("e4m3", "e5m2")):
        v = formats.representable(n, 0, 1e6)
        fig.add_scatter(x=v.tolist(), y=[i] * len(v), mode="markers", name=n,
                        marker={"symbol": "line-ns-open", "size": 14})
    fig.update_layout(xaxis_type="log", height=220, xaxis=POWERS, showlegend=False,
                      yaxis={"tickvals": [0, 1],
                      "ticktext": ["e4m3", "e5m2"]}, title="All positive fp8 values")
    return fig


def exponent_histogram(grads, scale: float = 1.0):
    """Histogram of log2|g| (nonzero gradients), fp16's limits marked; `scale` shifts it.
    The two labels 10 apart point away from each other (left of -24, right of -14): side by
    side they overlapped."""
    import plotly.graph_objects as go
    import torch

    g = grads[grads != 0].abs() * scale
    e = torch.log2(g).floor()
    fig = go.Figure(go.Histogram(x=e.tolist(), nbinsx=60, name=f"x {scale:g}"))
    for x, label, where in ((-24, "fp16 smallest subnormal", "top left"),
                            (-14, "fp16 smallest normal", "top right"),
                            (math.log2(65504), "fp16 max", "top left")):
        fig.add_vline(x=x, line_dash="dash", annotation_text=label, annotation_position=where)
    fig.update_layout(height=330, xaxis_title="floor(log2 |gradient|)", yaxis_title="count",
                      title=f"Tiny GPT gradient exponents (loss scaled by {scale:g})")
    return fig


def scale_figure(run):
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_scatter(y=run["scale"], name="loss scale", mode="lines+markers")
    skipped = [i for i, s in enumerate(run["skipped"]) if s]
    fig.add_scatter(x=skipped, y=[run["scale"][i] for i in skipped], mode="markers",
                    name="skipped (inf/NaN)", marker={"color": "red", "size": 10, "symbol": "x"})
    fig.update_layout(yaxis_type="log", height=360, xaxis_title="step", yaxis_title="S",
                      yaxis=POWERS, legend=LEGEND_BELOW, title="Dynamic loss scale over a run")
    return fig


def curves_figure(curves: dict, title="Loss"):
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, ys in curves.items():
        fig.add_scatter(y=ys, name=name, mode="lines")
    fig.update_layout(height=360, xaxis_title="step", yaxis_title="loss", title=title,
                      legend=LEGEND_BELOW)
    return fig


def bytes_text(n_params: float = 7e9, weights: str = "bf16", grads: str = "bf16",
               master: bool = True, moments: str = "fp32") -> str:
    """The calculator's answer, from labkit.costs.precision. fp32 weights are their own master
    copy: asking for another one adds nothing (else fp32 + master = 18 B/param, against the
    fp32 recipe's 16 in the table)."""
    master = master and weights != "fp32"
    r = cp.recipe(weights, grads, master, moments)
    note = "  (fp32 weights are the master copy)" if weights == "fp32" else ""
    return (f"{r.weights:g} + {r.grads:g} + {r.optimizer:g} = {r.total:g} bytes/param; "
            f"{n_params / 1e9:.3g}B params: {cp.model_bytes(n_params, r) / 1e9:,.0f} GB{note}")


CONTROLS = [logrng("n_params", "params (B)", -1, 3, 0.05, 7),
            sel("weights", "weights", ["bf16", "fp16", "fp8", "fp32"], "bf16"),
            sel("grads", "grads", ["bf16", "fp16", "fp32"], "bf16"),
            check("master", "fp32 master copy", True),
            sel("moments", "Adam moments", ["fp32", "bf16"], "fp32")]   # n_params in billions


def bytes_widget(n_params: float = 7e9):
    """Toggles: weights, gradients, master copy, moments, and a model-size slider; the recipe's
    bytes/param and the whole model's training state in GB (bytes_text)."""
    import ipywidgets as w

    ctl = build(CONTROLS, style={"description_width": "110px"})  # "Adam moments" whole
    ctl["n_params"].value = n_params / 1e9
    out = w.Output()

    def show():
        ctl["master"].disabled = ctl["weights"].value == "fp32"
        out.clear_output()
        with out:
            v = values(ctl)
            print(bytes_text(**{**v, "n_params": v["n_params"] * 1e9}))
    on_change(ctl, show)
    show()
    return w.VBox([ctl["n_params"], w.HBox([ctl["weights"], ctl["grads"]]),
                   w.HBox([ctl["master"], ctl["moments"]]), out])
