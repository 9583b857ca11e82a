"""ZeRO stage 2: shard the gradients too, reduce-scattered during backward (ZeRO paper, P_os+g).

    zero = ZeRO2(model.parameters(), torch.optim.AdamW, lr=1e-3)   # inside a launched rank
    loss = model(x, y)[1]; loss.backward(); zero.step(); zero.zero_grad()

Stage 1 still builds the full gradient on every rank (4Ψ bytes in fp32, 2Ψ in bf16) and only
then reduce-scatters it. Stage 2 cuts the parameters into buckets by the book's one rule
(labkit.buckets, chapter 02's DDP and PyTorch's reducer: last parameter first, a bucket closes
once it holds `bucket_bytes` or more) and collects each parameter's gradient the moment backward
has finished accumulating it (a post-accumulate-grad hook); when a bucket's last gradient is in,
one reduce-scatter sends all of it (buckets in index order, the same on every rank), rank r adds
its chunks into its shards' gradients, and the full gradients are freed at once. So during
backward about one bucket of full gradients is alive; after the step each rank holds the
gradients of its shard only. (`bucket_bytes=0` reduce-scatters every parameter on its own: the
naive version, many small messages.) The step sends any bucket still waiting (a parameter unused
on every rank leaves its bucket incomplete), updates the shards and all-gathers the parameters.
Bytes sent: the same 2(N-1)/N Ψ as stage 1 and DDP, with a ring reduce-scatter
(`reduce_scatter="backend"` forces the backend's own, which on Gloo moves all-reduce bytes:
chapter 03 measures the difference).

offload=True is ZeRO-Offload (Ren et al. 2021), which the paper builds on stage 2: the fp32
master shards, their gradients and the optimizer's state live in CPU memory and the step runs
there. Each bucket's reduced chunks are copied to the CPU as they arrive (Ψ/N gradient values
down per step), and the updated shards come back up before the all-gather (Ψ/N parameter
values): the device keeps only the full parameters and, during backward, one bucket of full
gradients (labkit.costs.zero.offload_transfer_bytes and offload_seconds price the copies).
"""
from __future__ import annotations

import torch

from labkit.accumulate import sync_paused
from labkit.buckets import assign_buckets
from labkit.flat import all_gather_many, reduce_scatter_mean_many
from labkit.observe.storage import storage_bytes
from labkit.zero.params import clip_, flat_params, param_groups
from labkit.zero.precision import resolve_model_policy
from labkit.zero.shard import master_shards
from labkit.zero.zero1 import DataParallel


