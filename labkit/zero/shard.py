"""Splitting a parameter into N equal (padded) shards, and the collectives that move them.

Every stage of ZeRO in labkit shards the same way (as FSDP2 does, per parameter): a parameter of
`numel` elements is flattened and zero-padded to N * c elements, c = ceil(numel / N), and rank r
owns elements [r*c, (r+1)*c). Equal chunks let reduce-scatter and all-gather use one flat buffer;
the padding (< N elements per parameter) is ignored when the full tensor is rebuilt. A parameter
whose size does not divide by N is the ordinary case, not an exception.

Also here: a counter of the bytes each rank sends through the ring collectives (to measure the
ZeRO paper's 2Ψ vs 3Ψ), and `held_bytes`, what a rank actually keeps in parameters, gradients and
optimizer state.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def chunk_size(numel: int, world: int) -> int:
    """Elements each rank owns of a numel-element tensor: ceil(numel / world)."""
    return math.ceil(numel / world)


def padded_flat(t: torch.Tensor, world: int) -> torch.Tensor:
    """t flattened and zero-padded to world * chunk_size elements.        # (N*c,)"""
    flat = t.detach().reshape(-1)
    pad = world * chunk_size(flat.numel(), world) - flat.numel()
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


def shard_of(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's chunk of t (a copy, so the full tensor can be freed).      # (c,)"""
    c = chunk_size(t.numel(), world)
    return padded_flat(t, world)[rank * c:(rank + 1) * c].clone()


class CommCounter:
    """Bytes this rank sends through ring collectives, by collective name.

    Ring reduce-scatter and all-gather of a D-byte buffer send (N-1)/N * D bytes per rank; a ring
    all-reduce is both, 2(N-1)/N * D (labkit.costs.comm)."""

    def __init__(self):
        self.sent = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}

    def add(self, op: str, full_bytes: float, world: int) -> None:
        factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
        self.sent[op] += factor * full_bytes

    @property
    def total(self) -> float:
        return sum(self.sent.values())

    def reset(self) -> None:
        for k in self.sent:
            self.sent[k] = 0.0


def _reduce_scatter(out, inp, op, group):
    # newer PyTorch renames reduce_scatter_tensor to reduce_scatter_single
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=op, group=group)


def _all_gather(out, inp, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def reduce_scatter_mean(full: torch.Tensor, group=None, counter: CommCounter | None = None):
    """This rank's chunk of the mean over ranks of `full` (any shape).        # (c,)"""
    world = dist.get_world_size(group)
    flat = padded_flat(full, world)                                  # (N*c,)
    out = flat.new_empty(flat.numel() // world)                      # (c,)
    _reduce_scatter(out, flat, op=dist.ReduceOp.SUM, group=group)
    if counter is not None:
        counter.add("reduce_scatter", flat.numel() * flat.element_size(), world)
    return out.div_(world)


def all_gather_full(shard: torch.Tensor, shape, group=None, counter: CommCounter | None = None):
    """The full tensor of `shape` rebuilt from every rank's chunk.         # shape"""
    world = dist.get_world_size(group)
    flat = shard.new_empty(world * shard.numel())                   # (N*c,)
    _all_gather(flat, shard.detach().contiguous(), group=group)
    if counter is not None:
        counter.add("all_gather", flat.numel() * flat.element_size(), world)
    numel = math.prod(shape)
    return flat[:numel].view(shape)


def reduce_scatter_mean_many(fulls, group=None, counter: CommCounter | None = None) -> list:
    """reduce_scatter_mean of several tensors in ONE collective (fewer, larger messages).

    Each padded tensor is viewed as (N, c_i); concatenating along dim 1 puts every rank's chunks
    side by side in row r, so a plain reduce-scatter hands rank r exactly its chunks."""
    world = dist.get_world_size(group)
    cols = [padded_flat(t, world).view(world, -1) for t in fulls]    # (N, c_i) each
    sizes = [c.shape[1] for c in cols]
    flat = torch.cat(cols, dim=1).reshape(-1)                        # (N * sum c_i,)
    out = flat.new_empty(sum(sizes))                                 # (sum c_i,)
    _reduce_scatter(out, flat, op=dist.ReduceOp.SUM, group=group)
    if counter is not None:
        counter.add("reduce_scatter", flat.numel() * flat.element_size(), world)
    return list(out.div_(world).split(sizes))


def all_gather_many(shards, shapes, group=None, counter: CommCounter | None = None) -> list:
    """all_gather_full of several shards in ONE collective; returns the full tensors."""
    world = dist.get_world_size(group)
    sizes = [s.numel() for s in shards]
    mine = torch.cat([s.detach().reshape(-1) for s in shards])       # (sum c_i,)
    flat = mine.new_empty(world * mine.numel())                      # (N * sum c_i,)
    _all_gather(flat, mine, group=group)
    if counter is not None:
        counter.add("all_gather", flat.numel() * flat.element_size(), world)
    rows = flat.view(world, -1).split(sizes, dim=1)                  # (N, c_i) each
    return [r.reshape(-1)[:math.prod(shape)].view(shape) for r, shape in zip(rows, shapes)]


def shard_optimizer(params, optimizer_class, group=None, **optimizer_kwargs):
    """ZeRO's first idea: this rank's shard of every parameter, and an optimizer over shards only.

    Returns (shards, optimizer): shards[i] is a leaf tensor (c_i,) that is a VIEW of rank's chunk
    of params[i], so updating it updates the parameter in place and costs no extra memory. (Each
    parameter's storage is moved into a zero-padded flat buffer of N*c_i elements first, so every
    chunk, the last included, has c_i elements.) The optimizer, any torch.optim class, keeps its
    state for these elements only."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shards = []
    for p in params:
        c = chunk_size(p.numel(), world)
        flat = padded_flat(p, world).clone()                         # (N*c,) owns the storage
        p.data = flat[:p.numel()].view(p.shape)                      # the parameter lives in it
        shards.append(flat[rank * c:(rank + 1) * c].requires_grad_(True))   # (c,) a view
    return shards, optimizer_class(shards, **optimizer_kwargs)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of every tensor the optimizer keeps in its state (momentum, variance, ...)."""
    return tensor_bytes(v for s in optimizer.state.values() for v in s.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)


def unique_params(module_or_params):
    """Parameters once each (tied weights are one tensor), in a deterministic order."""
    params = module_or_params.parameters() if hasattr(module_or_params, "parameters") \
        else module_or_params
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
