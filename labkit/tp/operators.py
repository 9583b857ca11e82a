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

Every collective here goes through `_collective`, which tells any open `CommLog` its size, so the
chapter can count the bytes of a real run instead of trusting a formula.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_LOGS: list = []  # open CommLog contexts (instrumentation only; groups are always passed)


class CommLog:
    """Records every collective the TP operators run on this rank, while open.

        with CommLog() as log:
            loss.backward()
        log.events  # [{"op": "all_reduce", "where": "g forward", "numel": ..., "bytes": ...}]
    """

    def __init__(self):
        self.events: list = []

    def __enter__(self):
        _LOGS.append(self)
        return self

    def __exit__(self, *exc):
        _LOGS.remove(self)
        return False

    def count(self, op: str | None = None, where: str | None = None) -> int:
        return len(self._select(op, where))

    def bytes(self, op: str | None = None, where: str | None = None) -> int:
        return sum(e["bytes"] for e in self._select(op, where))

    def _select(self, op, where):
        return [e for e in self.events
                if (op is None or e["op"] == op) and (where is None or e["where"] == where)]


def _collective(op: str, t: torch.Tensor, group, where: str) -> None:
    for log in _LOGS:
        log.events.append({"op": op, "where": where, "shape": tuple(t.shape), "numel": t.numel(),
                           "bytes": t.numel() * t.element_size()})


def world_of(group) -> tuple:
    """(rank, size) of this process in `group` (None: the default group)."""
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group, where: str) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x  # one rank: nothing to add (and nothing is sent)
    _collective("all_reduce", x, group, where)
    x = x.contiguous().clone()  # never reduce into a tensor autograd saved
    dist.all_reduce(x, group=group)
    return x


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
    _collective("all_gather", x, group, where)
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x, group=group)
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
