"""ZeRO stage 3: shard the parameters too, all-gathered just in time (Rajbhandari et al. 2020,
the ZeRO paper's P_os+g+p; PyTorch's FSDP with FULL_SHARD, FSDP2's fully_shard).

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

mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
(labkit.zero.precision, FSDP2's fields): the shards and the optimizer state stay fp32; each rank
casts its shard to bf16 BEFORE the all-gather, so the gathers move 2 bytes per value instead of
4, and the unit computes in bf16; gradients are reduce-scattered in reduce_dtype and added into
the fp32 shard gradients. replicate= keeps small parameters (norm weights, biases) whole on every
rank: never gathered, their gradients all-reduced (one message per unit), their optimizer state
replicated. It trades memory (their full states on every rank) for no gathers of tiny tensors
(a unit of norms only, like the final norm, sends nothing in forward) and no padding of shards
of a few elements; it adds one all-reduce per unit that mixes both kinds.

prefetch=True (labkit.zero.prefetch): each unit posts the all-gather of the next unit (in the
order of the first step, forward and backward apart) before it computes, so the gather travels
while this unit computes; about two units are whole at a time. reshard_after_forward=False
(FSDP2's flag, ZeRO++'s trade): keep the gathered parameters from forward to backward: no
gather in backward (2(N-1)/N Ψ sent instead of 3), every unit whole at the end of forward.
reshard_after_backward=False (FSDP2's set_reshard_after_backward(False)): keep them whole after
backward as well, across the micro-batches of a step, until the step frees them; with no_sync
(FSDP2's set_requires_gradient_sync(False)) a step of k micro-batches then gathers once instead
of 2k times: the production answer to "accumulation does not help ZeRO-3".
offload=True (ZeRO-Offload, Ren et al. 2021): the fp32 master shards, their gradients and the
optimizer state live in CPU memory and the optimizer steps there; the device keeps a copy of
its shard in the compute dtype, refreshed after each step, to gather from.

How the full parameters are dropped between forward and backward while the activations stay:
as FSDP2 does it (labkit.zero.unit). Each sharded parameter has one buffer for its whole value;
freeing resizes the buffer's storage to 0 bytes (every view autograd saved of it included), and
a hook on the unit's outputs' gradients gathers into the same storage again before the unit's
backward reads it. Backward runs no forward: the price is the activations each unit saves,
kept from its forward to its backward as in plain PyTorch.

Long because: the gather, hold, free and reduce bookkeeping, the step and FSDP2's switches all
act on the same per-unit state (buffers, holds, calls in flight); labkit.zero.unit, .reduce and
.prefetch already hold the parts that need none of it.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.accumulate import sync_paused
from labkit.flat import (
    all_gather_flat,
    all_gather_full,
    chunk_size,
    reduce_scatter_mean_many,
    shard_of,
)
from labkit.observe.storage import storage_bytes
from labkit.zero.params import clip_
from labkit.zero.params import param_groups as _param_groups
from labkit.zero.precision import replicated_ids, resolve
from labkit.zero.prefetch import ExecutionOrder, GatherInFlight
from labkit.zero.shard import unique_params
from labkit.zero.unit import (  # noqa: F401 (default_units, fsdp2_units: this API)
    default_units,
    fsdp2_units,
    own_params,
    wrap_forward,
)


class ZeRO3:
    """Fully sharded data parallel: parameters, gradients and optimizer states all sharded.

    Frozen parameters are sharded and gathered (forward needs them) but get no gradient, no
    reduce-scatter and no optimizer state. param_groups: torch-style dicts over the model's own
    parameters (e.g. labkit.zero.params.weight_decay_groups(model, 0.1)); max_grad_norm: clip by
    the global norm of the sharded gradients; find_unused_parameters: has-grad flags in each
    unit's reduce-scatter (a parameter of a unit that ran but did not use it). A unit no rank
    runs on a step leaves its shards' gradients None; which units run must be the same on every
    rank (their backward communicates). `no_sync()`: micro-batches inside hold full gradients
    (Ψ elements, unsharded) and send nothing; the backward after it reduce-scatters once.

    mp_policy: labkit.zero.precision.MixedPrecisionPolicy (or FSDP2's): fp32 masters and
    optimizer state, gathers and compute in param_dtype, gradients reduced in reduce_dtype.
    replicate: a function (name, parameter) -> bool; those parameters (e.g. one_dimensional:
    norm weights, biases) stay whole on every rank, are never gathered, and their gradients are
    all-reduced (averaged), one message per unit; their optimizer state is replicated too.
    prefetch, reshard_after_forward, offload: see the module docstring. timeline: a
    labkit.observe.timeline.Timeline that gets one compute span per unit and phase.

    units: modules, or a function model -> modules (default labkit.zero.unit.default_units).
    Units may nest, as fully_shard calls do: a unit manages the parameters no unit inside it
    manages, so labkit.zero.unit.fsdp2_units (each block, then the model) is FSDP2's usual
    wrapping: one root unit for the embeddings, final norm and head. The model as a unit is
    FSDP2's root and stays whole from its forward to its backward, which starts with it."""

    stage = 3

    def __init__(self, model: nn.Module, optimizer_class, group=None, units=None,
                 reduce_scatter: str | None = None, param_groups=None,
                 max_grad_norm: float | None = None, find_unused_parameters: bool = False,
                 mp_policy=None, replicate=None, prefetch: bool = False,
                 reshard_after_forward: bool = True, offload: bool = False, timeline=None,
                 reshard_after_backward: bool = True, **optimizer_kwargs):
        self.model, self.group = model, group
        self.prefetch, self.reshard_after_forward = bool(prefetch), bool(reshard_after_forward)
        self.reshard_after_backward = bool(reshard_after_backward)
        self.offload, self.timeline = bool(offload), timeline
        self._order, self._pending = ExecutionOrder(), {}
        self.find_unused = find_unused_parameters
        # None: labkit.zero.shard.reduce_scatter_algorithm (the constructor's reduce_scatter=)
        self.reduce_scatter_algorithm = reduce_scatter
        self.max_grad_norm, self.last_grad_norm = max_grad_norm, None
        self._sync, self._held = True, {}
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        groups, _ = _param_groups(model if param_groups is None else param_groups)
        self.params = unique_params(model)
        self.mp_policy = mp_policy
        master = next((p.dtype for p in self.params if p.is_floating_point()), torch.float32)
        (self.param_dtype, self.reduce_dtype, self.output_dtype,
         self.cast_forward_inputs) = resolve(mp_policy, master)
        self.replicated = replicated_ids(model, replicate)
        self.shapes = {id(p): p.shape for p in self.params}
        # offload: the fp32 masters (and so the optimizer and its step) live in CPU memory
        home = torch.device("cpu") if self.offload else None
        self.shards = [nn.Parameter((p.detach().clone() if id(p) in self.replicated  # p.shape
                                     else shard_of(p, rank, world)).to(home or p.device),  # (c,)
                                    requires_grad=p.requires_grad)
                       for p in self.params]
        self.shard_for = {id(p): s for p, s in zip(self.params, self.shards)}
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.device_shards = {}    # offload: id(p) -> the shard in compute dtype on the device
        self._copy_to_device()
        # one buffer per sharded parameter for its whole value, (N*c,) padded as gathered; its
        # storage is 0 bytes except while a unit needs it (labkit.zero.unit)
        self.world = world
        self.flat = {id(p): torch.empty(world * chunk_size(p.numel(), world), device=self.device,
                                        dtype=self.compute_dtype_of(p))             # (N*c,)
                     for p in self.params if id(p) not in self.replicated}
        for buf in self.flat.values():
            buf.untyped_storage().resize_(0)
        self._holds, self._calls = {}, []    # id(p) -> units holding it whole; calls in flight
        # makes the views handed to a unit require grad, so labkit.zero.unit.PostBackward runs
        self.anchor = torch.empty(0, device=self.device, requires_grad=True)
        # a function of the model (fsdp2_units) or the modules themselves; a ModuleList is
        # callable too (nn.Module), so it is told apart by its type
        wrapping = callable(units) and not isinstance(units, nn.Module)
        self.units = default_units(model) if units is None else \
            list(units(model) if wrapping else units)
        self.unit_params, self.orig_forward = {}, {}
        covered = set()
        for unit in self.units:
            ps = own_params(unit, self.units)      # less the units nested in it (FSDP2's root)
            self.unit_params[id(unit)] = ps
            covered |= {id(p) for p in ps}
            self.orig_forward[id(unit)] = unit.forward
            unit.forward = wrap_forward(self, unit, unit.forward)
        self._unit_by_id = {id(u): u for u in self.units}
        names = {id(m): n or "root" for n, m in model.named_modules()}
        self._unit_name = {id(u): names.get(id(u), type(u).__name__) for u in self.units}
        missing = [n for n, p in model.named_parameters() if id(p) not in covered]
        if missing:
            raise ValueError(f"parameters outside every ZeRO-3 unit: {missing}; pass units= "
                             f"that together contain all of the model's parameters")
        foreign = [g for g in groups for p in g["params"] if id(p) not in self.shard_for]
        if foreign:
            raise ValueError("param_groups hold tensors that are not this model's parameters")
        self._free(self.params)     # the model's own full copies go now: 0 elements each
        self.optimizer = optimizer_class(
            [{**g, "params": [self.shard_for[id(p)] for p in g["params"]]} for g in groups],
            **optimizer_kwargs)

    def no_sync(self):
        """Backward inside keeps full local gradients and sends nothing (see the class doc)."""
        return sync_paused(self)

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """FSDP2's name for no_sync as a switch: False holds full gradients and sends none."""
        self._sync = bool(sync)

    def set_reshard_after_backward(self, reshard: bool) -> None:
        """FSDP2's switch: False keeps every unit's parameters whole after its backward, so the
        next micro-batch gathers nothing (forward or backward) until the step frees them: with
        no gradient sync too, a step of k micro-batches gathers once, not 2k times, and holds Ψ
        full parameters meanwhile (ZeRO-2's memory for parameters)."""
        self.reshard_after_backward = bool(reshard)

    def compute_dtype_of(self, p) -> torch.dtype:
        """The dtype p is gathered and computed in: param_dtype, or the master's own."""
        master = self.shard_for[id(p)]
        return self.param_dtype if self.param_dtype and master.is_floating_point() \
            else master.dtype

    def reduce_dtype_of(self, p) -> torch.dtype:
        """The dtype p's gradient is reduced in: reduce_dtype, or the compute dtype."""
        floating = self.shard_for[id(p)].is_floating_point()
        return self.reduce_dtype if self.reduce_dtype and floating else self.compute_dtype_of(p)

    def _source(self, p) -> torch.Tensor:
        """What p's gather starts from on this rank: its shard in the compute dtype, on the
        device (offload: the copy made after the last step; else cast from the master now)."""
        if self.offload:
            return self.device_shards[id(p)]
        return self.shard_for[id(p)].detach().to(self.compute_dtype_of(p))

    def _copy_to_device(self) -> None:
        """offload: the masters, just updated on the CPU, copied (cast) to the device."""
        if self.offload:
            self.device_shards = {id(p): s.detach().to(self.device, self.compute_dtype_of(p))
                                  for p, s in zip(self.params, self.shards)}

    def _to_gather(self, unit) -> list:
        """The unit's sharded parameters that are not whole on this rank now."""
        return [p for p in self.unit_params[id(unit)]
                if id(p) in self.flat and not self.flat[id(p)].untyped_storage().nbytes()]

    def _whole_view(self, p) -> torch.Tensor:
        """p's whole value for the unit to compute with: a view of its buffer, or (replicated)
        its own master in the compute dtype."""
        if id(p) not in self.flat:
            return self._source(p)
        return self.flat[id(p)][:self.shapes[id(p)].numel()].view(self.shapes[id(p)])

    def _acquire(self, params) -> None:
        for p in params:
            self._holds[id(p)] = self._holds.get(id(p), 0) + 1

    def _release(self, params) -> None:
        """A unit is done with its parameters: free each buffer no other unit holds now."""
        for p in params:
            n = self._holds.get(id(p), 0) - 1
            self._holds[id(p)] = max(n, 0)
            if n <= 0 and id(p) in self.flat:
                self.flat[id(p)].untyped_storage().resize_(0)

    def _fill(self, params, rows) -> None:
        """Copy gathered rows (N, c) into the params' buffers, allocating storage if freed. The
        copy keeps the buffer's version counter (FSDP2's copy-out does the same,
        _fsdp_collectives.py): the views autograd saved in forward share it and would otherwise
        refuse to be read in backward; their values are the same, gathered from the same
        shards (no optimizer step comes between a forward and its backward)."""
        with torch.no_grad():
            for p, row in zip(params, rows):
                buf = self.flat[id(p)]
                if not buf.untyped_storage().nbytes():
                    buf.untyped_storage().resize_(buf.numel() * buf.element_size())
                with torch.autograd._unsafe_preserve_version_counter(buf):
                    buf.view(row.shape).copy_(row)

    def _enter(self, unit, phase: str) -> None:
        """Make the unit's parameters whole: wait for its prefetched gather, or gather now
        (one message for the whole unit, like FSDP); then post the next unit's gather."""
        self._order.saw(id(unit), phase)
        pending = self._pending.pop(id(unit), None)
        if pending is not None:
            params, work = pending
            self._fill(params, work.wait())
        need = self._to_gather(unit)
        if need:
            # cast BEFORE the gather: the wire carries param_dtype (half the bytes in bf16)
            mine = [self._source(p) for p in need]
            flat = self.gather(unit, phase, torch.cat([s.reshape(-1) for s in mine]))
            self._fill(need, flat.view(self.world, -1).split([s.numel() for s in mine], dim=1))
        nxt = self._order.after(id(unit), phase) if self.prefetch else None
        if nxt is not None and nxt not in self._pending:
            ahead = self._to_gather(self._unit_by_id[nxt])
            if ahead:
                self._pending[nxt] = (ahead, GatherInFlight(
                    [self._source(p) for p in ahead], [self.shapes[id(p)] for p in ahead],
                    self.group, where="ZeRO-3 prefetch"))

    def gather(self, unit, phase: str, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's shards of the unit (this rank's, concatenated: (sum c_i,)) in rank order,
        (N * sum c_i,): one all-gather. ZeRO++ (labkit.zero.zeropp) gathers otherwise."""
        return all_gather_flat(mine, self.group, where="ZeRO-3 gather")

    def reduce_scatter(self, fulls: list) -> list:
        """This rank's chunk (c_i,) of the mean over ranks of each full gradient, one message
        (labkit.zero.reduce calls it in backward). ZeRO++ reduces otherwise."""
        return reduce_scatter_mean_many(fulls, self.group, where="ZeRO-3 grads",
                                        algorithm=self.reduce_scatter_algorithm)

    def _settle(self) -> None:
        """Before the optimizer changes the shards: no gather in flight, no full parameter
        kept (reshard_after_forward=False, or a unit whose backward never ran)."""
        for _params, work in self._pending.values():
            work.wait()                     # every rank posted it: complete it, then drop it
        self._pending, self._holds, self._calls = {}, {}, []
        for buf in self.flat.values():
            buf.untyped_storage().resize_(0)
        self._order.close()

    @contextlib.contextmanager
    def _span(self, unit, phase: str):
        if self.timeline is None:
            yield
            return
        with self.timeline.span(phase, "compute", unit=self._unit_name[id(unit)]):
            yield

    def _open_span(self, unit, phase: str):
        """A span that begins now and ends in _close_span (backward: from hook to hook)."""
        if self.timeline is None:
            return None
        span = self._span(unit, phase)
        span.__enter__()
        return span

    def _close_span(self, span) -> None:
        if span is not None:
            span.__exit__(None, None, None)

    def _free(self, params) -> None:
        for p in params:
            p.data = p.data.new_empty(0)

    def step(self) -> None:
        self._settle()
        if self.max_grad_norm is not None:
            self.last_grad_norm = clip_(
                [s.grad for p, s in zip(self.params, self.shards) if id(p) not in self.replicated],
                self.max_grad_norm, self.group, sharded=True,
                replicated=[s.grad for p, s in zip(self.params, self.shards)
                            if id(p) in self.replicated], device=self.device)
        self.optimizer.step()        # local shards only: no all-gather before it
        self._copy_to_device()       # offload: the updated shards go back to the device

    def zero_grad(self) -> None:
        for s in self.shards:
            s.grad = None

    def full_parameters(self) -> dict:
        """name -> full tensor in the master dtype, all-gathered (for checking against a
        reference; collective). Replicated ones are this rank's own copy."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {names[id(p)]: s.detach().clone() if id(p) in self.replicated
                else all_gather_full(s.detach().to(self.device), self.shapes[id(p)], self.group)
                for p, s in zip(self.params, self.shards)}

    def full_buffers(self) -> list:
        """The buffers sharded parameters are gathered into, 0 bytes unless held whole now."""
        return list(self.flat.values())

    def held_bytes(self) -> dict:
        """Bytes this rank keeps, by storage (a view is not counted twice): on the device
        "params", "grads", "optimizer"; with offload also "cpu_grads" and "cpu_optimizer" (the
        fp32 masters and the optimizer's state: the memory calculator's offload_optimizer).
        Full parameters held at this moment (e.g. reshard_after_forward=False between forward
        and backward) count as params."""
        full = self.full_buffers()              # 0 bytes each unless whole now
        state = [v for st in self.optimizer.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        grads = [s.grad for s in self.shards]
        if not self.offload:
            return {"params": storage_bytes(list(self.shards) + full),
                    "grads": storage_bytes(grads), "optimizer": storage_bytes(state)}
        return {"params": storage_bytes(list(self.device_shards.values()) + full), "grads": 0,
                "optimizer": 0, "cpu_grads": storage_bytes(grads),
                "cpu_optimizer": storage_bytes(list(self.shards) + state)}
