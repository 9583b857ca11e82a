"""ZeRO-3's gradient reduction for one unit's backward (labkit.zero.unit.post_backward calls it):
the sharded parameters' gradients reduce-scattered in ONE message into this rank's chunks, the
replicated ones (replicate=) all-reduced in one message, both averaged over the ranks and cast up
to the masters' dtype (offload: moved to the CPU). With find_unused_parameters a has-grad flag
per parameter travels in the same message, so a parameter no rank used keeps gradient None.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.observe import commlog


def _payload(zero, params, grads, world: int, device) -> tuple:
    """The gradients in reduce_dtype (zeros where missing), and [has-grad flags repeated
    world times] if find_unused_parameters, else []."""
    fulls = [(torch.zeros(zero.shapes[id(p)], device=device) if g is None else g)
             .to(zero.reduce_dtype_of(p)) for p, g in zip(params, grads)]
    if not zero.find_unused:
        return fulls, []
    flags = torch.tensor([float(g is not None) for g in grads], device=device)   # (P,)
    return fulls, [flags.to(fulls[0].dtype).repeat(world)]                      # (N*P,)


def reduce_grads(zero, params, grads, device) -> dict:
    """id(p) -> the mean gradient for p's master, in the master's dtype: this rank's chunk
    (reduce-scatter) or the whole tensor if replicated (all-reduce); None: no rank had one."""
    out = {}
    sharded = [(p, g) for p, g in zip(params, grads) if id(p) not in zero.replicated]
    whole = [(p, g) for p, g in zip(params, grads) if id(p) in zero.replicated]
    if sharded:
        out.update(_reduce_scatter(zero, *zip(*sharded), device))
    if whole:
        out.update(_all_reduce(zero, *zip(*whole), device))
    return out


def _reduce_scatter(zero, params, grads, device) -> dict:
    fulls, flags = _payload(zero, params, grads, dist.get_world_size(zero.group), device)
    chunks = zero.reduce_scatter(fulls + flags)                   # (c_i,) each, one message
    used = chunks.pop().tolist() if flags else [1.0] * len(chunks)
    return {id(p): _to_master(zero, p, c) if u > 0 else None   # up to fp32 (offload: CPU)
            for p, c, u in zip(params, chunks, used)}


def _to_master(zero, p, g) -> torch.Tensor:
    master = zero.shard_for[id(p)]
    return g.to(master.device, master.dtype)


def _all_reduce(zero, params, grads, device) -> dict:
    fulls, flags = _payload(zero, params, grads, 1, device)
    parts = fulls + flags
    flat = torch.cat([t.reshape(-1) for t in parts])              # (sum numel,) one message
    commlog.all_reduce(flat, group=zero.group, where="ZeRO-3 replicated grads")
    reduced = flat.div_(dist.get_world_size(zero.group)).split([t.numel() for t in parts])
    used = reduced[-1].tolist() if flags else [1.0] * len(params)
    return {id(p): _to_master(zero, p, r.view(zero.shapes[id(p)]))
            if u > 0 else None for p, r, u in zip(params, reduced, used)}
