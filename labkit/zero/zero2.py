"""ZeRO stage 2: shard the gradients too, reduce-scattered during backward (ZeRO paper, P_os+g).

    zero = ZeRO2(model.parameters(), torch.optim.AdamW, lr=1e-3)   # inside a launched rank
    loss = model(x, y)[1]; loss.backward(); zero.step(); zero.zero_grad()

Stage 1 still builds the full gradient on every rank (4Ψ bytes in fp32, 2Ψ in bf16) and only
then reduce-scatters it. Stage 2 reduce-scatters each parameter's gradient the moment backward
has finished accumulating it (a post-accumulate-grad hook), adds rank r's chunk into the shard's
gradient, and frees the full gradient at once. At any moment of backward only the gradients
still being produced are full; after backward each rank holds the gradients of its shard only.
The step is stage 1's without the reduce-scatter: update the shards, all-gather the parameters.
Bytes sent: the same 2(N-1)/N Ψ as stage 1 and DDP.

(DeepSpeed buckets several gradients per reduce-scatter to send fewer, larger messages; one
collective per parameter keeps this version short; chapter 02 shows bucketing.)
"""
from __future__ import annotations

import torch

from labkit.zero.shard import (CommCounter, all_gather_many, reduce_scatter_mean,
                               shard_optimizer, unique_params)
from labkit.zero.zero1 import DataParallel


class ZeRO2(DataParallel):
    """Sharded optimizer states and gradients; full parameters on every rank."""

    stage = 2

    def __init__(self, params, optimizer_class, group=None, **optimizer_kwargs):
        self.params = unique_params(params)
        self.group, self.counter = group, CommCounter()
        self.shards, self.optimizer = shard_optimizer(self.params, optimizer_class, group,
                                                      **optimizer_kwargs)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(s))
                       for p, s in zip(self.params, self.shards)]

    def _make_hook(self, shard):
        def hook(p):  # runs in backward, once p.grad holds this step's local gradient
            chunk = reduce_scatter_mean(p.grad, self.group, self.counter)   # (c,)
            shard.grad = chunk if shard.grad is None else shard.grad.add_(chunk)
            p.grad = None                       # the full gradient is gone: ZeRO-2's saving
        return hook

    def step(self) -> None:
        self.optimizer.step()
        with torch.no_grad():
            fulls = all_gather_many(self.shards, [p.shape for p in self.params], self.group,
                                    self.counter)
            for p, full in zip(self.params, fulls):
                p.copy_(full)                                        # p.shape

    def zero_grad(self) -> None:
        for p, s in zip(self.params, self.shards):
            p.grad, s.grad = None, None

    def held_bytes(self) -> dict:
        out = super().held_bytes()
        out["grads"] += sum(s.grad.numel() * s.grad.element_size()
                            for s in self.shards if s.grad is not None)
        return out

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
