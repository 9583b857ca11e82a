"""Grade notebooks and folders of them: one row per file, a table, a CSV.

    labkit grade exercises/01_collectives_exercises.ipynb   # one notebook
    labkit grade submissions/ --csv scores.csv              # a folder of students' notebooks

A folder is searched recursively (submissions/alice/01_collectives_exercises.ipynb, or flat files
named alice_01_collectives_exercises.ipynb); the chapter comes from the file name, else from the
checker the notebook imports. Each notebook is graded by labkit.grade.judge.
"""
from __future__ import annotations

import csv
import importlib
import re
from pathlib import Path

from labkit.grade import judge
from labkit.grade.judge import CELL_TIMEOUT
from labkit.table import table as format_table


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
        m = re.search(r"labkit\.check(?: import |\.)ch(\d{2})",
                      Path(path).read_text(errors="replace"))
    except OSError:
        return None
    return int(m.group(1)) if m else None


def grade_notebook(path: Path, cell_timeout: int = CELL_TIMEOUT, name: str | None = None,
                   checker_timeout: float | None = None) -> dict:
    """One notebook's row (labkit.grade.judge.grade_notebook), its chapter and exercises found
    here, before any of its code runs."""
    path = Path(path)
    chapter = chapter_of_submission(path)
    expected = exercises_of(chapter) if chapter is not None else {}
    if not expected:
        return {"file": name or str(path), "chapter": chapter, "scores": {}, "points": {},
                "failures": {}, "stopped": True, "seconds": 0.0,
                "error": ("not an exercise notebook: no chapter number (NN_) in its name and no "
                          "labkit.check import inside")}
    return judge.grade_notebook(path, cell_timeout, name=name, checker_timeout=checker_timeout,
                                expected=expected, chapter=chapter)


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
        echo(f"    {sum(r['scores'].values()):g}/{sum(r['points'].values()):g} "
             f"in {r['seconds']:g} s"
             + (f"; {_label(r)}: {r['error']}" if r["error"] else ""), flush=True)
    echo(table(rows))
    if csv_path:
        write_csv(rows, csv_path)
        echo(f"wrote {csv_path}")
    return rows


def table(rows) -> str:
    ids = sorted({k for r in rows for k in r["scores"]},
                 key=lambda s: [int(x) for x in s.split(".")])

    def total(r):
        points = sum(r["points"].values()) or sum(1 for _ in r["scores"])
        return f"{round(sum(r['scores'].values()), 4):g}/{points:g}"

    columns = [("notebook", "file")]
    columns += [(i, lambda r, i=i: f"{r['scores'].get(i, 0):g}/{r['points'].get(i, 0):g}")
                for i in ids]
    out = [format_table(rows, columns + [("total", total)])]
    for r in rows:
        if r["error"]:
            out.append(f"{r['file']}: {_label(r)}: {r['error']}")
        for ex, fails in sorted(r["failures"].items()):
            for f in fails[:3]:
                out.append(f"{r['file']} {ex}: {f.splitlines()[0]}")
    return "\n".join(out)


def _label(row) -> str:
    return "stopped early" if row.get("stopped") else "note"


def write_csv(rows, path) -> None:
    ids = sorted({k for r in rows for k in r["scores"]},
                 key=lambda s: [int(x) for x in s.split(".")])
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["notebook"] + ids + ["total", "possible", "seconds", "failures", "error"])
        for r in rows:
            fails = "; ".join(f"{ex}: {m.splitlines()[0]}"
                              for ex, ms in sorted(r["failures"].items())
                              for m in ms)
            w.writerow([r["file"]] + [round(r["scores"].get(i, 0), 4) for i in ids]
                       + [round(sum(r["scores"].values()), 4), sum(r["points"].values()),
                          r["seconds"],
                          fails, r["error"]])
