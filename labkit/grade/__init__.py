"""Grade exercise notebooks where no student code runs in the process that decides the score.

    labkit grade exercises/01_collectives_exercises.ipynb   # one notebook
    labkit grade submissions/ --csv scores.csv              # a folder of students' notebooks

    folder    the rows, the table, the CSV; a folder searched recursively
    judge     one notebook: its cells run in a sandbox, its answers checked here
    sandbox   the sandbox, seen from the judge: a fresh interpreter, limits, one socket
    link      one exercise's requests from the judge to a fork of the sandbox
    child     the sandbox's side: the cells, then the judge's requests
    plain     what crosses back: plain data of exact types, in frames torch.load reads safely
    copy      the read-only copy of labkit each submission gets (labkit.check a stub), and the
              grader's own files, watched and restored
    guard     forbidden at run time: the reference refuses a caller from student code
    errors    the student's exceptions, rebuilt in the judge from data
    cells     the notebook's cells as the instructor finds them ("code cell 7")

The threat model, what is stopped and what is not, is in docs/grading.md. This package's
__init__ imports nothing: the sandbox imports labkit.grade.child and labkit.grade.guard from
its copy without the judge.
"""
from __future__ import annotations

import importlib

_FROM = {"grade": "folder", "grade_notebook": "folder", "table": "folder", "write_csv": "folder",
         "collect": "folder", "exercises_of": "folder", "chapter_of_submission": "folder",
         "CELL_TIMEOUT": "judge", "CHECKER_SLACK": "judge"}


def __getattr__(name):
    if name in _FROM:
        return getattr(importlib.import_module(f"labkit.grade.{_FROM[name]}"), name)
    raise AttributeError(f"module 'labkit.grade' has no attribute {name!r}")
