"""Chapter 09's pictures: formats on a number line, gradient exponents, the loss scale over a
run, loss curves, and bytes per parameter by recipe (a calculator over labkit.costs.precision)."""
from __future__ import annotations

import math

import plotly.graph_objects as go

from labkit.costs import precision as cp
from labkit.precision import formats


def spacing_figure(names=("fp32", "tf32", "bf16", "fp16", "e4m3", "e5m2")):
    """ulp(x) against x, log-log, each format over its own normal and subnormal range."""
    fig = go.Figure()
    for n in names:
        f = formats.info(n)
        lo, hi = math.log2(f.smallest), math.log2(f.max)
        xs = [2.0 ** (lo + (hi - lo) * i / 400) for i in range(401)]
        lo_plot = [x for x in xs if x >= 2.0**-40 and x <= 1e6]
        fig.add_scatter(x=lo_plot, y=formats.spacing(lo_plot, n).tolist(), name=n, mode="lines")
    fig.update_layout(xaxis_type="log", yaxis_type="log", height=380,
                      title="Spacing of representable numbers (ulp) at x",
                      xaxis_title="x", yaxis_title="gap to the next number")
    return fig


def fp8_values_figure():
    """Every positive finite e4m3 and e5m2 value: dense near 0, sparse near max."""
    fig = go.Figure()
    for i, n in enumerate(("e4m3", "e5m2")):
        v = formats.representable(n, 0, 1e6)
        fig.add_scatter(x=v.tolist(), y=[i] * len(v), mode="markers", name=n,
                        marker={"symbol": "line-ns-open", "size": 14})
    fig.update_layout(xaxis_type="log", height=220, yaxis={"tickvals": [0, 1],
                      "ticktext": ["e4m3", "e5m2"]}, title="All positive fp8 values")
    return fig


def exponent_histogram(grads, scale: float = 1.0):
    """Histogram of log2|g| (nonzero gradients), fp16's limits marked; `scale` shifts it."""
    import torch

    g = grads[grads != 0].abs() * scale
    e = torch.log2(g).floor()
    fig = go.Figure(go.Histogram(x=e.tolist(), nbinsx=60, name=f"x {scale:g}"))
    for x, label in ((-24, "fp16 smallest subnormal"), (-14, "fp16 smallest normal"),
                     (math.log2(65504), "fp16 max")):
        fig.add_vline(x=x, line_dash="dash", annotation_text=label)
    fig.update_layout(height=330, xaxis_title="floor(log2 |gradient|)", yaxis_title="count",
                      title=f"Tiny GPT gradient exponents (loss scaled by {scale:g})")
    return fig


def scale_figure(run):
    fig = go.Figure()
    fig.add_scatter(y=run["scale"], name="loss scale", mode="lines+markers")
    skipped = [i for i, s in enumerate(run["skipped"]) if s]
    fig.add_scatter(x=skipped, y=[run["scale"][i] for i in skipped], mode="markers",
                    name="skipped (inf/NaN)", marker={"color": "red", "size": 10, "symbol": "x"})
    fig.update_layout(yaxis_type="log", height=330, xaxis_title="step", yaxis_title="S",
                      title="Dynamic loss scale over a run")
    return fig


def curves_figure(curves: dict, title="Loss"):
    fig = go.Figure()
    for name, ys in curves.items():
        fig.add_scatter(y=ys, name=name, mode="lines")
    fig.update_layout(height=330, xaxis_title="step", yaxis_title="loss", title=title)
    return fig


def bytes_widget(n_params: float = 7e9):
    """Toggles: weights, gradients, master copy, moments, and a model-size slider; the recipe's
    bytes/param and the whole model's training state in GB."""
    import ipywidgets as w

    size = w.FloatLogSlider(value=n_params / 1e9, base=10, min=-1, max=3, step=0.05,
                            description="params (B)")
    wt = w.Dropdown(options=["bf16", "fp16", "fp8", "fp32"], value="bf16", description="weights")
    gr = w.Dropdown(options=["bf16", "fp16", "fp32"], value="bf16", description="grads")
    ms = w.Checkbox(value=True, description="fp32 master copy")
    mo = w.Dropdown(options=["fp32", "bf16"], value="fp32", description="Adam moments")
    out = w.Output()

    def show(*_):
        r = cp.recipe(wt.value, gr.value, ms.value, mo.value)
        n = size.value * 1e9
        out.clear_output()
        with out:
            print(f"{r.weights:g} + {r.grads:g} + {r.optimizer:g} = {r.total:g} bytes/param; "
                  f"{n / 1e9:.3g}B params: {cp.model_bytes(n, r) / 1e9:,.0f} GB")
    for c in (size, wt, gr, ms, mo):
        c.observe(show, "value")
    show()
    return w.VBox([size, w.HBox([wt, gr]), w.HBox([ms, mo]), out])
