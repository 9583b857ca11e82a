"""Cut n things into `parts` contiguous runs as evenly as possible: the one even split.

    even_bounds(10, 3, 0)     # (0, 4): the first 10 % 3 parts are one longer
    even_sizes(10, 3)         # [4, 3, 3]
    even_ranges(10, 3)        # [(0, 4), (4, 7), (7, 10)]

Rows of a batch over data-parallel ranks (labkit.model.shard_rows), micro-batches, a ring's
chunks (labkit.collectives), a pipeline's blocks over its chunks, a checkpoint's flat shards and
a sequence over context-parallel ranks (plain layout) all split this way, so a rank and the
formula that predicts its bytes agree on who holds what.
"""
from __future__ import annotations


def even_bounds(n: int, parts: int, i: int) -> tuple[int, int]:
    """[lo, hi) of part i of n split into `parts` runs; the first n % parts are one longer."""
    if parts < 1 or not 0 <= i < parts:
        raise ValueError(f"part {i} of {parts}: need parts >= 1 and 0 <= i < parts")
    base, extra = divmod(n, parts)
    lo = i * base + min(i, extra)
    return lo, lo + base + (1 if i < extra else 0)


def even_sizes(n: int, parts: int) -> list:
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def even_ranges(n: int, parts: int) -> list:
    return [even_bounds(n, parts, i) for i in range(parts)]
