"""Checkers for chapter 01: ring reduce-scatter, ring all-gather, ring all-reduce.

The reader writes, with dist.send/recv (or isend/irecv) only:
    reduce_scatter(x) -> this rank's chunk of the sum, cut by labkit.collectives.chunk_bounds
    all_gather(chunk, sizes) -> every rank's chunk concatenated in rank order
    all_reduce(x) -> x, summed over ranks in place
Each is run on real processes at several world sizes and awkward sizes (1 element, sizes that
N does not divide) and compared with torch.distributed's built-in on the same data. A function
whose source calls a collective fails with a hint (the source is read with ast; torch is not
patched). Each rank notes which call it is in (labkit.launch.note), so a hang report names it
beside the stack line each rank was stuck on.
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

COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
               "all_gather_into_tensor", "broadcast", "reduce", "gather", "scatter", "all_to_all",
               "all_to_all_single")


def collectives_called(fn) -> list:
    """Names of torch.distributed collectives `fn`'s own source calls (read, not run: nothing in
    torch is patched). Empty when the source cannot be read."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return []
    return sorted({node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
                   and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES})


def _job(kind, fn, numels):
    from labkit.launch import note

    out = []
    for i, numel in enumerate(numels):
        note(f"your {kind.replace('_', '-')} of {numel} elements (call {i + 1} of {len(numels)})")
        out.append(_one(kind, fn, numel))
    return out


def _one(kind, fn, numel):
    """Rank side: the reader's function and the built-in on the same integer-valued data, on this
    rank's device (drawn on the CPU, the same numbers anywhere); results come back on the CPU."""
    import torch
    import torch.distributed as dist

    from labkit.collectives import chunk_bounds
    from labkit.launch import device

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(17 * numel + rank)
    x = torch.randint(-9, 10, (numel,), generator=g, device="cpu").float().to(device())
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
    return {"got": got.cpu() if isinstance(got, torch.Tensor) else got, "want": want.cpu(),
            "input": x.cpu(), "inplace": mine.cpu(), "rank": rank}


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
    used = collectives_called(fn)
    for n, numels in cases:
        with c.case(f"{n} ranks, tensors of {' and '.join(map(str, numels))} elements"):
            if used:
                fail(f"your function calls {', '.join('dist.' + u for u in used)}: build the "
                     f"ring from point-to-point messages only (isend/irecv or send/recv)")
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
