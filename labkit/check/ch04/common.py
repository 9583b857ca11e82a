"""Chapter 04's rank jobs and assertion shared by its exercises and by tests/test_tp.py, so an
exercise passes exactly when the book's own layers would. Every job runs on real processes,
builds the same full module on every rank from a fixed seed, and returns (actual, expected)
pairs; the assertion runs in the checker's process.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.check import fail, tensors_close
from labkit.launch import device
from labkit.tp.layers import ColumnParallelLinear


def full_init(out_f: int, in_f: int, bias: bool, seed: int):
    """The full (out, in) weight and bias, nn.Linear's uniform init from a private generator (the
    checker's own, on purpose: it stays independent of labkit.tp, which it grades)."""
    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(in_f)
    w = (torch.rand(out_f, in_f, generator=gen) * 2 - 1) * bound
    b = (torch.rand(out_f, generator=gen) * 2 - 1) * bound if bias else None
    return w, b


def _reference_linear(in_f: int, out_f: int, bias: bool, seed: int):
    w, b = full_init(out_f, in_f, bias, seed)
    lin = nn.Linear(in_f, out_f, bias=bias).to(device())      # this rank's GPU under NCCL
    lin.weight.data.copy_(w)
    if bias:
        lin.bias.data.copy_(b)
    return lin


def data(shape, seed):
    """The same numbers on every rank and device: drawn by a seeded CPU generator, then moved."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device())


def linear_job(make, kind: str, in_f: int, out_f: int, bias: bool = True, seed: int = 0,
               parallel_input: bool = True, gather_output: bool = False):
    """On each rank: a TP linear (kind 'column' or 'row', built by make(linear, group)) against the
    full nn.Linear, forward and backward. Returns {name: (actual, expected)}."""

    rank, tp = dist.get_rank(), dist.get_world_size()
    ref = _reference_linear(in_f, out_f, bias, seed)
    layer = make(_reference_linear(in_f, out_f, bias, seed), None)
    x = data((2, 3, in_f), seed + 1).requires_grad_()       # (B, T, in) same on every rank
    w_out = data((2, 3, out_f), seed + 2)                   # a fixed upstream gradient
    (ref(x) * w_out).sum().backward()
    y_ref = ref(x).detach()
    lo_i, n_i = rank * (in_f // tp), in_f // tp
    lo_o, n_o = rank * (out_f // tp), out_f // tp
    whole_out = kind == "row" or gather_output
    if kind == "row" and parallel_input:
        x_in = x.detach()[..., lo_i:lo_i + n_i].clone().requires_grad_()
        x_grad_ref = x.grad[..., lo_i:lo_i + n_i]
    else:
        x_in = x.detach().clone().requires_grad_()
        x_grad_ref = x.grad
    y = layer(x_in)
    up = w_out if whole_out else w_out[..., lo_o:lo_o + n_o]
    (y * up).sum().backward()
    out = {"output": (y.detach(), y_ref if whole_out else y_ref[..., lo_o:lo_o + n_o]),
           "input gradient": (x_in.grad, x_grad_ref)}
    if kind == "row":
        out["weight gradient"] = (layer.weight.grad, ref.weight.grad[:, lo_i:lo_i + n_i])
        if bias:
            out["bias gradient"] = (layer.bias.grad, ref.bias.grad)
    else:
        out["weight gradient"] = (layer.weight.grad, ref.weight.grad[lo_o:lo_o + n_o])
        if bias:
            out["bias gradient"] = (layer.bias.grad, ref.bias.grad[lo_o:lo_o + n_o])
    return out


def mlp_job(make_row, make_col=None, h: int = 12, seed: int = 0):
    """On each rank: column (f inside) -> GELU -> row (g inside) vs the full two-layer MLP."""


    make_col = make_col or (lambda lin, group: ColumnParallelLinear.from_linear(lin, group))
    fc, proj = _reference_linear(h, 4 * h, True, seed), _reference_linear(4 * h, h, True, seed + 7)
    tfc = make_col(_reference_linear(h, 4 * h, True, seed), None)
    tproj = make_row(_reference_linear(4 * h, h, True, seed + 7), None)
    x = data((2, 3, h), seed + 1).requires_grad_()
    w_out = data((2, 3, h), seed + 2)
    y_ref = proj(F.gelu(fc(x)))
    (y_ref * w_out).sum().backward()
    xt = x.detach().clone().requires_grad_()
    y = tproj(F.gelu(tfc(xt)))
    (y * w_out).sum().backward()
    return {"MLP output": (y.detach(), y_ref.detach()), "MLP input gradient": (xt.grad, x.grad),
            "proj bias gradient": (tproj.bias.grad, proj.bias.grad)}



def assert_pairs(results, what: str = "", rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Every rank's (actual, expected) pairs match; the hint names the rank and the quantity."""
    for rank, pairs in enumerate(results):
        for name, (actual, expected) in pairs.items():
            if actual is None:
                fail(f"rank {rank}: {name} is None (was the tensor cut out of the autograd graph, "
                     "e.g. by .detach(), .data or torch.no_grad()?)")
            tensors_close(actual, expected, rtol=rtol, atol=atol,
                          what=f"rank {rank}: {what}{name}")


def off_by_one_vector(got, want) -> bool:
    """The output is off by the same vector at every position: a bias added on every rank
    before the sum (counted tp times) instead of once after it."""
    if got.shape != want.shape:
        return False
    diff = got.double() - want.double()                      # (B, T, out)
    return bool(diff.abs().max() > 1e-4 and
                torch.allclose(diff, diff[:1, :1].expand_as(diff), atol=1e-5))


def hint_bias(res, tp):
    """Say that a bias was added tp times, instead of only 'differs at index ...'."""
    y, y_ref = res[0]["output"]
    if off_by_one_vector(y, y_ref):
        fail(f"the output is off by the same vector at every position (about {tp - 1} extra "
             "copies of the bias): add the bias once, after the all-reduce (g), not on every rank "
             "before it")
