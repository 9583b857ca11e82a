"""Exercise 9.1: a dynamic loss scaler (grow, skip, back off).

    labkit.check.ch09.loss_scaler(MyScaler)

MyScaler(init_scale, growth_factor, backoff_factor, growth_interval) with .scale and
.update(found_inf) -> bool (take the step?), compared decision by decision with
torch.amp.GradScaler on the same gradients. tests/test_precision.py uses the same cases.
"""
from __future__ import annotations

import torch

from labkit.check import Checker, graded

EXERCISE, TITLE, POINTS = "9.1", "a dynamic loss scaler (grow, skip, back off)", 2


def gradscaler_decisions(pattern, init_scale=2.0**4, growth_interval=3):
    """torch.amp.GradScaler's (scale before the step, step taken) for gradients that are finite
    or not as `pattern` says (True = contains inf)."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    gs = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    out = []
    for bad in pattern:
        before = p.detach().clone()
        scale = gs.get_scale()
        p.grad = None
        gs.scale(p.sum()).backward()                                  # grad = scale * 1
        if bad:
            p.grad[0] = float("inf")                                  # an overflowed gradient
        gs.step(opt)
        gs.update()
        out.append((scale, not torch.equal(before, p.detach())))
    return out


def scaler_decisions(cls, pattern, init_scale=2.0**4, growth_interval=3):
    s = cls(init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
            growth_interval=growth_interval)
    out = []
    for bad in pattern:
        scale = float(s.scale)
        out.append((scale, bool(s.update(bool(bad)))))
    return out


PATTERNS = {
    "all finite (growth every 3 steps)": [False] * 8,
    "an overflow at the first step": [True] + [False] * 5,
    "overflows in the middle": [False, False, True, False, False, False, True, True, False],
    "two overflows in a row, then growth": [True, True, False, False, False, False],
}


@graded("9.1")
def loss_scaler(cls):
    c = Checker(EXERCISE, TITLE, POINTS)
    for name, pattern in PATTERNS.items():
        with c.case(name):
            got, want = c.here(scaler_decisions, cls, pattern), gradscaler_decisions(pattern)
            for i, ((gs, gt), (ws, wt)) in enumerate(zip(got, want)):
                assert gt == wt, (f"step {i}: you {'took' if gt else 'skipped'} the step, "
                                  f"GradScaler {'took' if wt else 'skipped'} it. Which steps "
                                  f"must an inf or NaN gradient cancel?")
                assert gs == ws, (f"step {i}: your scale is {gs:g}, GradScaler's {ws:g}. After "
                                  f"how many good steps in a row does the scale grow, and what "
                                  f"happens to that count after an overflow?")
    return c.finish()
