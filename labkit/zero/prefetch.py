"""ZeRO-3's prefetch: post the all-gather of the NEXT unit's parameters, then compute this one.

    zero = ZeRO3(model, torch.optim.AdamW, prefetch=True, reshard_after_forward=True, lr=1e-3)

Without prefetch a unit waits for its own gather before it can compute: every all-gather sits on
the critical path. With it (FSDP's forward_prefetch and BACKWARD_PRE prefetch; FSDP2's implicit
backward prefetch and set_modules_to_forward_prefetch) the gather of unit i+1 is in flight while
unit i computes, so a rank holds at most about two units' full parameters: the one computing and
the one arriving.

Which unit is next: the order the units ran in on the first step, forward and backward apart
(FSDP1 records the execution order on its first iteration the same way). The first step runs
without prefetch. Every rank runs the same model, so every rank posts the same gathers in the
same order, which is all the collectives need to match.

On CPU with Gloo a posted collective runs on Gloo's own threads while the main thread computes:
the overlap is real but small, since both share the same few cores. On a GPU the gather runs on a
separate NCCL stream and its copy engines, and hides almost completely behind a block's matmuls.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from labkit.observe import commlog
from labkit.timing import now


class GatherInFlight:
    """An all-gather of several shards in ONE message, posted with async_op=True.

    wait() returns each shard's rows of the output, (N, c_i). The commlog event (when a log is open)
    starts when posted, ends when Gloo's thread completed it (a callback on the work's future,
    CPU only; on a GPU: when wait() returned) and its `blocked` is only the time spent in wait():
    the part of the transfer that was not hidden."""

    def __init__(self, shards, shapes, group=None, where: str = "ZeRO-3 prefetch"):
        self.world = dist.get_world_size(group)
        self.sizes, self.shapes = [s.numel() for s in shards], list(shapes)
        self.mine = torch.cat([s.detach().reshape(-1) for s in shards])      # (sum c_i,)
        self.flat = self.mine.new_empty(self.world * self.mine.numel())      # (N * sum c_i,)
        self.event = commlog.posted("all_gather", self.flat, group, where)  # closed in wait()
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.work = fn(self.flat, self.mine, group=group, async_op=True)
        if self.event is not None and self.flat.device.type == "cpu":
            self.work.get_future().add_done_callback(self._done)

    def _done(self, _future) -> None:           # on Gloo's thread, when the data has arrived
        t = time.perf_counter()
        e = self.event
        e.end = t if e.end is None else min(e.end, t)

    def buffers(self) -> list:
        """The tensors this gather holds while in flight (for measuring memory by storage)."""
        return [t for t in (self.mine, self.flat) if t is not None]

    def wait(self) -> list:
        """Block until the data has arrived; returns each shard's rows, (N, c_i) views of the
        gathered buffer (every rank's chunk of it, in rank order), valid until this is dropped."""
        t0 = now(self.flat.device)
        self.work.wait()
        t1 = now(self.flat.device)
        if self.event is not None:
            self.event.blocked += t1 - t0
            self.event.end = t1 if self.event.end is None else min(self.event.end, t1)
        rows = self.flat.view(self.world, -1).split(self.sizes, dim=1)       # (N, c_i) each
        self.mine = self.flat = None              # the rows hold the output until dropped
        return list(rows)


class ExecutionOrder:
    """The order units ran in, forward and backward, as seen on the first step."""

    def __init__(self):
        self.order = {"forward": [], "backward": []}
        self.complete = {"forward": False, "backward": False}

    def saw(self, key, phase: str) -> None:
        """A unit (its key) starts in `phase`; a phase's record closes when the other begins."""
        other = "backward" if phase == "forward" else "forward"
        if self.order[other] and not self.complete[other]:
            self.complete[other] = True
        if not self.complete[phase] and key not in self.order[phase]:
            self.order[phase].append(key)

    def close(self) -> None:
        """After a step: whatever was recorded is the order."""
        for phase, keys in self.order.items():
            if keys:
                self.complete[phase] = True

    def after(self, key, phase: str):
        """The key that ran after `key` in `phase` on the first step, or None."""
        keys = self.order[phase]
        if not self.complete[phase] or key not in keys:
            return None
        i = keys.index(key)
        return keys[i + 1] if i + 1 < len(keys) else None
