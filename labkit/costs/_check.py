"""The two argument checks every cost formula makes, written once: a count (ranks, degrees,
lengths) is a positive int, not a bool or a float; a size or a rate is a positive number.

    positive_ints(dp=dp, tp=tp)        # ValueError: "tp must be a positive integer, got 0"
    positive(bandwidth=bw)             # ValueError: "bandwidth=-1 must be a positive number"
"""
from __future__ import annotations


def positive_ints(**counts) -> None:
    """Refuse any value that is not an int >= 1 (True is not a count)."""
    for name, v in counts.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def positive(**values) -> None:
    """Refuse any value that is not a number > 0 (int or float; True is not a number here)."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{name}={v!r} must be a positive number")
