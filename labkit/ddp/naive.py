"""Naive DDP: after backward, all-reduce every gradient, one at a time, then average.

Correct, and the baseline: every message waits for the whole backward pass, and each parameter
pays the per-message latency (alpha) once. Nothing overlaps with compute."""
from __future__ import annotations

import torch

from labkit.ddp.common import DDPBase


class NaiveDDP(DDPBase):
    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Call after backward, before optimizer.step(): all-reduce and average each gradient."""
        if not self._sync:
            return
        for p in self._params:
            if p.grad is None:
                raise RuntimeError(f"parameter {self._name(p)!r} has no gradient after backward: "
                                   "use every trainable parameter in forward, or set "
                                   "requires_grad=False on it")
            self._launch(p.grad, self._name(p)).wait()  # blocking: one after another
            p.grad.div_(self.world)
        self.steps += 1
