"""Exercises 4.1 and 4.2: Megatron's conjugate pair, f (identity forward, all-reduce backward)
and g (all-reduce forward, identity backward); one module, as the two mirror each other.

    labkit.check.ch04.f_operator(f)     # 4.1
    labkit.check.ch04.g_operator(g)     # 4.2

Each runs at 2 and 3 real ranks against its definition; f_job and g_job are also the tests'.
The jobs return (actual, expected) pairs; the checker keeps only the actual values and computes
the expected ones itself (expected), so that nothing beside the reader's code decides a case.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.check import Checker, fail, graded
from labkit.check.ch04.common import assert_pairs, data
from labkit.launch import device

EXERCISES = {"4.1": ("Megatron's f operator (identity forward, all-reduce backward)", 1),
             "4.2": ("Megatron's g operator (all-reduce forward, identity backward)", 1)}


def _graph_check(y, name):
    if not isinstance(y, torch.Tensor) or not y.requires_grad:
        return {f"{name}'s output is part of the autograd graph (requires_grad)":
                (torch.tensor(0.0, device=device()), torch.tensor(1.0, device=device()))}
    return None


def g_job(g):
    """On each rank: g sums the ranks' inputs forward and passes the gradient through."""
    rank, n = dist.get_rank(), dist.get_world_size()
    xs = [data((3, 5), 10 + r) for r in range(n)]           # every rank's input, known to all
    ws = [data((3, 5), 20 + r) for r in range(n)]           # every rank's upstream gradient
    x = xs[rank].clone().requires_grad_()
    y = g(x, None)
    bad = _graph_check(y, "g")
    if bad:
        return bad
    out = {"g forward (sum over ranks)": (y.detach().clone(), sum(xs))}
    (y * ws[rank]).sum().backward()
    out["g backward (identity)"] = (x.grad, ws[rank])
    out["g's input x (must not be changed in place)"] = (x.detach(), xs[rank])
    return out


def f_job(f):
    """On each rank: f passes x through forward and sums the ranks' gradients backward."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x0 = data((3, 5), 10)                                   # f's input is the same on all ranks
    ws = [data((3, 5), 20 + r) for r in range(n)]
    x = x0.clone().requires_grad_()
    y = f(x, None)
    bad = _graph_check(y, "f")
    if bad:
        return bad
    out = {"f forward (identity)": (y.detach().clone(), x0)}
    (y * ws[rank]).sum().backward()
    out["f backward (sum of the ranks' gradients)"] = (x.grad, sum(ws))
    return out


def _cpu(shape, seed):
    """common.data's numbers, on the CPU: the checker's own copy of what the ranks drew."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))   # shape


def expected(exercise: str, n: int, rank: int) -> dict:
    """{quantity: what rank `rank` must hold}, computed where the checker runs (under labkit
    grade: the judge, where no student code runs), never taken from the ranks."""
    ws = [_cpu((3, 5), 20 + r) for r in range(n)]            # every rank's upstream gradient
    if exercise == "4.1":
        return {"f forward (identity)": _cpu((3, 5), 10),
                "f backward (sum of the ranks' gradients)": sum(ws)}
    xs = [_cpu((3, 5), 10 + r) for r in range(n)]
    return {"g forward (sum over ranks)": sum(xs), "g backward (identity)": ws[rank],
            "g's input x (must not be changed in place)": xs[rank]}


def _judged(exercise: str, results: list) -> list:
    """The ranks' (actual, expected) pairs with the expected values replaced by the checker's;
    a rank that returned other quantities (the graph check's failure) fails."""
    out = []
    for rank, pairs in enumerate(results):
        want = expected(exercise, len(results), rank)
        if not isinstance(pairs, dict) or set(pairs) != set(want):
            graph = [k for k in pairs if "autograd graph" in str(k)] \
                if isinstance(pairs, dict) else []
            if graph:
                fail(f"rank {rank}: {graph[0]}: it is not (was the tensor cut out of the "
                     f"autograd graph, e.g. by .detach(), .data or torch.no_grad()?)")
            fail(f"rank {rank} returned {pairs!r:.200}; expected the quantities {sorted(want)}")
        out.append({k: (pairs[k][0] if isinstance(pairs[k], (tuple, list)) else None, w)
                    for k, w in want.items()})
    return out


def _grade(exercise, job, fn, case):
    """One operator of the pair against its definition at 2 and 3 real ranks."""
    c = Checker(exercise, *EXERCISES[exercise])
    for n in (2, 3):
        with c.case(f"{n} ranks: {case}"):
            assert_pairs(_judged(exercise, c.launch(job, n, args=(fn,))))
    return c.finish()


@graded("4.1")
def f_operator(f):
    """Exercise 4.1: f(x, group) against its definition at 2 and 3 ranks."""
    return _grade("4.1", f_job, f, "f forward is the identity, backward sums the gradients")


@graded("4.2")
def g_operator(g):
    """Exercise 4.2: g(x, group) against its definition at 2 and 3 ranks."""
    return _grade("4.2", g_job, g, "g forward sums over ranks, backward is the identity")
