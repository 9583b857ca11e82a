"""Re-execute the book, and know when its saved outputs are out of date.

    labkit book run [NN ...] [--solutions | --solutions-only]   execute chapters (and solutions)
    labkit book run [NN ...] --check       which saved notebooks are stale, and why (exit 1 if any)
    labkit book deps NN                    the labkit files chapter NN runs
    labkit book nav [--check]              write each chapter's closing links from the manifest

Each notebook runs from a clean kernel in its own folder (the kernel imports the installed
labkit) and is saved in place, stamped in its metadata with what produced its outputs:

    nb.metadata["labkit"] = {"sources": {"labkit/costs/comm.py": "<sha256, 16 hex>", ...},
                             "cells": "<hash of its code cells>", "torch": "2.x", "executed": ...}

"sources" are the labkit files the notebook's code runs: the labkit modules its code cells import
or name (`labkit.a.b`), closed over labkit's own imports, module-level and inside functions
(rank functions import inside their bodies), with the packages' __init__ files and the data files
named in them (labkit/data/corpus.txt). Not seen: a module imported by a name built at run time.
A notebook is stale when one of those files changed, a new one is needed, or its code cells were
edited after the run. After the solutions run, exercises/ is regenerated from them.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import os
import re
import sys
import time
from importlib.metadata import version
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

from labkit import chapters as manifest
from labkit import nbfile
from labkit.sources import Sources, digest

CLI = re.compile(r"labkit\s+(run|bench)\s+(\w+)")  # a code cell that runs the CLI (`!labkit run x`)


def code_cells(nb) -> list:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def parse_cell(source: str) -> ast.AST:
    """A code cell as Python: IPython lines (%magic, !shell) become `pass`."""
    lines = [("pass" if re.match(r"\s*[%!]", ln) else ln) for ln in source.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return ast.Module(body=[], type_ignores=[])


def notebook_modules(nb, sources: Sources) -> set:
    names = set()
    for src in code_cells(nb):
        names |= sources.names_in(parse_cell(src))
        for kind, what in CLI.findall(src):
            names |= {"labkit.cli", f"labkit.{'labs' if kind == 'run' else 'bench'}.{what}"}
    return {n for n in names if sources.is_module(n)}


def cells_digest(nb) -> str:
    return digest("\n\0".join(s.strip() for s in code_cells(nb)).encode())


def dependencies(nb, sources: Sources | None = None) -> dict:
    sources = sources or Sources()
    return sources.closure(notebook_modules(nb, sources))


def stale_reasons(nb, sources: Sources | None = None) -> list:
    """Why the saved outputs of `nb` may not be what its code produces today ([] = current)."""
    sources = sources or Sources()
    stamp = nb.metadata.get("labkit")
    if not stamp or "sources" not in stamp:
        return ["no labkit stamp: its outputs predate `labkit book run`"]
    reasons, now, then = [], dependencies(nb, sources), stamp["sources"]
    changed = [k for k in now if k in then and now[k] != then[k]]
    added = [k for k in now if k not in then]
    gone = [k for k in then if not (sources.pkg.parent / k).is_file()]
    if changed:
        reasons.append("changed since the run: " + ", ".join(changed))
    if added:
        reasons.append("now also runs: " + ", ".join(added))
    if gone:
        reasons.append("ran files that no longer exist: " + ", ".join(gone))
    if stamp.get("cells") != cells_digest(nb):
        reasons.append("its code cells were edited after the run")
    return reasons


def stamp(nb, deps: dict, seconds: float) -> None:

    nb.metadata["labkit"] = {
        "executed": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1), "torch": version("torch"),
        "python": ".".join(map(str, sys.version_info[:3])), "cells": cells_digest(nb),
        "sources": deps}


def execute(path: Path, timeout: int = 1800, sources: Sources | None = None) -> float:
    """Run `path` top to bottom in a fresh python3 kernel (cwd = its folder), save it in place
    with its stamp; return the seconds it took. A cell error leaves the file as it was."""


    sources = sources or Sources()
    nb = nbformat.read(str(path), as_version=4)
    before = dependencies(nb, sources)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.perf_counter() - start
    after = dependencies(nb, Sources(sources.pkg))
    if after != before:  # edited while it ran: keep the old hashes, so --check calls it stale
        print(f"  warning: {', '.join(k for k in after if after[k] != before.get(k))} changed "
              f"during the run of {path.name}; it will show as stale", flush=True)
    stamp(nb, before, seconds)
    nbfile.write(nb, path)  # as JupyterLab saves it: opening it later changes nothing
    return seconds


def select(root: Path, chapters, folders) -> list:
    """The notebooks under root of the manifest's chapters numbered in `chapters` (none = all)."""
    paths = []
    for folder in folders:
        for c in manifest.CHAPTERS:
            p = root / folder / f"{c.stem}.ipynb"
            if (not chapters or c.nn in chapters) and p.exists():
                paths.append(p)
    return paths


