"""Exercise 2.3: predict a DDP step's all-reduces and bytes, then measure them.

    labkit.check.ch02.predict_ddp_step(predict)   # (param_bytes, bucket_mb, world, accum,
                                                  #  no_sync) -> {"all_reduces", "bytes_sent"}

labkit's BucketedDDP trains a 108k-parameter GPT (fp32) for one optimizer step on real processes;
its all-reduces are counted by the dispatcher and its bytes by the kernel, and the reader's
prediction is graded exactly (all-reduces) and to 3% (bytes).
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist

from labkit.buckets import assign_buckets, cap_bytes
from labkit.check import Checker, Forbidden, fail, graded
from labkit.costs.comm import ring_bytes_sent_per_rank
from labkit.ddp import BucketedDDP
from labkit.labs.ddp.verify import build_model
from labkit.launch import device
from labkit.model import get_batch, shard_rows, tiny_corpus
from labkit.observe import netcount
from labkit.observe.dispatch import CollectiveLog

EXERCISE, TITLE, POINTS = "2.3", "predict a DDP step's all-reduces and bytes, then measure them", 3
DDP_TIMEOUT = 120.0         # seconds for a launch of several trainings on 2 busy cores
PREDICT_MODEL = dict(n_layer=2, n_embd=64, n_head=4, block_size=32)   # 108,288 parameters
# (world, bucket_mb, accumulation micro-batches, no_sync); one launch per world; 4 is hidden
PREDICT_CASES = [(3, [(0.5, 1, True), (0.1, 2, True), (None, 2, False)]),
                 (4, [(0.2, 3, False), (0.25, 2, True)])]
PREDICT_BATCH = 12
BYTES_TOLERANCE = 0.03


def predict_model_params():
    return [p for p in build_model(PREDICT_MODEL, dtype="float32").parameters()
            if p.requires_grad]


def _predict_job(runs):
    """Rank side: one optimizer step of labkit's BucketedDDP per run; all-reduces counted by the
    dispatcher, bytes by the kernel (both from outside the code under test)."""



    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    out = []
    for bucket_mb, accum, no_sync in runs:
        model = build_model(PREDICT_MODEL, dtype="float32").to(dev)
        ddp = BucketedDDP(model, bucket_mb=bucket_mb)
        x, y = (t.to(dev) for t in get_batch(tiny_corpus(), PREDICT_BATCH,
                                             PREDICT_MODEL["block_size"], 0))   # (B, T)
        dist.barrier()
        with netcount.socket_bytes() as net, CollectiveLog() as log:
            for i in range(accum):
                xm, ym = shard_rows(x, i, accum), shard_rows(y, i, accum)   # (b, T)
                last = i == accum - 1
                ctx = ddp.no_sync() if no_sync and not last else contextlib.nullcontext()
                with ctx:
                    ddp(shard_rows(xm, rank, world), shard_rows(ym, rank, world))[1].backward()
                if last or not no_sync:
                    ddp.finish_gradient_synchronization()
        out.append({"all_reduces": log.calls.count("all_reduce"), "bytes_sent": net.sent})
    return out


# the checker's own answer (labkit.costs' ring bytes over labkit.buckets' rule): a prediction
# that calls it predicts nothing (refused when read, and at run time under the grader)
ORACLE = Forbidden(("labkit.costs", "labkit.ddp", "labkit.buckets"),
                   why="predict it yourself: labkit.costs, labkit.ddp and labkit.buckets are the "
                       "checker's own answer")


def costs_prediction(param_bytes, bucket_mb, world, accum, no_sync) -> dict:
    """labkit.costs' answer over the book's bucket rule (labkit.buckets, last parameter first):
    ring bytes of every bucket, per sync."""
    order = list(reversed(param_bytes))
    sizes = [sum(order[i] for i in b) for b in assign_buckets(order, cap_bytes(bucket_mb))]
    syncs = 1 if no_sync else accum
    return {"all_reduces": syncs * len(sizes),
            "bytes_sent": syncs * sum(ring_bytes_sent_per_rank("all_reduce", b, world)
                                      for b in sizes)}


def _predict_hint(key, got, measured, world, accum, no_sync) -> str:
    said = f"{key}: predicted {got:,.0f}, measured {measured:,}. "
    if key == "all_reduces":
        return said + ("How many buckets does this cap make (the rule of 2.1)? And how many "
                       f"times does a step of {accum} micro-batch(es) synchronise "
                       f"{'with' if no_sync else 'without'} no_sync?")
    return said + (f"What fraction of each bucket's bytes does one rank send in a ring "
                   f"all-reduce over {world} ranks, and how many times per step?")


def _off(got, ref) -> float:
    """How far got is from ref, relative to ref."""
    return abs(got / ref - 1)


@graded("2.3")
def predict_ddp_step(fn, cases=PREDICT_CASES):
    """Exercise 2.3: fn(param_bytes, bucket_mb, world, accum, no_sync) -> {"all_reduces",
    "bytes_sent"} for one optimizer step, per rank."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(ORACLE.refusal(fn))
    param_bytes = [p.numel() * p.element_size() for p in predict_model_params()]
    for world, runs in cases:
        res, tried = None, False
        for i, (mb, accum, no_sync) in enumerate(runs):
            hidden = world == 4
            name = ("hidden case" if hidden else
                    f"{world} ranks, bucket_mb={mb}, {accum} micro-batch(es)"
                    + (", no_sync" if no_sync and accum > 1 else
                       ", every micro-batch synced" if accum > 1 else ""))
            with c.case(name):
                got = fn(list(param_bytes), mb, world, accum, no_sync)   # a stub stops here
                if not tried:
                    tried = True
                    res = c.measure(_predict_job, world, args=(runs,), timeout=DDP_TIMEOUT)
                if res is None:
                    fail("did not run (see the first case of this world size)")
                keys = ("all_reduces", "bytes_sent")
                if not (isinstance(got, dict) and all(isinstance(got.get(k), (int, float))
                                                      for k in keys)):
                    fail('return {"all_reduces": count, "bytes_sent": bytes}, numbers')
                measured = {"all_reduces": max(r[i]["all_reduces"] for r in res),
                            "bytes_sent": max(r[i]["bytes_sent"] or 0 for r in res)}
                if not hidden:
                    c.cases[-1]["name"] += "".join(
                        f"\n      {k}: predicted {got[k]:,.0f}, measured {measured[k]:,}"
                        for k in keys)
                want = costs_prediction(param_bytes, mb, world, accum, no_sync)
                sent = measured["bytes_sent"]  # 0 under NCCL (no kernel count): costs decide
                if want["all_reduces"] != measured["all_reduces"] or (
                        sent and _off(want["bytes_sent"], sent) > BYTES_TOLERANCE):
                    fail(f"labkit.costs says {want}, measured {measured}: the checker disagrees "
                         f"with itself (please report)")
                if got["all_reduces"] != measured["all_reduces"]:
                    fail(_predict_hint("all_reduces", got["all_reduces"],
                                       measured["all_reduces"], world, accum, no_sync))
                if sent and _off(got["bytes_sent"], sent) > BYTES_TOLERANCE:
                    fail(_predict_hint("bytes_sent", got["bytes_sent"], measured["bytes_sent"],
                                       world, accum, no_sync))
                if not sent and _off(got["bytes_sent"], want["bytes_sent"]) > BYTES_TOLERANCE:
                    fail(_predict_hint("bytes_sent", got["bytes_sent"], want["bytes_sent"],
                                       world, accum, no_sync))
    return c.finish()
