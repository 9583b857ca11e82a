"""Bucketed DDP with overlap: few, large all-reduces that still start during backward.

Parameters are grouped in the reverse of their registration order (roughly the order in which
backward produces their gradients) into buckets of at most `bucket_mb` MiB (PyTorch's
`bucket_cap_mb`, default 25, counts MiB = 2**20 bytes). A bucket's all-reduce is launched as
soon as all of its gradients are ready, and buckets are launched in index order on every rank
(so the ranks' collectives always match). A tiny size gives one parameter per bucket (the
per-parameter version); `bucket_mb=None` gives one bucket for everything (no overlap left).

Simplification against PyTorch: gradients are copied into a flat buffer at launch and back at
the end (PyTorch's `gradient_as_bucket_view` avoids the copy), and there is no smaller first
bucket."""
from __future__ import annotations

import torch

from labkit.ddp.common import DDPBase

MiB = 2**20


def assign_buckets(params, bucket_mb: float | None = 25.0) -> list:
    """Split `params` (registration order) into buckets, last-registered first.

    A new bucket starts when adding a parameter would pass `bucket_mb` MiB (a parameter larger
    than the cap gets a bucket of its own) or when the dtype changes."""
    if bucket_mb is not None and not bucket_mb > 0:
        raise ValueError(f"bucket_mb={bucket_mb}: give a positive size in MiB (e.g. 25.0), or "
                         "None for one bucket holding every gradient")
    cap = float("inf") if bucket_mb is None else bucket_mb * MiB
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        nbytes = p.nbytes
        if current and (size + nbytes > cap or p.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class BucketedDDP(DDPBase):
    def __init__(self, module, group=None, *, bucket_mb: float | None = 25.0, **kwargs):
        super().__init__(module, group, **kwargs)
        self.buckets = assign_buckets(self._params, bucket_mb)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._params]
        self._reset()

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)  # gradients ready, per bucket
        self._next = 0                         # the next bucket to launch (launch in order)
        self._pending = []                     # (bucket index, flat buffer, future)

    def _grad_ready(self, p) -> None:
        if not self._sync:
            return
        i = self._bucket_of[id(p)]
        self._ready[i] += 1
        if self._ready[i] > len(self.buckets[i]):
            raise RuntimeError(f"gradient of {self._name(p)!r} became ready twice before "
                               "finish_gradient_synchronization(): call it after every synced "
                               "backward, and wrap accumulation micro-batches in no_sync()")
        # launch every complete bucket whose predecessors are launched: same order on all ranks
        while self._next < len(self.buckets) and \
                self._ready[self._next] == len(self.buckets[self._next]):
            self._launch_bucket(self._next)
            self._next += 1

    def _launch_bucket(self, i: int) -> None:
        with self._span("pack", bucket=i):  # PyTorch's reducer copies in C++ (or not: as_view)
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])  # (bucket numel,)
        self._pending.append((i, flat, self._launch(flat, f"bucket {i}")))

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Call after backward, before optimizer.step(): wait for every bucket, average, unpack."""
        if not self._sync:
            return
        if self._next < len(self.buckets):
            stuck = self._next
            missing = [self._name(p) for p in self.buckets[stuck] if p.grad is None]
            self._reset()
            raise RuntimeError(f"bucket {stuck} of {len(self.buckets)} never became ready; "
                               f"parameters without a gradient: {missing[:5]}. Use every "
                               "trainable parameter in forward, or freeze it")
        for _, _, fut in self._pending:
            fut.wait()
        with self._span("unpack"):
            for i, flat, _ in self._pending:
                flat.div_(self.world)
                bucket = self.buckets[i]
                for p, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
                    p.grad.copy_(piece.view_as(p))
        self._reset()
        self.steps += 1
