"""All-reduce on this machine's ranks: a size sweep, bus bandwidth, and the alpha-beta fit.

    from labkit.calibrate import comm
    comm.sweep(2, sizes=(2**16, 2**22))     # {"ranks", "backend", "rows", "alpha", "bandwidth"}

N ranks (labkit.launch.run: NCCL with one GPU per rank, else Gloo on the CPU) time
`dist.all_reduce` of float32 buffers; a repeat lasts as long as its slowest rank, and the median
over repeats is the time. Bus bandwidth is NCCL's busbw (labkit.costs.comm.busbw: the buffer over
the time, times 2(N-1)/N). The fit is labkit.costs.comm.fit_alpha_beta, the least-squares line
t = a + bytes / bandwidth that the crossover labs fall back to and overlap_cp uses, fed the
bytes one rank sends (2(N-1)/N D) against the time; a, over the ring's 2(N-1) steps, is the
alpha per message that costs.comm.ring_time, the planner's clusters and the crossover labs use.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from labkit.costs import comm as costs_comm
from labkit.launch import device, run
from labkit.timing import now

CPU_SIZES = (2**14, 2**16, 2**18, 2**20, 2**22, 2**24)       # 16 KiB .. 16 MiB
GPU_SIZES = (2**20, 2**22, 2**24, 2**26, 2**28, 2**30)       # 1 MiB .. 1 GiB
QUICK_SIZES = (2**14, 2**20)


def all_reduce_times(numels, repeats: int) -> dict:
    """Rank side: seconds of each repeat of one dist.all_reduce per size (each repeat starts at a
    barrier), after a warm-up call; and where it ran."""


    dev = device()
    out = []
    for numel in numels:
        x = torch.ones(numel, device=dev)                   # (numel,) float32
        dist.all_reduce(x)                                  # warm-up: connections, buffers
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = now(dev)
            dist.all_reduce(x)
            times.append(now(dev) - t0)
        out.append(times)
    return {"times": out, "backend": dist.get_backend(), "device": str(dev)}


def sweep(ranks: int, sizes=CPU_SIZES, repeats: int = 5, timeout: float = 300.0) -> dict:
    """All-reduce times on `ranks` ranks for each size (bytes), busbw, and the alpha-beta fit."""

    numels = [max(1, int(b) // 4) for b in sizes]
    per_rank = run(all_reduce_times, ranks, args=(numels, repeats), echo=False, timeout=timeout)
    rows = []
    for i, numel in enumerate(numels):
        reps = [max(r["times"][i][j] for r in per_rank) for j in range(repeats)]
        t, nbytes = statistics.median(reps), 4 * numel
        rows.append({"bytes": nbytes, "seconds": t,
                     "busbw": costs_comm.busbw("all_reduce", nbytes, ranks, t)})
    out = {"ranks": ranks, "backend": per_rank[0]["backend"], "device": per_rank[0]["device"],
           "rows": rows, "alpha": None, "bandwidth": None, "fit_error": None}
    sent = [costs_comm.ring_bytes_sent_per_rank("all_reduce", r["bytes"], ranks) for r in rows]
    try:
        a, bw = costs_comm.fit_alpha_beta(sent, [r["seconds"] for r in rows])
    except ValueError as err:                   # noisy times on a busy machine: said, not hidden
        out["fit_error"] = str(err)
        return out
    out["alpha"] = a / costs_comm.ring_steps("all_reduce", ranks)
    out["bandwidth"] = bw
    for r in rows:
        r["model_seconds"] = costs_comm.ring_time("all_reduce", r["bytes"], ranks, out["alpha"], bw)
        r["ratio"] = r["seconds"] / r["model_seconds"]
    return out
