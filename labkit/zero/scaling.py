"""fp16 dynamic loss scaling over sharded gradients: every rank skips the same steps.

    from labkit.zero import MixedPrecisionPolicy, ShardedLossScaler, ZeRO3
    zero = ZeRO3(model, torch.optim.AdamW, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.float16, reduce_dtype=torch.float32), lr=1e-3)
    scaler = ShardedLossScaler()
    scaler.scale_loss(model(x, y)[1]).backward()
    scaler.step(zero)           # unscale, agree on overflow, step or skip; then zero.zero_grad()

The rules are labkit.precision.DynamicLossScaler's (torch.amp.GradScaler's: start at 2^16,
halve and skip on inf/NaN, double after 2000 good steps; S an fp32 number, never grown past
fp32's range). fp16 gradients are accepted, as ShardedGradScaler accepts them, and unscaled in
fp32. What sharding adds: a rank sees only
its chunk of each gradient, so an overflow may show on one rank and not on another. Each rank
unscales what it holds and one all-reduce (MAX of a 0/1 flag, 4 bytes) tells every rank whether
any found inf/NaN, so all skip or all step and the scales stay equal (torch's
ShardedGradScaler does the same). Unscaling before the step also lets clipping
(max_grad_norm) see true gradients, as GradScaler's unscale_ does.

Which gradients a stage holds before its step: DataParallel and ZeRO-1 the local full
gradients (the all-reduce / reduce-scatter happens inside step(); dividing by S first is the
same, the reduction being linear), ZeRO-2 and ZeRO-3 the reduced chunks of their shards.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.observe import commlog
from labkit.precision.scaler import DynamicLossScaler


def grads_before_step(zero) -> list:
    """The gradient tensors `zero` holds before its step (see the module docstring)."""
    if getattr(zero, "stage", 0) >= 2:
        return [s.grad for s in zero.shards]
    return [p.grad for p in zero.params]


class ShardedLossScaler(DynamicLossScaler):
    """DynamicLossScaler whose step() agrees over the group on whether to skip."""

    def __init__(self, group=None, **kw):
        # fp16 gradients are allowed, as torch's ShardedGradScaler allows them (ZeRO-0/1 with an
        # fp16 param_dtype hold fp16 p.grad before the step); unscaled in fp32, rounded once
        kw.setdefault("allow_fp16", True)
        super().__init__(**kw)
        self.group = group

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * S in fp32: an fp16 loss of 4.6 times 2^16 would be inf before backward began
        (GradScaler multiplies by an fp32 tensor, which promotes the same way)."""
        return loss.float() * self.scale

    def found_inf(self, zero) -> bool:
        """Unscale this rank's gradients in place; True if any rank found inf/NaN."""
        grads = [g for g in grads_before_step(zero) if g is not None]
        local = self.unscale_(grads)
        # the flag travels on the communication device (offload keeps the grads in CPU memory)
        device = getattr(zero, "device", None) or (grads[0].device if grads else
                                                   torch.device("cpu"))
        flag = torch.tensor([float(local)], device=device)                   # (1,)
        commlog.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group,
                           where="loss scaler: any inf")
        return bool(flag.item() > 0)

    def step(self, zero) -> bool:
        """Unscale, agree, then zero.step() or skip it (halving the scale). Returns whether the
        optimizer stepped. Call zero.zero_grad() afterwards either way."""
        if self.update(self.found_inf(zero)):
            zero.step()
            return True
        return False
