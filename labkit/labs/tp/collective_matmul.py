"""Time the collective matmul (labkit.tp.collective_matmul) against gather-then-multiply on real
ranks: chapter 04's measurement of what the decomposition hides.

    from labkit.labs.tp import collective_matmul as cmm
    run(cmm.time_job, 2, args=(256, 1024, 1024))   # medians of both, on real Gloo processes
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from labkit.launch import device
from labkit.observe import commlog
from labkit.tp.collective_matmul import allgather_matmul, collective_matmul


def _median_seconds(fn, repeats: int, group) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_job(m: int, k: int, n: int, repeats: int = 5, threads: int = 1, group=None) -> dict:
    """On each rank: both versions on rows (m, k) and a (k, n / N) weight slice, their outputs'
    largest difference, and the median seconds of each, alternating (same load for both);
    plus the matmul alone and the gather alone, to see what there was to hide."""

    torch.set_num_threads(threads)               # one core per rank: ranks do not share cores
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(m, k, generator=gen).to(device())            # cpu draw: same on any device
    w = torch.randn(k, n // size, generator=torch.Generator().manual_seed(100)).to(device())
    plain, overlapped = allgather_matmul(x, w, group), collective_matmul(x, w, group)
    gathered = torch.empty(size * m, k, device=device())
    fns = {"plain": lambda: allgather_matmul(x, w, group),
           "collective": lambda: collective_matmul(x, w, group),
           "matmul only": lambda: gathered @ w,
           "gather only": lambda: commlog.all_gather_into(gathered.view(-1), x.view(-1),
                                                          group=group)}
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_median_seconds(fn, 1, group))
    return {"max_diff": (plain - overlapped).abs().max().item(),
            **{name: statistics.median(t) for name, t in times.items()}}
