"""Column- and row-parallel linear layers (Megatron-LM, section 3).

For Y = X W with X (b*s, h_in) and W (h_in, h_out) there are two ways to cut W over tp ranks:

    column parallel: W = [W_1 | ... | W_tp] (out features split).  Y_i = X W_i is rank i's slice
        of Y's columns: no sum needed. The input X must be whole on every rank (operator f).
    row parallel:    W = [W_1; ...; W_tp]   (in features split).   X must be cut the same way
        (X = [X_1 | ... | X_tp]) and Y = sum_i X_i W_i: an all-reduce (operator g).

A column-parallel layer's output slice is exactly the input slice a row-parallel layer wants,
so column then row needs no communication between them: only g after the row layer.

torch stores nn.Linear's weight as (out, in), so "column parallel" splits weight dim 0 and "row
parallel" splits weight dim 1. Parameters are read in forward(), so a user may replace
`layer.weight` / `layer.bias` after construction (loading a checkpoint) and it takes effect.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.tp.operators import f, g, gather_last_dim, split_last_dim, world_of


def check_divisible(what: str, n: int, tp: int) -> None:
    """A clear error for a size the TP degree does not divide, naming both numbers."""
    if n % tp:
        divisors = [d for d in range(1, n + 1) if n % d == 0 and d <= 64]
        lo, hi = (n // tp) * tp, (n // tp + 1) * tp
        raise ValueError(
            f"{what}={n} is not divisible by the tensor-parallel degree {tp}: use a TP degree that "
            f"divides {n} ({', '.join(map(str, divisors))}) or make {what} a multiple of {tp} "
            f"(e.g. {lo or hi} or {hi})")


def _full_init(out_features: int, in_features: int, bias: bool, seed: int):
    """The full (out, in) weight and bias, nn.Linear's uniform init, from a private generator."""
    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(in_features)
    w = (torch.rand(out_features, in_features, generator=gen) * 2 - 1) * bound
    b = (torch.rand(out_features, generator=gen) * 2 - 1) * bound if bias else None
    return w, b


class _ParallelLinear(nn.Module):
    """What both layers keep: the full sizes, the group, this rank and the TP degree."""

    def _init_weight(self, in_features: int, out_features: int, bias: bool, group, seed: int,
                     full, dim: int):
        """Sets the shared fields and this rank's slice of torch's (out, in) weight along `dim`
        (0: out features, column parallel; 1: in features, row parallel). Returns the full bias
        (given, or initialised; None without one): the layers keep different parts of it."""
        self.rank, self.tp = world_of(group)
        check_divisible(("out_features", "in_features")[dim], (out_features, in_features)[dim],
                        self.tp)
        self.in_features, self.out_features, self.group = in_features, out_features, group
        w, b = full if full is not None else _full_init(out_features, in_features, bias, seed)
        shard = w.chunk(self.tp, dim)[self.rank]          # (out/tp, in) or (out, in/tp)
        self.weight = nn.Parameter(shard.clone())
        return b


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's output features (rows of torch's (out, in) weight) split over ranks.

    Input: the whole x (B, ..., in) on every rank. Output: (B, ..., out/tp), this rank's slice,
    or the whole (B, ..., out) with gather_output=True (an all-gather; rarely wanted: a following
    RowParallelLinear takes the slice as it is)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 gather_output: bool = False, seed: int = 0, *, _full=None):
        super().__init__()
        self.gather_output = gather_output
        b = self._init_weight(in_features, out_features, bias, group, seed, _full, dim=0)
        self.bias = (nn.Parameter(b.chunk(self.tp)[self.rank].clone())          # (out/tp,)
                     if b is not None else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, gather_output: bool = False):
        """This rank's shard of a full nn.Linear (same on every rank), for exact comparisons."""
        b = linear.bias.detach() if linear.bias is not None else None
        return cls(linear.in_features, linear.out_features, b is not None, group, gather_output,
                   _full=(linear.weight.detach(), b))

    def forward(self, x):                                    # (B, T, in), whole on every rank
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer expects "
                             f"{self.in_features}")
        x = f(x, self.group)                                 # backward: all-reduce dL/dx
        y = F.linear(x, self.weight, self.bias)              # (B, T, out/tp)
        return gather_last_dim(y, self.group) if self.gather_output else y

    def full_parameters(self) -> dict:
        """The whole weight (out, in) and bias (out,), all-gathered (every rank calls this)."""
        out = {"weight": _gather_dim(self.weight.detach(), 0, self.group)}
        if self.bias is not None:
            out["bias"] = _gather_dim(self.bias.detach(), 0, self.group)
        return out

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features} "
                f"(out/tp={self.out_features // self.tp} on rank {self.rank}), "
                f"gather_output={self.gather_output}")


class RowParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's input features (columns of torch's (out, in) weight) split.

    Input: this rank's slice (B, ..., in/tp) (input_is_parallel=True, e.g. a column-parallel
    layer's output), or the whole x, which is then split here. Output: the whole (B, ..., out)
    on every rank, after g's all-reduce. The bias is added once, after the all-reduce: added
    before, it would be summed tp times."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 input_is_parallel: bool = True, seed: int = 0, *, _full=None):
        super().__init__()
        self.input_is_parallel = input_is_parallel
        b = self._init_weight(in_features, out_features, bias, group, seed, _full, dim=1)
        self.bias = nn.Parameter(b.clone()) if b is not None else None           # (out,) whole

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, input_is_parallel: bool = True):
        b = linear.bias.detach() if linear.bias is not None else None
        return cls(linear.in_features, linear.out_features, b is not None, group,
                   input_is_parallel, _full=(linear.weight.detach(), b))

    def forward(self, x):                                    # (B, T, in/tp) or (B, T, in)
        want = self.in_features // self.tp if self.input_is_parallel else self.in_features
        if x.shape[-1] != want:
            raise ValueError(f"input has {x.shape[-1]} features, expected {want} (in_features="
                             f"{self.in_features}, tp={self.tp}, input_is_parallel="
                             f"{self.input_is_parallel})")
        if not self.input_is_parallel:
            x = split_last_dim(x, self.group)                # (B, T, in/tp)
        y = F.linear(x, self.weight)                         # (B, T, out) partial sum
        y = g(y, self.group)                                 # (B, T, out) all-reduced
        return y + self.bias if self.bias is not None else y

    def full_parameters(self) -> dict:
        out = {"weight": _gather_dim(self.weight.detach(), 1, self.group)}
        if self.bias is not None:
            out["bias"] = self.bias.detach().clone()
        return out

    def extra_repr(self):
        return (f"in={self.in_features} (in/tp={self.in_features // self.tp} on rank {self.rank}),"
                f" out={self.out_features}, input_is_parallel={self.input_is_parallel}")


def _gather_dim(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather equal shards along `dim` (not in labkit.observe.commlog: a save, not a step)."""
    _, tp = world_of(group)
    if tp == 1:
        return t.clone()
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=dim)
