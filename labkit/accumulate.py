"""Gradient accumulation's switch: a data-parallel wrapper sends nothing while it is paused.

    with sync_paused(wrapper):      # what DDP's no_sync() returns; ZeRO-2 and ZeRO-3 use it too
        loss.backward()             # gradients accumulate locally, no collective is launched

A wrapper keeps a `_sync` flag that its gradient hooks read (labkit.ddp's DDPBase, labkit.zero's
ZeRO2 and ZeRO3); PyTorch's DistributedDataParallel.no_sync flips `require_backward_grad_sync`
the same way (torch/nn/parallel/distributed.py).
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def sync_paused(wrapper):
    """no_sync() of every data-parallel wrapper: `wrapper._sync` is False inside, so backward
    accumulates local gradients and sends nothing; the value before is restored after (nests)."""
    old, wrapper._sync = wrapper._sync, False
    try:
        yield
    finally:
        wrapper._sync = old
