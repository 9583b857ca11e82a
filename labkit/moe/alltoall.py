"""All-to-all from point-to-point sends and receives, beside dist.all_to_all_single.

    out = all_to_all(x, out_splits, in_splits, group, schedule="pairwise")   # (sum out_splits, ...)

Rank r's input x holds in_splits[j] rows for each rank j (in rank order); its output holds
out_splits[j] rows from each rank j. Two schedules:

  naive     post every send and every receive at once (one batch): simple, but all n-1 peers
            write to one rank at the same moment, and every message is in flight together
  pairwise  n-1 steps; at step s rank r sends to r+s and receives from r-s (mod n), so every
            rank talks to exactly one peer per direction per step, like a ring's steps
            (the schedule NCCL and MPI use for large all-to-alls)

Its own rows stay local (a copy, no message). Counts must be known on both sides first: expert
parallelism exchanges them with a small all-to-all of integers before the rows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.collectives import exchange

SCHEDULES = ("naive", "pairwise")


def _offsets(splits):
    out, acc = [], 0
    for s in splits:
        out.append(acc)
        acc += s
    return out


def all_to_all(x: torch.Tensor, out_splits, in_splits, group=None,
               schedule: str = "pairwise", p2p=exchange) -> torch.Tensor:
    """p2p: how the sends and receives are posted (labkit.collectives.exchange; a
    labkit.shaped.Shaper's exchange gives every rank a link of limited bandwidth)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(in_splits) != n or len(out_splits) != n:
        raise ValueError(f"need one split per rank ({n}), got in_splits={list(in_splits)} "
                         f"and out_splits={list(out_splits)}")
    if sum(in_splits) != x.shape[0]:
        raise ValueError(f"in_splits add up to {sum(in_splits)} rows, x has {x.shape[0]}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))      # (sum out_splits, ...)
    io, oo = _offsets(in_splits), _offsets(out_splits)
    out[oo[rank]:oo[rank] + out_splits[rank]] = x[io[rank]:io[rank] + in_splits[rank]]

    def ops_with(to, frm):
        ops = []
        if in_splits[to]:
            ops.append((dist.isend, x[io[to]:io[to] + in_splits[to]], to, group))
        if out_splits[frm]:
            ops.append((dist.irecv, out[oo[frm]:oo[frm] + out_splits[frm]], frm, group))
        return ops

    if schedule == "naive":
        ops = []
        for s in range(1, n):
            ops += ops_with((rank + s) % n, (rank - s) % n)
        for w in p2p(ops, where="all-to-all naive"):
            w.wait()
    else:
        for s in range(1, n):
            for w in p2p(ops_with((rank + s) % n, (rank - s) % n),
                         where=f"all-to-all step {s}"):
                w.wait()
    return out
