"""Limited-precision accumulation inside an FP8 GEMM, emulated: fast and split ("2x") accumulation.

A cast to fp8 rounds the same on every device; the sum of K products does not. DeepSeek-AI,
"DeepSeek-V3 Technical Report" (2024), section 3.3.2, "Increasing Accumulation Precision": "the
accumulation precision of FP8 GEMM on NVIDIA H800 GPUs is limited to retaining around 14 bits",
which for K = 4096 random matrices gave "a maximum relative error of nearly 2%". Their fix: after
N_C = 128 elements (4 WGMMAs) the partial result is "copied to FP32 registers on CUDA Cores, where
full-precision FP32 accumulation is performed". Libraries expose the same choice as a flag:
`torch._scaled_mm(use_fast_accum=...)`, Transformer Engine's `use_split_accumulator` (its
`_2X_ACC_FPROP = False`, `_2X_ACC_DGRAD = True`, `_2X_ACC_WGRAD = True` in
`transformer_engine/pytorch/module/base.py`), torchao's `Float8GemmConfig(use_fast_accum=...)`.

The model (our assumptions; the hardware's adder is not documented):
* a product of two fp8 values is exact (4-bit x 4-bit significands: 8 bits);
* the tensor core adds `group` products (32: the k of one FP8 WGMMA) to its running sum in one
  step: the group's products and the running sum are aligned to the largest exponent E among them,
  and every bit below 2^(E - bits + 1) is dropped (`rounding="truncate"`: an aligned adder of fixed
  width shifts the smaller terms right and what falls off is lost, so each term moves towards 0);
  the aligned terms then add exactly. `bits` = 14 significant bits, the report's "around 14";
* fast accumulation: that running sum lasts the whole K. Split accumulation: every `promote_every`
  products (N_C = 128) it is added to an fp32 accumulator (round to nearest even) and restarts at 0;
* the result is fp32; the per-tensor dequantization scale multiplies it in fp32 (`scaled`).

What the model does not capture: the order of additions inside a group, guard or carry bits and
where the hardware normalises (a bit-level model of these: F. A. Khattak, M. Mikaitis, "Accurate
Models of NVIDIA Tensor Cores", arXiv:2512.07004, 2025); how cuBLAS tiles K (a split-K kernel sums
slices of K in fp32 and so shortens every chain: `split_k`, which the library picks and we cannot
see); bf16 outputs. Checked against one H200 (`MEASURED_H200`, tests/test_accumulate.py): within
4% of the measured error for K = 1,024 and 4,096 on 32x32 outputs (11% on 16x16: sampling noise),
fast and split, zero- and positive-mean data. Split still matches at K = 16,384 and 65,536; fast
does not: one chain gives 2.3-2.6x the measured error at K = 16,384 and 1.6-1.8x at 65,536, and
the measurement lies between K cut into 2 and into 4 slices (`split_k`), as if cuBLAS had run a
split-K kernel there (not recorded; a hypothesis). Rounding to nearest instead of truncating, or
13 or 15 bits instead of 14, misses the measured errors by 2x or more.
"""
from __future__ import annotations

import torch

from labkit.precision.fp8 import E4M3, quantize, tensor_scale

FAST, SPLIT = "fast", "split"
N_C = 128          # DeepSeek-V3's promotion interval, in products
WGMMA_K = 32       # products one FP8 WGMMA adds per output (m64nNk32)

# torch._scaled_mm, e4m3, one scale per tensor (448 / amax), M = N = 256, fp32 output; error =
# ||result - exact|| / ||exact|| with exact = the float64 product of the fp8 values (the cast error
# excluded). Mean of three seeds. Measured on one H200 (torch 2.11, CUDA 13.0), 2026-11-27:
# shared/gpu/README.md, raw figures in shared/gpu/h200-2026-11-27-run3.json ("fp8_accum_sweep").
MEASURED_H200 = {
    ("zero-mean", FAST): {1024: 5.43e-4, 4096: 1.337e-3, 16384: 1.591e-3, 65536: 3.726e-3},
    ("zero-mean", SPLIT): {1024: 1.279e-4, 4096: 1.272e-4, 16384: 1.278e-4, 65536: 1.272e-4},
    ("positive-mean", FAST): {1024: 1.548e-2, 4096: 7.937e-2, 16384: 1.019e-1, 65536: 3.872e-1},
    ("positive-mean", SPLIT): {1024: 2.347e-4, 4096: 2.316e-4, 16384: 2.299e-4, 65536: 2.301e-4},
}

