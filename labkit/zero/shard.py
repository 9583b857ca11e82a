"""ZeRO's sharding: this rank's chunk of every parameter, the optimizer over those chunks, and
what a rank keeps in parameters, gradients and optimizer state.

Every stage of ZeRO in labkit shards the same way (as FSDP2 does, per parameter): a parameter is
cut into N equal, zero-padded chunks of a flat buffer (labkit.flat, which also holds the
reduce-scatter and all-gather that move them), and rank r owns chunk r. A parameter whose size
does not divide by N is the ordinary case, not an exception.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.flat import chunk_size, padded_flat, shard_of


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
