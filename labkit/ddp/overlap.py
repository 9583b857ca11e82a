"""Per-parameter overlap: a hook launches each gradient's all-reduce the moment it is ready.

`register_post_accumulate_grad_hook` fires once per backward after a parameter's .grad holds
its full gradient (a tied parameter used twice is accumulated first, then fires once). The
all-reduce runs asynchronously while autograd goes on to earlier layers; the last call only
waits. Overlap is won, but every parameter is its own message: many small latency-bound
all-reduces (the reason for buckets)."""
from __future__ import annotations

import torch

from labkit.ddp.common import DDPBase


class OverlapDDP(DDPBase):
    def __init__(self, module, group=None, **kwargs):
        super().__init__(module, group, **kwargs)
        self._pending = []  # (param, future) in launch order
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._params]

    def _grad_ready(self, p) -> None:
        if not self._sync:  # inside no_sync(): keep accumulating locally
            return
        if any(q is p for q, _ in self._pending):
            raise RuntimeError(f"gradient of {self._name(p)!r} became ready twice before "
                               "finish_gradient_synchronization(): call it after every synced "
                               "backward, and wrap accumulation micro-batches in no_sync()")
        self._pending.append((p, self._launch(p.grad, self._name(p))))

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Call after backward, before optimizer.step(): wait for every all-reduce, average."""
        if not self._sync:
            return
        if len(self._pending) != len(self._params):
            seen = {id(p) for p, _ in self._pending}
            missing = [self._name(p) for p in self._params if id(p) not in seen]
            raise RuntimeError(f"{len(missing)} trainable parameter(s) got no gradient in this "
                               f"backward: {missing[:5]}; use them in forward or freeze them")
        for p, fut in self._pending:
            fut.wait()
            p.grad.div_(self.world)
        self._pending = []
        self.steps += 1
