"""Chapter 05's shared pieces: the reader's per-stage function as a Schedule, the run of a
schedule on real processes against the one-process reference, and the grading of an order on
paper then on processes (5.1 and 5.2 share all three).
"""
from __future__ import annotations

from labkit.check import Checker, fail
from labkit.model import GPTConfig
from labkit.pipeline import causality, executor
from labkit.pipeline.executor import schedules_job
from labkit.pipeline.schedules import Action, from_stage_fn

RUN_CASES = [(2, 3), (3, 5)]                                     # on real processes, batch 7 rows
RUN_TIMEOUT = 90.0  # seconds a launched case may run once its ranks joined (a loaded CI machine
                    # ran a correct P=3 case past the default 30 s); a real hang reports after it


def schedule_from(fn, P: int, K: int):
    """The reader's per-stage function as a Schedule (with a hint where it returns the wrong
    thing)."""
    s = from_stage_fn(fn, P, K, name="yours")
    for p, actions in enumerate(s.stages):
        if not all(isinstance(a, Action) for a in actions):
            bad = next(a for a in actions if not isinstance(a, Action))
            fail(f"stage {p}: found {bad!r} in the list; return actions made with F(k), B(k) "
                 f"(and W(k)) from labkit.pipeline.schedules")
    return s


def _run_job(s, cfg, batch_size):
    return schedules_job([s], cfg, batch_size)[0]


def run_on_processes(c: Checker, s, bubble_floor: bool) -> None:
    """Schedule s on P real processes (a GPT of P layers, a batch of 7 rows): loss and gradients
    against the one-process reference, and a causal timeline (and, with bubble_floor, no stage
    idle less than the schedule allows)."""
    cfg = GPTConfig(n_layer=s.P, n_embd=16, n_head=2, block_size=16)
    # the schedule is data (Actions): labkit's executor runs it on processes the checker starts
    # (under labkit grade: the judge's), with no student code beside it
    merged = executor.merge(c.measure(_run_job, s.P, args=(s, cfg, 7), timeout=RUN_TIMEOUT))
    executor.compare_to_reference(merged, executor.reference_step(cfg, 7))
    bad = causality.check_causality(s, merged["timeline"])
    if bubble_floor:
        bad += causality.check_bubble_floor(s, merged["timeline"])
    if bad:
        fail(f"the measured timeline is impossible ({len(bad)} problems), first: {bad[0]}")


def grade_order(c: Checker, fn, paper_cases, assert_schedule, on_paper: str, on_processes: str,
                bubble_floor: bool):
    """Grade the reader's order fn(p, P, K): each (P, K) of paper_cases as data by
    assert_schedule, then each of RUN_CASES on real processes; the claims name the cases."""
    for P, K in paper_cases:
        with c.case(f"P={P}, K={K}: {on_paper}"):
            assert_schedule(schedule_from(fn, P, K))
    for P, K in RUN_CASES:
        with c.case(f"real processes, P={P}, K={K}: {on_processes}"):
            run_on_processes(c, schedule_from(fn, P, K), bubble_floor=bubble_floor)
    return c.finish()
