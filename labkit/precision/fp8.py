"""FP8 matmuls, emulated: quantize to e4m3 / e5m2 with a scale, multiply, accumulate in fp32.

An fp8 number has 3 (e4m3) or 2 (e5m2) mantissa bits, so a tensor is first multiplied by a scale
s that maps its largest magnitude (amax) onto the format's max: s = max / amax, q = fp8(x * s),
and x ~ q / s. e4m3 (max 448, eps 1/8) carries weights and activations forward; e5m2 (max 57344,
eps 1/4) carries gradients backward, whose range is wider (the recipe of Micikevicius et al.,
"FP8 Formats for Deep Learning", 2022).

s is computed as Transformer Engine computes it (`tensor_scale`): correctly rounded to fp32, the
previous scale (1 at first) where amax is 0, inf or NaN, and an inf or NaN amax never enters the
delayed-scaling history.

Two ways to choose s:
* per tensor, delayed: s from the largest amax of the last H steps (amax history), known before
  the tensor is computed, as NVIDIA's Transformer Engine does. A value beyond it saturates.
* per block (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024): one scale per 1x128 tile of an
  activation row and per 128x128 block of a weight, from the block's own amax, so one outlier
  spoils 128 values, not the whole tensor.

The product of dequantized inputs is computed in fp32, so the casts are the only error here: that
is what any GPU's casts cost. A GPU's sum adds its own error, which depends on the accumulation
mode (fast, or split with promotion to fp32 every 128 products as DeepSeek-V3 does and as
`use_fast_accum=False` measures): labkit.precision.accumulate emulates both. On a CPU this
reproduces fp8's rounding exactly and says nothing about speed.
"""
from __future__ import annotations

import torch

from labkit.precision.formats import DTYPES, info

E4M3, E5M2 = "e4m3", "e5m2"


def quantize(x: torch.Tensor, fmt: str, scale) -> torch.Tensor:
    """fp8(x * scale), saturating at the format's max (no inf, no NaN from overflow)."""
    m = info(fmt).max
    return (x.float() * scale).clamp(-m, m).to(DTYPES[fmt])


def dequantize(q: torch.Tensor, scale) -> torch.Tensor:
    return q.float() / scale


def tensor_scale(amax, fmt: str, previous=1.0) -> torch.Tensor:
    """s = max / amax as fp32, Transformer Engine's rule (its delayed-scaling kernel):
    - correctly rounded: the quotient in float64, rounded once to fp32 (torch's `scalar / tensor`
      is `reciprocal(tensor) * scalar`, two roundings, 1 ulp off for about a quarter of amaxes);
    - where amax is 0, inf or NaN: the previous scale (1 at the start), so one inf in a tensor
      does not turn the scale into 0 and every value into NaN;
    - where max / amax overflows fp32 (a tiny amax): fp32's largest number."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    q = (torch.tensor(info(fmt).max, dtype=torch.float64) / amax.double()).float()
    q = q.clamp(max=torch.finfo(torch.float32).max)
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, q, torch.as_tensor(previous, dtype=torch.float32))


def fake_tensor(x: torch.Tensor, fmt: str, amax=None) -> torch.Tensor:
    """x through fp8 with one scale (from amax, default x's own) and back to fp32."""
    s = tensor_scale(x.abs().max() if amax is None else amax, fmt)
    return dequantize(quantize(x, fmt, s), s)


def quantize_blocks(x: torch.Tensor, fmt: str, block=(1, 128)):
    """Per-block scaling of a 2-D tensor: returns (q (R, C) fp8, scales (R/br, C/bc) fp32).
    Edge blocks may be smaller (R, C need not divide)."""
    R, C = x.shape
    br, bc = block
    nr, nc = -(-R // br), -(-C // bc)
    pad = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    pad[:R, :C] = x.float()
    blocks = pad.view(nr, br, nc, bc)                                   # (nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3))                                # (nr, nc)
    s = tensor_scale(amax, fmt)                                         # (nr, nc)
    q = quantize(blocks, fmt, s[:, None, :, None])
    return q.view(nr * br, nc * bc)[:R, :C], s


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block=(1, 128)) -> torch.Tensor:
    br, bc = block
    s = scales.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:q.shape[0], :q.shape[1]]
    return q.float() / s


