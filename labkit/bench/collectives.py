"""Benchmark: labkit's ring all-reduce vs the built-in vs the parameter server.

    labkit bench collectives [--ranks 2 4] [--sizes-mib 1 4 16 64] [--repeats 5]

Times each algorithm on the same buffer in the same run, interleaved, and reports bus bandwidth
(nccl-tests' convention, labkit.costs.comm.busbw) and the ratio to `dist.all_reduce`. The
notebook of chapter 01 calls `measure` directly.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.cliargs import bench_parser, positive
from labkit.collectives import Traffic, parameter_server_all_reduce, ring_all_reduce
from labkit.costs import comm
from labkit.launch import device, run
from labkit.table import table as format_table
from labkit.timing import now

ALGORITHMS = ("builtin", "ring", "parameter_server")


def _time_on_ranks(sizes_bytes, algorithms, repeats, dtype_name="float32"):
    """Rank side: min-of-repeats seconds per (size, algorithm), plus bytes this rank moved.
    The buffer lives on labkit.launch.device() (this rank's GPU under NCCL, else the CPU)."""


    fns = {"builtin": lambda x, t: dist.all_reduce(x),
           "ring": lambda x, t: ring_all_reduce(x, traffic=t),
           "parameter_server": lambda x, t: parameter_server_all_reduce(x, traffic=t)}
    dtype = getattr(torch, dtype_name)
    out = []
    for nbytes in sizes_bytes:
        numel = max(1, int(nbytes) // (torch.finfo(dtype).bits // 8))
        dev = device()
        x = torch.ones(numel, dtype=dtype, device=dev)
        best = {a: float("inf") for a in algorithms}
        traffic = {}
        for a in algorithms:  # warm-up: connections, allocations
            fns[a](x, None)
        for _ in range(repeats):
            for a in algorithms:  # interleaved, so drifting load hits every algorithm alike
                t = Traffic()
                dist.barrier()
                start = now(dev)                 # GPU: wait for queued work, then read
                fns[a](x, t)
                dist.barrier()
                best[a] = min(best[a], now(dev) - start)
                # the built-in's own traffic is not visible from Python
                traffic[a] = (None, None) if a == "builtin" else (t.sent, t.received)
        for a in algorithms:
            out.append({"bytes": numel * x.element_size(), "algorithm": a, "seconds": best[a],
                        "sent": traffic[a][0], "received": traffic[a][1],
                        "backend": dist.get_backend(), "device": str(dev)})
    return out


def measure(nprocs: int, sizes_bytes, algorithms=ALGORITHMS, repeats: int = 3,
            timeout: float = 600) -> list:
    """Rows {ranks, bytes, algorithm, seconds, busbw, ratio_to_builtin, max_received, max_sent,
    backend, device} (backend and device: what rank 0 ran on)."""
    per_rank = run(_time_on_ranks, nprocs, args=(list(sizes_bytes), tuple(algorithms), repeats),
                   timeout=timeout)
    rows = []
    for i, row in enumerate(per_rank[0]):
        # a collective is as slow as its slowest rank
        seconds = max(r[i]["seconds"] for r in per_rank)
        rows.append({"ranks": nprocs, "bytes": row["bytes"], "algorithm": row["algorithm"],
                     "seconds": seconds,
                     "busbw": comm.busbw("all_reduce", row["bytes"], nprocs, seconds),
                     "max_received": None if row["received"] is None
                     else max(r[i]["received"] for r in per_rank),
                     "max_sent": None if row["sent"] is None
                     else max(r[i]["sent"] for r in per_rank),
                     "backend": row["backend"], "device": row["device"]})
    builtin = {r["bytes"]: r["seconds"] for r in rows if r["algorithm"] == "builtin"}
    for r in rows:
        if r["bytes"] in builtin:
            r["busbw_ratio_to_builtin"] = builtin[r["bytes"]] / r["seconds"]
    return rows


def table(rows) -> str:
    return format_table(rows, [
        ("ranks", "ranks"),
        ("size MiB", lambda r: r["bytes"] / comm.MiB, ".3g"),
        ("algorithm", "algorithm"),
        ("time ms", lambda r: r["seconds"] * 1e3, ".2f"),
        ("busbw GB/s", lambda r: r["busbw"] / comm.GB, ".3f"),
        ("vs built-in", "busbw_ratio_to_builtin", lambda v: f"{v:.2f}x", ">")])


def options(argv=()):
    """(options, the arguments not taken), checked before any benchmark runs (labkit.bench)."""
    p = bench_parser("collectives", ranks=[2, 4], repeats=5)
    p.add_argument("--sizes-mib", type=positive, nargs="+", default=[1, 4, 16, 64],
                   help="buffer sizes, MiB")
    return p.parse_known_args(list(argv or ()))


def main(argv=()) -> dict:
    args, _ = options(argv)
    rows = []
    for n in args.ranks:
        rows += measure(n, [int(s * comm.MiB) for s in args.sizes_mib], repeats=args.repeats)
    print(table(rows), flush=True)
    return {"rows": rows, "units": {"bytes": "bytes", "seconds": "s", "busbw": "bytes/s"}}
