"""Exercise 0.2: YOUR shift_right runs on 2, 3 and 4 real ranks, with a 4 MB tensor among the
shapes (a blocking send first on every rank hangs there); collectives are refused while it runs.

    labkit.check.ch00.shift_right(shift_right)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.check import Checker, Refused, fail, graded, tensors_close
from labkit.launch import device, note
from labkit.observe.dispatch import CollectiveLog

EXERCISE, TITLE, POINTS = "0.2", "a first send/recv: shift right around a ring", 2
SHIFT_WORLDS = (2, 3, 4)            # 4: hidden
SHIFT_SHAPES = [(7,), (1, 4), (1_000_000,)]   # 4 MB: a blocking send waits for its receiver
SHIFT_TIMEOUT = 30.0


def _rank_data(r, shape, dev):
    """Rank r's tensor of this shape, the same on every rank that asks for it."""
    g = torch.Generator().manual_seed(1000 * r + len(shape))
    return torch.randn(shape, generator=g, device="cpu").to(dev)  # cpu: same anywhere


def _shift_job(fn, shapes):
    """Rank side: the reader's function on rank-dependent data, collectives refused; its result
    and x after the call go back (what they should be is computed by the checker)."""
    rank, dev = dist.get_rank(), device()
    out = []
    for shape in shapes:
        x = _rank_data(rank, shape, dev)   # shape
        note(f"your shift_right of a tensor of shape {shape}")
        with CollectiveLog(allow=(), error=Refused,
                           why="pass the tensor with send/recv (or isend/irecv)"):
            got = fn(x)
        out.append({"got": got.cpu() if isinstance(got, torch.Tensor) else got, "x": x.cpu()})
    return out


@graded("0.2")
def shift_right(fn, worlds=SHIFT_WORLDS):
    """Exercise 0.2: fn(x) -> the tensor of rank (rank - 1) mod N, by point-to-point messages."""
    c = Checker(EXERCISE, TITLE, POINTS)
    for world in worlds:
        name = f"{world} ranks, shapes {SHIFT_SHAPES}" if world < 4 else "hidden case"
        with c.case(name):
            rows = c.launch(_shift_job, world, args=(fn, SHIFT_SHAPES), timeout=SHIFT_TIMEOUT)
            for rank, per_shape in enumerate(rows):
                for shape, row in zip(SHIFT_SHAPES, per_shape):
                    what = f"rank {rank} of {world}, shape {shape}"
                    got, x = row["got"], row["x"]
                    # what rank r should hold, computed here (under labkit grade: the judge)
                    want = _rank_data((rank - 1) % world, shape, "cpu")   # shape
                    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                        fail(f"{what}: return a tensor of the input's shape, got "
                             f"{getattr(got, 'shape', type(got).__name__)}")
                    if world > 2 and torch.equal(got, _rank_data((rank + 1) % world, shape, "cpu")):
                        fail(f"{what}: you returned the RIGHT neighbour's tensor; whose tensor "
                             f"should rank r hold after a shift to the right?")
                    if not (isinstance(x, torch.Tensor) and torch.equal(x, _rank_data(rank, shape,
                                                                                      "cpu"))):
                        fail(f"{what}: the input x was overwritten; where should the incoming "
                             f"tensor land so that the caller keeps its data?")
                    tensors_close(got, want, rtol=0, atol=0,
                                  what=f"{what} (did you wait for the receive to complete?)")
    return c.finish()
