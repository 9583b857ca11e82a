"""This machine's roofs beside the datasheet's: matmul FLOP/s per dtype, memory bandwidth, FP8.

    from labkit.calibrate import roofs
    r = roofs.measure("cpu", quick=True)     # {"matmuls", "copies", "peak_flops", "bandwidth", ...}
    roofs.datasheet_of("cuda")               # the costs.chips entry of this GPU, or None

The timing is labkit.roofline's (torch.utils.benchmark.Timer, medians, synchronised on a GPU);
this module picks sizes that reach the roof (up to 8192^3 on a GPU: on one H200, bf16 reached
668 TFLOP/s at 2048^3 and 790-796 at 4096^3-8192^3, shared/gpu) and adds FP8 where the GPU has
it: `torch._scaled_mm` (e4m3, one scale per tensor) against bf16 at the same size, and its
accumulation error with `use_fast_accum=True` (the forward-GEMM default of torchao's
Float8LinearConfig and Transformer Engine's fprop) and False (promotion to fp32 every so many
products), against the exact (float64) product of the same fp8 values, so the cast error is left
out and only the accumulation is measured. Positive-mean data (rand + 0.5), as in shared/gpu.
"""
from __future__ import annotations

import torch
from torch.utils import benchmark

from labkit import roofline
from labkit.costs import chips

QUICK_CPU_SIZES = (128, 256, 512)
QUICK_GPU_SIZES = (2048, 4096)
QUICK_BYTES = 16 * 2**20           # 16 MiB: a quick run, past the caches of most laptops' cores
FP8_K = {"quick": (4096,), "full": (4096, 32768)}


def datasheet_of(device: str) -> chips.Chip | None:
    """The datasheet Chip of this device (by the GPU's name and memory), None on a CPU or for a
    GPU costs.chips does not list."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(dev)
    gib = torch.cuda.get_device_properties(dev).total_memory / 2**30
    for key in ("H200", "H100", "A100"):
        if key in name:
            cands = [c for n, c in chips.CHIPS.items() if n.startswith(key)]
            return min(cands, key=lambda c: abs((c.capacity or 0) / 2**30 - gib))
    return None


def fp8_available(device: str) -> bool:
    """An FP8 GEMM exists here: a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper,
    Blackwell) and a torch with torch._scaled_mm and float8_e4m3fn."""
    dev = torch.device(device)
    return (dev.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(dev) >= (8, 9)
            and hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn"))


def _to_fp8(x):
    """(x * scale) cast to e4m3 and the scale's inverse, per tensor (448 / amax)."""
    scale = 448.0 / x.abs().max().clamp(min=1e-12)
    return (x * scale).to(torch.float8_e4m3fn), (1.0 / scale).float()


def _scaled_mm(a8, b8, sa, sb, fast: bool):
    """torch._scaled_mm in fp32 out; some torch versions return (out, amax)."""
    out = torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.float32,
                           use_fast_accum=fast)
    return out[0] if isinstance(out, tuple) else out


def fp8_rate(n: int, device: str, min_run_time: float) -> dict:
    """FP8 (e4m3) and bf16 FLOP/s of an n x n x n GEMM, and their ratio (datasheet: 2x)."""
    a = torch.randn(n, n, device=device)                          # (n, n)
    b = torch.randn(n, n, device=device)                          # (n, n)
    a8, sa = _to_fp8(a)
    b8, sb = _to_fp8(b)
    b8 = b8.t().contiguous().t()                                  # (n, n) column-major: cuBLASLt
    env = {"mm": _scaled_mm, "a": a8, "b": b8, "sa": sa, "sb": sb}
    timer = benchmark.Timer("mm(a, b, sa, sb, False)", globals=env)      # synchronises CUDA
    t8 = timer.blocked_autorange(min_run_time=min_run_time).median
    fp8 = 2.0 * n ** 3 / t8
    bf16 = roofline.matmul_flops(n, "bf16", device, min_run_time)
    return {"n": n, "fp8_flops": fp8, "bf16_flops": bf16, "fp8_over_bf16": fp8 / bf16}


