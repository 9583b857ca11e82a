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

Every collective here goes through `observe.commlog` (the one communication log), so a timeline
can show each f and g; the proof of bytes on the wire comes from `labkit.observe.netcount`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.observe import commlog


def world_of(group) -> tuple:
    """(rank, size) of this process in `group` (None: the default group)."""
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group, where: str) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x  # one rank: nothing to add (and nothing is sent)
    x = x.contiguous().clone()  # never reduce into a tensor autograd saved
    return commlog.all_reduce(x, group=group, where=where)


class Conjugate(torch.autograd.Function):
    """y = forward(x); dL/dx = backward(dL/dy). Every operator of this module is such a pair, as
    are sequence parallelism's (labkit.context.sequence_parallel): each communicates in the pass
    where its conjugate does not."""

    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward_fn = backward
        y = forward(x)
        return y.view_as(y) if y is x else y  # autograd wants a new tensor out of forward

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad), None, None


def conjugate(x: torch.Tensor, forward, backward) -> torch.Tensor:
    """Apply `forward` to x and `backward` to the gradient coming back (each tensor -> tensor)."""
    return Conjugate.apply(x, forward, backward)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def f(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f (before a column-parallel layer): y = x; dL/dx = all-reduce(dL/dy)."""
    return conjugate(x, _identity, lambda grad: _all_reduce(grad, group, "f backward"))


def g(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g (after a row-parallel layer): y = all-reduce(x); dL/dx = dL/dy."""
    return conjugate(x, lambda t: _all_reduce(t, group, "g forward"), _identity)


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


def gather_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dim (forward); backward keeps this rank's slice of the gradient."""
    return conjugate(x, lambda t: _gather(t, group, "gather forward"),
                     lambda grad: _split(grad, group))


def split_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of the last dim (forward); backward all-gathers the gradient."""
    return conjugate(x, lambda t: _split(t, group),
                     lambda grad: _gather(grad, group, "split backward"))
