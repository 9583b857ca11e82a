"""NVFP4, emulated: E2M1 elements, 16-element blocks with E4M3 scales, one fp32 scale per tensor.

Sources: NVIDIA, "Pretraining Large Language Models with NVFP4" (arXiv:2509.25149), and
Transformer Engine's NVFP4 page (docs/features/low_precision_training/nvfp4/nvfp4.rst) with its
reference quantizer (transformer_engine/pytorch/custom_recipes/reference_nvfp4.py,
`NVFP4QuantizerRef._quantize_blockwise_reference`), which this module follows step for step.

An element is x = q * s_block * s_global:
* q is E2M1 (1 sign, 2 exponent, 1 mantissa bit): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives;
  round to nearest, ties to the even code (TE's `cast_to_fp4x2` thresholds: 0.25 -> 0,
  0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4);
* s_block, one per 16 consecutive elements, is stored in E4M3 (a positive fp8 number, not a
  power of two as MXFP's E8M0);
* s_global is one fp32 number for the tensor. E4M3 only spans 2^-9 .. 448, so the tensor is
  first mapped by the encode scale S_enc = 448 * 6 / amax(tensor) (TE's
  `compute_global_encode_scaling_factor_FP4`): the block scales amax_b / 6 * S_enc then fill
  E4M3's range, whatever the tensor's magnitude. Without it (S_enc = 1) a gradient of 1e-6
  gets block scales below E4M3's smallest subnormal, which round to 0.
The block scale is rounded to nearest, so amax_b / s_block can exceed 6 by up to E4M3's half
ulp (1/16): that element saturates at 6 (`saturated` counts it).

The training recipe (the paper; TE's `NVFP4BlockScaling`): 1x16 blocks for activations and
gradients, 16x16 blocks for weights (so W and W^T quantize to the same values), a 16x16 random
Hadamard transform on both inputs of the weight-gradient GEMM, stochastic rounding for gradients
and round-to-nearest-even for the rest. The Hadamard sign vector is TE's fixed one
(`get_wgrad_sign_vector`): "a single random sign vector is shared across all linear layers".
Emulated in fp32 on the CPU: the values are the format's, the speed is not Blackwell's.
"""
from __future__ import annotations

import torch

from labkit.precision.formats import info, relative_error

BLOCK = 16
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])   # the 8 magnitudes, code order
FP4_MAX = 6.0
E4M3_MAX = info("e4m3").max                                     # 448
FP32_MAX = torch.finfo(torch.float32).max
# transformer_engine/pytorch/custom_recipes/reference_nvfp4.py, get_wgrad_sign_vector()
TE_SIGNS = torch.tensor([1.0, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1])


def round_e2m1(v: torch.Tensor, stochastic: bool = False, generator=None) -> torch.Tensor:
    """v (any shape, |v| <= 6) to E2M1 values (fp32): to nearest, ties to the even code, or
    stochastically: up with probability (|v| - lo) / (hi - lo), so E[result] = v."""
    a = v.float().abs()
    hi_i = torch.searchsorted(E2M1, a.contiguous(), right=False).clamp(1, 7)  # first code >= a
    lo, hi = E2M1[hi_i - 1], E2M1[hi_i]
    frac = (a - lo) / (hi - lo)                                         # in [0, 1]
    if stochastic:
        up = torch.rand(a.shape, generator=generator) < frac
    else:                             # the even code of lo, hi has an even index (0, 1, 2, 4)
        up = (frac > 0.5) | ((frac == 0.5) & (hi_i % 2 == 0))
    return torch.where(up, hi, lo) * torch.sign(v)


def codes(q: torch.Tensor) -> torch.Tensor:
    """E2M1 values -> their 4-bit codes (sign << 3 | index), uint8."""
    idx = torch.searchsorted(E2M1, q.abs().contiguous())
    return ((q < 0).to(torch.uint8) << 3) | idx.to(torch.uint8)


