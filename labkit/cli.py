"""The `labkit` command.

    labkit run LAB [--nproc N] [lab options]   run a chapter's lab on N local processes
    torchrun --nproc-per-node N -m labkit run LAB       the same lab, one rank per process
    labkit bench [NAME ...] [--json FILE]      benchmarks: a table, and JSON
    labkit exercises [--check]                 generate exercises/ from solutions/ (or check)
    labkit grade PATH [PATH ...] [--csv FILE]  execute exercise notebooks and score them
    labkit book run [NN ...] [--solutions] [--check]   re-execute the book (or: which are stale)
    labkit book nav [--check]                  each chapter's closing links, from labkit.chapters
    labkit site build [--out build/site]       the book as a static website (readable offline)
    labkit site serve [--dir build/site]       serve it on 127.0.0.1: its calculators run live
    labkit calibrate [--json FILE] [--device cpu|cuda] [--quick]   this machine beside the formulas
    labkit list                                labs by chapter (labkit.chapters) and benchmarks

`labkit run` exits 0 when the lab ran, 1 when a rank failed or hung (its report is printed), and
2 on bad input (one line saying what to change, e.g. a DP x TP that does not fit --nproc).

Labs live in labkit/labs/NAME.py or labkit/labs/NAME/__init__.py (a `main(argv)` function; a
package without one holds experiments only), benchmarks in labkit/bench/NAME.py
(a `main(argv)` function returning a dict with "rows"); both are found by name.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from pathlib import Path

from labkit import chapters


def _names(package: str) -> list:
    mod = importlib.import_module(package)
    names = sorted(m.name for m in pkgutil.iter_modules(mod.__path__) if not m.name.startswith("_"))
    if package == "labkit.labs":  # labs/parallel/ holds chapter 10's experiments, not a lab
        names = [n for n in names if mod.is_lab(n)]
    return names


def _load(package: str, name: str):
    names = _names(package)
    if name not in names:
        kind = "lab" if package.endswith("labs") else "benchmark"
        raise SystemExit(f"labkit: no {kind} named {name!r}; "
                         f"available: {', '.join(names) or 'none'}")
    return importlib.import_module(f"{package}.{name}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="labkit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p_run = sub.add_parser("run", help="run a lab (labkit run LAB --help: its options)",
                           add_help=False)
    p_run.add_argument("lab", help="the lab's name (labkit list shows them)")
    p_bench = sub.add_parser("bench", help="run benchmarks (labkit bench NAME --help: options)",
                             add_help=False)
    p_bench.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    # here, not in _bench: so that `labkit bench --json FILE` does not read FILE as a name
    p_bench.add_argument("--json", default="bench-results.json",
                         help="where to write the results (default: bench-results.json)")
    p_ex = sub.add_parser("exercises", help="generate exercises/ from solutions/",
                          formatter_class=fmt)
    p_ex.add_argument("--check", action="store_true", help="only check they are in sync")
    p_ex.add_argument("--solutions", default="solutions", help="folder of solution notebooks")
    p_ex.add_argument("--exercises", default="exercises", help="folder to write exercises to")
    p_grade = sub.add_parser("grade", help="execute and score exercise notebooks",
                             formatter_class=fmt)
    p_grade.add_argument("paths", nargs="+", help="notebooks, or folders of them, to grade")
    p_grade.add_argument("--csv", default=None, help="also write the scores to this CSV file")
    p_grade.add_argument("--cell-timeout", type=int, default=300,
                         help="seconds one cell may run before the grader stops it")
    sub.add_parser("list", help="list labs and benchmarks")
    sub.add_parser("calibrate", help="measure this machine beside the book's formulas; --json "
                                     "FILE: a chip profile (labkit calibrate --help)",
                   add_help=False)
    sub.add_parser("book", help="re-execute notebooks, stamped; --check: which are stale",
                   add_help=False)
    sub.add_parser("site", help="the book's static website (site build --out DIR; site serve)",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)

    if args.cmd == "run":
        return _run_lab(args.lab, rest)
    if args.cmd == "calibrate":
        # here: a command imports only what it runs, so `labkit --help` and bad input answer at once
        from labkit import calibrate

        return calibrate.main(rest)
    if args.cmd == "bench":
        return _bench(args.names, rest, args.json)
    if args.cmd == "exercises":
        # here: a command imports only what it runs, so `labkit --help` and bad input answer at once
        from labkit import exercises

        if args.check:
            problems = exercises.out_of_sync(Path(args.solutions), Path(args.exercises))
            print("\n".join(problems) or "exercises are in sync with solutions")
            return 1 if problems else 0
        for p in exercises.generate(Path(args.solutions), Path(args.exercises)):
            print(f"wrote {p}")
        return 0
    if args.cmd == "grade":
        missing = [p for p in args.paths if not Path(p).exists()]
        if missing or args.cell_timeout < 1:
            why = (f"no such file or folder: {', '.join(missing)}" if missing else
                   f"--cell-timeout must be 1 second or more (got {args.cell_timeout})")
            print(f"labkit grade: {why}", file=sys.stderr)
            return 2
    if args.cmd == "grade":
        # here: a command imports only what it runs, so `labkit --help` and bad input answer at once
        from labkit.grade import grade

        grade(args.paths, csv_path=args.csv, cell_timeout=args.cell_timeout)
        return 0
    if args.cmd == "book":
        # here: a command imports only what it runs, so `labkit --help` and bad input answer at once
        from labkit import book

        return book.main(rest)
    if args.cmd == "site":
        # here: a command imports only what it runs, so `labkit --help` and bad input answer at once
        from labkit import site

        return site.main(rest)
    if args.cmd == "list":
        # here: a command imports only what it runs, so `labkit --help` and bad input answer at once
        from labkit.table import table

        rows = [(c.nn, c.title, ", ".join(c.lab_names)) for c in chapters.CHAPTERS]
        listed = {x.name for x in chapters.labs()}
        extra = [n for n in _names("labkit.labs") if n not in listed]
        if extra:
            rows.append(("--", "(no chapter)", ", ".join(extra)))
        print(table(rows, ["ch", "chapter", "labs"], indent="  ",
                    title="labs (labkit run LAB --nproc N), by chapter:"))
        # here: a command imports only what it runs, so `labkit --help` and bad input answer at once
        from labkit.labs import backend_of

        cpu = [n for n in _names("labkit.labs") if backend_of(n) == "gloo"]
        print("backend: NCCL where there is a GPU per rank, else Gloo; always Gloo (their lesson "
              "is on the CPU: RNG bit-equality, files, a killed rank, emulated links): "
              + (", ".join(cpu) or "none"))
        print("benchmarks (labkit bench NAME): " + ", ".join(_names("labkit.bench")))
        return 0
    return 2


def _input_errors() -> tuple:
    """Errors that mean "the command asked for something impossible": the message says what to
    change, so the reader gets that one line, not a Python traceback."""
    # here: a command imports only what it runs, so `labkit --help` and bad input answer at once
    from labkit.launch import LaunchError
    from labkit.topology import TopologyError

    return (LaunchError, TopologyError, ValueError)


def _run_lab(name: str, rest) -> int:
    """Run a lab's main. Bad input -> `labkit: ...` on stderr and exit code 2; a rank that failed
    or hung -> its report (the rank's traceback, or every rank's stack) and exit code 1.
    LABKIT_DEBUG=1 re-raises, with the local traceback."""
    if name not in _names("labkit.labs"):
        print(f"labkit: no lab named {name!r}; available: {', '.join(_names('labkit.labs'))} "
              f"(labkit list shows them by chapter)", file=sys.stderr)
        return 2
    bad = _bad_nproc(rest)
    if bad:  # before the lab's main: some run a one-process reference before they start ranks
        print(f"labkit: {name}: {bad}", file=sys.stderr)
        return 2
    lab = _load("labkit.labs", name)
    if getattr(lab, "BACKEND", "auto") == "gloo":
        _hide_gpus()
    else:
        _say_fallback_first(rest)
    return run_lab_main(name, lab.main, rest)


def _say_fallback_first(rest) -> None:
    """Where there are GPUs but fewer than --nproc, the line saying the lab falls back to Gloo
    comes first, before any phase line (labkit.launch.rendezvous says it once per process)."""
    for i, arg in enumerate(rest):
        if arg == "--nproc" or arg.startswith("--nproc="):
            value = arg.split("=", 1)[1] if "=" in arg else rest[i + 1]
            from labkit.launch import rendezvous  # here: torch, only for a lab about to run

            rendezvous.resolve_backend("auto", int(value))
            return


def _bad_nproc(rest) -> str | None:
    """What is wrong with --nproc in a lab's arguments (None when absent or a positive integer)."""
    for i, arg in enumerate(rest):
        if arg == "--nproc" or arg.startswith("--nproc="):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            else:
                value = rest[i + 1] if i + 1 < len(rest) else ""
            if not value.isdigit() or int(value) < 1:
                return f"--nproc must be a whole number of processes, 1 or more (got {value!r})"
    return None


