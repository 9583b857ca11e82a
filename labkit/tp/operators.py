"""Megatron's conjugate operators f and g, as autograd functions.

In a tensor-parallel layer every rank holds a slice of each weight. Two operators are all the
communication it needs (Megatron-LM, section 3, figure 3):

    f: forward  identity        backward  all-reduce   (enters a column-parallel layer)
    g: forward  all-reduce      backward  identity     (leaves a row-parallel layer)

They are conjugates: where one communicates in the forward pass, the other does in the backward.
Why f all-reduces gradients: each rank uses the same input X with its own slice of the weight,
so dL/dX = sum over ranks of each rank's partial dL/dX.

`gather_last_dim` / `split_last_dim` are the other pair (all-gather forward, take my slice
backward; and the reverse), used when a column-parallel output must be whole on every rank.

Every collective here goes through `labkit.commlog` (the one communication log), so a timeline
can show each f and g; the proof of bytes on the wire comes from `labkit.netcount`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit import commlog

def world_of(group) -> tuple:
    """(rank, size) of this process in `group` (None: the default group)."""
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group, where: str) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x  # one rank: nothing to add (and nothing is sent)
    x = x.contiguous().clone()  # never reduce into a tensor autograd saved
    return commlog.all_reduce(x, group=group, where=where)


class _F(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "f backward"), None


class _G(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group, "g forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def f(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f (before a column-parallel layer): y = x; dL/dx = all-reduce(dL/dy)."""
    return _F.apply(x, group)


def g(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g (after a row-parallel layer): y = all-reduce(x); dL/dx = dL/dy."""
    return _G.apply(x, group)


# ----------------------------------------------------------------------------- gather / split
def _split(x: torch.Tensor, group) -> torch.Tensor:
    rank, tp = world_of(group)
    n = x.shape[-1]
    if n % tp:
        raise ValueError(f"the last dimension ({n}) must be divisible by the TP degree ({tp})")
    return x.narrow(-1, rank * (n // tp), n // tp).contiguous()


def _gather(x: torch.Tensor, group, where: str) -> torch.Tensor:
    _, tp = world_of(group)
    if tp == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp)]
    commlog.all_gather_list(parts, x, group=group, where=where)
    return torch.cat(parts, dim=-1)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group, "gather forward")

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group), None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, "split backward"), None


def gather_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dim (forward); backward keeps this rank's slice of the gradient."""
    return _Gather.apply(x, group)


def split_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of the last dim (forward); backward all-gathers the gradient."""
    return _Split.apply(x, group)
