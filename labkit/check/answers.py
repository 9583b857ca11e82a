"""Checkers under `labkit grade`: the registry the judge runs from, and the handles it holds in
place of the student's functions.

Each exercise's checker is registered under its id:

    @graded("8.1")
    def routing_with_capacity(keep): ...

REGISTRY maps the id to the real checker, for the judge (labkit.grade.judge), which imports it
before any student code runs. Only the answer parameters are the student's (those without a
default, or `answers=`): the test knobs (`cases=`, `worlds=`) are the grader's, never the
notebook's. Anywhere but the grader a checker grades at once and prints its table.

Under the grader the student's code never runs in the judge's process: the notebook is run again
in a sandbox (labkit.grade.sandbox), where `labkit.check` is a stub that keeps each checker call's
answers; the judge then calls the real checker with a Remote for each function or class handed
in. Calling a Remote runs the student's function in the sandbox and returns plain data; a
checker's launch() runs its rank job there (labkit.check.Checker); reading a Remote's source or
what it reaches asks the sandbox (labkit.check.source, labkit.check.forbidden). `active()` is the
link to the sandbox while one exercise is checked, else None.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

REGISTRY: dict = {}   # exercise id -> the real checker (the function, undecorated)
_active: list = [None]


def graded(exercise: str, answers: tuple | None = None):
    """Register `checker` as exercise `exercise`'s."""
    def wrap(checker):
        sig = inspect.signature(checker)
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = answers if answers is not None else tuple(
            p.name for p in sig.parameters.values()
            if p.kind in positional and p.default is inspect.Parameter.empty)

        @functools.wraps(checker)
        def call(*args, **kwargs):
            return checker(*args, **kwargs)

        if exercise in REGISTRY and REGISTRY[exercise] is not checker:
            raise ValueError(f"two checkers registered for exercise {exercise}")
        REGISTRY[exercise] = checker
        checker.answer_names = names
        checker.params = tuple(p.name for p in sig.parameters.values()
                               if p.kind in positional)
        call.checker = checker
        return call
    return wrap


class Remote:
    """The judge's handle on a function or class the student handed in: it lives in the sandbox.
    Calling it returns plain data (labkit.grade.child.plain); anything else it is asked fails."""

    def __init__(self, link, exercise: str, param: str, kind: str, name: str):
        self._link, self._exercise, self._param = link, exercise, param
        self.kind, self.__name__, self.__qualname__ = kind, name, name

    def __call__(self, *args, **kwargs):
        return self._link.call(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<your {self.kind} {self.__name__}>"

    @property
    def ref(self) -> tuple:
        return ("answer", self._exercise, self._param)


class Opaque:
    """Something the student's code returned that is not plain data (an object of its own, a
    float subclass): described, never rebuilt. It compares equal to nothing and has no
    arithmetic, so a checker's `isinstance` test or comparison fails on it."""

    def __init__(self, type_name: str, text: str):
        self.type_name, self.text = type_name, text

    def __repr__(self) -> str:
        return f"<{self.type_name}: {self.text}>"

    def __eq__(self, other):
        return False

    __hash__ = object.__hash__


def is_remote(obj) -> bool:
    return isinstance(obj, Remote)


def active():
    """The link to the sandbox while the judge checks an exercise; None anywhere else."""
    return _active[0]


@contextlib.contextmanager
def checking(link):
    _active[0] = link
    try:
        yield link
    finally:
        _active[0] = None
