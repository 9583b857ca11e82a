"""Rank functions that train a few steps under the profiler, labelled, for labs and chapters.

    from labkit.launch import run
    from labkit.profiling import jobs
    out = run(jobs.ddp_job, 2, args=("traces/ddp",), kwargs=dict(kind="bucketed"))
    out[0]["trace"], out[0]["timeline"]     # rank 0's file, and labkit's own clock's spans

Each job traces its last step only (`steps - 1` steps run first, untraced: the first step opens
Gloo's connections and warms the allocator, which would dominate a one-step trace). Beside the
trace each returns labkit's own timeline of the traced step: spans {name, lane, start, end} in
seconds on labkit.timing's clock, from labkit.observe.timeline.Timeline and labkit.observe.commlog,
so the two views of one step can be set side by side.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.labs.ddp.verify import build_model, wrap
from labkit.launch import device
from labkit.model import GPT, GPTConfig, get_batch, shard_rows, tiny_corpus
from labkit.observe import commlog
from labkit.observe.timeline import Timeline
from labkit.pipeline import schedules
from labkit.pipeline.executor import DEFAULT_CFG, make_batch, run_schedule
from labkit.profiling.record import label, traced
from labkit.zero import ZeRO3

DDP_CFG = dict(n_layer=2, n_embd=64, n_head=4, block_size=32)
ZERO_CFG = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64)


def _labelled_step(tl, model, opt, x, y, finish=None):
    with tl.span("forward"), label("forward"):
        _, loss = model(x, y)
    with tl.span("backward"), label("backward"):
        loss.backward()
    if finish is not None:
        with tl.span("wait", lane="wait"):
            finish()
    with tl.span("optimizer"), label("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)


def ddp_job(folder=None, kind: str = "bucketed", steps: int = 2, batch: int = 8,
            bucket_mb: float = 0.05, cfg: dict = DDP_CFG) -> dict:
    """DDP (labkit.ddp's `kind`, or "torch") on this rank; the last step traced. Timeline:
    forward, backward, wait, optimizer on "compute"; each bucket's all-reduce on "comm", from
    its launch to the end of its future (labkit.ddp's own records)."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    torch.set_num_threads(1)         # ranks share a few cores: one thread each
    tl = Timeline(dev)
    model = build_model(cfg, seed=0, dtype="float32").to(dev)
    ddp = wrap(kind, model, bucket_mb=bucket_mb, timeline=None if kind == "torch" else tl)
    opt = torch.optim.SGD(ddp.module.parameters(), lr=1e-3)
    finish = getattr(ddp, "finish_gradient_synchronization", None)
    x, y = get_batch(tiny_corpus(), batch * world, cfg["block_size"], 0)       # (B, T)
    x, y = shard_rows(x, rank, world).to(dev), shard_rows(y, rank, world).to(dev)
    for _ in range(steps - 1):
        _labelled_step(Timeline(dev), ddp, opt, x, y, finish)
    launches = getattr(ddp, "launches", [])
    first = len(launches)
    dist.barrier()
    tl.reset()
    with traced(folder) as where:
        _labelled_step(tl, ddp, opt, x, y, finish)
    spans = tl.events + [dict(name=r["name"], lane="comm", start=r["start"], end=r["end"])
                         for r in launches[first:]]
    return {"rank": rank, "trace": str(where.path), "timeline": spans,
            "buckets": len(getattr(ddp, "buckets", []))}


def zero3_job(folder=None, steps: int = 2, batch: int = 4, cfg: GPTConfig = ZERO_CFG,
              prefetch: bool = False) -> dict:
    """ZeRO-3 (labkit.zero.ZeRO3, AdamW; prefetch= its option) on this rank; the last step
    traced. Timeline: forward, backward, optimizer on "compute"; every collective observe.commlog
    logged on "comm"."""

    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    torch.set_num_threads(1)
    model = GPT(cfg, seed=0).to(dev)
    zero = ZeRO3(model, torch.optim.AdamW, lr=1e-3, **({"prefetch": True} if prefetch else {}))
    x, y = get_batch(tiny_corpus(), batch * world, cfg.block_size, 0)          # (B, T)
    x, y = shard_rows(x, rank, world).to(dev), shard_rows(y, rank, world).to(dev)

    class _Opt:          # ZeRO3 steps and zeroes its own shards
        step, zero_grad = zero.step, staticmethod(lambda set_to_none=True: zero.zero_grad())

    for _ in range(steps - 1):
        _labelled_step(Timeline(dev), model, _Opt, x, y)
    dist.barrier()
    tl = Timeline(dev)
    with commlog.record() as log, traced(folder) as where:
        _labelled_step(tl, model, _Opt, x, y)
    spans = tl.events + [dict(name=f"{e.op} {e.where}", lane="comm", start=e.start - tl.t0,
                              end=(e.end or e.start) - tl.t0) for e in log.events]
    return {"rank": rank, "trace": str(where.path), "timeline": spans}


def pipeline_job(folder=None, schedule: str = "1f1b", K: int = 4, v: int = 1, batch: int = 8,
                 pad=(0.004, 0.008), cfg=None) -> dict:
    """One pipeline step (labkit.pipeline.executor) on this stage, traced after one untraced
    step. Timeline: the executor's own action spans (F, B, W) on labkit's clock."""

    cfg = cfg or DEFAULT_CFG
    torch.set_num_threads(1)
    s = schedules.make(schedule, dist.get_world_size(), K, v)
    model = GPT(cfg, seed=0).to(device())
    x, y = make_batch(batch, cfg)
    run_schedule(s, model, x, y, pad=pad)                 # warm-up: connections opened
    model.zero_grad(set_to_none=True)
    dist.barrier()
    with traced(folder) as where:
        out = run_schedule(s, model, x, y, pad=pad)
    spans = [dict(name=f"{e['kind']}{e['mb']}", lane="compute", start=e["start"], end=e["end"],
                  stage=e["stage"]) for e in out["timeline"]]
    return {"rank": dist.get_rank(), "trace": str(where.path), "timeline": spans}
