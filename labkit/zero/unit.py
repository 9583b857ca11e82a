"""One ZeRO-3 unit as an autograd Function: what happens to a block's parameters around its
forward and its backward (labkit.zero.zero3 wraps each unit's forward with it).

    forward    make the parameters whole (all-gather, or the prefetch that is already in flight)
               -> run the unit -> free them (unless reshard_after_forward=False)
    backward   make them whole again -> re-run the unit's forward with grad enabled and
               differentiate it (activation recomputation: only the input was saved) -> free
               them -> reduce-scatter the gradients into the shards' grads (or, inside
               no_sync(), hold the full gradients and send nothing)

Frozen parameters are gathered (forward needs them) but get no gradient.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from labkit.zero.params import require_grads


def default_units(model: nn.Module) -> list:
    """Each block of model.blocks, plus every other module that owns parameters directly."""
    blocks = list(getattr(model, "blocks", []))
    inside = {id(m) for b in blocks for m in b.modules()}
    others = [m for m in model.modules()
              if id(m) not in inside and any(True for _ in m.parameters(recurse=False))]
    return others + blocks


class Unit(torch.autograd.Function):
    """forward: gather, run, free.  backward: gather, re-run, differentiate, reduce-scatter."""

    @staticmethod
    def forward(ctx, zero, unit, x, *shards):
        params = zero.unit_params[id(unit)]
        zero._enter(unit, "forward")                                 # all-gather (or its prefetch)
        try:
            with zero._span(unit, "forward"):
                y = zero.orig_forward[id(unit)](x)
        finally:
            if zero.reshard_after_forward:
                zero._free(params)                                   # only shards remain
        ctx.zero, ctx.unit = zero, unit
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        zero, unit = ctx.zero, ctx.unit
        (x,) = ctx.saved_tensors
        params = zero.unit_params[id(unit)]
        trainable = [p for p in params if p.requires_grad]           # frozen: no gradient at all
        zero._enter(unit, "backward")                 # all-gather again (unless kept, or prefetched)
        try:
            with torch.enable_grad(), zero._span(unit, "backward"):
                xd = x.detach().requires_grad_(x.is_floating_point())
                y = zero.orig_forward[id(unit)](xd)
                inputs = ([xd] if xd.requires_grad else []) + trainable
                grads = torch.autograd.grad(y, inputs, grad_y, allow_unused=True)
        finally:
            zero._free(params)
        grad_x = grads[0] if xd.requires_grad else None
        pgrads = list(grads[1:] if xd.requires_grad else grads)
        none = (None,) * len(params)
        if not zero._sync:      # no_sync: hold the full gradients (reduce_dtype), send nothing
            for p, g in zip(trainable, pgrads):
                if g is not None:
                    g = g.to(zero.reduce_dtype_of(p))
                    held = zero._held.get(id(p))
                    zero._held[id(p)] = g if held is None else held + g
            return (None, None, grad_x, *none)
        for i, p in enumerate(trainable):   # add what earlier micro-batches held
            held = zero._held.pop(id(p), None)
            if held is not None:
                pgrads[i] = held if pgrads[i] is None else pgrads[i] + held
        if not trainable:
            return (None, None, grad_x, *none)
        if not zero.find_unused:
            require_grads(trainable, pgrads)
        # autograd accumulates what comes back into the masters' fp32 .grad (a tied weight
        # used by two units gets both)
        by_id = zero._reduce_grads(trainable, pgrads, grad_y.device)
        return (None, None, grad_x, *(by_id.get(id(p)) for p in params))