def fake_blocks(x: torch.Tensor, fmt: str, block=(1, 128)) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])                                       # (rows, C)
    return dequantize_blocks(*quantize_blocks(x2, fmt, block), block).view(shape)


class AmaxHistory:
    """Delayed scaling: the scale for this step comes from the amaxes of the last `length` steps;
    this step's amax is recorded after use. A non-finite amax (an inf or NaN in the tensor) is
    never recorded, as in Transformer Engine: one overflow must not spoil the next `length`
    steps' scales."""

    def __init__(self, length: int = 16):
        self.length, self.values = length, []
        self.scale = torch.tensor(1.0)          # the last scale used: kept when amax is 0 or inf

    def next_scale(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        """This step's scale from the history (TE's delayed scaling); where the history's amax
        is 0 (an all-zero tensor so far) or not finite, the previous step's scale stays."""
        self.scale = tensor_scale(self.amax(x), fmt, previous=self.scale)
        return self.scale

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        now = x.detach().abs().max().float()
        past = max(self.values) if self.values else now   # first step: no history, use its own
        if torch.isfinite(now):
            self.values = (self.values + [now])[-self.length:]
        return torch.as_tensor(past)


def fake(x, fmt, recipe, history=None, block=(1, 128)):
    """x through fp8 under a recipe: 'tensor' (delayed, needs history) or 'block'."""
    if recipe == "block":
        return fake_blocks(x, fmt, block)
    if history is None:
        return fake_tensor(x, fmt)
    s = history.next_scale(x, fmt)
    return dequantize(quantize(x, fmt, s), s)


class _Fp8Matmul(torch.autograd.Function):
    """y = x w^T with x, w in e4m3 forward; the output gradient in e5m2 backward; fp32 products."""

    @staticmethod
    def forward(ctx, x, w, layer):
        xq = fake(x, E4M3, layer.recipe, layer.hist["x"], (1, 128))            # (N, in)
        wq = fake(w, E4M3, layer.recipe, layer.hist["w"], (128, 128))          # (out, in)
        ctx.save_for_backward(xq, wq)
        ctx.layer = layer
        return xq @ wq.t()                                                      # (N, out) fp32

    @staticmethod
    def backward(ctx, gy):
        xq, wq = ctx.saved_tensors
        layer = ctx.layer
        gq = fake(gy, E5M2, layer.recipe, layer.hist["g"], (1, 128))           # (N, out)
        return gq @ wq, gq.t() @ xq, None                                       # (N, in), (out, in)


class Fp8Linear(torch.nn.Module):
    """nn.Linear whose matmul runs through fp8 (emulated): recipe 'tensor' or 'block'."""

    def __init__(self, linear: torch.nn.Linear, recipe: str = "tensor", history: int = 16):
        super().__init__()
        self.weight, self.bias, self.recipe = linear.weight, linear.bias, recipe
        self.hist = {k: AmaxHistory(history) for k in ("x", "w", "g")}

    def forward(self, x):                                     # (..., in)
        y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), self.weight, self)
        y = y.view(*x.shape[:-1], -1)                         # (..., out)
        return y if self.bias is None else y + self.bias


def to_fp8(model: torch.nn.Module, recipe: str = "tensor") -> torch.nn.Module:
    """Replace every nn.Linear inside the transformer blocks by an Fp8Linear (in place): the
    embedding and the tied output head stay in higher precision, as in DeepSeek-V3."""
    for block in getattr(model, "blocks", []):
        for mod in list(block.modules()):
            for cname, child in list(mod.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(mod, cname, Fp8Linear(child, recipe))
    return model
