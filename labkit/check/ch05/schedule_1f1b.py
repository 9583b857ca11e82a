"""Exercise 5.1: the 1F1B order of stage p.

    labkit.check.ch05.one_f_one_b(fn)   # fn(p, P, K) -> [F(k), B(k), ...]

Validated (every action once, backward after forward, no deadlock), simulated (peak held <= P - p,
bubble = GPipe's), and run on real processes against the one-process GPT.
"""
from __future__ import annotations

from labkit import costs
from labkit.check import Checker, fail, graded
from labkit.check.ch05.common import grade_order
from labkit.pipeline.simulate import simulate
from labkit.pipeline.validate import ScheduleError, validate

EXERCISE, TITLE, POINTS = "5.1", "the 1F1B order of actions", 4
PAPER_CASES = [(2, 1), (2, 4), (3, 2), (3, 7), (4, 8), (5, 3)]  # (P, K): K < P and K ∤ P too


def assert_1f1b_schedule(s) -> None:
    """Valid, peak in-flight <= P - p on every stage, bubble equal to GPipe's. Shared with tests."""
    P, K = s.P, s.K
    try:
        validate(s)
    except ScheduleError as err:
        fail(f"P={P}, K={K}: {err}")
    r = simulate(s, t_f=1.0, t_b=2.0)
    for p, peak in enumerate(r.peak_in_flight):
        limit = min(K, P - p)
        if peak > limit:
            fail(f"P={P}, K={K}: stage {p} holds {peak:g} micro-batches' activations at once; "
                 f"1F1B holds at most min(K, P - p) = {limit}. Run only P - p - 1 = "
                 f"{max(P - p - 1, 0)} forwards before the first backward, then alternate F, B")
    want = costs.pipeline.bubble_fraction(P, K)
    if abs(r.bubble - want) > 1e-9:
        fail(f"P={P}, K={K}: the simulated bubble is {r.bubble:.4f}, but GPipe's is "
             f"(P-1)/(K+P-1) = {want:.4f}; a stage waits longer than it must. Alternate one "
             f"forward and one backward in the steady state, oldest backward first")


@graded("5.1")
def one_f_one_b(fn):
    """Exercise 5.1: check the reader's 1F1B order, on paper and on real processes."""
    return grade_order(Checker(EXERCISE, TITLE, POINTS), fn, PAPER_CASES, assert_1f1b_schedule,
                       on_paper="valid, peak <= P - p, bubble = GPipe's",
                       on_processes="loss and gradients = one-process reference, timeline causal",
                       bubble_floor=True)
