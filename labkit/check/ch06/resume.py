"""Exercise 6.1: save and restore the random state for an exact resume.

    labkit.check.ch06.exact_resume(capture_rng_state, restore_rng_state)

The checker trains the chapter's tiny run (dropout on, data reshuffled by NumPy, windows jittered
by Python's `random`, torch drawing dropout masks), interrupts it on real processes, saves a full
checkpoint whose random state comes from YOUR capture function, starts fresh processes, restores
with YOUR restore function, and compares the final weights bit for bit with a run that was never
interrupted (started by the checker itself, under labkit grade the judge, not beside the answer),
at 1 and 2 ranks.
"""
from __future__ import annotations

import io
import random
import tempfile

import numpy as np
import torch

from labkit.check import CHECK_TIMEOUT, Checker, fail, graded
from labkit.launch import run

EXERCISE, TITLE, POINTS = "6.1", "save and restore the random state for an exact resume", 4


def _draws():
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist())


def round_trip(capture, restore) -> tuple:
    """Capture, draw from each generator, restore, draw again: (first draws, draws again)."""
    state = capture()
    first = _draws()
    restore(state)
    return first, _draws()


def weights_only_error(capture) -> str:
    """'' if the captured state survives torch.save + torch.load(weights_only=True), else the
    loader's first line."""
    buf = io.BytesIO()
    torch.save(capture(), buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as err:  # noqa: BLE001
        return str(err).splitlines()[0][:160] or type(err).__name__
    return ""


def assert_round_trip(capture, restore, here=None) -> None:
    """The draws after restore repeat those after capture; `here` runs the round trip where the
    answer lives (Checker.here), else in this process."""
    first, again = (here or (lambda job, *a: job(*a)))(round_trip, capture, restore)
    for name, a, b in zip(("Python's random", "NumPy's global generator", "torch's CPU generator"),
                          first, again):
        if a != b:
            fail(f"after restore, {name} gave {b} instead of {a}: capture and restore it too")


def assert_weights_only(capture, here=None) -> None:
    """The state must survive torch.save + torch.load(weights_only=True)."""
    said = (here or (lambda job, *a: job(*a)))(weights_only_error, capture)
    if said:
        fail("the captured state cannot be loaded with torch.load(weights_only=True): keep only "
             "tensors, numbers, strings, lists, tuples and dicts (convert NumPy arrays with "
             f"torch.from_numpy). The loader said: {said}")


def assert_resume_matches(first: list, later: list, world: int, expect_equal: bool = True):
    """first[r] = (straight, first-part) results, later[r] = (resumed,) results, per rank."""
    for r in range(world):
        straight, resumed = first[r][0][0], later[r][0][0]
        same = torch.equal(straight, resumed)
        if expect_equal and not same:
            diff = (straight - resumed).abs().max().item()
            fail(f"rank {r} of {world}: the resumed run ends with different weights (max "
                 f"difference {diff:.3g}). Some generator's state is not restored: dropout uses "
                 f"torch, shuffling NumPy, jitter Python's random.")
        if not expect_equal and same:
            fail(f"rank {r}: without the random state the resume should diverge, but it did not")


@graded("6.1")
def exact_resume(capture, restore, worlds=(1, 2)):
    # lazy: a module the ranks import must not load labkit.checkpoint (6.2 watches its import)
    from labkit.labs.checkpoint.resume import RunConfig, resume_jobs

    c = Checker(EXERCISE, TITLE, POINTS)
    cfg = RunConfig()
    with c.case("restore repeats the draws of Python, NumPy and torch (in this process)"):
        assert_round_trip(capture, restore, c.here)
    with c.case("the state loads with torch.load(weights_only=True)"):
        assert_weights_only(capture, c.here)
    for world in worlds:
        with c.case(f"{world} rank(s): stopped at step 3, resumed in fresh processes, "
                    f"bitwise equal at step 8"):
            with tempfile.TemporaryDirectory(prefix="labkit-ch06-") as root:
                c.launch(resume_jobs, world, args=(cfg, 8, 3, root, ("first",), capture, restore))
                later = c.launch(resume_jobs, world,
                                 args=(cfg, 8, 3, root, ("resume",), capture, restore))
            assert_resume_matches(straight_run(cfg, world, resume_jobs), later, world)
    return c.finish()


_STRAIGHT: dict = {}   # (world, config) -> the uninterrupted run's results: the same for everyone


def straight_run(cfg, world: int, jobs) -> list:
    """The run that was never interrupted, [[(flat params, losses)] per rank], on processes this
    process starts (under labkit grade: the judge's, where no student code runs; it needs none
    of the answer), once per world size and config."""
    key = (world, repr(cfg))
    if key not in _STRAIGHT:
        with tempfile.TemporaryDirectory(prefix="labkit-ch06-") as root:
            _STRAIGHT[key] = run(jobs, world, args=(cfg, 8, 3, root, ("straight",)),
                                 timeout=CHECK_TIMEOUT * 4, echo=False)
    return _STRAIGHT[key]
