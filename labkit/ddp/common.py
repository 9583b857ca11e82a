"""What every DDP version shares: the initial broadcast, the wrapper, launch records (drawn on a
labkit.observe.timeline.Timeline)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from labkit.accumulate import sync_paused
from labkit.observe import commlog
from labkit.observe.timeline import Timeline
from labkit.timing import now


@torch.no_grad()
def broadcast_module(module: nn.Module, group=None) -> None:
    """Copy the group's rank 0's parameters and buffers to every rank (one message per dtype)."""
    broadcast_tensors(list(module.parameters()) + list(module.buffers()), group)  # tied: once


@torch.no_grad()
def broadcast_tensors(tensors, group=None) -> None:
    """Copy the group's rank 0's `tensors` to every rank, in place (one message per dtype)."""
    group = group or dist.group.WORLD
    src = dist.get_global_rank(group, 0)
    tensors = list(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])                      # (sum numel,)
        dist.broadcast(flat, src=src, group=group)
        for t, piece in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(piece.view_as(t))


class DDPBase(nn.Module):
    """The wrapper: `.module`, forward, `no_sync()`, launch records; subclasses decide when to
    all-reduce. parameters() and state_dict() are the wrapped model's (same order and names).

    params: the parameters to synchronise (default: every trainable one of `module`); given, only
    they are broadcast, not the module's other parameters or buffers (labkit.parallel passes a
    pipeline stage's own parameters, without the experts, which differ between dp ranks)."""

    def __init__(self, module: nn.Module, group=None, *, timeline: Timeline | None = None,
                 params=None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: run this inside "
                               "labkit.launch.run(fn, nprocs) or under torchrun")
        self.module = module
        self.group = group or dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        first = next(module.parameters(), None)
        self.timeline = timeline or Timeline(first.device if first is not None else None)
        self.traced = timeline is not None  # record compute spans (pack, unpack) only if asked
        self.launches: list[dict] = []  # one per all-reduce: name, start, end, bytes, step
        self.steps = 0                  # finished synchronisations
        self._sync = True
        # module.parameters() yields a shared (tied) tensor once, so it is synchronised once
        chosen = module.parameters() if params is None else params
        self._params = list({id(p): p for p in chosen if p.requires_grad}.values())
        self._names = {id(p): n for n, p in module.named_parameters()}
        if params is None:
            broadcast_module(module, self.group)
        else:
            broadcast_tensors(self._params, self.group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        """Accumulate gradients locally: no communication inside (the next synced backward
        all-reduces the sum of every micro-batch's gradients)."""
        return sync_paused(self)

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError

    # -- the wrapped model's view of itself
    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # -- communication, recorded
    def _launch(self, flat: torch.Tensor, name: str):
        """Start an async all-reduce (sum) of `flat`; return a future that completes when it is
        done and its end time is recorded (in .launches, and in an open labkit.observe.commlog
        log: labkit.parallel counts the dp bytes there)."""
        record = {"name": name, "lane": "comm", "step": self.steps, "bytes":
                  flat.nbytes, "start": self.timeline.now(), "end": None}
        self.launches.append(record)
        event = commlog.posted("all_reduce", flat, group=self.group, where=f"DDP {name}")
        with record_function(f"all_reduce {name}"):  # a span in profiler traces (queues it)
            work = dist.all_reduce(flat, group=self.group, async_op=True)

        def done(fut):
            record["end"] = self.timeline.now()
            if event is not None:
                event.end = now(flat.device)
            return None

        return _Launched(work.get_future().then(done), event, flat.device)

    def _span(self, name: str, **info):
        """A span on the given timeline; nothing recorded when none was given (long runs)."""
        return self.timeline.span(name, **info) if self.traced else contextlib.nullcontext()

    def _name(self, p) -> str:
        return self._names.get(id(p), "?")


class _Launched:
    """A launched all-reduce: wait() waits for it and adds the time waited to its log event."""

    def __init__(self, future, event, device):
        self.future, self.event, self.device = future, event, device

    def wait(self):
        if self.event is None:            # no log open: no clock read (it syncs a GPU)
            return self.future.wait()
        start = now(self.device)
        out = self.future.wait()
        self.event.blocked += now(self.device) - start
        return out
