"""Benchmark: the hand-written all-to-all (labkit.moe.alltoall, naive and pairwise, from
point-to-point sends) against dist.all_to_all_single, at 4 ranks.

    labkit bench moe [--ranks 4] [--mib 4] [--repeats 5]

Bus bandwidth of an all-to-all: each rank sends (n-1)/n of its buffer, so busbw = S*(n-1)/n / t
for a buffer of S bytes per rank. Reported as a ratio to the built-in measured in the same run
(median over repeats, rank 0's clock); the two schedules must return the built-in's bytes exactly.
"""
from __future__ import annotations

from labkit.cliargs import bench_parser, count, positive
from labkit.labs.moe.alltoall import bench_job
from labkit.launch import run
from labkit.table import table


def options(argv=()):
    """(options, the arguments not taken), checked before any benchmark runs (labkit.bench)."""
    p = bench_parser("moe", repeats=5)
    p.add_argument("--ranks", type=count, default=4, help="ranks of the one launch")
    p.add_argument("--mib", type=positive, default=4.0, help="buffer per rank, MiB")
    return p.parse_known_args(list(argv or ()))


def main(argv=()) -> dict:

    a, _ = options(argv)
    n = a.ranks
    per_peer = max(1, int(a.mib * 2**20 / 4 / n))                 # float32 elements per peer
    res = run(bench_job, n, args=(per_peer, a.repeats), echo=False)[0]
    size = per_peer * n * 4
    rows = []
    for name, t in res["seconds"].items():
        busbw = size * (n - 1) / n / t
        rows.append({"all-to-all": name, "ms": t * 1e3, "busbw GB/s": busbw / 1e9,
                     "vs built-in": res["seconds"]["builtin"] / t,
                     "same bytes": res["equal"][name]})
    print(table(rows, ["all-to-all", ("ms", "ms", ".2f"), ("busbw GB/s", "busbw GB/s", ".3f"),
                       ("vs built-in", "vs built-in", ".2f"), "same bytes"],
                title=f"all-to-all at {n} ranks, {size / 2**20:.1f} MiB per rank, fp32, "
                      f"median of {a.repeats}"))
    return {"rows": rows, "config": {"ranks": n, "bytes_per_rank": size, "repeats": a.repeats}}
