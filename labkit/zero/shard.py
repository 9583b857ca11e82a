"""Splitting a parameter into N equal (padded) shards, and the collectives that move them.

Every stage of ZeRO in labkit shards the same way (as FSDP2 does, per parameter): a parameter of
`numel` elements is flattened and zero-padded to N * c elements, c = ceil(numel / N), and rank r
owns elements [r*c, (r+1)*c). Equal chunks let reduce-scatter and all-gather use one flat buffer;
the padding (< N elements per parameter) is ignored when the full tensor is rebuilt. A parameter
whose size does not divide by N is the ordinary case, not an exception.

Every collective goes through labkit.observe.commlog (one event per call, for timelines and counts).
The reduce-scatter is labkit's ring (labkit.collectives) where the backend's own moves
all-reduce bytes (Gloo), and the backend's where it is a ring (NCCL): `reduce_scatter_algorithm`.
The bytes really sent are counted by the kernel (observe.netcount), never by this module. Also
here: what a rank keeps in parameters, gradients and optimizer state (`tensor_bytes`, ...).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labkit.collectives import ring_reduce_scatter
from labkit.observe import commlog
from labkit.observe.storage import storage_bytes  # noqa: F401 (labkit.check.ch03 imports it here)


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


def shard_optimizer(params, optimizer_class, group=None, **optimizer_kwargs):
    """ZeRO's first idea: this rank's shard of every parameter, and an optimizer over shards only.

    params: tensors, or torch-style groups [{"params": [...], "lr": ...}].
    Returns (shards, optimizer): shards[i] is a leaf tensor (c_i,) that is a VIEW of rank's chunk
    of params[i], so updating it updates the parameter in place and costs no extra memory. (Each
    parameter's storage is moved into a zero-padded flat buffer of N*c_i elements first, so every
    chunk, the last included, has c_i elements.) The optimizer, any torch.optim class, keeps its
    state for these elements only."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    shards, shard_groups = [], []
    for g in groups:    # torch-style parameter groups (lr, weight_decay ...) keep their options
        mine = []
        for p in g["params"]:
            c = chunk_size(p.numel(), world)
            flat = padded_flat(p, world).clone()                     # (N*c,) owns the storage
            p.data = flat[:p.numel()].view(p.shape)                  # the parameter lives in it
            mine.append(flat[rank * c:(rank + 1) * c].requires_grad_(True))   # (c,) a view
        shards += mine
        shard_groups.append({**g, "params": mine})
    return shards, optimizer_class(shard_groups, **optimizer_kwargs)


def master_shards(params, optimizer_class, group=None, param_dtype=None, home=None, frozen=(),
                  **optimizer_kwargs):
    """shard_optimizer for mixed precision (ZeRO-1/2 with a policy): the shards are fp32 COPIES
    of this rank's chunks (the master weights, not views), and the parameters themselves are
    cast to param_dtype, so the model computes in it. Returns (masters, optimizer); the optimizer
    keeps fp32 state for the masters only. After each step the caller all-gathers the masters
    cast to param_dtype into the parameters. home: the device the masters (and so the optimizer
    state and its step) live on, e.g. the CPU for ZeRO-Offload; copies even without a policy
    (then in the parameters' own dtype). frozen: parameters without a master, cast to
    param_dtype as well, so the whole model computes in it (FSDP2 casts them too).
    param_dtype and home None: shard_optimizer (views)."""
    if param_dtype is None and home is None:
        return shard_optimizer(params, optimizer_class, group, **optimizer_kwargs)
    for p in frozen:
        if param_dtype is not None and p.is_floating_point():
            p.data = p.data.to(param_dtype)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    masters, master_groups = [], []
    for g in groups:
        mine = []
        for p in g["params"]:
            master = p.detach().float() if param_dtype is not None else p.detach()
            mine.append(shard_of(master, rank, world).to(home or p.device)
                        .requires_grad_(True))                                        # (c,)
            if param_dtype is not None:
                p.data = p.data.to(param_dtype)
        masters += mine
        master_groups.append({**g, "params": mine})
    return masters, optimizer_class(master_groups, **optimizer_kwargs)


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