def fp8_accumulation(k: int, device: str, m: int = 256, seed: int = 0) -> dict:
    """Relative error (Frobenius) of an (m, k) @ (k, m) FP8 GEMM with fast and with split
    accumulation, against the float64 product of the same dequantized fp8 values."""
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.rand(m, k, device=device, generator=g) + 0.5         # (m, k) positive mean
    b = torch.rand(k, m, device=device, generator=g) + 0.5         # (k, m)
    a8, sa = _to_fp8(a)
    b8, sb = _to_fp8(b)
    # float8 -> float32 is exact; then float64 for the exact product of the dequantized values
    exact = (a8.float().double() * sa.double()) @ (b8.float().double() * sb.double())  # (m, m)
    b8 = b8.t().contiguous().t()
    out = {"k": k}
    for name, fast in (("split", False), ("fast", True)):
        got = _scaled_mm(a8, b8, sa, sb, fast).double()            # (m, m)
        out[name] = ((got - exact).norm() / exact.norm()).item()
    return out


def measure(device: str = "cpu", quick: bool = False) -> dict:
    """Matmul FLOP/s per dtype and size, read/copy/add bandwidth, FP8 where there is one; the
    best of each is the roof. Quick: smaller sizes and shorter timings (seconds on a CPU)."""
    cuda = torch.device(device).type == "cuda"
    run = 0.05 if quick else 0.2
    if quick:
        sizes = QUICK_GPU_SIZES if cuda else QUICK_CPU_SIZES
    else:
        sizes = roofline.sizes_of(device)
    nbytes = QUICK_BYTES if quick else roofline.COPY_BYTES
    r = roofline.measure(device, sizes=sizes, nbytes=nbytes, min_run_time=run)
    out = {"device": str(device), "matmuls": [list(m) for m in r.matmuls],
           "copies": [list(c) for c in r.copies], "peak_flops": dict(r.peak),
           "bandwidth": r.bandwidth, "fp8": None,
           "fp8_why_not": None if fp8_available(device) else
           "no FP8 GEMM here (needs a CUDA GPU of compute capability 8.9+ and torch._scaled_mm)"}
    if out["fp8_why_not"] is None:
        rate = fp8_rate(max(sizes), device, run)
        ks = FP8_K["quick" if quick else "full"]
        out["fp8"] = {"rate": rate, "accumulation": [fp8_accumulation(k, device) for k in ks]}
        out["peak_flops"]["fp8"] = rate["fp8_flops"]
    return out


def units(device: str) -> tuple:
    """(FLOP/s unit, its name, bytes/s unit, its name): tera on a GPU, giga on a CPU."""
    if torch.device(device).type == "cuda":
        return 1e12, "TFLOP/s", 1e12, "TB/s"
    return 1e9, "GFLOP/s", 1e9, "GB/s"


def rows(r: dict, sheet: chips.Chip | None) -> list:
    """Table rows: what, measured, datasheet, measured / datasheet (in units(device))."""
    fu, fname, bu, bname = units(r["device"])

    def row(what, got, dtype=None):
        want = None
        if sheet is not None:
            want = sheet.bandwidth if dtype is None else sheet.peak.get(dtype)
        unit = bu if dtype is None else fu
        return {"what": what, "measured": got / unit, "datasheet": want and want / unit,
                "ratio": got / want if want else None}

    out = [row(f"{dt} matmul, best of n^3 for n = "
               f"{', '.join(str(n) for d, n, _ in r['matmuls'] if d == dt)} ({fname})", f, dt)
           for dt, f in r["peak_flops"].items() if dt != "fp8"]
    if r["fp8"]:
        rate = r["fp8"]["rate"]
        out.append(row(f"fp8 e4m3 torch._scaled_mm, {rate['n']}^3 ({fname})",
                       rate["fp8_flops"], "fp8"))
    for what, nbytes, bw in r["copies"]:
        out.append(row(f"memory {what}, {nbytes / 2**20:g} MiB fp32 ({bname})", bw))
    return out
