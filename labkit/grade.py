"""Grade exercise notebooks: execute each one headless and collect its checkers' scores.

    labkit grade exercises/01_collectives.ipynb          # one notebook
    labkit grade submissions/ --csv scores.csv           # a folder of students' notebooks

A folder is searched recursively (submissions/alice/01_collectives.ipynb, or flat files named
alice_01_collectives.ipynb); the chapter comes from the file name, else from the checker the
notebook imports. Each checker cell records its score in the file named by $LABKIT_GRADE_FILE. A notebook that
raises keeps going (every cell runs); one that hangs or kills its kernel scores zero for the
exercises it had not reached, and the next notebook is graded all the same; so does a file that
is not a notebook at all.

Grading runs the submitted code with your privileges, and trusts the scores the notebook's
checker cells record: grade untrusted submissions inside a container or VM.
"""
from __future__ import annotations

import csv
import importlib
import json
import os
import re
import tempfile
import time
from pathlib import Path

import nbformat

from labkit.check import GRADE_FILE_ENV
from labkit.table import table as format_table

CELL_TIMEOUT = 300  # seconds; checkers have their own, shorter, hang timeouts


def exercises_of(chapter: int) -> dict:
    """{"1.1": (title, points), ...} from labkit.check.chNN."""
    try:
        mod = importlib.import_module(f"labkit.check.ch{chapter:02d}")
    except ModuleNotFoundError:
        return {}
    return dict(getattr(mod, "EXERCISES", {}))


def chapter_of_submission(path: Path) -> int | None:
    """The chapter of a submitted notebook: `NN_` in its name, else the checker it imports."""
    m = re.search(r"(?<!\d)(\d{2})_[A-Za-z]", Path(path).name)
    if m:
        return int(m.group(1))
    try:
        m = re.search(r"labkit\.check(?: import |\.)ch(\d{2})", Path(path).read_text(errors="replace"))
    except OSError:
        return None
    return int(m.group(1)) if m else None


def grade_notebook(path: Path, cell_timeout: int = CELL_TIMEOUT, name: str | None = None) -> dict:
    """Execute one notebook; return {"file", "scores": {id: score}, "points", "failures", "error"}."""
    from nbclient import NotebookClient

    path = Path(path)
    chapter = chapter_of_submission(path)
    expected = exercises_of(chapter) if chapter is not None else {}
    row = {"file": name or str(path), "chapter": chapter, "scores": {k: 0.0 for k in expected},
           "points": {k: v[1] for k, v in expected.items()}, "failures": {}, "error": "",
           "seconds": 0.0}
    if not expected:
        row["error"] = ("not an exercise notebook: no chapter number (NN_) in its name and no "
                        "labkit.check import inside")
        return row
    fd, record = tempfile.mkstemp(prefix="labkit-grade-", suffix=".jsonl")
    os.close(fd)
    error = ""
    old = os.environ.get(GRADE_FILE_ENV)
    os.environ[GRADE_FILE_ENV] = record  # the kernel inherits it
    start = time.perf_counter()
    nb = None
    try:
        nb = nbformat.read(str(path), as_version=4)
        for cell in nb.cells:  # the student's own run is not evidence: start clean
            if cell.cell_type == "code":
                cell.execution_count, cell.outputs = None, []
        running = {}
        client = NotebookClient(nb, timeout=cell_timeout, allow_errors=True, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent.resolve())}},
                                on_cell_execute=lambda cell, cell_index: running.update(cell=cell))
        # The kernel's own stderr (ipykernel's warnings, a dying kernel's ZMQ traceback) goes to
        # a file, not the grader's terminal: the student's output reaches us as messages anyway.
        with tempfile.TemporaryFile() as kernel_err:
            client.execute(stdout=kernel_err, stderr=kernel_err)
    except Exception as err:  # noqa: BLE001 - a hung or dead notebook still gets a row
        error = _explain(err, nb, cell_timeout, running.get("cell") if nb is not None else None)
    finally:
        if old is None:
            os.environ.pop(GRADE_FILE_ENV, None)
        else:
            os.environ[GRADE_FILE_ENV] = old
    for line in Path(record).read_text().splitlines():
        rec = json.loads(line)
        row["scores"][rec["exercise"]] = rec["score"]  # the last run of a checker counts
        row["failures"][rec["exercise"]] = rec["failures"]
    os.unlink(record)
    row["error"], row["seconds"] = error, round(time.perf_counter() - start, 1)
    return row


