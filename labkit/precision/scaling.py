"""FP8 scaling recipes side by side: delayed, current, rowwise and block scales, same tensors.

Every recipe casts q = fp8(x * s) and multiplies q / s back; they differ in which values share one
scale s = max / amax and when amax is taken:

* delayed, per tensor: amax from the history of past steps (Transformer Engine's `DelayedScaling`,
  `amax_history_len = 1024` by default in `transformer_engine/common/recipe/__init__.py`): known
  before the tensor exists, so a new outlier saturates at 448;
* current, per tensor: amax of this tensor, now (TE's `Float8CurrentScaling`; torchao's default
  `tensorwise` recipe, "dynamic per-tensor scaling"): one outlier lowers every value's scale;
* rowwise (axiswise): one scale per row along the GEMM's inner dimension, i.e. per token for
  activations and per output channel for weights. torchao's `rowwise` recipe
  (`Float8LinearConfig.from_recipe_name("rowwise")` in `torchao/float8/config.py`): e4m3 for
  activations, weights and gradients, scales rounded down to a power of two
  (`round_scales_to_power_of_2=True`: exp2(floor(log2 s)), so x * s is exact);
* blocks: one scale per 1x128 tile of activations and gradients, per 128x128 block of weights
  (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 3.3.2: fp32 scales from the
  current amax; TE's `Float8BlockScaling`: the same blocks, e4m3 by default, power-of-two scales
  by default, split accumulation required for all three GEMMs).

A 1-D scale (rowwise, 1x128) runs along one dimension, and backward needs the transposed tensor
scaled along the other: TE quantizes both "from the high precision input to avoid double
quantization errors" (its `Float8BlockScaling` docstring). `transposed_errors` measures what the
shortcut of requantizing the fp8 copy would cost.
"""
from __future__ import annotations

import torch

from labkit.precision.formats import DTYPES
from labkit.precision.fp8 import (
    E4M3,
    dequantize,
    dequantize_blocks,
    quantize,
    quantize_blocks,
    tensor_scale,
)

RECIPES = ("delayed", "current", "rowwise", "block")
EPS = 1e-12        # torchao's floor under amax (torchao/float8/float8_utils.py, EPS)


def pow2(s: torch.Tensor) -> torch.Tensor:
    """A scale rounded down to a power of two, as torchao's `_round_scale_down_to_power_of_2`."""
    return torch.exp2(torch.floor(torch.log2(s.float())))


def axis_scale(x: torch.Tensor, fmt: str = E4M3, power_of_2: bool = True) -> torch.Tensor:
    """One scale per row of x (R, C) -> (R, 1): torchao's amax_to_scale on the row amaxes, the
    quotient in float64 rounded once to fp32, amax floored at EPS."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).double()         # (R, 1)
    s = (torch.finfo(DTYPES[fmt]).max / amax.clamp(min=EPS)).float()    # (R, 1)
    return pow2(s) if power_of_2 else s


def fake_rows(x: torch.Tensor, fmt: str = E4M3, power_of_2: bool = True) -> torch.Tensor:
    """x (R, C) through fp8 with one scale per row, back to fp32."""
    s = axis_scale(x, fmt, power_of_2)                                  # (R, 1)
    return dequantize(quantize(x, fmt, s), s)


def fake_blocks(x: torch.Tensor, fmt: str = E4M3, block=(1, 128), power_of_2: bool = False):
    """x (R, C) through fp8 with one scale per block; power_of_2 as TE's Float8BlockScaling,
    fp32 scales (False) as DeepSeek-V3."""
    q, s = quantize_blocks(x, fmt, block)
    if power_of_2:                           # requantize from x with the rounded-down scales
        s = pow2(s)
        full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        q = quantize(x, fmt, full[:x.shape[0], :x.shape[1]])
    return dequantize_blocks(q, s, block)


def fake(x: torch.Tensor, recipe: str, role: str, fmt: str = E4M3, history_amax=None,
         power_of_2: bool = False) -> torch.Tensor:
    """x (R, C) through fp8 under a recipe, for a GEMM whose inner dimension is C. role
    'activation' or 'weight' picks the block shape (1x128 or 128x128). delayed needs
    history_amax, the largest amax of past steps. rowwise always uses power-of-two scales."""
    if recipe == "delayed":
        if history_amax is None:
            raise ValueError("delayed scaling needs history_amax (the amax of past steps)")
        s = tensor_scale(history_amax, fmt)
        return dequantize(quantize(x, fmt, s), s)
    if recipe == "current":
        s = tensor_scale(x.detach().abs().max(), fmt)
        s = pow2(s) if power_of_2 else s
        return dequantize(quantize(x, fmt, s), s)
    if recipe == "rowwise":
        return fake_rows(x, fmt, power_of_2=True)
    if recipe == "block":
        return fake_blocks(x, fmt, (1, 128) if role == "activation" else (128, 128), power_of_2)
    raise ValueError(f"recipe must be one of {RECIPES}, not {recipe!r}")


def gemm_errors(a: torch.Tensor, w: torch.Tensor, a_history=None, w_history=None,
                rows=slice(None), recipes=RECIPES) -> dict:
    """Relative error of y = a w^T (a (T, in), w (out, in)) with both inputs through fp8 under
    each recipe, against the fp32 product, scored on the output rows `rows` (e.g. every token
    but an outlier); fp32 sums, so this is the cast error alone. Delayed scaling takes its amaxes
    from a_history / w_history (default: the tensors' own, a history that already saw them)."""
    ref = (a @ w.t())[rows]                                               # (T', out)
    ah = a.abs().max() if a_history is None else a_history
    wh = w.abs().max() if w_history is None else w_history
    out = {}
    for r in recipes:
        y = fake(a, r, "activation", history_amax=ah) @ fake(w, r, "weight", history_amax=wh).t()
        out[r] = float((y[rows] - ref).norm() / ref.norm())              # y: (T, out)
    return out


def transposed_errors(x: torch.Tensor, fmt: str = E4M3, block: int = 128) -> dict:
    """x (R, C) is scaled in 1 x block tiles along C for one GEMM; backward needs x^T in tiles
    along R. 'from_source': x^T quantized from x itself (TE's way); 'requantized': the 1 x block
    fp8 copy, dequantized and quantized again along the other axis (two roundings)."""
    row = fake_blocks(x, fmt, (1, block))                                  # (R, C) tiles along C
    direct = fake_blocks(x.t().contiguous(), fmt, (1, block))              # (C, R) tiles along R
    twice = fake_blocks(row.t().contiguous(), fmt, (1, block))             # (C, R)
    rel = lambda y: float((y - x.t()).norm() / x.norm())                  # noqa: E731
    return {"from_source": rel(direct), "requantized": rel(twice)}
