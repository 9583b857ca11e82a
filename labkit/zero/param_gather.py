"""ZeRO-1/2's parameter all-gather overlapped with the next forward (Megatron-LM's
`--overlap-param-gather`, which its megatron/training/arguments.py validate_args accepts only
with `--use-distributed-optimizer` (or Megatron FSDP) and `--overlap-grad-reduce`).

Without it, ZeRO-1/2's step is reduce-scatter (under backward for ZeRO-2) -> optimizer update of
the shards -> all-gather of the updated parameters, and nothing can run until that gather is
done: (N-1)/N Ψ p bytes exposed every step. The gather cannot start earlier (it sends what the
update produced), but no layer needs its parameters before its own forward. So:

    gather = OverlappedParamGather(model, zero)       # after building ZeRO1/ZeRO2 over model
    ... zero.step() posts one all-gather per module (async), and returns at once;
    ... the next forward waits, module by module, only for the gather of the module it runs

A forward pre-hook on every module that owns parameters waits for that module's gather and
copies the gathered values into the parameters. `finish()` completes every pending gather (the
step does it first, for a module the forward skipped; so does anything that reads the
parameters outside a forward: call it before checkpointing or comparing).

What it saves is time, not bytes: the same (N-1)/N Ψ p goes on the wire. The commlog events of
these gathers ("ZeRO params, overlapped") record how long the forward was blocked on each:
the exposed part.
"""
from __future__ import annotations

import torch

from labkit.zero.prefetch import GatherInFlight


class OverlappedParamGather:
    """Posts ZeRO-1/2's parameter all-gathers at the end of the step, one per module that owns
    parameters, and waits for each one in that module's forward pre-hook."""

    def __init__(self, model: torch.nn.Module, zero):
        if getattr(zero, "stage", None) not in (1, 2) or not getattr(zero, "flat", True) \
                or getattr(zero, "naive", False):
            raise ValueError("OverlappedParamGather works on labkit's ZeRO1 (flat) or ZeRO2")
        self.zero = zero
        shard_of = {id(p): s for p, s in zip(zero.params, zero.shards)}
        self.modules = []            # (module, [(param, shard)]) in registration order
        for module in model.modules():
            own = [(p, shard_of[id(p)]) for p in module.parameters(recurse=False)
                   if id(p) in shard_of]
            if own:
                self.modules.append((module, own))
                module.register_forward_pre_hook(self._pre_forward)
        self.pending: dict = {}      # id(module) -> GatherInFlight
        zero.param_gather = self     # ZeRO1/ZeRO2.step post through it instead of gathering

    def post(self) -> None:
        """After the optimizer step: one async all-gather per module (the masters cast first)."""
        self.finish()
        with torch.no_grad():
            for module, own in self.modules:
                shards = [s.detach().to(p.device, p.dtype) for p, s in own]
                self.pending[id(module)] = GatherInFlight(
                    shards, [p.shape for p, _ in own], self.zero.group,
                    where="ZeRO params, overlapped")

    def _pre_forward(self, module, _inputs) -> None:
        self._complete(module)

    def _complete(self, module) -> None:
        work = self.pending.pop(id(module), None)
        if work is None:
            return
        own = next(o for m, o in self.modules if m is module)
        rows = work.wait()                                       # (N, c_i) each
        with torch.no_grad():
            for (p, _), row in zip(own, rows):
                p.copy_(row.reshape(-1)[:p.numel()].view_as(p))      # p.shape

    def finish(self) -> None:
        """Complete every gather still in flight (in posting order: every rank the same)."""
        for module, _ in self.modules:
            if id(module) in self.pending:
                self._complete(module)