def _hide_gpus() -> None:
    """For a lab whose ranks keep their tensors on the CPU (its module says BACKEND = "gloo"):
    hide the GPUs from this process and the ranks it starts, so that labkit.launch's automatic
    choice (NCCL when there is a GPU per rank) picks Gloo, locally and under torchrun alike."""
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def run_lab_main(name: str, main, rest) -> int:
    """`main(rest)` of the lab `name`, with _run_lab's exit codes and messages."""
    import os

    # here: a command imports only what it runs, so `labkit --help` and bad input answer at once
    from labkit.launch import HangError, RankError

    try:
        code = main(rest) or 0
    except (RankError, HangError) as err:
        if os.environ.get("LABKIT_DEBUG"):
            raise
        print(f"labkit: lab {name!r} failed: {err}", file=sys.stderr, flush=True)
        return 1
    except _input_errors() as err:
        if os.environ.get("LABKIT_DEBUG"):
            raise
        text = " ".join(str(err).split()) or type(err).__name__
        print(f"labkit: {name}: {text}", file=sys.stderr, flush=True)
        return 2
    _finish_torchrun_rank(code)
    return code


def _finish_torchrun_rank(code: int = 0) -> None:
    """Under torchrun the lab ran in this process: leave the group cleanly, then exit at once.

    A Gloo group torn down by interpreter exit can abort the process, which torchrun reports as
    a failure; and even after destroy_process_group, a rank of a restarted attempt
    (--max-restarts) sometimes aborts in C++ static destructors during interpreter shutdown
    ("terminate called without an active exception", about 1 run in 4 here). The lab's work is
    done and its output flushed by then, so the rank skips that shutdown (os._exit)."""
    import os

    if "TORCHELASTIC_RUN_ID" not in os.environ or "LABKIT_CHILD" in os.environ:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _bench(names, rest, json_path: str = "bench-results.json") -> int:
    import os

    known = _names("labkit.bench")
    unknown = [n for n in names if n not in known]
    if unknown:  # before the first benchmark starts its processes
        print(f"labkit: no benchmark named {unknown[0]!r}; available: {', '.join(known)}",
              file=sys.stderr)
        return 2
    if not names and ({"-h", "--help"} & set(rest)):
        print(_bench_help(known))
        return 0
    names = names or known
    modules = {name: _load("labkit.bench", name) for name in names}
    if {"-h", "--help"} & set(rest):   # each named benchmark's options, then stop
        for module in modules.values():
            try:
                module.options(["--help"])
            except SystemExit:
                pass
        return 0
    # Every benchmark's options are checked before the first one starts: a bad value for the
    # third must not cost the reader the minutes of the first two.
    taken_by_none = None
    for name, module in modules.items():
        try:
            _, left = module.options(rest)
        except _input_errors() as err:
            print(f"labkit: bench {name}: {' '.join(str(err).split())}", file=sys.stderr)
            return 2
        taken_by_none = left if taken_by_none is None else [a for a in taken_by_none if a in left]
    if taken_by_none:
        print(f"labkit: bench: no benchmark named here takes {' '.join(taken_by_none)} "
              f"(labkit bench {names[0]} --help lists its options)", file=sys.stderr)
        return 2
    results = {}
    for name, module in modules.items():
        print(f"== benchmark: {name}", flush=True)
        try:
            results[name] = module.main(rest)
        except _input_errors() as err:  # bad input found only while running: one line, exit 2
            if os.environ.get("LABKIT_DEBUG"):
                raise
            print(f"labkit: bench {name}: {' '.join(str(err).split())}", file=sys.stderr,
                  flush=True)
            return 2
    Path(json_path).write_text(json.dumps(results, indent=2))
    print(f"wrote {json_path}")
    return 0


def _bench_help(known) -> str:
    """`labkit bench --help`: the command's own options and each benchmark's first line."""
    lines = ["usage: labkit bench [NAME ...] [--json FILE] [options of the benchmarks named]", "",
             "Run benchmarks: each prints a table; all results go to one JSON file. With no NAME,",
             "every benchmark runs (docs/benchmarks.md shows their tables).", "",
             "options:",
             "  --json FILE   where to write the results (default: bench-results.json)",
             "  -h, --help    this help; `labkit bench NAME --help` shows NAME's options", "",
             "benchmarks:"]
    for name in known:
        doc = (_load("labkit.bench", name).__doc__ or "").strip().split("\n\n")[0]
        first = " ".join(doc.split()).removeprefix("Benchmark: ")
        lines.append(f"  {name:<12}  {first}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
