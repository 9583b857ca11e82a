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

from labkit.flat import (
    all_gather_full,
    all_gather_many,
    reduce_scatter_mean,
    reduce_scatter_mean_many,
)
from labkit.observe import commlog
from labkit.observe.storage import storage_bytes
from labkit.zero.params import clip_, flat_params, param_groups, require_grads, with_flags
from labkit.zero.precision import resolve_model_policy
from labkit.zero.shard import master_shards


def zero1_step(params, shards, optimizer, group=None) -> None:
    """One ZeRO-1 step: reduce-scatter gradients, update this rank's shards, all-gather params.

    params: the full parameters (same values on every rank), each with this rank's local .grad.
    shards: this rank's chunk of each parameter (labkit.zero.shard_optimizer), which `optimizer`
    updates. Afterwards every rank's params hold the same updated values."""
    for p, s in zip(params, shards):
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        s.grad = reduce_scatter_mean(g, group)                      # (c,) mean over ranks
    optimizer.step()
    with torch.no_grad():
        for p, s in zip(params, shards):
            p.copy_(all_gather_full(s, p.shape, group))            # p.shape


def zero1_step_flat(params, shards, optimizer, group=None) -> None:
    """zero1_step with one reduce-scatter and one all-gather for all parameters together: the
    same bytes in 2 messages instead of 2 per parameter (what DeepSpeed's buckets do)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    for s, g in zip(shards, reduce_scatter_mean_many(grads, group)):
        s.grad = g                                                   # (c,) mean over ranks
    optimizer.step()
    with torch.no_grad():
        for p, full in zip(params, all_gather_many(shards, [p.shape for p in params], group)):
            p.copy_(full)


def naive_zero1_step(params, shards, optimizer, group=None) -> None:
    """The same update with a full all-reduce first (3(N-1)/N Ψ sent instead of 2(N-1)/N Ψ)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for p, s in zip(params, shards):
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        commlog.all_reduce(g, group=group, where="naive ZeRO-1")    # everyone gets everything...
        c = s.numel()
        flat = torch.cat([g.reshape(-1), g.new_zeros(world * c - g.numel())])
        s.grad = flat[rank * c:(rank + 1) * c] / world               # ...and keeps 1/N of it
    optimizer.step()
    with torch.no_grad():
        for p, s in zip(params, shards):
            p.copy_(all_gather_full(s, p.shape, group))


