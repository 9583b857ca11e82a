"""Measure DDP on real ranks: step times (benchmark, bucket sweep) and one step's timeline.

Rank side only (call inside labkit.launch.run). Float32, the tiny GPT, each rank its own
`batch` rows per step (weak scaling: the per-rank work is fixed as ranks are added)."""
from __future__ import annotations

import contextlib
import statistics

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from labkit.collectives import Traffic, ring_all_reduce
from labkit.labs.ddp.verify import build_model, wrap
from labkit.launch import device
from labkit.model import get_batch, tiny_corpus
from labkit.observe.timeline import Timeline
from labkit.timing import now

BENCH = dict(n_layer=2, n_embd=64, n_head=4, block_size=32)


def _step(ddp, opt, x, y, timeline=None):
    tl = timeline or _NULL
    with tl.span("forward"):
        _, loss = ddp(x, y)
    with tl.span("backward"):
        loss.backward()
    with tl.span("wait"):
        if hasattr(ddp, "finish_gradient_synchronization"):
            ddp.finish_gradient_synchronization()
    with tl.span("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)


class _Null:
    def span(self, *a, **k):
        return contextlib.nullcontext()


_NULL = _Null()


def _setup(kind, cfg, bucket_mb, timeline=None):
    model = build_model(cfg, seed=0, dtype="float32").to(device())
    ddp = wrap(kind, model, bucket_mb=bucket_mb, timeline=timeline)
    opt = torch.optim.SGD(ddp.module.parameters(), lr=1e-3)
    return ddp, opt


def time_steps(variants, cfg: dict = BENCH, *, batch: int = 8, steps: int = 5, rounds: int = 5,
               warmup: int = 2) -> list:
    """Seconds per step of each variant (kind, bucket_mb): median over `rounds` blocks of `steps`
    steps, blocks interleaved across variants so drifting load hits every variant alike."""
    rank = dist.get_rank()
    tokens = tiny_corpus()
    setups = [_setup(kind, cfg, mb) for kind, mb in variants]
    x, y = get_batch(tokens, batch, cfg["block_size"], step=rank)            # (batch, T)
    x, y = x.to(device()), y.to(device())
    for ddp, opt in setups:
        for _ in range(warmup):
            _step(ddp, opt, x, y)
    times = [[] for _ in variants]
    for r in range(rounds):
        order = list(range(len(variants)))
        order = order[r % len(order):] + order[:r % len(order)]  # rotate who goes first
        for i in order:
            ddp, opt = setups[i]
            dist.barrier()
            start = now(device())
            for _ in range(steps):
                _step(ddp, opt, x, y)
            dist.barrier()
            times[i].append((now(device()) - start) / steps)
    rows = []
    for (kind, mb), (ddp, _), ts in zip(variants, setups, times):
        launches = getattr(ddp, "launches", None)
        per_step = len(launches) / (warmup + steps * rounds) if launches is not None else None
        rows.append({"version": kind, "bucket_mb": mb, "step_s": statistics.median(ts),
                     "allreduces_per_step": per_step})
    return rows


def trace_step(kind: str, cfg: dict = BENCH, *, batch: int = 8, bucket_mb=25.0, warmup: int = 2):
    """One measured step on this rank: compute spans and each all-reduce (launch to completion),
    in milliseconds since the step began (clocks aligned by a barrier just before)."""
    tl = Timeline(device())
    ddp, opt = _setup(kind, cfg, bucket_mb, timeline=tl)
    x, y = (t.to(device()) for t in get_batch(tiny_corpus(), batch, cfg["block_size"],
                                              step=dist.get_rank()))
    for _ in range(warmup):
        _step(ddp, opt, x, y)
    dist.barrier()
    tl.reset()
    del ddp.launches[:]
    _step(ddp, opt, x, y, tl)
    events = tl.events + [dict(e) for e in ddp.launches]
    for e in events:
        e["start"], e["end"] = 1e3 * e["start"], 1e3 * e["end"]
        e["rank"], e["version"] = dist.get_rank(), kind
    return events


def torch_ddp_buckets(cfg: dict = BENCH, *, batch: int = 8, bucket_mb: float = 25.0) -> int:
    """All-reduces per step of PyTorch's DDP, counted by a communication hook (one call per
    bucket); the first step is skipped (PyTorch rebuilds its buckets after it)."""
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.buffer().numel())
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))

    model = build_model(cfg, seed=0, dtype="float32").to(device())
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    ddp.register_comm_hook(None, counting_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = (t.to(device()) for t in get_batch(tiny_corpus(), batch, cfg["block_size"],
                                              step=dist.get_rank()))
    _step(ddp, opt, x, y)
    calls.clear()
    _step(ddp, opt, x, y)
    return len(calls)


def ring_traffic(grad_bytes: int, sizes=(2, 3, 4)) -> dict:
    """Bytes this rank sent in a ring all-reduce of the gradients, in groups of each size
    (ranks 0..n-1 of the world); {n: bytes} on ranks that took part. Needs max(sizes) ranks."""
    out = {}
    for n in sizes:
        group = dist.new_group(list(range(n)))  # every rank must call new_group
        if dist.get_rank() < n:
            t = Traffic()
            ring_all_reduce(torch.ones(grad_bytes // 4, device=device()), group=group, traffic=t)
            out[n] = t.sent
        dist.barrier()
    return out

