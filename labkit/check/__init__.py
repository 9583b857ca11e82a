"""Exercise checkers: run the reader's code on real processes and say what passed.

Each chapter is a package `labkit.check.chNN` with one module per exercise (named after its
idea) and an `EXERCISES` table ({"1.1": ("ring reduce-scatter", points), ...}); its __init__
re-exports the checkers, called from the notebook's checker cells with the reader's code.
Exercise modules import the shared tools below (and their chapter's common.py, where one
exists), never each other: tests/test_check_layout.py holds the import graph to a DAG.

    this module    Checker, Result, fail: the cases, the table, the score; expect_tensor
    answers        @graded(id): the registry the grader (labkit.grade, worker) runs from
    worker         the grader's checker process
    source         the one reader of the reader's source (ast): calls, collectives
    forbidden      what of a set of modules and names the reader's code reaches
    refusal        the one refusal: Forbidden (before a run), Refused (during one)
    mistakes       mistake tables as data: a wrong answer's ratio -> its hint

What a checker watches while the reader's code runs is labkit.observe's: the collectives really
dispatched (`observe.dispatch.CollectiveLog(allow=(), why=..., error=Refused)` refuses any but
point-to-point), the bytes the kernel counted (`observe.netcount`), the bytes saved for backward.

A checker is a list of cases:

    def ring_all_reduce(fn):
        c = Checker("1.3", "ring all-reduce", points=4)
        for world, numel in [(2, 8), (3, 10)]:
            with c.case(f"{world} ranks, {numel} elements"):
                out = c.launch(_job, world, args=(fn, numel))
                assert ..., "a hint the learner can act on"
        return c.finish()

An answer that uses what the exercise forbids is refused once, before any case runs
(`c.refuse(FORBIDDEN.refusal(fn))`, labkit.check.refusal), or while it runs (a Refused raised on
a rank or here): the table shows the refusal's message.

A case fails on an AssertionError (its message is the hint), on a rank's exception (the rank's
last traceback lines), on a hang (where each rank was stuck), or on sys.exit or an interrupt
inside the answer (an interrupt also skips the cases left). A stub that still raises
NotImplementedError fails every case at once. `finish()` prints the table.

Each checker is registered under its exercise id (`@graded("1.3")`, labkit.check.answers): under
`labkit grade` the notebook runs in a sandbox where a checker cell only hands its answer in, and
the grader runs the checker in its own process with handles on the answer (labkit.grade): a call
of the answer, `launch()` and `here()` run in the sandbox and return plain data; the cases are
judged here. What a case's answer should be is computed here too, never taken from the ranks, and
a run of the checker's own that needs no answer (a measurement, a reference run) goes through
`measure()`, on processes this process starts, never the sandbox's.
"""
from __future__ import annotations

import contextlib
import time
import traceback

from labkit.check.answers import active, graded  # noqa: F401 - graded: every checker's decorator
from labkit.check.refusal import MARK, Forbidden, Refused, collectives_refusal, reason_in  # noqa: F401 - re-exported
from labkit.launch import HangError, RankError, run
from labkit.launch.source import cell_name, frame_line
from labkit.testing import tensors_close  # noqa: F401 - the checkers' comparison, re-exported

CHECK_TIMEOUT = 30.0  # seconds per launched case before it is called a hang


class _Skip(Exception):
    pass


