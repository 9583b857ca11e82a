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
import hashlib
import os
import re
import sys
import time
from pathlib import Path

from labkit import chapters as manifest

EXCLUDED = {"labkit/book.py"}  # this file: running the book does not depend on it
CLI = re.compile(r"labkit\s+(run|bench)\s+(\w+)")  # a code cell that runs the CLI (`!labkit run x`)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


class Sources:
    """The labkit package on disk: which file a module name is, and what each file imports."""

    def __init__(self, package_dir: Path | None = None):
        if package_dir is None:
            import labkit

            package_dir = Path(labkit.__file__).parent
        self.pkg = Path(package_dir).resolve()
        self._imports, self._data = {}, {}

    def key(self, path: Path) -> str:
        return path.resolve().relative_to(self.pkg.parent).as_posix()

    def file_of(self, name: str):
        """The file module `name` (labkit.x.y) runs, as the import system picks it: a package's
        __init__.py before a same-named .py; None when it is no module (or a namespace folder)."""
        parts = name.split(".")
        if parts[0] != self.pkg.name:
            return None
        base = self.pkg.joinpath(*parts[1:])
        for cand in (base / "__init__.py", base.with_suffix(".py")):
            if cand.is_file():
                return cand
        return None

    def is_module(self, name: str) -> bool:
        return self.file_of(name) is not None or self.pkg.joinpath(*name.split(".")[1:]).is_dir()

    def names_in(self, tree: ast.AST, module: str = "", is_package: bool = False) -> set:
        """labkit module names that `tree` imports or names, anywhere in it (functions too)."""
        found, alias = set(), {}
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    found.add(a.name)
                    top = a.name.split(".")[0]
                    alias[a.asname or top] = a.name if a.asname else top
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                found.add(base)
                for a in node.names:
                    found.add(f"{base}.{a.name}")
                    alias[a.asname or a.name] = f"{base}.{a.name}"
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"labkit(\.\w+)+", node.value):  # importlib / `python -m labkit.x`
                    found |= {node.value, node.value + ".__main__"}
                elif package and re.fullmatch(r"\w+\.py", node.value):  # a sibling run as a file
                    found.add(f"{package}.{node.value[:-3]}")
        for node in ast.walk(tree):  # attribute chains on a bound module: costs.memory.f
            chain = []
            while isinstance(node, ast.Attribute):
                chain.append(node.attr)
                node = node.value
            if chain and isinstance(node, ast.Name) and node.id in alias:
                found.add(".".join([alias[node.id]] + chain[::-1]))
        return {self._module_prefix(n) for n in found if n.split(".")[0] == self.pkg.name} - {None}

    def _module_prefix(self, name: str):
        """The longest prefix of a dotted name that is a module (costs.memory.f -> costs.memory)."""
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if self.is_module(".".join(parts[:n])):
                return ".".join(parts[:n])
        return None

    def _imports_of(self, name: str) -> set:
        if name not in self._imports:
            path = self.file_of(name)
            names, data = set(), set()
            if path is not None:
                tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
                names = self.names_in(tree, name, path.name == "__init__.py")
                data = {f for n in ast.walk(tree)
                        if isinstance(n, ast.Constant) and isinstance(n.value, str)
                        and re.fullmatch(r"[\w./-]+\.(txt|json|csv|npz|pt)", n.value)
                        for f in (self.pkg / n.value, path.parent / n.value) if f.is_file()}
            self._imports[name] = names
            self._data[name] = data  # read by name: resources.files("labkit") / "data/x.txt"
        return self._imports[name]

    def closure(self, names) -> dict:
        """{file key: sha256-16} of every labkit file that importing `names` can run or read."""
        seen, todo = set(), list(names)
        while todo:
            name = todo.pop()
            parts = name.split(".")
            for n in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__
                sub = ".".join(parts[:n])
                if sub not in seen:
                    seen.add(sub)
                    todo.extend(self._imports_of(sub))
        files = ({self.file_of(n) for n in seen}
                 | {f for n in seen for f in self._data.get(n, ())}) - {None}
        keyed = {self.key(p): p for p in files}
        return {k: _digest(p.read_bytes()) for k, p in sorted(keyed.items()) if k not in EXCLUDED}


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
    return _digest("\n\0".join(s.strip() for s in code_cells(nb)).encode())


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
    from importlib.metadata import version

    nb.metadata["labkit"] = {
        "executed": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1), "torch": version("torch"),
        "python": ".".join(map(str, sys.version_info[:3])), "cells": cells_digest(nb),
        "sources": deps}


def execute(path: Path, timeout: int = 1800, sources: Sources | None = None) -> float:
    """Run `path` top to bottom in a fresh python3 kernel (cwd = its folder), save it in place
    with its stamp; return the seconds it took. A cell error leaves the file as it was."""
    import nbformat
    from nbclient import NotebookClient

    from labkit import nbfile

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
    """The notebooks under root of the manifest's chapters (labkit.chapters) numbered in
    `chapters` ("03", ...; none = all), folder by folder."""
    paths = []
    for folder in folders:
        for c in manifest.CHAPTERS:
            p = root / folder / f"{c.stem}.ipynb"
            if (not chapters or c.nn in chapters) and p.exists():
                paths.append(p)
    return paths


def chapter_number(text: str) -> str:
    """argparse's type for a chapter: "7" or "07" -> "07", a chapter of the manifest."""
    try:
        return manifest.chapter(int(text)).nn
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"no chapter {text!r}: the book's chapters are "
            f"{' '.join(c.nn for c in manifest.CHAPTERS)} (labkit.chapters)") from None


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

        changed = landing.write_nav(root, check=args.check)
        verb = "would change" if args.check else "wrote"
        print("\n".join(f"{verb} the closing links of {p.relative_to(root)}" for p in changed)
              or "every chapter ends with its closing links")
        return 1 if changed and args.check else 0
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
    import nbformat

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
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

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
