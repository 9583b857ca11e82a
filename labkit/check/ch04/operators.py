"""Exercises 4.1 and 4.2: Megatron's conjugate pair, f (identity forward, all-reduce backward)
and g (all-reduce forward, identity backward); one module, as the two mirror each other.

    labkit.check.ch04.f_operator(f)     # 4.1
    labkit.check.ch04.g_operator(g)     # 4.2

Each runs at 2 and 3 real ranks against its definition; f_job and g_job are also the tests'.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.check import Checker, graded
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


def _grade(exercise, job, fn, case):
    """One operator of the pair against its definition at 2 and 3 real ranks."""
    c = Checker(exercise, *EXERCISES[exercise])
    for n in (2, 3):
        with c.case(f"{n} ranks: {case}"):
            assert_pairs(c.launch(job, n, args=(fn,)))
    return c.finish()


@graded("4.1")
def f_operator(f):
    """Exercise 4.1: f(x, group) against its definition at 2 and 3 ranks."""
    return _grade("4.1", f_job, f, "f forward is the identity, backward sums the gradients")


@graded("4.2")
def g_operator(g):
    """Exercise 4.2: g(x, group) against its definition at 2 and 3 ranks."""
    return _grade("4.2", g_job, g, "g forward sums over ranks, backward is the identity")