class Checker:
    def __init__(self, exercise: str, title: str, points: float):
        self.exercise, self.title, self.points = exercise, title, float(points)
        self.cases: list[dict] = []
        self._stop_reason = None

    # -- running cases
    @contextlib.contextmanager
    def case(self, name: str):
        record = {"name": name, "passed": False, "message": ""}
        self.cases.append(record)
        if self._stop_reason:  # the body still runs (a with-block cannot be skipped), but
            record["message"] = self._stop_reason  # launch() refuses at once; nothing counts
            try:
                yield
            except BaseException:  # noqa: BLE001 - a skipped case counts for nothing anyway
                pass
            return
        start = time.perf_counter()
        try:
            yield
            record["passed"] = True
        except _Skip as skip:
            record["message"] = str(skip)
        except AssertionError as err:
            record["message"] = str(err) or "the result is wrong"
        except NotImplementedError as err:
            record["message"] = f"not implemented yet: {err}"
            self._stop_reason = "skipped: the exercise is not implemented yet"
        except HangError as err:
            record["message"] = "HANG: " + _shorten_hang(err)
            self._stop_reason = "skipped after a hang (fix the hang first)"
        except Refused as err:
            record["message"] = err.reason
            self._same_error(record)
        except RankError as err:
            record["message"] = _rank_failure(err)
            if reason_in(err.remote_traceback):
                record["message"] = _refused_on_rank(err)
            elif "NotImplementedError" in err.remote_traceback:
                last = err.remote_traceback.strip().splitlines()[-1]
                record["message"] = "not implemented yet: " + last
                self._stop_reason = "skipped: the exercise is not implemented yet"
            else:
                self._same_error(record)
        except Exception as err:  # noqa: BLE001 - any other failure of the reader's code
            where = "" if getattr(err, "where", None) is not None else _where(err, cells_only=True)
            record["message"] = f"{type(err).__name__}: {err}{where}"
            self._same_error(record)
        except SystemExit as err:  # the answer's own exit ends this case, not the checker
            code = "" if err.code is None else repr(err.code)
            record["message"] = f"the answer called sys.exit({code}){_where(err)}"
            record["stopped"] = True
        except KeyboardInterrupt as err:  # the Stop button: end quickly, with the table so far
            record["message"] = f"interrupted (KeyboardInterrupt){_where(err)}"
            record["stopped"] = True
            self._stop_reason = "skipped after an interrupt"
        record["seconds"] = round(time.perf_counter() - start, 2)

    def _same_error(self, record: dict) -> None:
        """One bug, one message: the same error twice in a row skips the cases left."""
        errors = [c for c in self.cases[:-1] if not c["passed"]]
        if errors and errors[-1]["message"] == record["message"] and self.cases[-2] is errors[-1]:
            self._stop_reason = "skipped: the same error as the case above (fix it first)"

    def refuse(self, reason: str) -> None:
        """Fail every case from here on with `reason` (labkit.check.refusal), launching nothing:
        an answer that uses what the exercise forbids earns nothing. '' refuses nothing."""
        if reason and not self._stop_reason:
            self._stop_reason = reason

    def go_on(self) -> None:
        """Stop the current case at once where the checker has stopped (a refusal, a hang, a
        stub), before work that does not go through launch() (a run of labkit's own code)."""
        if self._stop_reason:
            raise _Skip(self._stop_reason)

    def launch(self, fn, nprocs: int, args=(), kwargs=None, timeout: float = CHECK_TIMEOUT):
        """labkit.launch.run with a checker's timeout and without echoing the ranks' prints."""
        if self._stop_reason:
            raise _Skip(self._stop_reason)
        link = active()
        if link is not None:   # under the grader: on the sandbox's ranks, plain data back
            return link.launch(fn, nprocs, args, kwargs, timeout=timeout)
        return run(fn, nprocs, args, kwargs, timeout=timeout, echo=False)

    def measure(self, job, nprocs: int, args=(), kwargs=None, timeout: float = CHECK_TIMEOUT):
        """A job of the checker's own that needs none of the answer (a measurement, a reference
        run): on processes this process starts, so under labkit grade the judge's, never the
        sandbox's, where the student's code could tamper with it."""
        if self._stop_reason:
            raise _Skip(self._stop_reason)
        return run(job, nprocs, args, kwargs, timeout=timeout, echo=False)

    def here(self, job, *args, **kwargs):
        """job(*args, **kwargs) where the answer lives: in this process, or under the grader in
        the sandbox (labkit.grade), which sends back plain data. For a check that must call the
        answer and read what it did in one process (a random state captured, then restored)."""
        link = active()
        if link is not None:
            return link.here(job, args, kwargs)
        return job(*args, **kwargs)

    def cases_on_one_launch(self, label: str, checks, launch) -> None:
        """Several named checks graded on ONE launch's results (one launch per world size keeps
        a checker quick): `launch()` runs inside the first case; if it fails, every case of this
        label fails the same way."""
        results, error = None, None
        for name, check in checks:
            with self.case(f"{label}: {name}"):
                if error:
                    raise error
                if results is None:
                    try:
                        results = launch()
                    except Exception as err:  # noqa: BLE001 - re-raised for each case
                        error = err
                        raise
                check(results)

    # -- results
    @property
    def score(self) -> float:
        if not self.cases:
            return 0.0
        return round(self.points * sum(c["passed"] for c in self.cases) / len(self.cases), 2)

    def finish(self) -> "Result":
        result = Result(self.exercise, self.title, self.score, self.points, list(self.cases))
        print(result.table())
        return result


