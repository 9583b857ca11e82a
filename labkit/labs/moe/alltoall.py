"""Timing labkit.moe.alltoall's schedules beside dist.all_to_all_single, on real ranks.

    from labkit.launch import run
    from labkit.labs.moe.alltoall import bench_job
    per_rank = run(bench_job, 4, args=(numel_per_peer, repeats))
    per_rank[0]["seconds"]["pairwise"], per_rank[0]["equal"]["naive"]

Rank side only (call inside labkit.launch.run); `labkit bench moe` and chapter 08 run it.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from labkit.launch import device
from labkit.moe.alltoall import SCHEDULES, all_to_all
from labkit.timing import now


def bench_job(numel_per_peer: int, repeats: int, schedules=("builtin",) + SCHEDULES) -> dict:
    """On each rank: median seconds of an all-to-all moving numel_per_peer float32 elements to
    every peer, for the built-in and each hand-written schedule; and whether they agree."""
    torch.set_num_threads(1)
    dev, n, rank = device(), dist.get_world_size(), dist.get_rank()
    x = torch.arange(n * numel_per_peer, dtype=torch.float32, device=dev) + 1e6 * rank
    splits = [numel_per_peer] * n
    ref = torch.empty_like(x)
    dist.all_to_all_single(ref, x)
    times, same = {}, {}
    for name in schedules:
        ts = []
        for _ in range(repeats):
            dist.barrier()
            t0 = now(dev)
            if name == "builtin":
                out = torch.empty_like(x)
                dist.all_to_all_single(out, x)
            else:
                out = all_to_all(x, splits, splits, schedule=name)
            ts.append(now(dev) - t0)
        times[name] = statistics.median(ts)
        same[name] = bool(torch.equal(out, ref))
    return {"seconds": times, "equal": same}
