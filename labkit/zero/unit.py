"""One ZeRO-3 unit's forward and backward, with hooks on autograd as FSDP2 places them
(labkit.zero.zero3 wraps each unit's forward with `wrap_forward`).

    forward        make the parameters whole (all-gather, or the prefetch already in flight),
                   hand the module views of them, run it, keep every activation autograd saves,
                   free the parameters' storage (unless reshard_after_forward=False)
    pre-backward   a hook on each output's gradient: make the parameters whole again, into the
                   SAME storage the saved activations point at; nothing runs forward again
    post-backward  `PostBackward`'s backward, once the unit's input and parameter gradients are
                   all computed: free the parameters, reduce-scatter their gradients into the
                   shards' grads (or, inside no_sync(), hold them and send nothing)

How the saved tensors survive the free: a matmul saves a view of its weight (weight.t()), not
the parameter, so swapping a parameter's tensor would leave autograd holding the old one. Each
sharded parameter has one buffer for its whole value; freeing it resizes the buffer's storage to
0 bytes, and gathering resizes it back and copies the gathered values in, so every view autograd
saved sees them again (FSDP2: torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
free_storage / alloc_storage on the unsharded parameter).

Where the hooks sit: FSDP2 registers its pre-backward on the unit's outputs (_fsdp_state.py,
_register_pre_backward_hook) and its post-backward on an identity Function over the unit's
inputs (_fsdp_param_group.py, RegisterPostBackwardFunction), and reads the gradients from the
unsharded parameters' .grad. `PostBackward` here is an identity over the inputs AND the
parameter views, so its backward receives each use's parameter gradients directly: a weight
tied between two units (the embedding and the head) gets one gradient from each, reduced by each
as the ZeRO-3 unit it belongs to, and no unsharded .grad is ever stored.

Units may nest, as fully_shard calls do (`own_params`: a unit manages what no unit inside it
manages); `fsdp2_units` is FSDP2's usual wrapping, each block plus the model as root unit, and
the root is not freed after forward, as FSDP2 leaves its root (backward begins with it).

Frozen parameters are gathered (forward and backward need them) but get no gradient.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from labkit.zero.params import require_grads
from labkit.zero.precision import cast_floating
from labkit.zero.reduce import reduce_grads


def default_units(model: nn.Module) -> list:
    """Each block of model.blocks, plus every other module that owns parameters directly."""
    blocks = list(getattr(model, "blocks", []))
    inside = {id(m) for b in blocks for m in b.modules()}
    others = [m for m in model.modules()
              if id(m) not in inside and any(True for _ in m.parameters(recurse=False))]
    return others + blocks


def fsdp2_units(model: nn.Module) -> list:
    """FSDP2's usual wrapping (fully_shard on each block, then on the model): the model itself
    as the root unit, holding what no block holds (embeddings, final norm, head), plus each
    block of model.blocks."""
    return [model, *getattr(model, "blocks", [])]


def own_modules(unit: nn.Module, units) -> list:
    """The unit's modules less those of other units nested inside it: as with FSDP2's
    fully_shard, a unit manages only the parameters no unit inside it manages."""
    inside = {id(m) for m in unit.modules()}
    nested = {id(m) for u in units if u is not unit and id(u) in inside for m in u.modules()}
    return [m for m in unit.modules() if id(m) not in nested]


def own_params(unit: nn.Module, units) -> list:
    """The parameters the unit manages (own_modules'), once each, in registration order."""
    seen, out = set(), []
    for m in own_modules(unit, units):
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def param_slots(unit: nn.Module, units=()) -> list:
    """[(module, name, parameter)] of every parameter the unit manages (a tensor registered
    twice, e.g. a tied weight, appears at each place)."""
    return [(m, name, p) for m in own_modules(unit, units) for name, p in m._parameters.items()
            if p is not None]


class Call:
    """One forward call of a unit, until its backward is done: whether its parameters are held
    whole for it, and whether its pre- and post-backward ran."""

    def __init__(self, unit, params):
        self.unit, self.params = unit, params
        self.held = self.pre = self.post = False
        self.span = None                         # the backward's timeline span, when open


class PostBackward(torch.autograd.Function):
    """Identity in forward over [anchor, parameter views..., inputs...]; its backward runs once
    every gradient of the unit's parameters and inputs has been computed: the post-backward."""

    @staticmethod
    def forward(ctx, zero, call, anchor, n_params: int, *tensors):
        ctx.zero, ctx.call, ctx.n_params = zero, call, n_params
        ctx.set_materialize_grads(False)       # an unused parameter's gradient stays None
        frozen = [t for p, t in zip(call.params, tensors) if not p.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tensors                         # views of the same storage

    @staticmethod
    def backward(ctx, *grads):
        pgrads, xgrads = grads[:ctx.n_params], grads[ctx.n_params:]
        post_backward(ctx.zero, ctx.call, list(pgrads))
        return (None, None, None, None, *(None,) * ctx.n_params, *xgrads)


def _tensors(tree) -> list:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for v in tree for t in _tensors(v)]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return []


def _swap(slots, values) -> list:
    """Put values[id(p)] where each slot's parameter is registered; returns the old ones."""
    old = []
    for m, name, p in slots:
        old.append(m._parameters[name])
        m._parameters[name] = values[id(p)]
    return old


def wrap_forward(zero, unit, orig_forward):
    """unit.forward for ZeRO-3: gather, run with the whole parameters, free, hook backward."""
    params, slots = zero.unit_params[id(unit)], param_slots(unit, zero.units)
    # FSDP2's root (_fsdp_state.py, _lazy_init: the root's post_forward_mesh_info = None) is not
    # resharded after forward: backward starts with it, so it would be gathered again at once
    keep = unit is zero.model

    def forward(*args, **kwargs):
        if zero.cast_forward_inputs:         # FSDP2's cast at the unit boundary
            args, kwargs = cast_floating(args, zero.param_dtype), {
                k: cast_floating(v, zero.param_dtype) for k, v in kwargs.items()}
        grad_on = torch.is_grad_enabled()
        call = Call(unit, params)
        zero._enter(unit, "forward")                     # all-gather (or its prefetch)
        zero._acquire(params)
        try:
            views = [zero._whole_view(p) for p in params]
            inputs = list({id(t): t for t in _tensors((args, kwargs))
                           if t.requires_grad}.values()) if grad_on else []
            if grad_on and (inputs or any(p.requires_grad for p in params)):
                outs = PostBackward.apply(zero, call, zero.anchor, len(params), *views, *inputs)
                views, swapped = outs[:len(params)], dict(zip(map(id, inputs), outs[len(params):]))
                args, kwargs = _replace((args, kwargs), swapped)
            old = _swap(slots, dict(zip(map(id, params), views)))
            try:
                with zero._span(unit, "forward"):
                    y = orig_forward(*args, **kwargs)
            finally:
                for (m, name, _), p in zip(slots, old):
                    m._parameters[name] = p
        except BaseException:
            zero._release(params)
            raise
        hooked = [t for t in _tensors(y) if t.requires_grad] if grad_on else []
        if (zero.reshard_after_forward and not keep) or not hooked:
            zero._release(params)                        # only shards remain
        else:
            call.held = True                             # kept whole until post-backward
        for t in hooked:
            t.register_hook(lambda g, call=call: pre_backward(zero, call))
        if hooked:
            zero._calls.append(call)
        return cast_floating(y, zero.output_dtype)
    return forward


def _replace(tree, swapped):
    if isinstance(tree, torch.Tensor):
        return swapped.get(id(tree), tree)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_replace(v, swapped) for v in tree)
    if isinstance(tree, dict):
        return {k: _replace(v, swapped) for k, v in tree.items()}
    return tree


