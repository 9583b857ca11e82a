"""The `labkit` command.

    labkit run LAB [--nproc N] [lab options]   run a chapter's lab on N local processes
    torchrun --nproc-per-node N -m labkit.cli run LAB   the same lab, one rank per process
    labkit bench [NAME ...] [--json FILE]      benchmarks: a table, and JSON
    labkit exercises [--check]                 generate exercises/ from solutions/ (or check)
    labkit grade PATH [PATH ...] [--csv FILE]  execute exercise notebooks and score them
    labkit list                                labs and benchmarks available

Labs live in labkit/labs/NAME.py (a `main(argv)` function), benchmarks in labkit/bench/NAME.py
(a `main(argv)` function returning a dict with "rows"); both are found by name.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from pathlib import Path


def _names(package: str) -> list:
    mod = importlib.import_module(package)
    return sorted(m.name for m in pkgutil.iter_modules(mod.__path__) if not m.name.startswith("_"))


def _load(package: str, name: str):
    names = _names(package)
    if name not in names:
        kind = "lab" if package.endswith("labs") else "benchmark"
        raise SystemExit(f"labkit: no {kind} named {name!r}; available: {', '.join(names) or 'none'}")
    return importlib.import_module(f"{package}.{name}")


def is_rank_zero() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="labkit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="run a lab", add_help=False)
    p_run.add_argument("lab")
    p_bench = sub.add_parser("bench", help="run benchmarks", add_help=False)
    p_bench.add_argument("names", nargs="*")
    p_ex = sub.add_parser("exercises", help="generate exercises/ from solutions/")
    p_ex.add_argument("--check", action="store_true", help="only check they are in sync")
    p_ex.add_argument("--solutions", default="solutions")
    p_ex.add_argument("--exercises", default="exercises")
    p_grade = sub.add_parser("grade", help="execute and score exercise notebooks")
    p_grade.add_argument("paths", nargs="+")
    p_grade.add_argument("--csv", default=None)
    p_grade.add_argument("--cell-timeout", type=int, default=300)
    sub.add_parser("list", help="list labs and benchmarks")
    args, rest = parser.parse_known_args(argv)

    if args.cmd == "run":
        code = _load("labkit.labs", args.lab).main(rest) or 0
        _finish_torchrun_rank()
        return code
    if args.cmd == "bench":
        return _bench(args.names, rest)
    if args.cmd == "exercises":
        from labkit import exercises

        if args.check:
            problems = exercises.out_of_sync(Path(args.solutions), Path(args.exercises))
            print("\n".join(problems) or "exercises are in sync with solutions")
            return 1 if problems else 0
        for p in exercises.generate(Path(args.solutions), Path(args.exercises)):
            print(f"wrote {p}")
        return 0
    if args.cmd == "grade":
        from labkit.grade import grade

        grade(args.paths, csv_path=args.csv, cell_timeout=args.cell_timeout)
        return 0
    if args.cmd == "list":
        print("labs:       " + ", ".join(_names("labkit.labs")))
        print("benchmarks: " + ", ".join(_names("labkit.bench")))
        return 0
    return 2


def _finish_torchrun_rank() -> None:
    """Under torchrun the lab ran in this process: leave the group cleanly (a Gloo group torn
    down by interpreter exit can abort the process, which torchrun reports as a failure)."""
    import os

    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _bench(names, rest) -> int:
    parser = argparse.ArgumentParser(prog="labkit bench")
    parser.add_argument("--json", default="bench-results.json", help="where to write the results")
    opts, rest = parser.parse_known_args(rest)
    names = names or _names("labkit.bench")
    results = {}
    for name in names:
        print(f"== benchmark: {name}", flush=True)
        results[name] = _load("labkit.bench", name).main(rest)
    Path(opts.json).write_text(json.dumps(results, indent=2))
    print(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
