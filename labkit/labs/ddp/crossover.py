"""Measure where a DDP step turns communication-bound: the pieces of costs.hiding.dp, on real ranks.

Rank side only (call inside labkit.launch.run). Three measurements on the same processes, so
they share the machine's load:
  matmul_rate  FLOP/s of the model's own matmul shapes (q, k, v, o, the MLP's two) at a number
               of tokens: the C of costs.hiding.
  sweep        BucketedDDP steps at several per-rank batches, in interleaved rounds, read from
               labkit's own clocks (the DDP's Timeline and its launch records): forward,
               backward, wait (exposed communication: after backward, until the last bucket is
               reduced), the step, and the all-reduces' busy time (the union of their launch-to-
               completion intervals).
  batches, rotated_rounds   each rank's data and the interleaved timed rounds, shared with
               labkit.labs.zero.crossover's ZeRO-3 sweep.
The all-reduce's alpha and bandwidth come from labkit.labs.intro's timing and fit (the lab).
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from labkit import roofline
from labkit.ddp.bucketed import BucketedDDP
from labkit.labs.ddp.verify import build_model
from labkit.launch import device
from labkit.model import get_batch, tiny_corpus
from labkit.observe.timeline import Timeline

# wide enough that a backward's matmuls, not Python, set its time near the crossover
WIDE = dict(n_layer=2, n_embd=512, n_head=8, block_size=8)


def matmul_shapes(cfg: dict) -> list:
    """(in, out) of every matmul in one block of the GPT: q, k, v, o projections and the MLP."""
    h = cfg["n_embd"]
    f = cfg.get("ffn_mult", 4) * h
    return [(h, h)] * 4 + [(h, f), (f, h)]


def matmul_rate(cfg: dict, tokens: int, repeats: int = 5) -> float:
    """FLOP/s of one block's matmuls at `tokens` rows (float32), the median of `repeats` rounds."""
    xs, ws, flops = roofline.matmul_operands(matmul_shapes(cfg), tokens, device())
    return flops / statistics.median(roofline.time_matmuls(xs, ws, repeats))


def busy(launches) -> float:
    """Seconds during which at least one all-reduce was in flight (union of the intervals)."""
    total, cur = 0.0, None
    for start, end in sorted((r["start"], r["end"]) for r in launches):
        if cur is None or start > cur[1]:
            total += 0.0 if cur is None else cur[1] - cur[0]
            cur = [start, end]
        else:
            cur[1] = max(cur[1], end)
    return total + (cur[1] - cur[0] if cur else 0.0)


def batches(rows, block_size: int, dev) -> dict:
    """{b: this rank's (x, y)} for each batch of b sequences of block_size tokens."""
    tokens = tiny_corpus()
    return {b: [t.to(dev) for t in get_batch(tokens, b, block_size, step=dist.get_rank())]
            for b in rows}                                                     # (b, T) each


def rotated_rounds(step, data: dict, timeline, rounds: int, warmup: int) -> dict:
    """step(x, y) per batch of `data`, each after a barrier and timeline.reset(): `warmup` untimed
    calls per batch, then `rounds` rounds over every batch, the batches rotated across rounds so
    drifting load hits every batch alike. Returns {b: [step's result per round]}."""
    def once(b):
        dist.barrier()
        timeline.reset()
        return step(*data[b])

    order = list(data)
    for b in order:
        for _ in range(warmup):
            once(b)
    out = {b: [] for b in order}
    for r in range(rounds):
        for b in order[r % len(order):] + order[:r % len(order)]:
            out[b].append(once(b))
    return out


def sweep(cfg: dict, rows, *, bucket_mb: float = 4.0, rounds: int = 5, warmup: int = 1) -> dict:
    """One timed BucketedDDP step per (round, per-rank batch), batches rotated across rounds so
    drifting load hits every batch alike. Returns {"params", "grad_bytes", "buckets", "steps":
    {rows: [{forward, backward, wait, optimizer, step, comm, launches} per round]}}, seconds."""
    dev = device()
    model = build_model(cfg, seed=0, dtype="float32").to(dev)
    tl = Timeline(dev)
    ddp = BucketedDDP(model, bucket_mb=bucket_mb, timeline=tl)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = batches(rows, cfg["block_size"], dev)

    def step(x, y):
        del ddp.launches[:]
        with tl.span("forward"):
            _, loss = ddp(x, y)
        with tl.span("backward"):
            loss.backward()
        with tl.span("wait"):
            ddp.finish_gradient_synchronization()
        with tl.span("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        spans = {e["name"]: e["end"] - e["start"] for e in tl.events
                 if e["name"] in ("forward", "backward", "wait", "optimizer")}
        return dict(spans, step=tl.events[-1]["end"], comm=busy(ddp.launches),
                    launches=len(ddp.launches))

    out = rotated_rounds(step, data, tl, rounds, warmup)
    params = [p for p in model.parameters() if p.requires_grad]
    return {"params": sum(p.numel() for p in params),
            "grad_bytes": sum(p.numel() * p.element_size() for p in params),
            "buckets": len(ddp.buckets), "steps": out}
