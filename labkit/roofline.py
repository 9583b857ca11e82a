"""This machine's roofline, measured: matmul FLOP/s and memory bandwidth.

    from labkit import roofline
    r = roofline.measure()                 # CPU fp32 (and bf16/fp16 on a GPU): Roofline
    r.peak["fp32"], r.bandwidth            # FLOP/s, bytes/s
    roofline.time_matmul(1, 4096, 4096)    # seconds of one (1, 4096) @ (4096, 4096)

Timing: torch.utils.benchmark.Timer (which synchronises a GPU and warms up), with all the threads
torch would use (the Timer's default is one) and the median of its blocked runs. FLOP/s = 2 m k n
/ median; bandwidth = bytes read + bytes written / median, counted from the tensors' sizes for
`x.sum()` (read x), `out.copy_(x)` (read x, write out) and `torch.add(x, y, out=z)` (read two,
write one), on tensors far larger than the caches. The best of each is the roof: small matmuls do
not fill the machine, and a memory-bound op streams at most as fast as the fastest of the three.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.utils import benchmark

from labkit.costs import roofline as costs
from labkit.timing import now

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MATMUL_SIZES = (256, 512, 1024, 2048)
# A GPU's tensor cores fill only at large sizes: on one H200, bf16 reached 668 TFLOP/s at 2048^3
# and 790-796 at 4096^3-8192^3 (measured, shared/gpu); the sizes must reach the roof
GPU_MATMUL_SIZES = (1024, 2048, 4096, 8192)
COPY_BYTES = 256 * 2**20           # 256 MiB per tensor: far past any CPU's last-level cache


@dataclass
class Roofline:
    """Measured roofs of one device: peak[dtype] FLOP/s, bandwidth bytes/s, and the points."""
    device: str
    peak: dict
    bandwidth: float
    matmuls: list = field(default_factory=list)     # (dtype, n, FLOP/s)
    copies: list = field(default_factory=list)      # (what, bytes moved, bytes/s)

    def chip(self) -> costs.Chip:
        return costs.Chip(f"this machine ({self.device})", dict(self.peak), self.bandwidth,
                          "measured by labkit.roofline")


def _median_seconds(stmt: str, env: dict, device: str, min_run_time: float) -> float:
    """Median seconds per run of `stmt` (the Timer synchronises CUDA around its blocks)."""
    timer = benchmark.Timer(stmt=stmt, globals=env, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def time_matmul(m: int, k: int, n: int, dtype: str = "fp32", device: str = "cpu",
                min_run_time: float = 0.2) -> float:
    """Median seconds of (m, k) @ (k, n) into a preallocated output."""
    dt = DTYPES[dtype]
    a = torch.randn(m, k, device=device).to(dt)
    b = torch.randn(k, n, device=device).to(dt)
    out = torch.empty(m, n, device=device, dtype=dt)
    return _median_seconds("torch.mm(a, b, out=out)", {"torch": torch, "a": a, "b": b, "out": out},
                           device, min_run_time)


def matmul_operands(shapes, tokens: int, device="cpu") -> tuple:
    """Random float32 operands of the matmuls (tokens, in) @ (in, out), one per (in, out) in
    `shapes`: ([x (tokens, in)], [w (in, out)]), and their FLOPs, 2 * tokens * in * out summed."""
    xs = [torch.randn(tokens, k, device=device) for k, _ in shapes]          # (tokens, in)
    ws = [torch.randn(k, n, device=device) for k, n in shapes]               # (in, out)
    return xs, ws, sum(2 * tokens * k * n for k, n in shapes)


def time_matmuls(xs, ws, repeats: int = 5, warmup: int = 1) -> list:
    """Seconds of each of `repeats` passes over x @ w for the pairs of `matmul_operands`, after
    `warmup` untimed passes (a sweep's ranks time them side by side, so no Timer blocks here)."""
    dev = xs[0].device
    times = []
    for i in range(warmup + repeats):
        start = now(dev)
        for x, w in zip(xs, ws):
            x @ w                                                             # (tokens, out)
        if i >= warmup:
            times.append(now(dev) - start)
    return times


def matmul_flops(n: int, dtype: str = "fp32", device: str = "cpu",
                 min_run_time: float = 0.2) -> float:
    """FLOP/s of an n x n x n matmul: 2 n^3 / median seconds."""
    return 2.0 * n ** 3 / time_matmul(n, n, n, dtype, device, min_run_time)


def copy_bandwidth(nbytes: int = COPY_BYTES, device: str = "cpu", op: str = "copy",
                   min_run_time: float = 0.2) -> float:
    """Bytes/s of a large fp32 read (a sum), copy (read + write) or add (two reads + a write)."""
    numel = nbytes // 4
    x = torch.rand(numel, device=device)
    out = torch.empty_like(x)
    if op == "read":
        stmt, env, moved = "x.sum()", {"x": x}, numel * 4
    elif op == "copy":
        stmt, env, moved = "out.copy_(x)", {"x": x, "out": out}, 2 * numel * 4
    elif op == "add":
        y = torch.rand(numel, device=device)
        stmt, moved = "torch.add(x, y, out=out)", 3 * numel * 4
        env = {"torch": torch, "x": x, "y": y, "out": out}
    else:
        raise ValueError(f"op={op!r}: choose 'read', 'copy' or 'add'")
    return moved / _median_seconds(stmt, env, device, min_run_time)


def dtypes_of(device: str) -> tuple:
    """fp32 everywhere; bf16 and fp16 where the device has fast matmuls for them (a GPU). On a
    CPU they exist but run through slower paths, which would not be the machine's roof."""
    return ("fp32", "bf16", "fp16") if torch.device(device).type == "cuda" else ("fp32",)


def sizes_of(device: str) -> tuple:
    """Matmul sizes that reach the device's roof: up to 2048 on a CPU, 8192 on a GPU."""
    return GPU_MATMUL_SIZES if torch.device(device).type == "cuda" else MATMUL_SIZES


def measure(device: str = "cpu", sizes=None, dtypes=None, nbytes: int = COPY_BYTES,
            min_run_time: float = 0.2) -> Roofline:
    """Time matmuls at `sizes` (default sizes_of(device)) per dtype and a large read, copy and
    add: the best of each is the roof."""
    dtypes = dtypes or dtypes_of(device)
    sizes = sizes or sizes_of(device)
    matmuls = [(dt, n, matmul_flops(n, dt, device, min_run_time)) for dt in dtypes for n in sizes]
    copies = [(op, nbytes, copy_bandwidth(nbytes, device, op, min_run_time))
              for op in ("read", "copy", "add")]
    peak = {dt: max(f for d, _, f in matmuls if d == dt) for dt in dtypes}
    bandwidth = max(bw for _, _, bw in copies)
    for v in [*peak.values(), bandwidth]:
        if not (math.isfinite(v) and v > 0):
            raise RuntimeError(f"a measurement came out as {v}: timer failure?")
    return Roofline(str(device), peak, bandwidth, matmuls, copies)


# ----------------------------------------------------------------------------- a layer's ops
def _attention_unfused(q, k, v):
    scores = q @ k.transpose(-2, -1)                    # (b, heads, s, s): to memory and back
    return torch.softmax(scores, dim=-1) @ v            # (b, heads, s, head_dim)


def _adam_step(opt):
    opt.step()


def transformer_ops(device: str = "cpu", dtype: str = "fp32", h: int = 1024,
                    tokens=(1, 16, 256, 2048), seq: int = 512, heads: int = 8,
                    adam_params: int = 4 * 2**20, min_run_time: float = 0.2) -> list:
    """A transformer's ops timed here, each with its labkit.costs Op: (Op, median seconds).
    The MLP's up projection (tokens, h) @ (h, 4h) at several token counts, a residual add, a GELU
    and a layernorm, attention unfused and fused (F.scaled_dot_product_attention), and an Adam
    step (fp32) run one op at a time and fused (torch.optim.Adam(fused=True))."""
    dt = DTYPES[dtype]

    def rand(*shape):
        return torch.randn(*shape, device=device).to(dt)

    out = []
    for t in tokens:
        op = costs.matmul(1, t, h, 4 * h, dtype, f"MLP up, {t} tokens")
        out.append((op, time_matmul(t, h, 4 * h, dtype, device, min_run_time)))
    x, w, bias = rand(tokens[-1], h), rand(h), rand(h)
    y, z = rand(tokens[-1], h), rand(tokens[-1], h)
    nn = {"F": torch.nn.functional, "torch": torch, "x": x, "y": y, "z": z, "w": w, "b": bias}
    # out= where PyTorch has it: a fresh output per call would add the allocator's page faults
    out.append((costs.elementwise(x.numel(), dtype, 1, reads=2, name="residual add"),
                _median_seconds("torch.add(x, y, out=z)", nn, device, min_run_time)))
    out.append((costs.elementwise(x.numel(), dtype, costs.GELU_FLOPS, name="GELU"),
                _median_seconds("torch._C._nn.gelu(x, out=z)", nn, device, min_run_time)))
    out.append((costs.layernorm(1, tokens[-1], h, dtype), _median_seconds(
        f"F.layer_norm(x, ({h},), w, b)", nn, device, min_run_time)))
    q, k, v = (rand(1, heads, seq, h // heads) for _ in range(3))      # (b, heads, s, head_dim)
    env = {"q": q, "k": k, "v": v, "F": torch.nn.functional, "unfused": _attention_unfused}
    out.append((costs.attention(1, seq, heads, h // heads, dtype, fused=False),
                _median_seconds("unfused(q, k, v)", env, device, min_run_time)))
    out.append((costs.attention(1, seq, heads, h // heads, dtype, fused=True),
                _median_seconds("F.scaled_dot_product_attention(q, k, v)", env, device,
                                min_run_time)))
    for how, kw in (("one op at a time", {"foreach": False}), ("fused", {"fused": True})):
        p = torch.nn.Parameter(torch.randn(adam_params, device=device))   # fp32 weights, states
        p.grad = torch.randn_like(p)
        opt = torch.optim.Adam([p], lr=1e-3, **kw)
        opt.step()                                                      # states exist from here
        out.append((costs.adam_step(adam_params, name=f"Adam step ({how})"), _median_seconds(
            "step(opt)", {"step": _adam_step, "opt": opt}, device, min_run_time)))
    return out


def measured_point(op: costs.Op, seconds: float) -> dict:
    """A point for the figure: the op's intensity and the FLOP/s it reached in `seconds`."""
    return {"name": op.name, "intensity": op.intensity, "flops_per_s": op.flops / seconds}
