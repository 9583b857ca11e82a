"""Checkers for chapter 05: the 1F1B order of actions for one pipeline stage.

The reader writes `one_f_one_b(p, P, K) -> [F(0), F(1), ..., B(0), ...]`: the actions stage p
runs, in order, with F and B from labkit.pipeline.schedules. The checker
1. validates the whole schedule (every action once, backward after forward, no deadlock),
2. simulates it: the peak number of micro-batches held on stage p must be at most P - p and the
   bubble must equal GPipe's, (P-1)/(K+P-1),
3. runs it on real processes, GPT split into P stages, against the one-process reference
   (loss and every gradient), and checks the measured timeline is causal
   (labkit.pipeline.causality).
"""
from __future__ import annotations

from labkit import costs
from labkit.check import Checker, fail

EXERCISES = {
    "5.1": ("the 1F1B order of actions", 6),
    "5.2": ("from 1F1B to ZB-H1: defer the weight gradients", 6),
}
ZB_PAPER_CASES = [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8)]  # K >= P (the formula's range)

PAPER_CASES = [(2, 1), (2, 4), (3, 2), (3, 7), (4, 8), (5, 3)]  # (P, K): K < P and K ∤ P too
RUN_CASES = [(2, 3), (3, 5)]                                     # on real processes, batch 7 rows


def schedule_from(fn, P: int, K: int):
    """The reader's per-stage function as a Schedule (with a hint when it returns the wrong thing)."""
    from labkit.pipeline.schedules import Action, from_stage_fn

    s = from_stage_fn(fn, P, K, name="yours")
    for p, actions in enumerate(s.stages):
        if not all(isinstance(a, Action) for a in actions):
            bad = next(a for a in actions if not isinstance(a, Action))
            fail(f"stage {p}: found {bad!r} in the list; return actions made with F(k), B(k) "
                 f"(and W(k)) from labkit.pipeline.schedules")
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
    from labkit.pipeline import causality, executor

    c = Checker("5.1", EXERCISES["5.1"][0], EXERCISES["5.1"][1])
    for P, K in PAPER_CASES:
        with c.case(f"P={P}, K={K}: valid, peak <= P - p, bubble = GPipe's"):
            assert_1f1b_schedule(schedule_from(fn, P, K))
    for P, K in RUN_CASES:
        with c.case(f"real processes, P={P}, K={K}: loss and gradients = one-process reference, "
                    f"timeline causal"):
            s = schedule_from(fn, P, K)
            cfg = GPTConfig(n_layer=P, n_embd=16, n_head=2, block_size=16)
            merged = executor.merge(c.launch(_run_job, P, args=(s, cfg, 7)))
            executor.compare_to_reference(merged, executor.reference_step(cfg, 7))
            bad = (causality.check_causality(s, merged["timeline"])
                   + causality.check_bubble_floor(s, merged["timeline"]))
            if bad:
                fail(f"the measured timeline is impossible ({len(bad)} problems), first: {bad[0]}")
    return c.finish()


def assert_zb_h1_schedule(s) -> None:
    """Split backward, both validators, peak <= 1F1B's (P micro-batches, W holding them), and
    with t_F = t_B = t_W the simulated bubble (P-1)/(3K+P-1). Shared with tests."""
    from labkit.pipeline.simulate import simulate
    from labkit.pipeline.validate import ScheduleError, check_message_order, validate

    P, K = s.P, s.K
    if not s.split:
        fail(f"P={P}, K={K}: no W actions: split every backward into B(k) (input gradient) "
             f"and W(k) (weight gradient)")
    try:
        validate(s)
        check_message_order(s)
    except ScheduleError as err:
        fail(f"P={P}, K={K}: {err}")
    try:
        from labkit.pipeline.torch_orders import torch_validate
        torch_validate(s)
    except AssertionError as err:
        fail(f"P={P}, K={K}: PyTorch's schedule validator refuses it: {str(err).splitlines()[0]}")
    r = simulate(s, t_f=1.0, t_b=2.0, t_w=1.0)
    for p, peak in enumerate(r.peak_in_flight):
        if peak > P:
            fail(f"P={P}, K={K}: stage {p} holds {peak:g} micro-batches (a micro-batch is held "
                 f"from its F to its W); 1F1B's peak is P = {P}. Run each W at most p B's late")
    want = costs.pipeline.schedule_bubble("zb-h1", P, K, 1, 1.0, 2.0, 1.0)
    if r.bubble > want + 1e-9:
        fail(f"P={P}, K={K}: the simulated bubble is {r.bubble:.4f} (t_F = t_B = t_W), ZB-H1's is "
             f"(P-1)/(3K+P-1) = {want:.4f}: some stage idles in the cool-down where a deferred "
             f"W could run")


def zb_h1(fn):
    """Exercise 5.2: the reader's ZB-H1 order, on paper and on real processes."""
    from labkit.model import GPTConfig
    from labkit.pipeline import causality, executor

    c = Checker("5.2", EXERCISES["5.2"][0], EXERCISES["5.2"][1])
    for P, K in ZB_PAPER_CASES:
        with c.case(f"P={P}, K={K}: valid (labkit's and PyTorch's validators), peak <= P, "
                    f"bubble (P-1)/(3K+P-1)"):
            assert_zb_h1_schedule(schedule_from(fn, P, K))
    for P, K in RUN_CASES:
        with c.case(f"real processes, P={P}, K={K}: B and W run apart, loss and gradients = "
                    f"one-process reference, timeline causal"):
            s = schedule_from(fn, P, K)
            cfg = GPTConfig(n_layer=P, n_embd=16, n_head=2, block_size=16)
            merged = executor.merge(c.launch(_run_job, P, args=(s, cfg, 7)))
            executor.compare_to_reference(merged, executor.reference_step(cfg, 7))
            bad = causality.check_causality(s, merged["timeline"])
            if bad:
                fail(f"the measured timeline is impossible ({len(bad)} problems), first: {bad[0]}")
    return c.finish()
