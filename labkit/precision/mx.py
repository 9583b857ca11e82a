"""MXFP8, emulated: 32-element blocks, one power-of-two (E8M0) scale each, E4M3 elements.

OCP "Microscaling Formats (MX) Specification" v1.0 (2023): a block of k = 32 values V_i shares one
scale X = 2^e stored as E8M0 (8 exponent bits, bias 127, no mantissa, no sign: 2^-127 .. 2^127),
and each element is P_i = e4m3(V_i / X). The whole question is how e is chosen from the block's
amax. Three rules, all in production code:

* floor (the spec's rule, section 6.3, as the docstring of torchao's
  `ScaleCalculationMode.FLOOR`, its default mode, quotes it):
      e = floor(log2 amax) - emax_elem,   emax_elem = 8 (E4M3's top binade: 448 = 1.75 * 2^8)
  so amax / X lies in [256, 512): whenever the block max's mantissa exceeds 1.75 the max is
  above 448 and saturates (torchao clamps it to +-448 before the cast).
* rceil (round the scale up): e = ceil(log2(amax / 448)), so amax / X lies in (224, 448] and no
  element ever saturates. Mishra, Stosic, Layton, "Recipes for Pre-training LLMs with MXFP8"
  (arXiv:2506.08027): the spec's rounding "can lead to divergence", rounding the scale towards
  +infinity trains an 8B model on 15T tokens. Transformer Engine computes it exactly so:
  `float_to_e8m0(amax * max_norm_rcp)` with `cvt.rp.satfinite.ue8m0x2.f32` (round towards
  +inf), or on older GPUs the fp32 exponent bits plus one if the mantissa is non-zero
  (transformer_engine/common/util/ptx_arch_spec.cuh; docs: features/low_precision_training/
  mxfp8); torchao's `RCEIL` mode and cuBLAS's "Computing scaling and conversion factors for FP8
  with UE8M0 scales" are the same rule.
* ceil (torchao `ScaleCalculationMode.CEIL`): e = ceil(log2 amax) - 8, amax / X in (128, 256]:
  no saturation either, but up to one binade of E4M3's range is left unused.

On a CPU the casts are exact (torch's float8_e4m3fn and float8_e8m0fnu round as the formats
define); nothing here says anything about Blackwell's speed.
"""
from __future__ import annotations

import torch

from labkit.precision.formats import info, relative_error
from labkit.precision.fp8 import E4M3, dequantize, quantize

BLOCK = 32                      # OCP MX v1.0: k = 32 for every concrete MX format
E8M0_BIAS = 127                 # E8M0 holds 2^-127 .. 2^127 (0xFF is NaN)
EMAX_E4M3 = 8                   # floor(log2(448)): the spec's emax_elem for E4M3
RULES = ("floor", "rceil", "ceil")


def _log2_floor_ceil(v: torch.Tensor):
    """floor(log2 v) and ceil(log2 v) of positive fp32 values, exactly (from frexp, no log)."""
    m, e = torch.frexp(v.float())                      # v = m * 2^e, m in [0.5, 1)
    return e - 1, torch.where(m == 0.5, e - 1, e)


