"""Exercise 3.1: model-state bytes per GPU under a ZeRO stage.

    labkit.check.ch03.model_state_bytes(my_fn)   # (n_params, zero, dp, weights, grads,
                                                 #  optimizer) -> bytes per GPU
"""
from __future__ import annotations

import math

from labkit.check import Checker, fail, graded
from labkit.costs import memory

EXERCISE, TITLE, POINTS = "3.1", "model-state bytes per GPU under ZeRO", 2


@graded("3.1")
def model_state_bytes(fn):
    """fn(n_params, zero, dp, weights, grads, optimizer) -> bytes per GPU."""

    c = Checker(EXERCISE, TITLE, POINTS)
    cases = [("13B, stage 0, 12-byte recipe", (13e9, 0, 1, 2, 2, 8)),
             ("13B, ZeRO-2 over 8, 12-byte recipe", (13e9, 2, 8, 2, 2, 8)),
             ("13B, ZeRO-3 over 8, 12-byte recipe", (13e9, 3, 8, 2, 2, 8)),
             ("7B, ZeRO-1 over 64, 16-byte recipe", (7e9, 1, 64, 2, 2, 12)),
             ("70B, ZeRO-2 over 3, 18-byte recipe", (70e9, 2, 3, 2, 4, 12))]
    for name, (n, zero, dp, w, g, o) in cases:
        with c.case(name):
            got = fn(n, zero, dp, w, g, o)
            want = memory.model_states(n, recipe=memory.Precision("r", w, g, o), zero=zero,
                                       dp=dp).total
            if not isinstance(got, (int, float)):
                fail(f"return a number of bytes, got {type(got).__name__}")
            if not math.isclose(got, want, rel_tol=1e-9):
                which = ["nothing", "the optimizer states", "optimizer states and gradients",
                         "everything"][zero]
                fail(f"got {got / 1e9:.4g} GB, expected {want / 1e9:.4g} GB: stage {zero} "
                     f"divides {which} by dp={dp}")
    return c.finish()
