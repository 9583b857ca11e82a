"""Checkers for chapter 01: ring reduce-scatter, ring all-gather, ring all-reduce.

The reader writes, with dist.send/recv (or isend/irecv) only:
    reduce_scatter(x) -> this rank's chunk of the sum, cut by labkit.collectives.chunk_bounds
    all_gather(chunk, sizes) -> every rank's chunk concatenated in rank order
    all_reduce(x) -> x, summed over ranks in place
Each is run on real processes at several world sizes and awkward sizes (1 element, sizes that
N does not divide) and compared with torch.distributed's built-in on the same data. While it
runs, every send and receive is counted, so a hang says which step each rank was on.
"""
from __future__ import annotations

from labkit.check import Checker, fail

EXERCISES = {
    "1.1": ("ring reduce-scatter", 3),
    "1.2": ("ring all-gather", 3),
    "1.3": ("ring all-reduce", 4),
}

CASES = [(2, (8, 1)), (3, (10, 37)), (4, (1, 23))]  # (world size, element counts): one launch each
HANG_TIMEOUT = 20.0  # seconds; a correct ring finishes these cases in well under one


def _trace_p2p():
    """Wrap dist's point-to-point calls so each rank's latest one is its hang note."""
    import torch.distributed as dist

    from labkit.launch import note

    counts = {"send": 0, "recv": 0}

    def wrap(name, kind, peer_key):
        real = getattr(dist, name)

        def traced(tensor, *args, **kwargs):
            counts[kind] += 1
            peer = kwargs.get(peer_key, kwargs.get("group_" + peer_key, args[0] if args else "?"))
            note(f"{name} #{counts[kind]} ({'to' if kind == 'send' else 'from'} rank {peer}, "
                 f"{tensor.numel()} elements)")
            return real(tensor, *args, **kwargs)

        setattr(dist, name, traced)

    for name, kind, key in [("send", "send", "dst"), ("isend", "send", "dst"),
                            ("recv", "recv", "src"), ("irecv", "recv", "src")]:
        wrap(name, kind, key)
    return counts


def _job(kind, fn, numels):
    _trace_p2p()
    return [_one(kind, fn, numel) for numel in numels]


def _one(kind, fn, numel):
    """Rank side: the reader's function and the built-in on the same integer-valued data."""
    import torch
    import torch.distributed as dist

    from labkit.collectives import chunk_bounds

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(17 * numel + rank)
    x = torch.randint(-9, 10, (numel,), generator=g).float()
    total = x.clone()
    dist.all_reduce(total)
    bounds = chunk_bounds(numel, n)
    lo, hi = bounds[rank]
    mine = x.clone()
    if kind == "reduce_scatter":
        got = fn(mine)
        want = total[lo:hi]
    elif kind == "all_gather":
        got = fn(total[lo:hi].clone(), [b - a for a, b in bounds])
        want = total
    else:
        got = fn(mine)
        want = total
    return {"got": got, "want": want, "input": x, "inplace": mine, "rank": rank}


def _compare(kind, results, n, numel):
    import torch

    for r in results:
        got, want = r["got"], r["want"]
        if kind == "all_reduce" and got is None:
            got = r["inplace"]
        if not isinstance(got, torch.Tensor):
            fail(f"rank {r['rank']} returned {type(got).__name__}; return a tensor")
        if got.numel() != want.numel():
            hint = {"reduce_scatter": f"rank r returns only its chunk: chunk_bounds({numel}, {n})"
                                      f"[r] gives its (start, end)",
                    "all_gather": "the result holds every rank's chunk, concatenated in rank order",
                    "all_reduce": "the result has the input's size"}[kind]
            fail(f"rank {r['rank']}: got {got.numel()} elements, expected {want.numel()}. {hint}")
        got = got.reshape(-1).to(want.dtype)
        if not torch.equal(got, want):
            if kind != "all_gather" and torch.equal(got, r["input"].reshape(-1)[:got.numel()]):
                fail(f"rank {r['rank']}: the result is still this rank's own input: add each "
                     f"received chunk into your copy")
            bad = (got != want).nonzero().reshape(-1)
            fail(f"rank {r['rank']} of {n}: {len(bad)} of {want.numel()} values wrong (first at "
                 f"index {bad[0].item()}: got {got[bad[0]].item():g}, expected "
                 f"{want[bad[0]].item():g}). At step s rank r should send chunk (r - s - 1) mod N"
                 f"{' and receive (r - s - 2) mod N' if kind != 'all_gather' else ''}; "
                 f"with uneven sizes use chunk_bounds for every chunk")
        if kind == "all_reduce" and not torch.equal(r["inplace"].reshape(-1), want):
            fail(f"rank {r['rank']}: all_reduce must work in place, like dist.all_reduce: "
                 f"write the result into the tensor you were given")


def _check(exercise, kind, fn, cases=CASES):
    title, points = EXERCISES[exercise]
    c = Checker(exercise, title, points)
    for n, numels in cases:
        with c.case(f"{n} ranks, tensors of {' and '.join(map(str, numels))} elements"):
            per_rank = c.launch(_job, n, args=(kind, fn, numels), timeout=HANG_TIMEOUT)
            for i, numel in enumerate(numels):
                _compare(kind, [r[i] for r in per_rank], n, numel)
    return c.finish()


def ring_reduce_scatter(fn):
    """Exercise 1.1: fn(x) -> this rank's chunk of the sum over ranks."""
    return _check("1.1", "reduce_scatter", fn)


def ring_all_gather(fn):
    """Exercise 1.2: fn(chunk, sizes) -> every rank's chunk concatenated in rank order."""
    return _check("1.2", "all_gather", fn)


def ring_all_reduce(fn):
    """Exercise 1.3: fn(x) sums x over ranks in place (and may return it)."""
    return _check("1.3", "all_reduce", fn)