def pre_backward(zero, call) -> None:
    """The gradient of one of the unit's outputs is ready: make the parameters whole again
    (once per call), before any of the unit's backward reads a saved view of them."""
    if call.pre:
        return
    call.pre = True
    zero._enter(call.unit, "backward")   # all-gather again (unless kept, or prefetched)
    if not call.held:
        zero._acquire(call.params)
        call.held = True
    call.span = zero._open_span(call.unit, "backward")


def post_backward(zero, call, pgrads) -> None:
    """The unit's gradients are all computed: free its parameters, reduce-scatter the
    gradients (reduce_dtype) and add them to the masters' .grad (a tied weight gets one from
    each unit that uses it)."""
    call.post = True
    zero._close_span(call.span)
    if call.held:
        if zero.reshard_after_backward:
            zero._release(call.params)
        call.held = False           # else kept whole (its hold stays) until the step's _settle
    if call in zero._calls:
        zero._calls.remove(call)
    params = call.params
    trainable = [p for p in params if p.requires_grad]           # frozen: no gradient at all
    grads = [g for p, g in zip(params, pgrads) if p.requires_grad]
    if not zero._sync:          # no_sync: hold the full gradients (reduce_dtype), send nothing
        for p, g in zip(trainable, grads):
            if g is not None:
                g = g.to(zero.reduce_dtype_of(p))
                held = zero._held.get(id(p))
                zero._held[id(p)] = g if held is None else held + g
        return
    for i, p in enumerate(trainable):   # add what earlier micro-batches held
        held = zero._held.pop(id(p), None)
        if held is not None:
            grads[i] = held if grads[i] is None else grads[i] + held
    if not trainable:
        return
    if not zero.find_unused:
        require_grads(trainable, grads)
    for p, g in reduce_grads(zero, trainable, grads, zero.device).items():
        if g is not None:
            s = zero.shard_for[p]
            s.grad = g if s.grad is None else s.grad + g
