"""Floating-point formats shown from torch.finfo and from real casts.

A binary float with m explicit mantissa bits holds numbers x = ±1.f · 2^e. Between 2^e and 2^(e+1)
there are 2^m equally spaced values, so the spacing (one "unit in the last place") at x is

    ulp(x) = 2^(floor(log2|x|) - m)          relative precision eps = 2^-m

and round-to-nearest moves x by at most ulp(x)/2. The exponent bits set the range: the largest
finite value (finfo.max) and the smallest normal one (finfo.tiny); below tiny, subnormals keep
spacing 2^(emin - m) down to that value itself, and anything below half of it becomes 0.

tf32 is not a storage dtype: tensor cores read fp32 and keep 10 mantissa bits. We emulate it by
rounding an fp32 tensor's mantissa to 10 bits (round to nearest even), which is what the hardware
does to matmul inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MANTISSA = {"fp32": 23, "tf32": 10, "bf16": 7, "fp16": 10, "e4m3": 3, "e5m2": 2}
EXPONENT = {"fp32": 8, "tf32": 8, "bf16": 8, "fp16": 5, "e4m3": 4, "e5m2": 5}


@dataclass(frozen=True)
class Format:
    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    max: float        # largest finite value
    tiny: float       # smallest positive normal value
    smallest: float   # smallest positive subnormal value
    eps: float        # spacing just above 1.0 = 2^-mantissa_bits

    @property
    def decimal_digits(self) -> float:
        return self.mantissa_bits * math.log10(2) + math.log10(2)   # (m + 1) bits of precision


def info(name: str) -> Format:
    """The format's numbers from torch.finfo (tf32: fp32's range, 10 mantissa bits)."""
    fi = torch.finfo(DTYPES[name])
    m = MANTISSA[name]
    bits = 19 if name == "tf32" else fi.bits
    eps = 2.0 ** -m
    return Format(name, bits, EXPONENT[name], m, float(fi.max), float(fi.tiny),
                  float(fi.tiny) * eps, eps)


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest value with a 10-bit mantissa (ties to even), still stored as fp32."""
    b = x.float().contiguous().view(torch.int32)
    drop = 23 - 10
    half = (1 << (drop - 1)) - 1 + ((b >> drop) & 1)               # round to nearest, ties even
    return ((b + half) & ~((1 << drop) - 1)).view(torch.float32)


def cast(x: torch.Tensor, name: str) -> torch.Tensor:
    """x rounded to the format and back to fp32: what the format can hold of x. Values beyond
    max saturate (clamped first: a plain cast to e5m2 gives inf, and e4m3fn has no inf at all)."""
    if name == "fp32":
        return x.float()
    if name == "tf32":
        return round_tf32(x)
    f = info(name)
    return x.float().clamp(-f.max, f.max).to(DTYPES[name]).float()


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| (Frobenius), in float64: the error measure of every precision
    experiment in labkit.precision."""
    y, ref = y.double(), ref.double()
    return float((y - ref).norm() / ref.norm())


def spacing(x, name: str) -> torch.Tensor:
    """ulp at |x| in the format: the gap to the next representable number (subnormals included)."""
    x = torch.as_tensor(x, dtype=torch.float64).abs()
    f = info(name)
    e = torch.floor(torch.log2(x.clamp(min=f.tiny)))                  # subnormals: emin
    return torch.pow(2.0, e - f.mantissa_bits)


def representable(name: str, lo: float, hi: float) -> torch.Tensor:
    """Every positive value of an 8-bit format in [lo, hi] (all 256 bit patterns, decoded)."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = bits.view(DTYPES[name]).float()
    v = v[torch.isfinite(v) & (v > 0)]
    return torch.unique(v[(v >= lo) & (v <= hi)])


def table() -> list[dict]:
    """One row per format, for the chapter's table."""
    rows = []
    for n in DTYPES:
        f = info(n)
        rows.append({"format": n, "bits": f.bits, "exp": f.exponent_bits, "mant": f.mantissa_bits,
                     "max": f.max, "min normal": f.tiny, "min subnormal": f.smallest,
                     "eps": f.eps, "digits": round(f.decimal_digits, 1)})
    return rows
