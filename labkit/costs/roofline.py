"""Rooflines: is an operation limited by the chip's arithmetic or by its memory? Pure Python.

Williams, Waterman and Patterson, "Roofline: An Insightful Visual Performance Model for Multicore
Architectures" (CACM 52(4), 2009). An operation does F FLOPs and moves B bytes between memory and
the chip; its arithmetic intensity is I = F / B (FLOPs per byte). On a chip with a peak of P FLOP/s
and a memory bandwidth of W bytes/s it runs at most at

    attainable(I) = min(P, I * W)      FLOP/s,   and takes at least  max(F / P, B / W)  seconds.

Below the ridge point I* = P / W the op is memory-bound (it waits for bytes); above it,
compute-bound. The byte counts here are the ideal: each input read once, each output written once
(a cache that holds everything a kernel reuses). Real kernels move more, so a measured point sits
at or below its roof.

    from labkit.costs import roofline
    op = roofline.matmul(b=8, s=1024, h=4096, h_out=4096, dtype="bf16")
    roofline.bound(op.intensity, "H100 80GB", "bf16")   # 'compute' (a chip by its costs.chips name)

No torch here: the website runs labkit.costs in the browser (Pyodide).
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.costs import chips
from labkit.costs.chips import Chip
from labkit.costs.dtypes import itemsize

# FLOPs per element, counted by hand (a multiply or an add is one FLOP; sqrt and divide count one).
LAYERNORM_FLOPS = 8      # mean 1, variance 3 (subtract, square, add), normalise 2, scale+shift 2
GELU_FLOPS = 8           # tanh form: x^3, multiply-adds, tanh (counted as one), final products
ADAM_FLOPS = 12          # m: 3, v: 4, bias corrections 2, sqrt + eps + divide 3 (AdamW: +2)


@dataclass(frozen=True)
class Op:
    """One operation's work: FLOPs done and bytes moved to and from memory."""
    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


# ----------------------------------------------------------------------------- operations
def matmul_mkn(m: int, k: int, n: int, dtype="bf16", name: str = "matmul") -> Op:
    """(m, k) @ (k, n): 2mkn FLOPs (a multiply and an add per term); reads both inputs and
    writes the output once: itemsize * (mk + kn + mn) bytes."""
    size = itemsize(dtype)
    return Op(name, 2.0 * m * k * n, float(size * (m * k + k * n + m * n)))


def matmul(b: int, s: int, h: int, h_out: int, dtype="bf16", name: str = "matmul") -> Op:
    """A linear layer on activations (b, s, h) with weights (h, h_out): the m = b*s tokens of the
    batch share one weight read. Its intensity tends to 2*b*s / itemsize when b*s << h, h_out:
    few tokens per device make a matmul memory-bound."""
    return matmul_mkn(b * s, h, h_out, dtype, name)


def attention(b: int, s: int, heads: int, head_dim: int, dtype="bf16", fused: bool = True,
              name: str = "") -> Op:
    """Attention's core, forward: Q K^T then softmax then P V, 4 * b * heads * s^2 * head_dim
    FLOPs (softmax's few FLOPs per score left out). Unfused, the (s, s) scores per head go to
    memory and back: written, read by softmax, probabilities written, read by P V (4 passes).
    Fused (FlashAttention, Dao et al. 2022) they stay on chip: only Q, K, V in and O out, the
    ideal (the paper's IO bound Theta(s^2 d^2 / M) adds re-reads of K and V when d^2 > M)."""
    size, h = itemsize(dtype), heads * head_dim
    f = 4.0 * b * heads * s * s * head_dim
    qkvo = 4.0 * b * s * h
    scores = 0.0 if fused else 4.0 * b * heads * s * s
    label = name or ("attention (fused)" if fused else "attention (unfused)")
    return Op(label, f, size * (qkvo + scores))


def elementwise(numel: int, dtype="bf16", flops_per_element: float = 1.0, reads: int = 1,
                writes: int = 1, name: str = "elementwise") -> Op:
    """An op that touches each element once (add, GELU, dropout): reads + writes tensors of numel
    elements. Its intensity is a few FLOPs per element over several bytes: always memory-bound."""
    size = itemsize(dtype)
    return Op(name, flops_per_element * numel, float(size * numel * (reads + writes)))


def layernorm(b: int, s: int, h: int, dtype="bf16") -> Op:
    """LayerNorm over h: read x, write y (the 2h weights are negligible), LAYERNORM_FLOPS each."""
    return elementwise(b * s * h, dtype, LAYERNORM_FLOPS, name="layernorm")


def adam_step(n_params: float, state_bytes: int = 4, name: str = "Adam step") -> Op:
    """One Adam update: reads parameter, gradient, m and v, writes parameter, m and v (fp32
    master weights and states: 7 * 4 = 28 bytes per parameter), ADAM_FLOPS per parameter."""
    return Op(name, ADAM_FLOPS * n_params, 7.0 * state_bytes * n_params)


def transformer_layer(b: int, s: int, h: int, heads: int, dtype="bf16", fused: bool = True,
                      mlp_ratio: int = 4) -> list:
    """The forward ops of one GPT layer (pre-LN, GELU MLP), in order."""
    hd, f = h // heads, mlp_ratio * h
    return [layernorm(b, s, h, dtype),
            matmul(b, s, h, 3 * h, dtype, "QKV projection"),
            attention(b, s, heads, hd, dtype, fused),
            matmul(b, s, h, h, dtype, "output projection"),
            elementwise(b * s * h, dtype, 1, reads=2, name="residual add"),
            layernorm(b, s, h, dtype),
            matmul(b, s, h, f, dtype, "MLP up"),
            elementwise(b * s * f, dtype, GELU_FLOPS, name="GELU"),
            matmul(b, s, f, h, dtype, "MLP down"),
            elementwise(b * s * h, dtype, 1, reads=2, name="residual add")]


# ----------------------------------------------------------------------------- the roofline
def attainable(intensity: float, peak: float, bandwidth: float) -> float:
    """min(peak, intensity * bandwidth): the most FLOP/s an op of this intensity can reach."""
    if intensity <= 0 or peak <= 0 or bandwidth <= 0:
        raise ValueError(f"intensity={intensity}, peak={peak}, bandwidth={bandwidth} must be > 0")
    return min(peak, intensity * bandwidth)


def ridge(peak: float, bandwidth: float) -> float:
    """The intensity (FLOPs/byte) where the memory roof meets the compute roof."""
    return peak / bandwidth


def bound(intensity: float, peak, bandwidth=None) -> str:
    """'compute' or 'memory': `peak` and `bandwidth` as numbers, or a Chip (or its name) and a
    dtype in place of the bandwidth: bound(I, "H100 80GB", "bf16")."""
    if isinstance(peak, (str, Chip)):
        c = chips.chip(peak)
        peak, bandwidth = c.peak_flops(bandwidth or "bf16"), c.bandwidth
    return "compute" if intensity >= ridge(peak, bandwidth) else "memory"


def seconds(op: Op, peak: float, bandwidth: float) -> float:
    """The roofline's lower bound on an op's time: max(flops / peak, bytes / bandwidth)."""
    return max(op.flops / peak, op.bytes / bandwidth)


def mfu_ceiling(ops, peak: float, bandwidth: float) -> float:
    """The best MFU a sequence of ops can reach, each at its roof and none overlapped:
    total FLOPs / (peak * total roofline time). Memory-bound ops pull it below 1."""
    ops = list(ops)
    return sum(o.flops for o in ops) / (peak * sum(seconds(o, peak, bandwidth) for o in ops))