class Result:
    def __init__(self, exercise, title, score, points, cases):
        self.exercise, self.title, self.score, self.points, self.cases = (
            exercise, title, score, points, cases)

    @property
    def passed(self) -> bool:
        return all(c["passed"] for c in self.cases) and bool(self.cases)

    def as_dict(self) -> dict:
        return {"exercise": self.exercise, "title": self.title, "score": self.score,
                "points": self.points,
                "failures": [f"{c['name']}: {c['message']}" for c in self.cases if not c["passed"]]}

    def table(self) -> str:
        lines = [f"Exercise {self.exercise}: {self.title}"]
        for c in self.cases:
            mark = "PASS" if c["passed"] else "FAIL"
            lines.append(f"  [{mark}] {c['name']}")
            if not c["passed"] and c["message"]:
                lines += ["         " + m for m in c["message"].splitlines()]
        lines.append(f"  score: {self.score:g} / {self.points:g}")
        return "\n".join(lines)

    def __repr__(self):
        return f"<Result {self.exercise}: {self.score:g}/{self.points:g}>"


def _where(err: BaseException, cells_only: bool = False) -> str:
    """' (Cell In[5], line 6, in predict)': the line that raised, as the reader names it (with
    cells_only, the last line of a notebook cell the traceback went through, or '')."""
    if getattr(err, "where", ""):   # raised in the grader's sandbox: it says where
        return f" ({err.where})"
    frames = traceback.extract_tb(err.__traceback__)
    if cells_only:
        frames = [f for f in frames if cell_name(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    name = cell_name(f.filename)
    line = frame_line(f.filename, f.lineno, f.name, {f.filename: name} if name else None)
    return f" ({line.strip()})"


def _rank_failure(err: RankError) -> str:
    lines = err.remote_traceback.strip().splitlines()
    # the reader's own frames matter most: keep the last few lines of the rank's traceback
    return f"rank {err.rank} raised:\n" + "\n".join(lines[-6:])


def _refused_on_rank(err: RankError) -> str:
    """A Refused raised on a rank: its message, then where the rank was (its traceback's end)."""
    lines = [ln for ln in err.remote_traceback.strip().splitlines() if MARK not in ln]
    return f"{reason_in(err.remote_traceback)}\n(rank {err.rank}, at:\n" + \
        "\n".join(lines[-4:]) + ")"


def _shorten_hang(err: HangError) -> str:
    parts = []
    for rank, stack in sorted(err.stacks.items()):
        note = err.notes.get(rank) or ""
        if stack == "(finished)":
            parts.append(f"rank {rank} finished" + (f" (last: {note})" if note else ""))
            continue
        frames = [ln for ln in stack.splitlines() if ln.strip()]
        parts.append(f"rank {rank} stuck" + (f" at {note}" if note else "") + ":\n"
                     + "\n".join(frames[-4:]))
    return ("the ranks stopped making progress (a send without a matching recv, or ranks that "
            "disagree on the order of sends and receives).\n" + "\n".join(parts))


def fail(hint: str):
    """Fail the current case with a hint (same as `assert False, hint`)."""
    raise AssertionError(hint)


CUT_FROM_GRAPH = ("is the tensor part of the autograd graph (no .detach(), .data or "
                  "torch.no_grad() on the way)?")   # why a gradient or output is None, mostly


def expect_tensor(got, want, what: str, if_shape: str, if_none: str = CUT_FROM_GRAPH) -> None:
    """Fail unless `got` is a tensor of `want`'s shape, before its values are compared: `what`
    names it (rank and quantity), the hints say where to look when it is None or misshapen."""
    if got is None:
        fail(f"{what} is None: {if_none}")
    if got.shape != want.shape:
        fail(f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}: {if_shape}")