# The same GPU's rates, TFLOP/s, on M = N = K: torch.matmul in bf16 and torch._scaled_mm in e4m3
# with per-tensor scales, its default use_fast_accum=False ("e4m3") and True ("e4m3 fast"); raw
# figures in shared/gpu/h200-2026-11-27-run1.json, key "fp8". The datasheet says 2x bf16.
MEASURED_H200_TFLOPS = {4096: {"bf16": 790.565, "e4m3": 1340.027, "e4m3 fast": 1444.264},
                        8192: {"bf16": 796.233, "e4m3": 1418.034, "e4m3 fast": 1330.587}}


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 |x|) as an integer tensor, exactly, from frexp (-1 where x is 0: any exponent
    aligns 0 to 0)."""
    return torch.frexp(x)[1] - 1


def _drop(x: torch.Tensor, rounding: str) -> torch.Tensor:
    """To an integer: towards 0 (an integer cast; torch.trunc is 1000x slower on some CPUs) or to
    nearest, ties to even."""
    return x.to(torch.int64) if rounding == "truncate" else torch.round(x).to(torch.int64)


def matmul(qa: torch.Tensor, qb: torch.Tensor, mode: str = FAST, *, bits: int = 14,
           group: int = WGMMA_K, promote_every: int = N_C, split_k: int = 1,
           rounding: str = "truncate") -> torch.Tensor:
    """qa @ qb summed as the model above sums it: qa (M, K), qb (K, N) hold fp8 values (an fp8
    dtype or their float values); returns (M, N) fp32, unscaled. K must divide into split_k
    slices of whole groups; for SPLIT, promote_every must be a multiple of group."""
    if mode not in (FAST, SPLIT):
        raise ValueError(f"mode must be {FAST!r} or {SPLIT!r}, not {mode!r}")
    if rounding not in ("truncate", "nearest"):
        raise ValueError(f"rounding must be 'truncate' or 'nearest', not {rounding!r}")
    M, K = qa.shape
    N = qb.shape[1]
    if K % (split_k * group) or (mode == SPLIT and promote_every % group):
        raise ValueError(f"K = {K} must split into {split_k} slices of whole groups of {group}"
                         f" (and promote_every = {promote_every} into groups); try K = 4096")
    ks = K // split_k
    a = qa.float().view(M, split_k, ks).transpose(0, 1)                # (S, M, ks)
    b = qb.float().view(split_k, ks, N)                                # (S, ks, N)
    run = torch.zeros(split_k, M, N)                                   # (S, M, N) tensor-core sum
    out = torch.zeros(split_k, M, N)                                   # (S, M, N) fp32 accumulator
    step = max(group, 2048 // group * group)                           # products made per block
    for b0 in range(0, ks, step):
        g_n = min(step, ks - b0) // group
        ab = a[:, :, b0:b0 + g_n * group].reshape(split_k, M, g_n, group)  # (S, M, G, g)
        bb = b[:, b0:b0 + g_n * group].reshape(split_k, g_n, group, N)     # (S, G, g, N)
        p = ab.permute(2, 0, 1, 3)[:, :, :, None, :] * bb.permute(1, 0, 3, 2)[:, :, None]
        pe = _exponent(p.abs().amax(-1))                               # (G, S, M, N)
        for j in range(g_n):                                           # p: (G, S, M, N, g) exact
            # every term on the grid 2^(E - bits + 1), E the largest exponent of the step; in
            # units of that grid the terms are integers below 2^bits, added exactly
            up = torch.exp2((bits - 1 - torch.maximum(pe[j], _exponent(run))).float())
            terms = _drop(p[j] * up[..., None], rounding).sum(-1)        # (S, M, N) integers
            run = (_drop(run * up, rounding) + terms).float() / up
            if mode == SPLIT and (b0 + (j + 1) * group) % promote_every == 0:
                out, run = out + run, torch.zeros_like(run)              # fp32 add: RNE
    out = out + run                                                    # (S, M, N)
    return out.sum(0) if split_k > 1 else out[0]                       # fp32 sum of the slices


def data(kind: str, K: int, M: int = 64, N: int = 64, seed: int = 0):
    """The H200 sweep's recipe: A (M, K), B (K, N) from torch.randn ('zero-mean') or
    torch.rand + 0.5 ('positive-mean'), each cast to e4m3 with one scale 448 / amax.
    Returns (qa, qb, sa, sb): fp8 tensors and their fp32 scales."""
    if kind not in ("zero-mean", "positive-mean"):
        raise ValueError(f"kind must be 'zero-mean' or 'positive-mean', not {kind!r}")
    g = torch.Generator().manual_seed(seed)
    draw = (lambda *s: torch.randn(*s, generator=g)) if kind == "zero-mean" else (
        lambda *s: torch.rand(*s, generator=g) + 0.5)
    A, B = draw(M, K), draw(K, N)                                      # (M, K), (K, N)
    sa, sb = 448.0 / A.abs().max(), 448.0 / B.abs().max()
    qa = (A * sa).to(torch.float8_e4m3fn)                              # (M, K) e4m3
    qb = (B * sb).to(torch.float8_e4m3fn)                              # (K, N) e4m3
    return qa, qb, sa, sb


def scaled(qa, qb, sa, sb, mode: str = FAST, **model) -> torch.Tensor:
    """What torch._scaled_mm(qa, qb, 1/sa, 1/sb) returns under the model: fp32 (M, N)."""
    return matmul(qa, qb, mode, **model) * (1.0 / (sa * sb))


def relative_error(kind: str, K: int, mode: str = FAST, M: int = 64, seed: int = 0,
                   **model) -> float:
    """||emulated - exact|| / ||exact|| on the H200 recipe, exact = the float64 product of the
    fp8 values: the accumulation error alone, as MEASURED_H200 reports it."""
    qa, qb, _, _ = data(kind, K, M, M, seed)
    exact = qa.double() @ qb.double()                                  # (M, M)
    got = matmul(qa, qb, mode, **model).double()
    return float((got - exact).norm() / exact.norm())


def per_tensor(x: torch.Tensor):
    """Current per-tensor scaling: (fp8(x * s) e4m3, s) with s = 448 / amax(x)."""
    s = tensor_scale(x.detach().abs().max(), E4M3)
    return quantize(x, E4M3, s), s


def split_errors(a: torch.Tensor, b: torch.Tensor, quantize, mode: str = FAST, **model) -> dict:
    """Cast error and accumulation error of one FP8 GEMM a (M, K) @ b (K, N), kept apart.
    quantize(x) -> (q fp8, s) with one scale per tensor. 'cast': the exact product of the
    dequantized inputs against the exact product of the originals (what any GPU's cast costs);
    'accumulation': the emulated sum against the exact product of the dequantized inputs; 'total':
    the emulated result against the exact product of the originals."""
    qa, sa = quantize(a)
    qb, sb = quantize(b)
    exact = a.double() @ b.double()                                    # (M, N)
    deq = (qa.double() / sa.double()) @ (qb.double() / sb.double())    # (M, N) cast error only
    got = scaled(qa, qb, sa, sb, mode, **model).double()               # (M, N)
    rel = lambda x, ref: float((x - ref).norm() / ref.norm())          # noqa: E731
    return {"cast": rel(deq, exact), "accumulation": rel(got, deq), "total": rel(got, exact)}
