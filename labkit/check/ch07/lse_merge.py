"""Exercise 7.1: the log-sum-exp merge of two partial attention results, on one process.

    labkit.check.ch07.merge(merge)   # merge(out1, lse1, out2, lse2) -> (out, lse)

Compared with attention over all keys (labkit.context.tiled.attend, fp64), with one side empty
(every key in the future: lse = -inf) and with log-sum-exps near 100 (exp overflows fp32).
"""
from __future__ import annotations

import torch

from labkit.check import Checker, fail, graded
from labkit.context.tiled import attend

EXERCISE, TITLE, POINTS = "7.1", "log-sum-exp merge of two partial attention results", 3


def _merge_case(fn, seed, B, H, T, d, split, kind):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, d, generator=g, dtype=torch.float64) for _ in range(3))
    if kind == "large":                                      # scores near 100: exp overflows fp32
        q = q * 40.0
    pos = torch.arange(T)
    if kind == "empty":                                      # second block: every key in future
        o1, l1 = attend(q, k, v, pos, pos)
        o2, l2 = attend(q, k, v, pos, pos + 10 * T)
        want_o, want_l = o1, l1
    else:
        o1, l1 = attend(q, k[:, :, :split], v[:, :, :split])
        o2, l2 = attend(q, k[:, :, split:], v[:, :, split:])
        want_o, want_l = attend(q, k, v)
    dt = torch.float32 if kind == "large" else torch.float64
    got = fn(o1.to(dt), l1.to(dt), o2.to(dt), l2.to(dt))
    if not (isinstance(got, tuple) and len(got) == 2):
        fail("return a tuple (out, lse): the merged output and its log-sum-exp")
    out, lse = got
    if out.shape != want_o.shape or lse.shape != want_l.shape:
        fail(f"shapes: out {tuple(out.shape)}, lse {tuple(lse.shape)}; expected "
             f"{tuple(want_o.shape)} and {tuple(want_l.shape)}")
    if torch.isnan(out).any() or torch.isnan(lse).any():
        fail("NaN in the result: with lse = -inf on one side, or with lse near 100 (exp "
             "overflows fp32), is everything you exponentiate at most exp(0)? Which value would "
             "you subtract?")
    tol = 1e-4 if dt == torch.float32 else 1e-9
    if not torch.allclose(lse.double(), want_l, atol=tol, rtol=tol):
        fail("the merged log-sum-exp is wrong: the sum of exp over all keys is the sum of the two "
             "blocks' sums; what is log(e^a + e^b) in terms of a, b?")
    if not torch.allclose(out.double(), want_o, atol=tol, rtol=tol):
        fail("the merged output is wrong: each block's output is normalized by its own sum; what "
             "weight does block 1's output get in the whole softmax (use lse1 and the new lse)?")


@graded("7.1")
def merge(fn):
    """Exercise 7.1: fn(out1, lse1, out2, lse2) -> (out, lse)."""
    c = Checker(EXERCISE, TITLE, POINTS)
    cases = [("two halves of the keys", (1, 1, 1, 8, 4, 4, "split")),
             ("uneven split, several heads", (2, 2, 3, 11, 8, 3, "split")),
             ("one block has no visible key (lse = -inf)", (3, 1, 2, 6, 4, 0, "empty")),
             ("fp32, log-sum-exps near 100", (4, 1, 2, 9, 16, 5, "large")),
             ("hidden case", (5, 3, 1, 17, 4, 13, "split"))]
    for name, (seed, B, H, T, d, split, kind) in cases:
        with c.case(name):
            _merge_case(fn, seed, B, H, T, d, split, kind)
    return c.finish()