class DataParallel:
    """Stage 0: all-reduce the mean gradient, full optimizer on every rank (the baseline).

    params: tensors or torch-style groups (labkit.zero.params: frozen ones left out).
    find_unused_parameters: send a has-grad flag per parameter with the gradients, so that one no
    rank used keeps gradient None (False, the default as in torch DDP: a missing gradient is an
    error). max_grad_norm: clip by the global norm before the step."""

    stage = 0

    def __init__(self, params, optimizer_class, group=None, max_grad_norm: float | None = None,
                 find_unused_parameters: bool = False, **optimizer_kwargs):
        self.find_unused = find_unused_parameters
        self.groups, self.frozen = param_groups(params)
        self.params = flat_params(self.groups)
        self.group, self.max_grad_norm, self.last_grad_norm = group, max_grad_norm, None
        self.optimizer = optimizer_class(self.groups, **optimizer_kwargs)

    def step(self) -> None:
        world = dist.get_world_size(self.group)
        parts = self._parts(1)                                       # grads (+ (P,) flags)
        flat = torch.cat([g.reshape(-1) for g in parts])  # one message, not one per tensor
        commlog.all_reduce(flat, group=self.group, where="DP all-reduce")  # a ring on Gloo too
        reduced = list(flat.div_(world).split([g.numel() for g in parts]))
        grads, flags = self._split_flags(reduced)
        for p, g, used in zip(self.params, grads, flags):
            p.grad = g.view_as(p) if used > 0 else None              # unused everywhere: None
        if self.max_grad_norm is not None:   # full gradients: the local norm is the global one
            self.last_grad_norm = clip_([p.grad for p in self.params], self.max_grad_norm,
                                        self.group, sharded=False)
        self.optimizer.step()

    def _parts(self, world: int) -> list:
        """The local gradients to reduce, plus has-grad flags if find_unused_parameters."""
        grads = [p.grad for p in self.params]
        if self.find_unused:
            return with_flags(self.params, grads, world)
        require_grads(self.params, grads)
        return grads

    def _split_flags(self, reduced):
        if self.find_unused:
            return reduced[:-1], reduced[-1].tolist()
        return reduced, [1.0] * len(reduced)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def held_bytes(self) -> dict:
        """What this rank keeps between steps: parameters, gradients, optimizer state, by
        storage (labkit.zero.shard.storage_bytes: a view, e.g. a shard of its parameter's
        buffer or a gradient in the all-reduced flat buffer, is not counted twice)."""
        state = [v for st in self.optimizer.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        if getattr(self, "param_dtype", None) is not None:   # fp32 masters: the recipe's 12
            state += list(self.shards)                       # bytes are master + m + v
        return {"params": storage_bytes(self.params + self.frozen),
                "grads": storage_bytes(self._grads_held()),
                "optimizer": storage_bytes(state)}

    def _grads_held(self) -> list:
        return [p.grad for p in self.params]


class ZeRO1(DataParallel):
    """A sharded optimizer: wraps any torch.optim class; state only for this rank's shards.
    With mp_policy pass every parameter, frozen ones too (e.g. weight_decay_groups(model, wd)):
    ZeRO-1/2 cast the parameters they are given to param_dtype, and see no others."""

    stage = 1

    def __init__(self, params, optimizer_class, group=None, naive=False, flat=True,
                 max_grad_norm: float | None = None, find_unused_parameters: bool = False,
                 mp_policy=None, **optimizer_kwargs):
        self.find_unused = find_unused_parameters
        self.groups, self.frozen = param_groups(params)
        self.params = flat_params(self.groups)
        self.group, self.naive, self.flat = group, naive, flat
        self.max_grad_norm, self.last_grad_norm = max_grad_norm, None
        self.param_dtype, self.reduce_dtype = resolve_model_policy(mp_policy, self.params)
        if self.param_dtype is not None and (naive or not flat):
            raise ValueError("mp_policy needs ZeRO1(flat=True, naive=False): the exercise's "
                             "steps update parameter views in place, not fp32 masters")
        self.shards, self.optimizer = master_shards(self.groups, optimizer_class, group,
                                                    self.param_dtype, frozen=self.frozen,
                                                    **optimizer_kwargs)

    def step(self) -> None:
        if self.naive or not self.flat:   # the exercise's paths: a missing gradient is zeros
            fn = naive_zero1_step if self.naive else zero1_step
            fn(self.params, self.shards, self.optimizer, self.group)
        else:
            self._step_flat()
        if not getattr(self, "keep_shard_grads", False):   # True: tests compare them
            for s in self.shards:  # the reduced chunk was only needed for the update
                s.grad = None

    def _step_flat(self) -> None:
        """zero1_step_flat, plus has-grad flags, clipping and frozen parameters."""
        world = dist.get_world_size(self.group)
        parts = [g.to(self.reduce_dtype) if self.reduce_dtype else g for g in self._parts(world)]
        reduced = reduce_scatter_mean_many(parts, self.group)               # (c_i,) each
        chunks, flags = self._split_flags(reduced)
        for s, g, used in zip(self.shards, chunks, flags):
            s.grad = g if used > 0 else None
        if self.max_grad_norm is not None:
            self.last_grad_norm = clip_([s.grad for s in self.shards], self.max_grad_norm,
                                        self.group, sharded=True)
        self.optimizer.step()
        if getattr(self, "param_gather", None) is not None:   # labkit.zero.param_gather:
            self.param_gather.post()                            # waited for in the next forward
            return
        with torch.no_grad():   # mp_policy: the fp32 masters cast BEFORE the gather
            fulls = all_gather_many([s.detach().to(p.dtype) for p, s in
                                     zip(self.params, self.shards)],
                                    [p.shape for p in self.params], self.group)
            for p, full in zip(self.params, fulls):
                p.copy_(full)                                        # p.shape