def _explain(err: Exception, nb, cell_timeout: int, cell=None) -> str:
    """One line for the table: what stopped the notebook, and in which cell."""
    kind = type(err).__name__
    if kind == "CellTimeoutError":
        what = f"a cell ran longer than {cell_timeout} s (a hang? raise --cell-timeout if not)"
    elif kind == "DeadKernelError":
        what = "the kernel died (a crash, os._exit, or out of memory)"
    elif nb is None:
        return f"not a readable notebook: {kind}: {str(err).strip()[:200]}"
    else:
        text = str(err).strip()
        what = f"{kind}: {text.splitlines()[0] if text else ''}"
    if cell is not None:
        code = [c for c in nb.cells if c.cell_type == "code"]
        number = next(i for i, c in enumerate(code, 1) if c is cell)
        first = next((ln for ln in cell.source.splitlines() if ln.strip()), "")
        what += f", in code cell {number} ({first.strip()[:60]!r})"
    return what


def collect(paths) -> list:
    """[(path, name shown in the table)]: files as given; folders searched recursively."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += [(f, str(f.relative_to(p))) for f in sorted(p.rglob("*.ipynb"))
                      if ".ipynb_checkpoints" not in f.parts]
        else:
            files.append((p, p.name))
    return files


def grade(paths, csv_path=None, cell_timeout: int = CELL_TIMEOUT, echo=print) -> list:
    files = collect(paths)
    if not files:
        raise SystemExit(f"labkit grade: no .ipynb files in {' '.join(map(str, paths))}")
    rows = []
    for i, (nb, name) in enumerate(files, 1):
        echo(f"[{i}/{len(files)}] grading {name} ...", flush=True)
        rows.append(grade_notebook(nb, cell_timeout, name=name))
        r = rows[-1]
        echo(f"    {sum(r['scores'].values()):g}/{sum(r['points'].values()):g} in {r['seconds']:g} s"
             + (f"; stopped early: {r['error']}" if r["error"] else ""), flush=True)
    echo(table(rows))
    if csv_path:
        write_csv(rows, csv_path)
        echo(f"wrote {csv_path}")
    return rows


def table(rows) -> str:
    ids = sorted({k for r in rows for k in r["scores"]}, key=lambda s: [int(x) for x in s.split(".")])

    def total(r):
        points = sum(r["points"].values()) or sum(1 for _ in r["scores"])
        return f"{round(sum(r['scores'].values()), 4):g}/{points:g}"

    columns = [("notebook", "file")]
    columns += [(i, lambda r, i=i: f"{r['scores'].get(i, 0):g}/{r['points'].get(i, 0):g}")
                for i in ids]
    out = [format_table(rows, columns + [("total", total)])]
    for r in rows:
        if r["error"]:
            out.append(f"{r['file']}: stopped early: {r['error']}")
        for ex, fails in sorted(r["failures"].items()):
            for f in fails[:3]:
                out.append(f"{r['file']} {ex}: {f.splitlines()[0]}")
    return "\n".join(out)


def write_csv(rows, path) -> None:
    ids = sorted({k for r in rows for k in r["scores"]}, key=lambda s: [int(x) for x in s.split(".")])
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["notebook"] + ids + ["total", "possible", "seconds", "failures", "error"])
        for r in rows:
            fails = "; ".join(f"{ex}: {m.splitlines()[0]}" for ex, ms in sorted(r["failures"].items())
                              for m in ms)
            w.writerow([r["file"]] + [round(r["scores"].get(i, 0), 4) for i in ids]
                       + [round(sum(r["scores"].values()), 4), sum(r["points"].values()), r["seconds"],
                          fails, r["error"]])
