"""Grade exercise notebooks: execute each one headless and collect its checkers' scores.

    labkit grade exercises/01_collectives.ipynb          # one notebook
    labkit grade submissions/ --csv scores.csv           # a folder of students' notebooks

Each checker cell records its score in the file named by $LABKIT_GRADE_FILE. A notebook that
raises keeps going (every cell runs); one that hangs or kills its kernel scores zero for the
exercises it had not reached, and the next notebook is graded all the same.
"""
from __future__ import annotations

import csv
import importlib
import json
import os
import tempfile
import time
from pathlib import Path

import nbformat

from labkit.check import GRADE_FILE_ENV
from labkit.exercises import chapter_of

CELL_TIMEOUT = 300  # seconds; checkers have their own, shorter, hang timeouts


def exercises_of(chapter: int) -> dict:
    """{"1.1": (title, points), ...} from labkit.check.chNN."""
    try:
        mod = importlib.import_module(f"labkit.check.ch{chapter:02d}")
    except ModuleNotFoundError:
        return {}
    return dict(getattr(mod, "EXERCISES", {}))


def grade_notebook(path: Path, cell_timeout: int = CELL_TIMEOUT) -> dict:
    """Execute one notebook; return {"file", "scores": {id: score}, "points", "failures", "error"}."""
    from nbclient import NotebookClient

    path = Path(path)
    expected = exercises_of(chapter_of(path))
    fd, record = tempfile.mkstemp(prefix="labkit-grade-", suffix=".jsonl")
    os.close(fd)
    error = ""
    old = os.environ.get(GRADE_FILE_ENV)
    os.environ[GRADE_FILE_ENV] = record  # the kernel inherits it
    start = time.perf_counter()
    try:
        nb = nbformat.read(str(path), as_version=4)
        client = NotebookClient(nb, timeout=cell_timeout, allow_errors=True, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent.resolve())}})
        client.execute()
    except Exception as err:  # noqa: BLE001 - a hung or dead notebook still gets a row
        error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    finally:
        if old is None:
            os.environ.pop(GRADE_FILE_ENV, None)
        else:
            os.environ[GRADE_FILE_ENV] = old
    scores, failures = {k: 0.0 for k in expected}, {}
    for line in Path(record).read_text().splitlines():
        rec = json.loads(line)
        scores[rec["exercise"]] = rec["score"]  # the last run of a checker counts
        failures[rec["exercise"]] = rec["failures"]
    os.unlink(record)
    points = {k: v[1] for k, v in expected.items()}
    return {"file": str(path), "scores": scores, "points": points, "failures": failures,
            "error": error, "seconds": round(time.perf_counter() - start, 1)}


def collect(paths) -> list:
    files = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.ipynb")) if p.is_dir() else [p]
    return files


def grade(paths, csv_path=None, cell_timeout: int = CELL_TIMEOUT, echo=print) -> list:
    rows = []
    for nb in collect(paths):
        echo(f"grading {nb} ...")
        rows.append(grade_notebook(nb, cell_timeout))
    echo(table(rows))
    if csv_path:
        write_csv(rows, csv_path)
        echo(f"wrote {csv_path}")
    return rows


def table(rows) -> str:
    ids = sorted({k for r in rows for k in r["scores"]}, key=lambda s: [int(x) for x in s.split(".")])
    head = ["notebook"] + ids + ["total"]
    lines = [head]
    for r in rows:
        total = sum(r["scores"].values())
        points = sum(r["points"].values()) or sum(1 for _ in r["scores"])
        lines.append([Path(r["file"]).name] + [f"{r['scores'].get(i, 0):g}/{r['points'].get(i, 0):g}"
                                               for i in ids] + [f"{total:g}/{points:g}"])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        if r["error"]:
            out.append(f"{Path(r['file']).name}: stopped early: {r['error']}")
        for ex, fails in sorted(r["failures"].items()):
            for f in fails[:3]:
                out.append(f"{Path(r['file']).name} {ex}: {f.splitlines()[0]}")
    return "\n".join(out)


def write_csv(rows, path) -> None:
    ids = sorted({k for r in rows for k in r["scores"]}, key=lambda s: [int(x) for x in s.split(".")])
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["notebook"] + ids + ["total", "possible", "failures", "error"])
        for r in rows:
            fails = "; ".join(f"{ex}: {m.splitlines()[0]}" for ex, ms in sorted(r["failures"].items())
                              for m in ms)
            w.writerow([r["file"]] + [r["scores"].get(i, 0) for i in ids]
                       + [sum(r["scores"].values()), sum(r["points"].values()), fails, r["error"]])
