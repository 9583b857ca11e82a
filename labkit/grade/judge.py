"""The judge: one notebook's row of scores, made in a process where no student code runs.

    grade_notebook("submissions/alice/01_collectives_exercises.ipynb")  # {"scores", ...}

The notebook's code cells run again in a sandbox (labkit.grade.sandbox); each checker call there
hands its answer in. For each exercise of the grader's own table (imported here before any
student code runs) the judge calls the real checker (labkit.check.answers.REGISTRY) with a
Remote for each function or class handed in: the student's code runs in a fork of the sandbox,
the checker's comparisons and its case records here. The score is this table's points times the
fraction of cases passed. A run that stops early (a hang, a death) is run again up to the cell
before the one that stopped it, so the exercises it reached are still graded.
"""
from __future__ import annotations

import contextlib
import io
import re
import time
from pathlib import Path

import nbformat

from labkit.check.answers import REGISTRY, checking
from labkit.grade import cells as nbcells
from labkit.grade.copy import Pristine
from labkit.grade.errors import RemoteExit, RemoteInterrupt, Stopped
from labkit.grade.sandbox import MEMORY_LIMIT, Sandbox

CELL_TIMEOUT = 300  # seconds; checkers have their own, shorter, hang timeouts
CHECKER_SLACK = 30  # seconds a checker gets on top of the cell timeout (a checker cell's budget)
_PRISTINE: list = []  # the grader's files as they were before the first notebook ran


def pristine() -> Pristine:
    if not _PRISTINE:
        _PRISTINE.append(Pristine())
    return _PRISTINE[0]


def grade_notebook(path: Path, cell_timeout: int = CELL_TIMEOUT, name: str | None = None,
                   checker_timeout: float | None = None, expected: dict | None = None,
                   chapter: int | None = None, memory: int | None = MEMORY_LIMIT) -> dict:
    """Run one notebook, check its answers; return {"file", "chapter", "scores": {id: score},
    "points", "failures": {id: [message]}, "error" (every stop and note, with its cell),
    "stopped" (the run ended before its last cell), "seconds"}."""
    path = Path(path)
    row = {"file": name or str(path), "chapter": chapter, "scores": {k: 0.0 for k in expected},
           "points": {k: v[1] for k, v in expected.items()}, "failures": {}, "error": "",
           "stopped": False, "seconds": 0.0}
    watch = pristine()
    timeout = checker_timeout or cell_timeout + CHECKER_SLACK
    start = time.perf_counter()
    try:
        nb = nbformat.read(str(path), as_version=4)
        code = nbcells.code_cells(nb)
        sources = [str(c.source) for c in code]
    except Exception as err:  # noqa: BLE001 - not a notebook: a row all the same
        row["error"] = f"not a readable notebook: {type(err).__name__}: {str(err).strip()[:200]}"
        row["stopped"] = True
        return row
    for cell in code:
        cell.execution_count, cell.outputs = None, []
    stops, notes = [], []
    box = Sandbox(chapter, path.parent.resolve(), memory)
    try:
        printed, stop = _run(box, nb, code, sources, cell_timeout)
        if stop:
            stops.append(stop)
            row["stopped"] = True
            box.close()
            # the answers died with the sandbox: run again, up to the cell that stopped it
            box = Sandbox(chapter, path.parent.resolve(), memory)
            reached = max(sum(c.execution_count is not None for c in code) - 1, 0)
            _run(box, nb, code, sources[:reached], cell_timeout)
        answers = box.answers(cell_timeout)
        for ex in expected:
            score, failures, note = _check_one(box, chapter, ex, row["points"][ex], answers, nb,
                                               timeout, row["stopped"], stops)
            row["scores"][ex] = score
            if failures:
                row["failures"][ex] = failures
            if note:
                notes.append(f"{ex}: {note}")
    finally:
        left = box.close()
    if left:
        notes.append(f"the notebook left {len(left)} process{'es' if len(left) > 1 else ''} "
                     f"behind, killed: {', '.join(left[:5])}")
    changed = watch.changed()
    if changed:
        watch.restore()
        row["scores"] = {k: 0.0 for k in expected}
        notes.insert(0, f"the notebook changed the grader's own files on disk "
                        f"({', '.join(Pristine.describe(p) for p in changed[:5])}): restored, "
                        f"and every exercise of this notebook scores 0")
    row["error"] = "; ".join(nbcells.stops_in_cells(nb, printed) + stops + notes)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def _run(box, nb, code, sources, cell_timeout):
    """Run `sources` in the sandbox, writing what each cell did into `nb`; (printed, stop)."""
    index = {id(c): i for i, c in enumerate(nb.cells)}
    printed, stop = {}, ""
    for kind, k, info in box.run(sources, cell_timeout):
        cell = code[k - 1] if 1 <= k <= len(code) else None
        if kind == "stop":
            stop = info + (f", in {nbcells.describe(nb, cell)}" if cell is not None else "")
            if cell is not None:
                cell.execution_count = k
            break
        cell.execution_count = k
        error = info.get("error")
        cell.outputs = ([nbformat.v4.new_output("error", ename=str(error.get("ename")),
                                                evalue=str(error.get("evalue")), traceback=[])]
                        if isinstance(error, dict) else [])
        count = info.get("printed")
        printed[index[id(cell)]] = count if type(count) is int else 0
    return printed, stop


