"""Bytes per value of each number format the cost models name, written once (roofline byte counts,
precision recipes, communication volumes). fp8 is either E4M3 or E5M2: one byte each."""
from __future__ import annotations

BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def itemsize(dtype) -> int:
    """Bytes per value of `dtype` (a name in BYTES, or an int of bytes, returned as is)."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        return dtype
    if dtype not in BYTES:
        raise KeyError(f"unknown dtype {dtype!r}; choose one of {', '.join(BYTES)} or bytes")
    return BYTES[dtype]
