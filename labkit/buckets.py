"""The one gradient-bucket rule: chapter 02's DDP, chapter 03's ZeRO-2, exercises 2.1 and 3.2.

    assign_buckets([4, 4, 4, 100, 4], cap=8)   # -> [[0, 1], [2, 3], [4]]: indices into the sizes

Sizes are bytes, in the order the gradients become ready (DDP and ZeRO-2 pass their parameters
last-registered first, roughly the order backward finishes them). A parameter joins the open
bucket; the bucket closes as soon as its bytes REACH its cap (>=), so a bucket ends with the
parameter that filled it, may pass the cap by that one parameter, and a parameter at least as
large as the cap closes a bucket alone (cap 0: one parameter per bucket; cap None: one bucket).
`first_cap` is the cap of each kind's first bucket, the caps after it are `cap`. Tensors of
another kind (dtype, device) fill buckets of their own, and the buckets come out ordered by
their first parameter's position.

This is PyTorch's rule, `compute_bucket_assignment_by_size` in
torch/csrc/distributed/c10d/reducer.cpp: one accumulator per BucketKey(scalar_type, device),
`bucket.size += tensor.numel() * tensor.element_size()`, then `if (bucket.size >=
bucket_size_limit)` close it and advance to the next limit (limits [first_bucket_bytes_cap,
bucket_bytes_cap], torch/nn/parallel/distributed.py; the first is 1 MiB,
dist._DEFAULT_FIRST_BUCKET_BYTES, only when bucket_cap_mb is left at its default), remaining
buckets added, sorted by their smallest index. DDP's `bucket_cap_mb` is MiB, turned into bytes
as PyTorch does: int(bucket_cap_mb * 2**20) (`cap_bytes`). tests/test_buckets.py compares this
function with torch.distributed._compute_bucket_assignment_by_size on several parameter lists.
Pure Python (no torch), so that a checker or the website can import it.
"""
from __future__ import annotations

MiB = 2**20


def cap_bytes(bucket_mb: float | None) -> int | None:
    """A cap in MiB (PyTorch's `bucket_cap_mb`) as bytes, int(mb * 2**20) as PyTorch; None: none."""
    if bucket_mb is None:
        return None
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb={bucket_mb}: give a positive size in MiB (e.g. 25.0), or "
                         "None for one bucket holding every gradient")
    return int(bucket_mb * MiB)


def assign_buckets(nbytes, cap: int | None, *, first_cap: int | None = None,
                   keys=None) -> list[list[int]]:
    """Buckets of indices into `nbytes` (bytes, in gradient-ready order), by the rule above.

    cap: bytes (None: no cap, one bucket per kind); first_cap: the first bucket's cap of each
    kind (None: `cap`); keys: one hashable per size (dtype, device), or None for one kind."""
    for name, value in (("cap", cap), ("first_cap", first_cap)):
        if value is not None and not value >= 0:
            raise ValueError(f"{name}={value}: give a bucket cap in bytes >= 0 (e.g. "
                             f"{25 * MiB} for PyTorch's 25 MiB), or None for no cap")
    inf = float("inf")
    limits = [inf if cap is None else cap]
    if first_cap is not None:
        limits.insert(0, first_cap)
    keys = [None] * len(nbytes) if keys is None else list(keys)
    if len(keys) != len(nbytes):
        raise ValueError(f"{len(keys)} keys for {len(nbytes)} sizes: give one key per size")
    open_, closed, limit_at = {}, [], {}   # key -> [indices, bytes]; key -> index into limits
    for i, (size, key) in enumerate(zip(nbytes, keys)):
        bucket = open_.setdefault(key, [[], 0])
        bucket[0].append(i)
        bucket[1] += size
        at = limit_at.setdefault(key, 0)
        if bucket[1] >= limits[at]:              # reached its cap: it closes with this one
            closed.append(bucket[0])
            del open_[key]
            limit_at[key] = min(at + 1, len(limits) - 1)
    closed += [indices for indices, _ in open_.values()]
    return sorted(closed, key=min)