def scale_exponent(amax: torch.Tensor, rule: str = "rceil") -> torch.Tensor:
    """The unbiased E8M0 exponent e (int32, same shape as amax) of each block's scale 2^e.
    An all-zero block gets the smallest scale, 2^-127 (Transformer Engine's code 0x00)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, not {rule!r}; try rule='rceil'")
    amax = amax.float()
    nonzero = amax > 0
    safe = torch.where(nonzero, amax, torch.ones_like(amax))
    if rule == "rceil":
        # TE: the fp32 product amax * fp32(1/448) (its max_norm_rcp), then rounded up to 2^e
        descale = safe * torch.tensor(1.0 / info(E4M3).max, dtype=torch.float32)
        e = _log2_floor_ceil(descale)[1]
    else:
        lo, hi = _log2_floor_ceil(safe)
        e = (lo if rule == "floor" else hi) - EMAX_E4M3
    e = torch.where(nonzero, e, torch.full_like(e, -E8M0_BIAS))
    return e.clamp(-E8M0_BIAS, E8M0_BIAS).int()


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (R, C) -> (R, C / block, block); C must divide (as TE and torchao require)."""
    R, C = x.shape
    if C % block:
        raise ValueError(f"the last dimension ({C}) must be a multiple of the block ({block}); "
                         f"try C = {block * max(1, C // block)}")
    return x.float().reshape(R, C // block, block)


def quantize_mx(x: torch.Tensor, rule: str = "rceil", block: int = BLOCK):
    """x (R, C) -> (q (R, C) float8_e4m3fn, e (R, C / block) int32 exponents, saturated (R, C)
    bool: |x| / 2^e beyond 448, clamped to +-448 before the cast)."""
    xb = _blocks(x, block)                                              # (R, nb, block)
    e = scale_exponent(xb.abs().amax(-1), rule)                         # (R, nb)
    inv = torch.exp2(-e.float())[..., None]                             # (R, nb, 1) = 1 / X
    saturated = (xb * inv).abs() > info(E4M3).max                       # (R, nb, block)
    q = quantize(xb, E4M3, inv)                                         # (R, nb, block) e4m3
    return q.reshape(x.shape), e, saturated.reshape(x.shape)


def dequantize_mx(q: torch.Tensor, e: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """q (R, C) e4m3, e (R, C / block) -> (R, C) fp32 = q * 2^e."""
    R, C = q.shape
    inv = torch.exp2(-e.float())[..., None]                             # (R, nb, 1)
    return dequantize(q.reshape(R, C // block, block), inv).reshape(R, C)


def e8m0(e: torch.Tensor) -> torch.Tensor:
    """The scales 2^e stored as torch.float8_e8m0fnu (exact: every 2^e, |e| <= 127, is one)."""
    return torch.exp2(e.float()).to(torch.float8_e8m0fnu)


def fake_mx(x: torch.Tensor, rule: str = "rceil", block: int = BLOCK) -> torch.Tensor:
    """x (..., C) through MXFP8 along its last dimension and back to fp32."""
    x2 = x.reshape(-1, x.shape[-1])                                     # (rows, C)
    q, e, _ = quantize_mx(x2, rule, block)
    return dequantize_mx(q, e, block).reshape(x.shape)


def errors(x: torch.Tensor, rule: str, block: int = BLOCK) -> dict:
    """One tensor through MXFP8 under a rule: relative error, the share of elements saturated,
    of non-zero elements flushed to 0, and of blocks whose max saturated."""
    x2 = x.reshape(-1, x.shape[-1]).float()                             # (rows, C)
    q, e, sat = quantize_mx(x2, rule, block)
    y = dequantize_mx(q, e, block)                                      # (rows, C)
    flushed = (y == 0) & (x2 != 0)
    return {"rule": rule, "rel_error": relative_error(y, x2),
            "saturated": float(sat.float().mean()), "flushed": float(flushed.float().mean()),
            "blocks_saturated": float(sat.reshape(*e.shape, block).any(-1).float().mean())}


def tensors(rows: int = 256, cols: int = 1024, seed: int = 0) -> dict:
    """Test tensors (rows, cols): 'gaussian' N(0, 1); 'student-t(3)', heavy tails as LLM
    gradients have; 'outlier channels', N(0, 1) with 8 of the columns x 50, the few "massive"
    activation channels of LLMs (Dettmers et al., "LLM.int8()", 2022)."""
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(rows, cols, generator=g)                        # (rows, cols)
    z = torch.randn(rows, cols, generator=g)
    chi2 = torch.randn(3, rows, cols, generator=g).pow(2).sum(0)        # chi^2 with 3 dof
    student = z / (chi2 / 3).sqrt()                                     # (rows, cols) t(3)
    outl = torch.randn(rows, cols, generator=g)
    outl[:, torch.randperm(cols, generator=g)[:8]] *= 50.0
    return {"gaussian": gauss, "student-t(3)": student, "outlier channels": outl}


def rule_table(rows: int = 256, cols: int = 1024, seed: int = 0) -> list[dict]:
    """errors() for every rule on every test tensor: the rows of the chapter's table."""
    return [{"tensor": name, **errors(x, rule)}
            for name, x in tensors(rows, cols, seed).items() for rule in RULES]
