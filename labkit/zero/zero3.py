"""ZeRO stage 3: shard the parameters too, all-gathered just in time (ZeRO paper, P_os+g+p;
PyTorch's FSDP with FULL_SHARD, FSDP2's fully_shard).

    model = GPT(cfg)
    zero = ZeRO3(model, torch.optim.AdamW, lr=1e-3)     # inside a launched rank; model changed
    loss = model(x, y)[1]; loss.backward(); zero.step(); zero.zero_grad()

Each rank keeps only its chunk of every parameter (labkit.zero.shard); the model's own
parameters are emptied (0 elements). The model is cut into units (each transformer block; each
other module that owns parameters: embeddings, final norm, output head). For every unit:

    forward    all-gather the unit's parameters -> run the unit -> free the full parameters
    backward   all-gather them again -> gradients -> reduce-scatter them into the shards' grads
               -> free the full parameters and full gradients
    step       the optimizer updates the local shards: no all-gather before it (nothing in the
               step needs a full parameter; the next forward gathers what it needs)

so a rank holds 16Ψ/N bytes of model states (mixed precision) plus one unit's full parameters
at a time. Bytes sent per rank: all-gather in forward + all-gather in backward + reduce-scatter
= 3(N-1)/N Ψ, 1.5x DDP's 2(N-1)/N Ψ.

How this version drops the full parameters between forward and backward: the unit runs as one
autograd Function that saves only its input and, in backward, gathers the parameters and runs
the unit's forward again to differentiate it (activation recomputation, as in FSDP with
activation checkpointing). FSDP2 keeps the activations and re-gathers only the parameters, with
hooks on autograd; the parameters held and the bytes sent are the same, the compute is not
(one extra forward of each block here).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.zero.params import clip_, require_grads
from labkit.zero.params import param_groups as _param_groups
from labkit.zero.shard import (all_gather_full, all_gather_many, optimizer_state_bytes,
                               reduce_scatter_mean_many, shard_of, unique_params)


def default_units(model: nn.Module) -> list:
    """Each block of model.blocks, plus every other module that owns parameters directly."""
    blocks = list(getattr(model, "blocks", []))
    inside = {id(m) for b in blocks for m in b.modules()}
    others = [m for m in model.modules()
              if id(m) not in inside and any(True for _ in m.parameters(recurse=False))]
    return others + blocks


class _Unit(torch.autograd.Function):
    """forward: gather, run, free.  backward: gather, re-run, differentiate, reduce-scatter."""

    @staticmethod
    def forward(ctx, zero, unit, x, *shards):
        params = zero.unit_params[id(unit)]
        zero._materialize(params)                                    # all-gather
        try:
            y = zero.orig_forward[id(unit)](x)
        finally:
            zero._free(params)                                       # only shards remain
        ctx.zero, ctx.unit = zero, unit
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        zero, unit = ctx.zero, ctx.unit
        (x,) = ctx.saved_tensors
        params = zero.unit_params[id(unit)]
        trainable = [p for p in params if p.requires_grad]           # frozen: no gradient at all
        zero._materialize(params)                                    # all-gather again
        try:
            with torch.enable_grad():
                xd = x.detach().requires_grad_(x.is_floating_point())
                y = zero.orig_forward[id(unit)](xd)
                inputs = ([xd] if xd.requires_grad else []) + trainable
                grads = torch.autograd.grad(y, inputs, grad_y, allow_unused=True)
        finally:
            zero._free(params)
        grad_x = grads[0] if xd.requires_grad else None
        pgrads = list(grads[1:] if xd.requires_grad else grads)
        none = (None,) * len(params)
        if not zero._sync:      # no_sync: hold the full gradients, send nothing
            for p, g in zip(trainable, pgrads):
                if g is not None:
                    held = zero._held.get(id(p))
                    zero._held[id(p)] = g if held is None else held + g
            return (None, None, grad_x, *none)
        for i, p in enumerate(trainable):   # add what earlier micro-batches held
            held = zero._held.pop(id(p), None)
            if held is not None:
                pgrads[i] = held if pgrads[i] is None else pgrads[i] + held
        if not trainable:
            return (None, None, grad_x, *none)
        # reduce-scatter each full gradient into this rank's chunk, with has-grad flags in the
        # same message; autograd accumulates the chunks into the shards' .grad (a tied weight
        # used by two units gets both)
        world = dist.get_world_size(zero.group)
        if not zero.find_unused:
            require_grads(trainable, pgrads)
        flags = torch.tensor([float(g is not None) for g in pgrads]).to(grad_y.device)  # (P,)
        fulls = [g if g is not None else torch.zeros(zero.shapes[id(p)], device=grad_y.device,
                                                      dtype=zero.shard_for[id(p)].dtype)
                 for p, g in zip(trainable, pgrads)]
        extra = [flags.repeat(world)] if zero.find_unused else []
        chunks = reduce_scatter_mean_many(                            # (c_i,) each, one message
            fulls + extra, zero.group, where="ZeRO-3 grads", algorithm=zero.reduce_scatter)
        used = chunks.pop().tolist() if zero.find_unused else [1.0] * len(chunks)
        by_id = {id(p): (c if u > 0 else None) for p, c, u in zip(trainable, chunks, used)}
        return (None, None, grad_x, *(by_id.get(id(p)) for p in params))


class ZeRO3:
    """Fully sharded data parallel: parameters, gradients and optimizer states all sharded.

    Frozen parameters are sharded and gathered (forward needs them) but get no gradient, no
    reduce-scatter and no optimizer state. param_groups: torch-style dicts over the model's own
    parameters (e.g. labkit.zero.params.weight_decay_groups(model, 0.1)); max_grad_norm: clip by
    the global norm of the sharded gradients; find_unused_parameters: has-grad flags in each
    unit's reduce-scatter (a parameter of a unit that ran but did not use it). A unit no rank runs on a step leaves its shards'
    gradients None; which units run must be the same on every rank (their backward communicates).
    `no_sync()`: micro-batches inside hold full gradients (Ψ elements, unsharded) and send
    nothing; the backward after it reduce-scatters once."""

    stage = 3

    def __init__(self, model: nn.Module, optimizer_class, group=None, units=None,
                 reduce_scatter: str | None = None, param_groups=None,
                 max_grad_norm: float | None = None, find_unused_parameters: bool = False,
                 **optimizer_kwargs):
        self.model, self.group = model, group
        self.find_unused = find_unused_parameters
        self.reduce_scatter = reduce_scatter   # None: labkit.zero.shard.reduce_scatter_algorithm
        self.max_grad_norm, self.last_grad_norm = max_grad_norm, None
        self._sync, self._held = True, {}
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        groups, _ = _param_groups(model if param_groups is None else param_groups)
        self.params = unique_params(model)
        self.shapes = {id(p): p.shape for p in self.params}
        self.shards = [nn.Parameter(shard_of(p, rank, world), requires_grad=p.requires_grad)
                       for p in self.params]                          # (c,) each
        self.shard_for = {id(p): s for p, s in zip(self.params, self.shards)}
        self.units = default_units(model) if units is None else list(units)
        self.unit_params, self.orig_forward = {}, {}
        covered = set()
        for unit in self.units:
            ps = unique_params(unit)
            self.unit_params[id(unit)] = ps
            covered |= {id(p) for p in ps}
            self.orig_forward[id(unit)] = unit.forward
            unit.forward = self._wrap(unit)
        missing = [n for n, p in model.named_parameters() if id(p) not in covered]
        if missing:
            raise ValueError(f"parameters outside every ZeRO-3 unit: {missing}; pass units= "
                             f"that together contain all of the model's parameters")
        foreign = [g for g in groups for p in g["params"] if id(p) not in self.shard_for]
        if foreign:
            raise ValueError("param_groups hold tensors that are not this model's parameters")
        self._free(self.params)                                     # the full copies go now
        self.optimizer = optimizer_class(
            [{**g, "params": [self.shard_for[id(p)] for p in g["params"]]} for g in groups],
            **optimizer_kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _wrap(self, unit):
        def forward(x):
            shards = [self.shard_for[id(p)] for p in self.unit_params[id(unit)]]
            return _Unit.apply(self, unit, x, *shards)
        return forward

    def _materialize(self, params) -> None:
        """All-gather a unit's parameters (one message for the whole unit, like FSDP)."""
        fulls = all_gather_many([self.shard_for[id(p)] for p in params],
                                [self.shapes[id(p)] for p in params], self.group,
                                where="ZeRO-3 gather")
        for p, full in zip(params, fulls):
            p.data = full          # a fresh tensor (the gather copied it out of the buffer)

    def _free(self, params) -> None:
        for p in params:
            p.data = p.data.new_empty(0)

    def step(self) -> None:
        if self.max_grad_norm is not None:
            self.last_grad_norm = clip_([s.grad for s in self.shards], self.max_grad_norm,
                                        self.group, sharded=True)
        self.optimizer.step()        # local shards only: no all-gather before it

    def zero_grad(self) -> None:
        for s in self.shards:
            s.grad = None

    def full_parameters(self) -> dict:
        """name -> full tensor, all-gathered (for checking against a reference; collective)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {names[id(p)]: all_gather_full(s.detach(), self.shapes[id(p)], self.group)
                for p, s in zip(self.params, self.shards)}

    def held_bytes(self) -> dict:
        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)
        return {"params": nbytes(self.shards) + nbytes(p.data for p in self.params),
                "grads": nbytes(s.grad for s in self.shards),
                "optimizer": optimizer_state_bytes(self.optimizer)}
