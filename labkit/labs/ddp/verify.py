"""Train a DDP version on real ranks and compare it with one process: shared by the tests, the
exercise checker, the lab and the benchmark (so a checker can never test something else).

Inside a rank (labkit.launch.run):  report = train_on_rank("bucketed", steps=3, bucket_mb=0.01)
In the parent:                      assert_matches(report, train(*spec(steps=3)).params)

The reference is labkit.reference.train (spec() gives its model and TrainSpec); the comparison is
labkit.testing.compare_dicts, after a check of the parameters' names that says what to fix.
"""
from __future__ import annotations

import contextlib
import time

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from labkit.ddp.bucketed import BucketedDDP
from labkit.ddp.naive import NaiveDDP
from labkit.ddp.overlap import OverlapDDP
from labkit.launch import device
from labkit.model import GPTConfig, get_batch, shard_rows, tiny_corpus
from labkit.observe.dispatch import CollectiveLog
from labkit.reference import TrainSpec, build, make_optimizer
from labkit.testing import compare_dicts

SMALL = dict(n_layer=1, n_embd=16, n_head=2, block_size=16)  # fast enough for tests on 2 cores


def spec(cfg: dict = SMALL, *, steps: int = 3, batch: int = 6, optimizer: str = "sgd",
         frozen=(), dtype: str = "float64", seed: int = 0) -> tuple:
    """(GPTConfig, labkit.reference.TrainSpec) of a DDP run: float64 by default, so that ranks
    can be held to near-exact agreement with the reference (labkit.testing's table)."""
    return GPTConfig(**cfg), TrainSpec(steps=steps, batch=batch, optimizer=optimizer, seed=seed,
                                       data_seed=0, frozen=tuple(frozen), dtype=dtype)


def build_model(cfg: dict, seed: int = 0, frozen=(), dtype: str = "float64"):
    """The tiny GPT with the named parameters frozen (requires_grad=False)."""
    gpt, how = spec(cfg, frozen=frozen, dtype=dtype, seed=seed)
    return build(gpt, how)


def wrap(kind, model, group=None, bucket_mb: float | None = 25.0, timeline=None):
    """kind: 'naive' | 'overlap' | 'bucketed' | 'torch', or a callable (model, group) -> wrapper."""
    if callable(kind):
        return kind(model, group)
    if kind == "torch":
        return DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb or 1e4)
    extra = {"timeline": timeline} if timeline is not None else {}
    if kind == "naive":
        return NaiveDDP(model, group, **extra)
    if kind == "overlap":
        return OverlapDDP(model, group, **extra)
    if kind == "bucketed":
        return BucketedDDP(model, group, bucket_mb=bucket_mb, **extra)
    raise ValueError(f"unknown DDP kind {kind!r}: naive, overlap, bucketed or torch")


def _micro_batches(x, y, accum: int):
    return [(shard_rows(x, i, accum), shard_rows(y, i, accum)) for i in range(accum)]


def train_on_rank(kind="bucketed", cfg: dict = SMALL, *, steps: int = 3, batch: int = 6,
                  optimizer: str = "sgd", frozen=(), accum: int = 1, bucket_mb=25.0,
                  dtype: str = "float64", group=None, no_sync: bool = True) -> dict:
    """Run `steps` optimizer steps of DDP on this rank; return its parameters and, per step,
    the all-reduces it launched and how many of them started while backward was running.

    Ranks start from different weights (seed = rank) so the initial broadcast is tested. The
    loss of a rank is weighted by its share of the global batch, so uneven shards still give
    exactly the gradient of the whole batch. With no_sync=False each of the `accum` micro-batches
    is synchronised on its own (the communication that no_sync() saves)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if batch < world * accum:
        raise ValueError(f"batch={batch} is too small for world={world} x accum={accum}")
    dev = device()  # this rank's GPU under NCCL, else the CPU
    model = build_model(cfg, seed=rank, frozen=frozen, dtype=dtype).to(dev)
    ready = []  # when each gradient became ready; hooks registered first fire first
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: ready.append(time.perf_counter()))
    ddp = wrap(kind, model, group, bucket_mb)
    module = ddp.module
    finish = getattr(ddp, "finish_gradient_synchronization", lambda: None)
    opt = make_optimizer(optimizer, module.parameters())
    tokens, block = tiny_corpus(), module.config.block_size
    per_step = []
    with CollectiveLog() as counter:
        for step in range(steps):
            x, y = get_batch(tokens, batch, block, step)                     # (batch, T)
            first, windows = len(counter.times("all_reduce")), []
            ready.clear()
            for i, (xm, ym) in enumerate(_micro_batches(x, y, accum)):
                xl = shard_rows(xm, rank, world).to(dev)                        # (b, T)
                yl = shard_rows(ym, rank, world).to(dev)
                last = i == accum - 1
                ctx = ddp.no_sync() if no_sync and not last else contextlib.nullcontext()
                with ctx:
                    _, loss = ddp(xl, yl)
                    start = time.perf_counter()
                    (loss * (xl.shape[0] * world / batch)).backward()
                    windows.append((start, time.perf_counter()))
                if not no_sync and not last:
                    finish()
            finish()
            calls = counter.times("all_reduce")[first:]
            last_start, last_end = windows[-1]
            per_step.append({"allreduces": len(calls),
                             "during_backward": sum(last_start <= t < last_end for t in calls),
                             # strictly before the last gradient existed: real overlap
                             "before_last_grad": sum(t < max(ready) for t in calls) if ready else 0,
                             "in_no_sync": sum(t < windows[-1][0] for t in calls)})
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {"rank": rank, "world": world, "steps": per_step,
            "n_buckets": len(ddp.buckets) if hasattr(ddp, "buckets") else None,
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "param_names": [n for n, _ in ddp.named_parameters()],
            "state_keys": list(ddp.state_dict().keys())}


# ----------------------------------------------------------------------------- assertions
def _fail(hint: str):
    raise AssertionError(hint)  # a checker shows the message as the learner's hint


def assert_matches(report: dict, expected: dict, *, rtol=1e-7, atol=1e-9, what="") -> None:
    """Every parameter of a rank equals the reference (names, shapes, values)."""
    got = report["params"]
    if list(got) != list(expected):
        _fail(f"{what}rank {report['rank']}: parameter names {list(got)[:4]}... differ from the "
              f"wrapped model's {list(expected)[:4]}...; keep .module's names and order")
    compare_dicts(got, expected, rtol=rtol, atol=atol,
                  what=f"{what}rank {report['rank']}/{report['world']}, after training, parameter")


def assert_launches(report: dict, *, expected: int | None, overlapped: bool | None,
                    what="") -> None:
    """The all-reduces per step equal `expected` (None: any); with overlapped=True some start
    before backward produced its last gradient, with False none starts during backward."""
    for i, s in enumerate(report["steps"]):
        where = f"{what}rank {report['rank']}, step {i}: "
        if s["in_no_sync"]:
            _fail(where + f"{s['in_no_sync']} all-reduce(s) were launched inside no_sync(); "
                  "skip communication while accumulating")
        if expected is not None and s["allreduces"] != expected:
            _fail(where + f"{s['allreduces']} all-reduces were launched, expected {expected} "
                  "(one per bucket)")
        if overlapped and s["before_last_grad"] == 0:
            _fail(where + "no all-reduce started before backward finished; launch a bucket from "
                  "the gradient hook as soon as its last gradient is ready")
        if overlapped is False and s["during_backward"]:
            _fail(where + f"{s['during_backward']} all-reduce(s) started during backward; the "
                  "naive version communicates only after it")