def chapter_number(text: str) -> str:
    """argparse's type for a chapter of the manifest: "7" or "07" -> "07"."""
    if not text.isdigit() or int(text) not in [c.number for c in manifest.CHAPTERS]:
        raise argparse.ArgumentTypeError(f"no chapter {text!r} in labkit.chapters: "
                                         f"{' '.join(c.nn for c in manifest.CHAPTERS)}")
    return f"{int(text):02d}"


def _default_root() -> Path:
    cwd = Path.cwd()
    return cwd if (cwd / "chapters").is_dir() else Sources().pkg.parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="labkit book", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("run", "deps", "nav"))
    parser.add_argument("chapters", nargs="*", type=chapter_number, help="00 07 or 0 7; none = all")
    parser.add_argument("--solutions", action="store_true", help="solutions/ too")
    parser.add_argument("--solutions-only", action="store_true", help="solutions/ only")
    parser.add_argument("--check", action="store_true",
                        help="only say which are stale (exit 1 if any)")
    parser.add_argument("--root", type=Path, default=None,
                        help="folder holding chapters/ solutions/")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    args = parser.parse_args(argv)
    root = (args.root or _default_root()).resolve()
    if args.action == "nav":
        from labkit import landing  # nbformat: only this action writes notebooks' markdown
        return landing.nav_command(root, check=args.check)
    chapters = set(args.chapters)
    # --check reads solutions too: a stale solution is as wrong as a stale chapter
    folders = (["chapters"] if not args.solutions_only else []) + (
        ["solutions"] if args.solutions or args.solutions_only or args.check else [])
    sources = Sources()
    paths = select(root, chapters, folders)
    if not paths:
        print(f"labkit book: no notebooks under {root} for {sorted(chapters) or 'all'}",
              file=sys.stderr)
        return 2

    if args.action == "deps":
        for p in paths:
            print(f"{p.parent.name}/{p.name}:")
            for k, h in dependencies(nbformat.read(str(p), as_version=4), sources).items():
                print(f"  {k}  {h}")
        return 0
    if args.check:
        stale = 0
        for p in paths:
            reasons = stale_reasons(nbformat.read(str(p), as_version=4), sources)
            if reasons:
                stale += 1
                flag = " --solutions-only" if p.parent.name == "solutions" else ""
                print(f"STALE {p.parent.name}/{p.name}: {'; '.join(reasons)} "
                      f"-> labkit book run {p.name[:2]}{flag}")
        print(f"{stale} of {len(paths)} notebooks stale" if stale
              else f"{len(paths)} notebooks current")
        if "solutions" in folders and (root / "exercises").is_dir():
            from labkit import exercises

            unsynced = exercises.out_of_sync(root / "solutions", root / "exercises")
            print("\n".join(f"STALE {x}" for x in unsynced) or "exercises/ in sync with solutions/")
            stale += len(unsynced)
        return 1 if stale else 0
    return _run_all(root, paths, args.timeout, sources)


def _run_all(root: Path, paths: list, timeout: int, sources: Sources) -> int:

    total, failed = 0.0, []
    for p in paths:
        start = time.perf_counter()
        try:
            load = os.getloadavg()[0]  # timings saved under a busy machine are worth a second look
            try:
                seconds = execute(p, timeout, sources)
            except CellTimeoutError:
                # nbclient sometimes never sees a widget cell's reply, with the kernel idle
                # (jupyter/nbclient#312): one more try from a fresh kernel before calling it failed
                print(f"{p.parent.name}/{p.name}: a cell passed --timeout {timeout} s; "
                      f"trying once more", flush=True)
                seconds = execute(p, timeout, sources)
            print(f"{p.parent.name}/{p.name}  {seconds:7.1f} s  (1-min load {load:.1f} at start)",
                  flush=True)
        except (CellExecutionError, TimeoutError, RuntimeError) as err:
            seconds = time.perf_counter() - start
            failed.append(p)
            first = str(err).strip().splitlines()[-1:] or [type(err).__name__]
            print(f"{p.parent.name}/{p.name}  {seconds:7.1f} s  FAILED (left as it was): "
                  f"{first[0]}", flush=True)
        total += seconds
    if any(p.parent.name == "solutions" for p in paths):
        from labkit import exercises

        written = exercises.generate(root / "solutions", root / "exercises")
        print(f"regenerated {len(written)} exercise notebooks from solutions/")
    print(f"total {total:.1f} s for {len(paths)} notebooks"
          + (f", {len(failed)} failed" if failed else ""))
    return 1 if failed else 0
