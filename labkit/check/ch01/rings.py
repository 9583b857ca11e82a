"""Exercises 1.1 and 1.2, the two halves of a ring all-reduce (one module: they share their rank
job, their comparison with torch.distributed and their byte bound):

    labkit.check.ch01.ring_reduce_scatter(reduce_scatter)   # -> this rank's chunk of the sum
    labkit.check.ch01.ring_all_gather(all_gather)           # -> every rank's chunk, in rank order

With dist.send/recv (or isend/irecv) only. Both run on real processes at 2 and 3 ranks and a
hidden 4, with awkward sizes (1 element, sizes that N does not divide, fewer elements than ranks)
and one of 100,003 elements, and are compared with torch.distributed's built-in on the same data.
Watched from outside the reader's code: the collectives called (a dispatch mode refuses any,
observe.dispatch; the source is also read, so the refusal comes before any launch), the bytes
each rank sent (the kernel's socket counters, observe.netcount) against the ring's optimum plus a
small slack, and the use of labkit.collectives (the answer, already written). Each rank notes
which call it is in (labkit.launch.note), so a hang report names it beside the stack line each
rank was stuck on.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.check import Checker, Forbidden, Refused, collectives_refusal, fail, graded
from labkit.launch import device, note
from labkit.observe import netcount
from labkit.observe.dispatch import CollectiveLog

EXERCISES = {"1.1": ("ring reduce-scatter", 3), "1.2": ("ring all-gather", 3)}
# (world size, element counts): one launch each; the 4-rank case is hidden
CASES = [(2, (8, 1, 100_003)), (3, (10, 37, 100_003)), (4, (1, 23, 65_537))]
SHOWN_WORLDS = (2, 3)
HANG_TIMEOUT = 20.0  # seconds; a correct ring finishes these cases in well under one
BYTES_SLACK = 0.05   # over the optimum: the few header bytes Gloo adds per message
HEADER_BYTES = 512   # per message, absolute (Gloo's header is under 200 bytes)
FORBIDDEN = Forbidden(("labkit.collectives",), why="that ring is already written; write yours "
                      "from isend/irecv (your own chunk_bounds included)")


def _job(kind, fn, numels):
    out = []
    for i, numel in enumerate(numels):
        note(f"your {kind.replace('_', '-')} of {numel} elements (call {i + 1} of {len(numels)})")
        out.append(_one(kind, fn, numel))
    return out


def rank_input(numel: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s integer-valued data (CPU): drawn the same on the ranks and in the checker."""
    g = torch.Generator().manual_seed(17 * numel + rank)
    return torch.randint(-9, 10, (numel,), generator=g, device="cpu").float()   # (numel,)


def expected(kind: str, numel: int, n: int, rank: int) -> torch.Tensor:
    """What rank `rank` must return, computed where the checker runs (under labkit grade: the
    judge, where no student code runs), from the same data the ranks drew."""
    total = sum(rank_input(numel, r) for r in range(n))   # (numel,) the sum over ranks, exact
    lo, hi = chunk_bounds(numel, n)[rank]
    return total if kind != "reduce_scatter" else total[lo:hi]


