"""Rooflines drawn: this machine's measured roofs beside an H100's and an A100's, with a
transformer's ops placed on them, and a calculator of one layer's arithmetic intensity.

    from labkit.widgets import roofline as rw
    rw.figure(measured, points)          # plotly: roofs, predicted (open) and measured (filled)
    rw.calculator()                      # dropdowns + slider -> intensity, ridge, bound

Every number comes from labkit.costs.roofline, so the widget and the text can never disagree.
"""
from __future__ import annotations

from labkit.costs import chips, roofline
from labkit.widgets.controls import build, rng, sel

GPUS = ("H100 80GB", "A100 80GB")     # costs.chips names, as every chapter prints them
LAYERS = ("MLP up (matmul)", "QKV projection (matmul)", "attention (unfused)",
          "attention (fused)", "layernorm", "GELU", "Adam step")
# the datasheet chips with a roof for every dtype the calculator offers (Blackwell lists no fp32)
ROOFED = [n for n, c in chips.CHIPS.items() if {"bf16", "fp16", "fp32"} <= set(c.peak)]
INTENSITIES = [10 ** (k / 8) for k in range(-24, 33)]        # 1e-3 .. 1e4 FLOPs/byte


def layer_op(layer: str, batch: int, seq: int, width: int, heads: int = 32,
             dtype: str = "bf16") -> roofline.Op:
    """The labkit.costs op the calculator shows, by its menu name."""
    ops = {"MLP up (matmul)": lambda: roofline.matmul(batch, seq, width, 4 * width, dtype),
           "QKV projection (matmul)": lambda: roofline.matmul(batch, seq, width, 3 * width, dtype),
           "attention (unfused)": lambda: roofline.attention(batch, seq, heads, width // heads,
                                                             dtype, fused=False),
           "attention (fused)": lambda: roofline.attention(batch, seq, heads, width // heads,
                                                           dtype, fused=True),
           "layernorm": lambda: roofline.layernorm(batch, seq, width, dtype),
           "GELU": lambda: roofline.elementwise(batch * seq * 4 * width, dtype,
                                                roofline.GELU_FLOPS, name="GELU"),
           "Adam step": lambda: roofline.adam_step(12 * width * width)}   # one layer's weights
    if layer not in ops:
        raise KeyError(f"unknown layer {layer!r}; choose one of {', '.join(ops)}")
    return ops[layer]()


def verdict(layer: str, batch: int, seq: int, width: int, gpu: str, dtype: str = "bf16") -> str:
    """One line: intensity, the GPU's ridge, the bound and the attainable rate."""
    c, op = chips.chip(gpu), layer_op(layer, batch, seq, width, dtype=dtype)
    peak = c.peak_flops(dtype)
    rate = roofline.attainable(op.intensity, peak, c.bandwidth)
    what = (f"{layer} on one layer's {12 * width * width:,} fp32 weights and states"
            if layer == "Adam step" else f"{layer}, batch {batch} x seq {seq}, width {width}, "
                                         f"{dtype}")
    return (f"{what}: "
            f"{op.intensity:,.1f} FLOPs/byte; {gpu} ridge {c.ridge(dtype):,.0f} FLOPs/byte -> "
            f"{roofline.bound(op.intensity, peak, c.bandwidth)}-bound, at most "
            f"{rate / 1e12:,.1f} TFLOP/s ({rate / peak:.1%} of the {dtype} peak)")


def _roof(fig, name: str, peak: float, bandwidth: float, dash: str) -> None:
    ys = [roofline.attainable(i, peak, bandwidth) for i in INTENSITIES]
    fig.add_scatter(x=INTENSITIES, y=ys, mode="lines", name=name, line_dash=dash)


def figure(measured=None, points=(), gpu_ops=(), dtype: str = "bf16", gpus=GPUS):
    """Log-log roofline. `measured`: a labkit.roofline.Roofline (its fp32 roofs drawn);
    `points`: (Op, seconds) timed on it (filled: measured, open: its roof's prediction);
    `gpu_ops`: Ops placed on each GPU's `dtype` roof (predicted only)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for g in gpus:
        c = chips.chip(g)
        _roof(fig, f"{g} {dtype} (datasheet)", c.peak_flops(dtype), c.bandwidth, "solid")
        fig.add_scatter(x=[o.intensity for o in gpu_ops], mode="markers+text",
                        y=[roofline.attainable(o.intensity, c.peak_flops(dtype), c.bandwidth)
                           for o in gpu_ops], text=[o.name for o in gpu_ops] if g == gpus[0]
                        else None, textposition="top left", name=f"ops on {g} (predicted)",
                        marker_symbol="diamond-open", marker_size=9)
    if measured is not None:
        peak = measured.peak["fp32"]
        _roof(fig, f"this machine fp32 (measured, ridge {peak / measured.bandwidth:.1f})",
              peak, measured.bandwidth, "dash")
        xs = [o.intensity for o, _ in points]
        fig.add_scatter(x=xs, y=[roofline.attainable(i, peak, measured.bandwidth) for i in xs],
                        mode="markers", name="here: predicted", marker_symbol="circle-open",
                        marker_size=10)
        fig.add_scatter(x=xs, y=[o.flops / t for o, t in points], mode="markers",
                        name="here: measured", text=[o.name for o, _ in points],
                        hovertemplate="%{text}<br>%{x:.2f} FLOPs/byte, %{y:.3g} FLOP/s")
    fig.update_layout(height=520, xaxis_type="log", yaxis_type="log",
                      xaxis_title="arithmetic intensity (FLOPs per byte moved)",
                      yaxis_title="FLOP/s", legend_orientation="h",
                      title="Rooflines: min(peak, intensity x bandwidth)")
    return fig


CONTROLS = [sel("layer", "layer", list(LAYERS), "MLP up (matmul)"),
            sel("gpu", "GPU", ROOFED, "H100 80GB"),
            sel("dtype", "dtype", ["bf16", "fp16", "fp32"], "bf16"),
            rng("batch", "batch", 1, 64, 1, 1),
            sel("seq", "sequence", [1, 128, 512, 2048, 4096, 8192], 512),
            sel("width", "width", [1024, 2048, 4096, 8192, 12288], 4096)]


def calculator():
    """A layer, a batch, a sequence length, a width and a GPU -> its intensity and bound."""
    import ipywidgets as w
    from IPython.display import display

    controls = build(CONTROLS)
    out = w.interactive_output(lambda **kw: print(verdict(**kw)), controls)
    box = w.VBox([w.HBox([controls["layer"], controls["gpu"], controls["dtype"]]),
                  w.HBox([controls["batch"], controls["seq"], controls["width"]]), out])
    display(box)