def global_encode_scale(amax) -> torch.Tensor:
    """S_enc = 448 * 6 / amax in fp32, fp32's max where that overflows, 1 where amax is 0
    (TE's compute_global_encode_scaling_factor_FP4)."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    s = (torch.tensor(E4M3_MAX * FP4_MAX) / amax).clamp(max=FP32_MAX)
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def _block_amax(x: torch.Tensor, block2d: bool) -> torch.Tensor:
    """x (R, C) -> (R, C/16, 1): each element's block amax (1x16, or 16x16 for weights)."""
    R, C = x.shape
    if C % BLOCK or (block2d and R % BLOCK):
        raise ValueError(f"shape {tuple(x.shape)}: C (and R for 16x16 blocks) must be "
                         f"multiples of {BLOCK}; try ({BLOCK * 8}, {BLOCK * 8})")
    if not block2d:
        return x.abs().reshape(R, C // BLOCK, BLOCK).amax(-1, keepdim=True)
    tiles = x.abs().reshape(R // BLOCK, BLOCK, C // BLOCK, BLOCK).amax(dim=(1, 3))  # (R/16, C/16)
    return tiles.repeat_interleave(BLOCK, 0)[..., None]


def quantize(x: torch.Tensor, *, block2d: bool = False, per_tensor: bool = True,
             stochastic: bool = False, generator=None) -> dict:
    """x (R, C) -> NVFP4 as TE's reference quantizer makes it: q (R, C) E2M1 values (fp32),
    s_block (R, C/16) float8_e4m3fn, s_global = 1 / S_enc (fp32), and `saturated` (R, C): the
    elements clamped at +-6. per_tensor=False leaves S_enc = 1 (block scales alone)."""
    x = x.float()
    R, C = x.shape
    amax_b = _block_amax(x, block2d)                                    # (R, C/16, 1)
    s_enc = global_encode_scale(x.abs().max()) if per_tensor else torch.tensor(1.0)
    s_dec_g = 1.0 / s_enc
    dec = (amax_b * (s_enc * (1.0 / FP4_MAX))).clamp(max=E4M3_MAX)       # (R, C/16, 1) fp32
    dec = dec.to(torch.float8_e4m3fn)                                   # rounded to nearest
    enc = (1.0 / (dec.float() * s_dec_g)).clamp(max=FP32_MAX)           # (R, C/16, 1)
    scaled = x.reshape(R, C // BLOCK, BLOCK) * enc                      # (R, C/16, 16)
    saturated = scaled.abs() > FP4_MAX
    q = round_e2m1(scaled.clamp(-FP4_MAX, FP4_MAX), stochastic, generator)
    return {"q": q.reshape(R, C), "s_block": dec[..., 0], "s_global": s_dec_g,
            "saturated": saturated.reshape(R, C)}


def dequantize(t: dict) -> torch.Tensor:
    """q * s_block * s_global, (R, C) fp32."""
    R, C = t["q"].shape
    s = t["s_block"].float()[..., None] * t["s_global"]                 # (R, C/16, 1)
    return (t["q"].reshape(R, C // BLOCK, BLOCK) * s).reshape(R, C)


def fake(x: torch.Tensor, **kw) -> torch.Tensor:
    """x (R, C) through NVFP4 and back to fp32 (keywords as quantize)."""
    return dequantize(quantize(x, **kw))


def hadamard(n: int = BLOCK, signs: torch.Tensor | None = TE_SIGNS) -> torch.Tensor:
    """The random Hadamard matrix H = S_d H_d / sqrt(d) (TE's `_build_hadamard_matrix`):
    Sylvester's H_d (entries +-1), rows flipped by the sign vector, orthogonal: H H^T = I."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != n:
        raise ValueError(f"the Hadamard size must be a power of two, not {n}; try 16")
    if signs is not None:
        h = signs[:n, None] * h
    return h / n ** 0.5                                                # (n, n)


def rht(x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., C) -> x' = x H on each 16-wide tile of the last dimension (TE's tiled RHT)."""
    h = hadamard() if h is None else h
    d = h.shape[0]
    return (x.float().reshape(-1, d) @ h).reshape(x.shape)             # (..., C)


def wgrad(dy: torch.Tensor, x: torch.Tensor, *, use_rht: bool = True,
          stochastic: bool = True, generator=None) -> torch.Tensor:
    """The weight gradient dW = dy^T x (dy (N, out), x (N, in)) with both operands in NVFP4,
    16-blocks along the token dimension N (the GEMM's inner one): dy^T (out, N) and x^T (in, N),
    each optionally rotated by the same H along N first, (dy^T H)(x^T H)^T = dy^T x. The
    gradient is stochastically rounded, the activation rounded to nearest."""
    a, b = dy.t().float(), x.t().float()                               # (out, N), (in, N)
    if use_rht:
        a, b = rht(a), rht(b)
    qa = fake(a, stochastic=stochastic, generator=generator)           # (out, N)
    qb = fake(b)                                                       # (in, N)
    return qa @ qb.t()                                                 # (out, in) fp32 sum


def sr_bias(x: torch.Tensor, draws: int = 256, seed: int = 0) -> dict:
    """Round-to-nearest against stochastic rounding of the same tensor x (R, C), 1x16 blocks.
    'one': the relative error of one quantization; 'mean': of the average of `draws` independent
    ones. SR is unbiased where nothing is clamped, so its mean's error falls as 1/sqrt(draws)
    ('noise': one / sqrt(draws)); RN's mean is its one draw. 'mean unclamped' scores only the
    elements below the clamp at 6, and 'clamped shift' is the clamped elements' mean signed
    relative error: a block scale rounded down in E4M3 clamps the block max, SR or not."""
    g = torch.Generator().manual_seed(seed)
    rn = fake(x)                                                        # (R, C)
    sat = quantize(x)["saturated"]                                      # (R, C)
    acc, first = torch.zeros_like(x, dtype=torch.float64), None
    for _ in range(draws):
        y = fake(x, stochastic=True, generator=g)                       # (R, C)
        first = y if first is None else first
        acc += y.double()
    mean = acc / draws                                                  # (R, C)
    out, noise = [], relative_error(first, x) / draws ** 0.5
    for name, one, avg in (("nearest", rn, rn.double()), ("stochastic", first, mean)):
        out.append({"rounding": name, "one": relative_error(one, x),
                    "mean": relative_error(avg, x),
                    "noise": noise if name == "stochastic" else None,
                    "mean unclamped": relative_error(avg[~sat], x[~sat]),
                    "clamped shift": float(((avg - x) / x)[sat].mean()),
                    "clamped": float(sat.float().mean()), "draws": draws})
    return out