def _check_one(box, chapter, ex, points, answers, nb, timeout, stopped, stops):
    """(score, failure messages, note) of one exercise: the real checker, here, on the answer
    handed in, whose functions run in a fork of the sandbox."""
    entry = answers.get(ex)
    checker = REGISTRY.get(ex)
    if checker is None:
        return 0.0, [f"no checker is registered for exercise {ex} (please report)"], ""
    if not isinstance(entry, dict) or not isinstance(entry.get("given"), dict):
        return 0.0, [_not_graded(chapter, ex, nb, checker, stopped, stops)], ""
    cell = nbcells.cell_of_count(nb, entry.get("cell"))
    where = f"answer from {cell}" if cell else "answer"
    cases, stop = [], ""
    try:
        with box.exercise(ex, timeout) as link, checking(link), \
                contextlib.redirect_stdout(io.StringIO()):
            given = {k: link.remote(k, v) for k, v in entry["given"].items()
                     if k in checker.answer_names}
            cases = list(checker(**given).cases)
    except Stopped as err:
        stop = str(err)
    except (RemoteExit, RemoteInterrupt) as err:
        what = (f"sys.exit({'' if err.code is None else repr(err.code)})"
                if isinstance(err, SystemExit) else "KeyboardInterrupt")
        stop = f"the checker stopped: the answer called {what}" + \
            (f" ({err.where})" if err.where else "")
    except Exception as err:  # noqa: BLE001 - a checker that fails on this answer says why
        stop = f"the checker stopped: {type(err).__name__}: {err}"
    if stop:
        stop = f"{where}: {_renumber(stop, nb)}"
        return 0.0, [stop], stop
    passed = sum(c["passed"] is True for c in cases)
    score = round(points * passed / len(cases), 2) if cases else 0.0
    fails = [_renumber(f"{c['name']}: {c['message']}", nb) for c in cases if not c["passed"]]
    stopped_cases = [_renumber(c["message"], nb) for c in cases if c.get("stopped")]
    note = f"{where}: {stopped_cases[0]}" if stopped_cases else ""
    return score, fails, note


def _not_graded(chapter: int, ex: str, nb, checker, stopped: bool, stops: list) -> str:
    """Why an exercise has no answer: its checker cell failed, the run stopped, or no call."""
    call = re.compile(rf"\bch{chapter:02d}\.{checker.__name__}\(")
    found = [c for c in nbcells.code_cells(nb) if call.search(c.source)]
    for cell in reversed(found):
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            said = (f"not graded: its checker cell, {nbcells.describe(nb, cell)}, raised "
                    f"{errors[-1].get('ename')}: {errors[-1].get('evalue', '')[:200]}")
            return said + _earlier_error(nb, cell)
    if stopped:
        return f"not graded: the notebook stopped before its checker ran ({stops[-1]})"
    return (f"not graded: the notebook never called its checker, "
            f"labkit.check.ch{chapter:02d}.{checker.__name__}")


def _earlier_error(nb, cell) -> str:
    """Where a NameError in a checker cell comes from: the last cell before it that raised."""
    code = nbcells.code_cells(nb)
    for before in reversed(code[:code.index(cell)]):
        errors = [o for o in before.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            return (f" (after {nbcells.describe(nb, before)} raised {errors[-1].get('ename')}: "
                    f"{errors[-1].get('evalue', '')[:200]})")
    return ""


def _renumber(text: str, nb) -> str:
    """'Cell In[5]' (the grader's run) as 'code cell 5' (where the instructor finds it)."""
    def cell(m):
        found = nbcells.cell_of_count(nb, int(m.group(1)))
        return found.split(" (")[0] if found else m.group(0)
    return re.sub(r"Cell In\[(\d+)\]", cell, text)
