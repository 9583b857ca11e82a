"""Equal padded chunks of a flat tensor, and the collectives that move them: one buffer, N chunks.

A tensor of `numel` elements is flattened and zero-padded to N * c elements, c = ceil(numel / N),
and rank r owns elements [r*c, (r+1)*c). Equal chunks let reduce-scatter and all-gather use one
flat buffer; the padding (< N elements) is ignored when the full tensor is rebuilt. ZeRO shards
every parameter this way (labkit.zero.shard, as FSDP2 does, per parameter), and context and
sequence parallelism move their activations with the same two collectives (labkit.context).

Every collective goes through labkit.observe.commlog (one event per call, for timelines and counts).
The reduce-scatter is labkit's ring (labkit.collectives) where the backend's own moves
all-reduce bytes (Gloo), and the backend's where it is a ring (NCCL): `reduce_scatter_algorithm`.
The bytes really sent are counted by the kernel (observe.netcount), never by this module. The
default `where` labels are ZeRO's (its callers are the most); other callers pass their own.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labkit.collectives import ring_reduce_scatter
from labkit.observe import commlog


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


def reduce_scatter_algorithm(group=None) -> str:
    """"ring" (labkit.collectives, built from send/recv) or "backend" (the backend's own).

    NCCL's reduce-scatter is a ring: each rank sends (N-1)/N of the buffer. PyTorch's Gloo backend
    all-reduces a copy of the whole buffer and keeps this rank's chunk: 2(N-1)/N, twice the ring
    (counted by the kernel: observe.netcount, chapter 03), so there labkit runs its own ring and
    ZeRO moves what the ZeRO paper says on every backend."""
    return "backend" if "nccl" in str(dist.get_backend(group)).lower() else "ring"


def reduce_scatter_sum(flat: torch.Tensor, group=None, where: str = "ZeRO reduce-scatter",
                       algorithm: str | None = None) -> torch.Tensor:
    """This rank's chunk of the sum over ranks of flat (N*c,), logged as one reduce-scatter
    (observe.commlog). `flat` is not changed. algorithm: None (reduce_scatter_algorithm), "ring"
    or "backend"."""
    world = dist.get_world_size(group)
    algorithm = algorithm or reduce_scatter_algorithm(group)
    if algorithm == "backend":
        out = flat.new_empty(flat.numel() // world)                  # (c,)
        return commlog.reduce_scatter_into(out, flat, group=group, where=where)
    if algorithm != "ring":
        raise ValueError(f"algorithm must be 'ring' or 'backend', got {algorithm!r}")
    with commlog.composite("reduce_scatter", flat, group=group, where=where):
        return ring_reduce_scatter(flat.clone(), "sum", group)   # (c,); the ring writes its input


def all_gather_flat(mine: torch.Tensor, group=None, where: str = "ZeRO all-gather") -> torch.Tensor:
    """Every rank's (c,) piece, concatenated in rank order (N*c,): the backend's all-gather (a
    ring on Gloo and NCCL alike: (N-1)/N of the output sent per rank), logged by commlog."""
    out = mine.new_empty(dist.get_world_size(group) * mine.numel())  # (N*c,)
    return commlog.all_gather_into(out, mine.detach().contiguous(), group=group, where=where)


def reduce_scatter_mean(full: torch.Tensor, group=None, where: str = "ZeRO reduce-scatter"):
    """This rank's chunk of the mean over ranks of `full` (any shape).        # (c,)"""
    world = dist.get_world_size(group)
    return reduce_scatter_sum(padded_flat(full, world), group, where).div_(world)


def all_gather_full(shard: torch.Tensor, shape, group=None, where: str = "ZeRO all-gather"):
    """The full tensor of `shape` rebuilt from every rank's chunk.         # shape"""
    flat = all_gather_flat(shard, group, where)                      # (N*c,)
    return flat[:math.prod(shape)].view(shape)


def reduce_scatter_mean_many(fulls, group=None, where: str = "ZeRO reduce-scatter",
                             algorithm: str | None = None) -> list:
    """reduce_scatter_mean of several tensors in ONE collective (fewer, larger messages).

    Each padded tensor is viewed as (N, c_i); concatenating along dim 1 puts every rank's chunks
    side by side in row r, so a plain reduce-scatter hands rank r exactly its chunks."""
    world = dist.get_world_size(group)
    cols = [padded_flat(t, world).view(world, -1) for t in fulls]    # (N, c_i) each
    sizes = [c.shape[1] for c in cols]
    flat = torch.cat(cols, dim=1).reshape(-1)                        # (N * sum c_i,)
    return list(reduce_scatter_sum(flat, group, where, algorithm).div_(world).split(sizes))


def all_gather_many(shards, shapes, group=None, where: str = "ZeRO all-gather") -> list:
    """all_gather_full of several shards in ONE collective; returns the full tensors."""
    world = dist.get_world_size(group)
    sizes = [s.numel() for s in shards]
    mine = torch.cat([s.detach().reshape(-1) for s in shards])       # (sum c_i,)
    flat = all_gather_flat(mine, group, where)                       # (N * sum c_i,)
    rows = flat.view(world, -1).split(sizes, dim=1)                  # (N, c_i) each
    return [r.reshape(-1)[:math.prod(shape)].view(shape) for r, shape in zip(rows, shapes)]
