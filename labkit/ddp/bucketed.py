"""Bucketed DDP with overlap: few, large all-reduces that still start during backward.

Parameters are grouped in the reverse of their registration order (roughly the order in which
backward produces their gradients) into buckets by the book's one rule, labkit.buckets (PyTorch's
reducer's): a bucket closes as soon as its bytes reach `bucket_mb` MiB (PyTorch's
`bucket_cap_mb`, default 25, turned into bytes as int(mb * 2**20)), so it ends with the gradient
that filled it. A bucket's all-reduce is launched as soon as all of its gradients are ready, and
buckets are launched in index order on every rank (so the ranks' collectives always match). A
tiny size gives one parameter per bucket (the per-parameter version); `bucket_mb=None` gives one
bucket for everything (no overlap left). `first_bucket_mb` caps the first bucket apart
(PyTorch's first_bucket_bytes_cap: 1 MiB when bucket_cap_mb is left at its default; None here:
the same cap as the others, as PyTorch's when bucket_cap_mb is given).

Simplification against PyTorch: gradients are copied into a flat buffer at launch and back at
the end (PyTorch's `gradient_as_bucket_view` avoids the copy), and the buckets are not rebuilt
from the order gradients arrived in the first step (PyTorch's reducer rebuilds them once)."""
from __future__ import annotations

import torch

from labkit import buckets as rule
from labkit.ddp.common import DDPBase


def assign_buckets(params, bucket_mb: float | None = 25.0,
                   first_bucket_mb: float | None = None) -> list:
    """Split `params` (registration order) into buckets, last-registered first, by
    labkit.buckets.assign_buckets: a bucket closes once it holds `bucket_mb` MiB or more (a
    parameter as large as the cap closes one alone); each dtype and device fills its own."""
    params = list(reversed(list(params)))
    cap = rule.cap_bytes(bucket_mb)
    first = None if first_bucket_mb is None else rule.cap_bytes(first_bucket_mb)
    groups = rule.assign_buckets([p.numel() * p.element_size() for p in params], cap,
                                 first_cap=first, keys=[(p.dtype, p.device) for p in params])
    return [[params[i] for i in g] for g in groups]


class BucketedDDP(DDPBase):
    def __init__(self, module, group=None, *, bucket_mb: float | None = 25.0,
                 first_bucket_mb: float | None = None, **kwargs):
        rule.cap_bytes(bucket_mb)    # a bad size fails before the broadcast in DDPBase
        super().__init__(module, group, **kwargs)
        self.buckets = assign_buckets(self._params, bucket_mb, first_bucket_mb)
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
    def synchronize_accumulated(self) -> None:
        """After backward(s) run inside no_sync(): launch every bucket now, in order, and finish
        (no overlap). labkit.parallel's pipeline path uses it: its executor runs K backward
        passes per step and still edits gradients after the last one (the tied embedding's two
        halves are summed over pp), so the buckets cannot be packed during backward."""
        if not self._sync:
            raise RuntimeError("synchronize_accumulated() inside no_sync(): call it after")
        self._reset()
        missing = [self._name(p) for p in self._params if p.grad is None]
        if missing:
            raise RuntimeError(f"parameters without a gradient: {missing[:5]}. Use every "
                               "trainable parameter in forward, or freeze it")
        for i in range(len(self.buckets)):
            self._launch_bucket(i)
        self._next = len(self.buckets)
        self.finish_gradient_synchronization()

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
