"""Checkers under `labkit grade`: the notebook hands in answers; the grader's own process grades.

Each exercise's checker is registered under its id:

    @graded("8.1")
    def routing_with_capacity(keep): ...

REGISTRY maps the id to the real checker, for the grader and its checker processes
(labkit.check.worker), which import it before any of the reader's code runs.

When a notebook runs under the grader ($LABKIT_GRADE_ANSWERS names a folder), a checker call
grades nothing: it writes the call's answers (the reader's functions and classes, by value, with
labkit.launch.source so tracebacks still name the reader's cells) and the cell it was called from
to `<folder>/<id>.json`; a later call replaces an earlier one (the last call counts). Anywhere
else a checker grades at once and prints its table, as it always did.

Why: a notebook can write any file, patch any module and print anything, so nothing the kernel
computes or reports is taken as a score; it hands in answers, and answers are all it can forge.
Only the answer parameters travel (those without a default, or `answers=`): the test knobs
(`cases=`, `worlds=`) are the grader's, never the notebook's.
"""
from __future__ import annotations

import base64
import functools
import inspect
import json
import os
import re
import sys
from pathlib import Path

import cloudpickle

from labkit.launch.source import cell_name, dumps, install

ANSWERS_ENV = "LABKIT_GRADE_ANSWERS"
REGISTRY: dict = {}   # exercise id -> the real checker (the function, undecorated)


def graded(exercise: str, answers: tuple | None = None):
    """Register `checker` as exercise `exercise`'s; under the grader, record its answers instead."""
    def wrap(checker):
        sig = inspect.signature(checker)
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = answers if answers is not None else tuple(
            p.name for p in sig.parameters.values()
            if p.kind in positional and p.default is inspect.Parameter.empty)

        @functools.wraps(checker)
        def call(*args, **kwargs):
            folder = os.environ.get(ANSWERS_ENV)
            if not folder:
                return checker(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            given = {k: v for k, v in bound.arguments.items() if k in names}
            record(Path(folder), exercise, given, sorted(set(bound.arguments) - set(names)))
            return None

        if exercise in REGISTRY and REGISTRY[exercise] is not checker:
            raise ValueError(f"two checkers registered for exercise {exercise}")
        REGISTRY[exercise] = checker
        call.checker = checker
        return call
    return wrap


def record(folder: Path, exercise: str, answers: dict, ignored=()) -> None:
    """Write one checker call's answers for the grader (atomically: a reader sees the old or the
    new answer, never half of one)."""
    entry = {"exercise": exercise, "cell": _execution_count(), "ignored": list(ignored),
             "cwd": os.getcwd(), "sys_path": list(sys.path)}   # where the answer's imports live
    try:
        payload, sources = dumps(answers)
        entry["payload"] = base64.b64encode(payload).decode("ascii")
        entry["sources"] = {file: [name, lines] for file, (name, lines) in sources.items()}
    except Exception as err:  # noqa: BLE001 - the grader reports it in the exercise's row
        entry["error"] = (f"the answer could not be sent to the grader's checker process "
                          f"({type(err).__name__}: {err}); does it hold an open file, a lock or "
                          f"a process group?")
    tmp = folder / f".{exercise}.json.tmp"
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, folder / f"{exercise}.json")
    note = f" (the grader uses its own {', '.join(ignored)})" if ignored else ""
    print(f"Exercise {exercise}: answer handed in{note}; `labkit grade` checks it in a process "
          f"of its own.")


def load(entry: dict) -> dict:
    """In a checker process: the answers of one recorded call, as keyword arguments. This runs
    the reader's code (unpickling may), so the checker must be picked before it is called."""
    if entry.get("error"):
        raise ValueError(entry["error"])
    # a helper module next to the notebook travels by reference: see the folders the kernel saw
    os.chdir(entry.get("cwd") or ".")
    sys.path += [p for p in entry.get("sys_path", []) if isinstance(p, str) and p not in sys.path]
    install({file: (name, lines) for file, (name, lines) in entry["sources"].items()})
    return cloudpickle.loads(base64.b64decode(entry["payload"]))


def _execution_count() -> int | None:
    """N of the running cell, In[N]: the outermost frame compiled from a cell (the shell's own
    counter has already moved on to the next cell while this one runs); None outside a kernel."""
    found, frame = None, sys._getframe(1)
    while frame is not None:
        found = cell_name(frame.f_code.co_filename) or found
        frame = frame.f_back
    m = re.fullmatch(r"Cell In\[(\d+)\]", found or "")
    return int(m.group(1)) if m else None
