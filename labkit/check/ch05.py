"""Checkers for chapter 05: the 1F1B order of actions for one pipeline stage.

The reader writes `one_f_one_b(p, P, K) -> [F(0), F(1), ..., B(0), ...]`: the actions stage p
runs, in order, with F and B from labkit.pipeline.schedules. The checker
1. validates the whole schedule (every action once, backward after forward, no deadlock),
2. simulates it: the peak number of micro-batches held on stage p must be at most P - p and the
   bubble must equal GPipe's, (P-1)/(K+P-1),
3. runs it on real processes, GPT split into P stages, against the one-process reference
   (loss and every gradient).
"""
from __future__ import annotations

from labkit import costs
from labkit.check import Checker, fail

EXERCISES = {
    "5.1": ("the 1F1B order of actions", 6),
}

PAPER_CASES = [(2, 1), (2, 4), (3, 2), (3, 7), (4, 8), (5, 3)]  # (P, K): K < P and K ∤ P too
RUN_CASES = [(2, 3), (3, 5)]                                     # on real processes, batch 7 rows


def schedule_from(fn, P: int, K: int):
    """The reader's per-stage function as a Schedule (with a hint when it returns the wrong thing)."""
    from labkit.pipeline.schedules import Action, from_stage_fn

    s = from_stage_fn(fn, P, K, name="yours")
    for p, actions in enumerate(s.stages):
        if not all(isinstance(a, Action) for a in actions):
            bad = next(a for a in actions if not isinstance(a, Action))
            fail(f"stage {p}: found {bad!r} in the list; return actions made with F(k) and B(k) "
                 f"from labkit.pipeline.schedules")
    return s


def assert_1f1b_schedule(s) -> None:
    """Valid, peak in-flight <= P - p on every stage, bubble equal to GPipe's. Shared with tests."""
    from labkit.pipeline.simulate import simulate
    from labkit.pipeline.validate import ScheduleError, validate

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


def _run_job(s, cfg, batch_size):
    from labkit.pipeline.executor import schedules_job

    return schedules_job([s], cfg, batch_size)[0]


def one_f_one_b(fn):
    """Exercise 5.1: check the reader's 1F1B order, on paper and on real processes."""
    from labkit.model import GPTConfig
    from labkit.pipeline import executor

    c = Checker("5.1", EXERCISES["5.1"][0], EXERCISES["5.1"][1])
    for P, K in PAPER_CASES:
        with c.case(f"P={P}, K={K}: valid, peak <= P - p, bubble = GPipe's"):
            assert_1f1b_schedule(schedule_from(fn, P, K))
    for P, K in RUN_CASES:
        with c.case(f"real processes, P={P}, K={K}: loss and gradients = one-process reference"):
            s = schedule_from(fn, P, K)
            cfg = GPTConfig(n_layer=P, n_embd=16, n_head=2, block_size=16)
            merged = executor.merge(c.launch(_run_job, P, args=(s, cfg, 7)))
            executor.compare_to_reference(merged, executor.reference_step(cfg, 7))
    return c.finish()
