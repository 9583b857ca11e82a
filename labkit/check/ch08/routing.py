"""Exercise 8.1: top-k routing with capacity, GShard's priority, on one process.

    labkit.check.ch08.routing_with_capacity(keep)   # keep(expert (n, k), n_expert, cap)
                                                    #   -> (n, k) bool

Compared with plain loops: first choices of all tokens in token order, then second choices.
"""
from __future__ import annotations

import torch

from labkit.check import Checker, graded
from labkit.check.ch08.common import kept_by_loops

EXERCISE, TITLE, POINTS = "8.1", "top-k routing with capacity (GShard priority)", 2


@graded("8.1")
def routing_with_capacity(keep):
    """keep(expert (n, k) int64, n_expert, cap) -> (n, k) bool."""
    c = Checker(EXERCISE, TITLE, POINTS)
    g = torch.Generator().manual_seed(8)
    cases = [("3 tokens, top-2, capacity 2 (the chapter's example)",
              torch.tensor([[0, 1], [0, 1], [1, 0]]), 2, 2),
             ("top-1, one crowded expert", torch.tensor([[2], [2], [2], [0], [2]]), 3, 2)]
    for n, E, k, cap in [(16, 4, 2, 5), (37, 8, 2, 6), (20, 6, 3, 4), (9, 3, 1, 1)]:
        e = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
        cases.append((f"{n} tokens, {E} experts, top-{k}, capacity {cap}", e, E, cap))
    for name, e, E, cap in cases:
        with c.case(name):
            got = keep(e.clone(), E, cap)
            want = torch.tensor(kept_by_loops(e.tolist(), E, cap))
            assert isinstance(got, torch.Tensor) and got.shape == e.shape, (
                f"return a bool tensor of shape {tuple(e.shape)}, one entry per assignment")
            got = got.bool()
            per = torch.bincount(e[got], minlength=E)
            assert int(per.max()) <= cap, (
                "an expert kept more assignments than its capacity: does your count of places "
                "taken include earlier tokens' choices?")
            assert torch.equal(got, want), (
                f"kept {got.int().tolist()}, expected {want.int().tolist()}: are all first choices "
                f"served before any second choice, and earlier tokens before later ones?")
    return c.finish()
