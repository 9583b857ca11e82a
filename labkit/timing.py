"""Clocks that tell the truth on a GPU.

CUDA kernels and NCCL collectives are queued: the call returns before the work is done. Reading
`time.perf_counter()` right after would time the queueing, not the work. So every timing in
labkit reads the clock through `now(device)`, which first waits for the device to finish what
was queued (torch.cuda.synchronize). On the CPU (Gloo) the work is done when the call returns,
and `now` is just perf_counter.

    from labkit.timing import now
    t0 = now(x.device)
    dist.all_reduce(x)
    seconds = now(x.device) - t0
"""
from __future__ import annotations

import time


def synchronize(device=None) -> None:
    """Wait until `device` (a torch.device, a string like "cuda:0", or a tensor) has finished its
    queued work. A no-op for the CPU and for None."""
    if device is None:
        return
    import torch

    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device=None) -> float:
    """perf_counter seconds, read after `device` has finished its queued work."""
    synchronize(device)
    return time.perf_counter()
