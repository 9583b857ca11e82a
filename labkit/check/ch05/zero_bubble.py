"""Exercise 5.2: from 1F1B to ZB-H1, the weight gradients deferred.

    labkit.check.ch05.zb_h1(fn)   # fn(p, P, K) -> [F(k), B(k), W(k), ...]

Split backward, both validators (labkit's and PyTorch's), peak <= P, bubble (P-1)/(3K+P-1) at
t_F = t_B = t_W; run on real processes with B and W apart.
"""
from __future__ import annotations

from labkit import costs
from labkit.check import Checker, fail, graded
from labkit.check.ch05.common import grade_order
from labkit.pipeline.simulate import simulate
from labkit.pipeline.torch_orders import torch_validate
from labkit.pipeline.validate import ScheduleError, check_message_order, validate

EXERCISE, TITLE, POINTS = "5.2", "from 1F1B to ZB-H1: defer the weight gradients", 4
ZB_PAPER_CASES = [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8)]  # K >= P (the formula's range)


def assert_zb_h1_schedule(s) -> None:
    """Split backward, both validators, peak <= 1F1B's (P micro-batches, W holding them), and
    with t_F = t_B = t_W the simulated bubble (P-1)/(3K+P-1). Shared with tests."""
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


@graded("5.2")
def zb_h1(fn):
    """Exercise 5.2: the reader's ZB-H1 order, on paper and on real processes."""
    return grade_order(Checker(EXERCISE, TITLE, POINTS), fn, ZB_PAPER_CASES,
                       assert_zb_h1_schedule,
                       on_paper="valid (labkit's and PyTorch's validators), peak <= P, "
                                "bubble (P-1)/(3K+P-1)",
                       on_processes="B and W run apart, loss and gradients = one-process "
                                    "reference, timeline causal",
                       bubble_floor=False)
