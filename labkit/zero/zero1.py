"""ZeRO stage 1: shard the optimizer states (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models"), beside plain data parallelism (stage 0).

    zero = ZeRO1(model.parameters(), torch.optim.AdamW, lr=1e-3)   # inside a launched rank
    loss = model(x, y)[1]; loss.backward(); zero.step(); zero.zero_grad()

Stage 0 (plain DP): every rank all-reduces the full gradient and runs the full optimizer: every
rank holds 16Ψ bytes in mixed precision, N identical copies of the optimizer state.

Stage 1: rank r keeps optimizer state only for its chunk of each parameter (labkit.zero.shard).
A step is
    1. reduce-scatter the gradients: rank r receives the mean gradient of its chunk only;
    2. the optimizer updates rank r's chunk (state for 1/N of the elements);
    3. all-gather the updated chunks: every rank holds the same full parameters again.
Reduce-scatter + all-gather is exactly a ring all-reduce split in its two phases, so stage 1
sends the same 2(N-1)/N Ψ values per rank as DDP, and saves (N-1)/N of the optimizer state.
The naive version (all-reduce the gradients, then all-gather the parameters) sends 3(N-1)/N Ψ.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.zero.shard import (CommCounter, all_gather_full, all_gather_many,
                               optimizer_state_bytes, reduce_scatter_mean,
                               reduce_scatter_mean_many, shard_optimizer, tensor_bytes,
                               unique_params)


def zero1_step(params, shards, optimizer, group=None, counter=None) -> None:
    """One ZeRO-1 step: reduce-scatter gradients, update this rank's shards, all-gather params.

    params: the full parameters (same values on every rank), each with this rank's local .grad.
    shards: this rank's chunk of each parameter (labkit.zero.shard_optimizer), which `optimizer`
    updates. Afterwards every rank's params hold the same updated values."""
    for p, s in zip(params, shards):
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        s.grad = reduce_scatter_mean(g, group, counter)             # (c,) mean over ranks
    optimizer.step()
    with torch.no_grad():
        for p, s in zip(params, shards):
            p.copy_(all_gather_full(s, p.shape, group, counter))   # p.shape


def zero1_step_flat(params, shards, optimizer, group=None, counter=None) -> None:
    """zero1_step with one reduce-scatter and one all-gather for all parameters together: the
    same bytes in 2 messages instead of 2 per parameter (what DeepSpeed's buckets do)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    for s, g in zip(shards, reduce_scatter_mean_many(grads, group, counter)):
        s.grad = g                                                   # (c,) mean over ranks
    optimizer.step()
    with torch.no_grad():
        for p, full in zip(params, all_gather_many(shards, [p.shape for p in params], group,
                                                    counter)):
            p.copy_(full)


def naive_zero1_step(params, shards, optimizer, group=None, counter=None) -> None:
    """The same update with a full all-reduce first (3(N-1)/N Ψ sent instead of 2(N-1)/N Ψ)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for p, s in zip(params, shards):
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        dist.all_reduce(g, group=group)                             # everyone gets everything...
        if counter is not None:
            counter.add("all_reduce", g.numel() * g.element_size(), world)
        c = s.numel()
        flat = torch.cat([g.reshape(-1), g.new_zeros(world * c - g.numel())])
        s.grad = flat[rank * c:(rank + 1) * c] / world               # ...and keeps 1/N of it
    optimizer.step()
    with torch.no_grad():
        for p, s in zip(params, shards):
            p.copy_(all_gather_full(s, p.shape, group, counter))


class DataParallel:
    """Stage 0: all-reduce the mean gradient, full optimizer on every rank (the baseline)."""

    stage = 0

    def __init__(self, params, optimizer_class, group=None, **optimizer_kwargs):
        self.params = unique_params(params)
        self.group, self.counter = group, CommCounter()
        self.optimizer = optimizer_class(self.params, **optimizer_kwargs)

    def step(self) -> None:
        world = dist.get_world_size(self.group)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])            # one message, not one per tensor
        dist.all_reduce(flat, group=self.group)
        self.counter.add("all_reduce", flat.numel() * flat.element_size(), world)
        for p, g in zip(self.params, flat.div_(world).split([g.numel() for g in grads])):
            p.grad = g.view_as(p)
        self.optimizer.step()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def held_bytes(self) -> dict:
        """What this rank keeps between steps: parameters, gradients, optimizer state."""
        return {"params": tensor_bytes(self.params),
                "grads": tensor_bytes(p.grad for p in self.params),
                "optimizer": optimizer_state_bytes(self.optimizer)}


class ZeRO1(DataParallel):
    """A sharded optimizer: wraps any torch.optim class; state only for this rank's shards."""

    stage = 1

    def __init__(self, params, optimizer_class, group=None, naive=False, flat=True,
                 **optimizer_kwargs):
        self.params = unique_params(params)
        self.group, self.counter, self.naive, self.flat = group, CommCounter(), naive, flat
        self.shards, self.optimizer = shard_optimizer(self.params, optimizer_class, group,
                                                      **optimizer_kwargs)

    def step(self) -> None:
        fn = naive_zero1_step if self.naive else zero1_step_flat if self.flat else zero1_step
        fn(self.params, self.shards, self.optimizer, self.group, self.counter)
        for s in self.shards:  # the reduced chunk was only needed for the update
            s.grad = None
