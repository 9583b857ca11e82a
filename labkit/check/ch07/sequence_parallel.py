"""Exercise 7.2: sequence parallelism's all-gather / reduce-scatter pair, on real processes.

    labkit.check.ch07.sp_pair(sp_gather[, sp_reduce_scatter])   # tp = 2, 3, 4

The pair runs on ranks with a different upstream gradient on every rank, so a backward that only
slices (forgets to sum over ranks) is caught.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.check import Checker, fail, graded
from labkit.context import reduce_scatter_sequence
from labkit.launch import device, note

EXERCISE, TITLE, POINTS = "7.2", "sequence parallelism's all-gather / reduce-scatter pair", 3
HANG_TIMEOUT = 30.0


def _draws(T, B, h, tp):
    """The whole sequence, every rank's dy, partial sums and dz: the same numbers on the ranks and
    in the checker (a seeded CPU generator, drawn in this order)."""
    g = torch.Generator().manual_seed(T)
    full = torch.randn(B, T, h, generator=g)                  # (B, T, h)
    up = torch.randn(tp, B, T, h, generator=g)                # a dy per rank
    parts = torch.randn(tp, B, T, h, generator=g)             # rank r's partial sums
    up2 = torch.randn(tp, B, T // tp, h, generator=g)         # a dz per rank
    return full, up, parts, up2


def expected(T, B, h, tp, rank) -> dict:
    """What rank `rank` must get, computed where the checker runs (under labkit grade: the
    judge, where no student code runs)."""
    full, up, parts, up2 = _draws(T, B, h, tp)
    n = T // tp
    return {"gather": full, "gather_grad": up.sum(0)[:, rank * n:(rank + 1) * n],
            "scatter": parts.sum(0)[:, rank * n:(rank + 1) * n],
            "scatter_grad": torch.cat(list(up2), dim=1)}


def _sp_job(gather_fn, scatter_fn, T, B, h):
    rank, tp, dev = dist.get_rank(), dist.get_world_size(), device()
    full, up, parts, up2 = _draws(T, B, h, tp)   # cpu: the same numbers on any device
    n = T // tp
    mine = full[:, rank * n:(rank + 1) * n].clone().to(dev).requires_grad_()  # (B, T/tp, h)
    note("your sp_gather")
    y = gather_fn(mine, None)
    y.backward(up[rank].to(dev))
    out = {"gather": y.detach().cpu(), "gather_grad": mine.grad.cpu(), "rank": rank}
    x = parts[rank].clone().to(dev).requires_grad_()          # (B, T, h)
    note("your sp_reduce_scatter")
    z = scatter_fn(x, None)
    z.backward(up2[rank].to(dev))
    out.update(scatter=z.detach().cpu(), scatter_grad=x.grad.cpu())
    return out


SP_HINTS = {
    "gather": "sp_gather's forward: every rank's (B, T/tp, h) piece, concatenated along the "
              "sequence (dim 1) in rank order",
    "gather_grad": "sp_gather's backward: each rank's dy is different, and every rank used your "
                   "piece. Which gradient pieces must be added, and which collective adds and "
                   "splits at once?",
    "scatter": "sp_reduce_scatter's forward: the sum over ranks, this rank keeps its T/tp rows",
    "scatter_grad": "sp_reduce_scatter's backward: every row of x fed one rank's output; where are "
                    "the gradients of the rows you did not keep?",
}


@graded("7.2", answers=("gather_fn", "scatter_fn"))
def sp_pair(gather_fn, scatter_fn=None):
    """Exercise 7.2: gather_fn(x, group) all-gathers the sequence forward and reduce-scatters the
    gradient backward; scatter_fn(x, group) the reverse (None: labkit's own,
    labkit.context.reduce_scatter_sequence). group None: the whole world."""
    scatter_fn = scatter_fn or reduce_scatter_sequence
    c = Checker(EXERCISE, TITLE, POINTS)
    for tp, T, B, h in [(2, 8, 2, 4), (3, 9, 1, 5), (4, 8, 2, 3)]:
        with c.case(f"tp={tp}, T={T}"):
            res = c.launch(_sp_job, tp, args=(gather_fn, scatter_fn, T, B, h),
                           timeout=HANG_TIMEOUT)
            for rank, r in enumerate(res):
                wants = expected(T, B, h, tp, rank)
                for key, hint in SP_HINTS.items():
                    got, want = r[key], wants[key]
                    if got.shape != want.shape:
                        fail(f"rank {r['rank']}: {key} has shape {tuple(got.shape)}, expected "
                             f"{tuple(want.shape)}. {hint}")
                    if not torch.allclose(got, want, atol=1e-5):
                        fail(f"rank {r['rank']}: {key} is wrong. {hint}")
    return c.finish()