def _one(kind, fn, numel):
    """Rank side: the reader's function on integer-valued data, on this rank's device (drawn on
    the CPU, the same numbers anywhere); its result comes back on the CPU. The reader's call runs
    inside the kernel's byte counter and a dispatch mode that refuses collectives. What it should
    return is computed by the checker (expected), not here beside the reader's code."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = rank_input(numel, rank).to(device())   # (numel,)
    bounds = chunk_bounds(numel, n)
    lo, hi = bounds[rank]
    if kind == "all_gather":   # the input: this rank's chunk of the sum, made from the same data
        total = sum(rank_input(numel, r) for r in range(n)).to(device())   # (numel,)
        args = (total[lo:hi].clone(), [b - a for a, b in bounds])
    else:
        args = (x.clone(),)
    dist.barrier()
    with netcount.socket_bytes() as net, \
            CollectiveLog(allow=(), error=Refused,
                          why="build the ring from isend/irecv (or send/recv) only"):
        got = fn(*args)
    return {"got": got.cpu() if isinstance(got, torch.Tensor) else got, "rank": rank,
            "sent": net.sent}


def chunk_bounds(numel: int, n: int) -> list:
    """[(start, end)] of n chunks covering numel elements; the first numel % n one longer."""
    base, extra = divmod(numel, n)
    starts = [r * base + min(r, extra) for r in range(n + 1)]
    return list(zip(starts[:-1], starts[1:]))


def optimal_sent(kind: str, numel: int, n: int, itemsize: int = 4) -> float:
    """The most bytes a rank of a ring sends: N-1 steps of at most one (largest) chunk each."""
    biggest = -(-numel // n) * itemsize
    return (n - 1) * biggest


def _compare(kind, results, n, numel):
    for rank, r in enumerate(results):
        if r.get("rank") != rank:
            fail(f"rank {rank}'s result came back as rank {r.get('rank')!r}'s")
        got, want = r["got"], expected(kind, numel, n, rank)
        if not isinstance(got, torch.Tensor):
            fail(f"rank {r['rank']} returned {type(got).__name__}; return a tensor")
        if got.numel() != want.numel():
            hint = {"reduce_scatter": f"rank r returns only its chunk r; with {numel} elements "
                                      f"over {n} ranks the chunks have "
                                      f"{[b - a for a, b in chunk_bounds(numel, n)]} elements",
                    "all_gather": "the result holds every rank's chunk, concatenated in rank "
                                  "order"}[kind]
            fail(f"rank {r['rank']}: got {got.numel()} elements, expected {want.numel()}. {hint}")
        got = got.reshape(-1).to(want.dtype)
        if not torch.equal(got, want):
            if kind != "all_gather" and torch.equal(got, rank_input(numel, rank)[:got.numel()]):
                fail(f"rank {r['rank']}: the result is still this rank's own input: add each "
                     f"received chunk into your copy")
            bad = (got != want).nonzero().reshape(-1)
            fail(f"rank {r['rank']} of {n}: {len(bad)} of {want.numel()} values wrong (first at "
                 f"index {bad[0].item()}: got {got[bad[0]].item():g}, expected "
                 f"{want[bad[0]].item():g}). At step s, which chunk does rank r send, and which "
                 f"does it receive: is the one it receives the one its left neighbour just "
                 f"sent? With {numel} elements over {n} ranks, are your chunks "
                 f"{[b - a for a, b in chunk_bounds(numel, n)]} elements long?")
    for r in results:
        if r["sent"] is None:
            continue                                   # NCCL: no TCP counter sees it
        steps = n - 1
        best = optimal_sent(kind, numel, n)
        allowed = best * (1 + BYTES_SLACK) + HEADER_BYTES * steps
        if r["sent"] > allowed:
            fail(f"rank {r['rank']} of {n} sent {r['sent']:,} bytes (the kernel's count) for "
                 f"{numel} elements; a ring sends at most {best:,.0f} (+{BYTES_SLACK:.0%} and "
                 f"{HEADER_BYTES} B per message allowed: {allowed:,.0f}). Does every step send "
                 f"ONE chunk, never the whole tensor?")


def _check(exercise, kind, fn, cases=CASES, helpers=()):
    title, points = EXERCISES[exercise]
    c = Checker(exercise, title, points)
    c.refuse(collectives_refusal(fn, "build the ring from point-to-point messages only "
                                     "(isend/irecv or send/recv)")
             or FORBIDDEN.refusal(fn, *helpers))
    for n, numels in cases:
        shown = n in SHOWN_WORLDS
        with c.case(f"{n} ranks, tensors of {', '.join(map(str, numels))} elements" if shown
                    else "hidden case"):
            per_rank = c.launch(_job, n, args=(kind, fn, numels), timeout=HANG_TIMEOUT)
            for i, numel in enumerate(numels):
                _compare(kind, [r[i] for r in per_rank], n, numel)
    return c.finish()


@graded("1.1")
def ring_reduce_scatter(fn, cases=CASES):
    """Exercise 1.1: fn(x) -> this rank's chunk of the sum over ranks."""
    return _check("1.1", "reduce_scatter", fn, cases)


@graded("1.2")
def ring_all_gather(fn, cases=CASES):
    """Exercise 1.2: fn(chunk, sizes) -> every rank's chunk concatenated in rank order."""
    return _check("1.2", "all_gather", fn, cases)