class ZeRO2(DataParallel):
    """Sharded optimizer states and gradients; full parameters on every rank.

    Frozen parameters get no hook, no shard, no state; with mp_policy pass them too (every
    parameter, e.g. weight_decay_groups(model, wd)), so they are cast to param_dtype with the
    rest. A parameter unused on a step never fires its hook, so its shard's gradient stays None
    (the optimizer skips it); which parameters are used must be the same on every rank, as in
    DDP without find_unused_parameters (accepted here, and not needed), or the buckets'
    collectives would not match. The buckets follow `params` as given, last first: pass them in
    registration order (model.parameters()) so that backward fills them one after another.
    `no_sync()`: accumulate full local gradients over micro-batches and reduce-scatter once, on
    the last (hook-free) backward."""

    stage = 2

    def __init__(self, params, optimizer_class, group=None, bucket_bytes: int = 64 * 1024,
                 reduce_scatter: str | None = None, max_grad_norm: float | None = None,
                 find_unused_parameters: bool = False, mp_policy=None, offload: bool = False,
                 **optimizer_kwargs):
        self.groups, self.frozen = param_groups(params)
        self.params = flat_params(self.groups)
        self.group, self.bucket_bytes = group, bucket_bytes
        self.max_grad_norm, self.last_grad_norm = max_grad_norm, None
        self.reduce_scatter = reduce_scatter   # None: labkit.zero.shard.reduce_scatter_algorithm
        self.param_dtype, self.reduce_dtype = resolve_model_policy(mp_policy, self.params)
        self.offload = bool(offload)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.shards, self.optimizer = master_shards(   # offload: fp32 masters in CPU memory
            self.groups, optimizer_class, group, self.param_dtype,
            home=torch.device("cpu") if self.offload else None, frozen=self.frozen,
            **optimizer_kwargs)
        order = list(reversed(range(len(self.params))))         # last parameter first
        plan = assign_buckets([self.params[i].numel() * self.params[i].element_size()
                               for i in order], bucket_bytes,
                              keys=[(self.params[i].dtype, self.params[i].device) for i in order])
        self.buckets = [[order[j] for j in b] for b in plan]     # indices into self.params
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.reductions = 0              # buckets reduce-scattered so far (one message each)
        self._sync = True
        self._reset()
        for i, p in enumerate(self.params):   # for the life of the parameters
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    def _reset(self) -> None:
        self._ready = [set() for _ in self.buckets]   # indices whose gradient is in, per bucket
        self._next = 0                                # the next bucket to send (index order)

    def no_sync(self):
        """Backward inside keeps full local gradients (p.grad accumulates; 2Ψ or 4Ψ bytes held)
        and sends nothing; the next backward outside reduce-scatters the sum once."""
        return sync_paused(self)

    def _make_hook(self, i: int):
        def hook(p):  # runs in backward, once p.grad holds this step's local gradient
            if not self._sync:
                return  # no_sync: the full gradient stays in p.grad and keeps accumulating
            self._ready[self._bucket_of[i]].add(i)   # again before its bucket was sent: queued
            while self._next < len(self.buckets) and \
                    len(self._ready[self._next]) == len(self.buckets[self._next]):
                self._flush(self._next)              # complete, and every earlier one is sent
                self._next += 1
            if self._next == len(self.buckets):      # all sent: another backward (accumulating
                self._reset()                        # without no_sync) sends them all again
        return hook

    def _flush(self, b: int) -> None:
        """Reduce-scatter bucket b's gradients into the shards; free the full gradients."""
        members = [i for i in self.buckets[b] if self.params[i].grad is not None]
        if not members:
            return
        params = [self.params[i] for i in members]
        shards = [self.shards[i] for i in members]
        grads = [p.grad.to(self.reduce_dtype) if self.reduce_dtype else p.grad for p in params]
        chunks = reduce_scatter_mean_many(grads, self.group,
                                          where="ZeRO-2 bucket", algorithm=self.reduce_scatter)
        self.reductions += 1
        for p, s, chunk in zip(params, shards, chunks):              # chunk: (c,)
            if self.offload:                    # down to the CPU, where the step runs
                chunk = chunk.to(s.device, s.dtype)
            s.grad = chunk if s.grad is None else s.grad.add_(chunk)
            p.grad = None                       # the full gradient is gone: ZeRO-2's saving

    def step(self) -> None:
        for b in range(self._next, len(self.buckets)):   # waiting on a parameter never used
            self._flush(b)
        self._reset()
        if self.max_grad_norm is not None:
            self.last_grad_norm = clip_([s.grad for s in self.shards], self.max_grad_norm,
                                        self.group, sharded=True, device=self.device)
        self.optimizer.step()
        if getattr(self, "param_gather", None) is not None:   # labkit.zero.param_gather:
            self.param_gather.post()                            # waited for in the next forward
            return
        with torch.no_grad():   # mp: cast first; offload: back up to the device
            fulls = all_gather_many([s.detach().to(p.device, p.dtype) for p, s in
                                     zip(self.params, self.shards)],
                                    [p.shape for p in self.params], self.group,
                                    where="ZeRO-2 params")
            for p, full in zip(self.params, fulls):
                p.copy_(full)                                        # p.shape

    def zero_grad(self) -> None:
        for p, s in zip(self.params, self.shards):
            p.grad, s.grad = None, None

    def _grads_held(self) -> list:      # full gradients (freed once reduced) and shards' chunks
        return [p.grad for p in self.params] + [s.grad for s in self.shards]

    def held_bytes(self) -> dict:
        """DataParallel.held_bytes; with offload the shards' gradients, the fp32 masters and the
        optimizer's state are "cpu_grads" and "cpu_optimizer" (the memory calculator's
        offload_optimizer), and the device keeps the parameters and any full gradient."""
        if not self.offload:
            return super().held_bytes()
        state = [v for st in self.optimizer.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        return {"params": storage_bytes(self.params + self.frozen),
                "grads": storage_bytes([p.grad for p in self.params]), "optimizer": 0,
                "cpu_grads": storage_bytes([s.grad for s in self.shards]),
                "cpu_optimizer": storage_bytes(list(self.shards) + state)}
