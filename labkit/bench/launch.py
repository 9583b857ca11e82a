"""Benchmark: how long the first N-rank cell takes from a fresh interpreter.

    labkit bench launch [--ranks 2 4 8] [--repeats 3]

Each measurement starts a new Python (as a fresh notebook kernel would be), imports labkit,
and times `run(fn, N)` of a function that does one all-reduce: process start, torch import,
rendezvous and the collective. Target: under 5 s for 4 ranks.
"""
from __future__ import annotations

import json
import subprocess
import sys

from labkit.cliargs import bench_parser
from labkit.table import table

_PROBE = """
import json, time
t0 = time.perf_counter()
from labkit.launch import run
def first_cell():
    import torch, torch.distributed as dist
    t = torch.ones(4)
    dist.all_reduce(t)
    return t[0].item()
t1 = time.perf_counter()
out = run(first_cell, {n})
t2 = time.perf_counter()
out = run(first_cell, {n})
t3 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "first_run_s": t2 - t1, "second_run_s": t3 - t2,
                  "ok": out == [{n}.0] * {n}}}))
"""


def measure(n: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(n=n)], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def options(argv=()):
    """(options, the arguments not taken), checked before any benchmark runs (labkit.bench)."""
    return bench_parser("launch", ranks=[2, 4, 8], repeats=3).parse_known_args(list(argv or ()))


def main(argv=()) -> dict:
    args, _ = options(argv)
    rows = []
    for n in args.ranks:
        runs = [measure(n) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["import_s"] + r["first_run_s"])
        rows.append({"ranks": n, "first_cell_s": best["import_s"] + best["first_run_s"],
                     "next_cell_s": best["second_run_s"], "ok": all(r["ok"] for r in runs)})
    print(table(rows, [("ranks", "ranks"), ("first cell (s)", "first_cell_s", ".2f"),
                       ("next cell (s)", "next_cell_s", ".2f")]))
    return {"rows": rows, "target": "first 4-rank cell under 5 s"}
