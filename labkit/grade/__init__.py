"""Grade exercise notebooks: run each one headless, then check its answers in processes of our own.

    labkit grade exercises/01_collectives.ipynb          # one notebook
    labkit grade submissions/ --csv scores.csv           # a folder of students' notebooks

A folder is searched recursively (submissions/alice/01_collectives.ipynb, or flat files named
alice_01_collectives.ipynb); the chapter comes from the file name, else from the checker the
notebook imports.

How a score is made. The notebook runs in a fresh kernel (labkit.grade.kernel), where each
checker cell hands in its answer (the reader's functions and classes, labkit.check.answers)
instead of grading it. Once the kernel and its processes are gone, for each exercise of the
grader's own table (imported here before any student code runs) the checker registered for it
runs on the last answer handed in, in a child forked for that exercise from a clean process of
the grader's that never loads an answer (labkit.grade.checkers, labkit.check.worker), and sends
its cases (name, passed, message) back on a socket the notebook cannot open; the score is this
table's points times the fraction of cases passed. Nothing the notebook writes, patches or
prints is read as a score: a forged record, a patched checker or an edited points table counts
for nothing.

Not guaranteed: the student's code runs with the grader's privileges, in the kernel and in the
checker's process, where the answer is loaded and called. An answer written to attack the
grader there (patch the checker in that process's memory, write to its socket) is not stopped,
nor is a notebook that turns those privileges on the grader from outside (edits labkit's files,
leaves a process behind outside its kernel's process group): grade untrusted submissions inside
a container or VM.

Every stop has a reason, with its exercise and cell, in the table and the CSV: a cell timeout,
a dead kernel, sys.exit or KeyboardInterrupt in a cell or in an answer, a checker process that
dies or outlives its timeout, an output flood. A notebook that raises keeps going (every cell
runs); one that hangs or kills its kernel scores zero for the exercises it had not reached, and
the next notebook is graded all the same; so does a file that is not a notebook at all.
"""
from __future__ import annotations

import csv
import importlib
import json
import re
import time
from pathlib import Path

from labkit.check.answers import REGISTRY
from labkit.grade import kernel
from labkit.grade.checkers import Checkers
from labkit.table import table as format_table

CELL_TIMEOUT = 300  # seconds; checkers have their own, shorter, hang timeouts
CHECKER_SLACK = 30  # seconds a checker gets on top of the cell timeout (a checker cell's budget)


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
    """Run one notebook, check its answers; return {"file", "chapter", "scores": {id: score},
    "points", "failures": {id: [message]}, "error" (every stop and note, with its cell),
    "stopped" (the run ended before its last cell), "seconds"}."""
    path = Path(path)
    chapter = chapter_of_submission(path)
    expected = exercises_of(chapter) if chapter is not None else {}   # before any student code
    row = {"file": name or str(path), "chapter": chapter, "scores": {k: 0.0 for k in expected},
           "points": {k: v[1] for k, v in expected.items()}, "failures": {}, "error": "",
           "stopped": False, "seconds": 0.0}
    if not expected:
        row["error"] = ("not an exercise notebook: no chapter number (NN_) in its name and no "
                        "labkit.check import inside")
        row["stopped"] = True
        return row
    timeout = checker_timeout or cell_timeout + CHECKER_SLACK
    start = time.perf_counter()
    checkers = Checkers(chapter)   # imports while the notebook runs; its channel is a socket
    try:
        run = kernel.run(path, cell_timeout, list(expected))
        stops = list(run.stops)
        if run.nb is not None:
            for ex in expected:
                score, failures, stop = _check_one(checkers, chapter, ex, row["points"][ex], run,
                                                   timeout)
                row["scores"][ex], row["failures"][ex] = score, failures
                if stop:
                    stops.append(f"{ex}: {stop}")
            row["failures"] = {ex: f for ex, f in row["failures"].items() if f}
    finally:
        checkers.close()
    row["error"], row["stopped"] = "; ".join(stops), run.stopped
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def _check_one(checkers, chapter: int, ex: str, points: float, run, timeout: float):
    """(score, failure messages, stop) of one exercise: its last answer, checked by its own
    checker in a fresh process; the score from the grader's points."""
    answer = run.answers.get(ex)
    if answer is None:
        return 0.0, [_not_graded(chapter, ex, run)], ""
    try:
        cell = kernel.cell_of_count(run.nb, json.loads(answer).get("cell"))
    except (ValueError, AttributeError):
        cell = ""
    where = f"answer from {cell}" if cell else "answer"
    outcome = checkers.check(ex, answer, timeout)
    notes = ([f"{where}: the checker's process printed {outcome.printed / 1e6:.1f} MB"]
             if outcome.printed > kernel.OUTPUT_LIMIT else [])
    if outcome.stop:
        stop = f"{where}: {_renumber(outcome.stop, run.nb)}"
        return 0.0, [stop], "; ".join([stop] + notes)
    cases = outcome.cases
    passed = sum(c["passed"] for c in cases)
    score = round(points * passed / len(cases), 2) if cases else 0.0
    fails = [_renumber(f"{c['name']}: {c['message']}", run.nb) for c in cases if not c["passed"]]
    stops = [_renumber(c["message"], run.nb) for c in cases if c.get("stopped")]
    if stops:   # sys.exit or an interrupt inside the answer: a stop, with where it happened
        notes.insert(0, f"{where}: {stops[0]}")
    return score, fails, "; ".join(notes)


def _not_graded(chapter: int, ex: str, run) -> str:
    """Why an exercise has no answer: its checker cell failed, the run stopped, or no call."""
    checker = REGISTRY.get(ex)
    if checker is None:
        return f"no checker is registered for exercise {ex} (please report)"
    call = re.compile(rf"\bch{chapter:02d}\.{checker.__name__}\(")
    cells = [c for c in kernel.code_cells(run.nb) if call.search(c.source)]
    for cell in reversed(cells):
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            return (f"not graded: its checker cell, {kernel.describe(run.nb, cell)}, raised "
                    f"{errors[-1].get('ename')}: {errors[-1].get('evalue', '')[:200]}")
    if run.stopped:
        return f"not graded: the notebook stopped before its checker ran ({run.stops[-1]})"
    return (f"not graded: the notebook never called its checker, "
            f"labkit.check.ch{chapter:02d}.{checker.__name__}")


def _renumber(text: str, nb) -> str:
    """'Cell In[5]' (the grader's run) as 'code cell 3' (where the instructor finds it)."""
    def cell(m):
        found = kernel.cell_of_count(nb, int(m.group(1)))
        return found.split(" (")[0] if found else m.group(0)
    return re.sub(r"Cell In\[(\d+)\]", cell, text)


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
