"""Exercise 2.2: bucketed DDP with overlap, the whole wrapper.

    labkit.check.ch02.bucketed_ddp(MyBucketedDDP)   # MyBucketedDDP(module, group, bucket_mb)

The initial broadcast, buckets, gradient hooks that launch each complete bucket's async all-reduce
in bucket order, no_sync, finish_gradient_synchronization. The class runs on real processes at
world sizes 2 and 3 and a hidden 4 (3 and 4 do not divide their batches) against one process
trained on the whole batch, with a frozen weight, a frozen bias and tied embeddings, under SGD
and AdamW and with no_sync accumulation. Every all-reduce is counted and timed against the moment
backward produced its last gradient (a dispatch mode in labkit.labs.ddp.verify, the same code the
tests use), and the bytes each rank sent during the steps are counted by the kernel
(observe.netcount) against the ring's 2(N-1)/N per gradient byte plus 5%. The reader's code may
not use labkit.ddp or torch's DistributedDataParallel.
"""
from __future__ import annotations

import torch

from labkit.check import Checker, Forbidden, fail, graded
from labkit.costs.comm import ring_bytes_sent_per_rank
from labkit.ddp import assign_buckets as reference_buckets
from labkit.labs.ddp.verify import (
    SMALL,
    assert_launches,
    assert_matches,
    build_model,
    spec,
    train_on_rank,
)
from labkit.observe import netcount
from labkit.reference import train

EXERCISE, TITLE, POINTS = "2.2", "bucketed DDP with overlap, the whole wrapper", 7
FORBIDDEN = Forbidden(("labkit.ddp", "torch.nn.parallel"),
                      frozenset({"DistributedDataParallel", "BucketedDDP"}),
                      why="that is the exercise done for you. Write it with torch.distributed "
                          "calls (and your own functions) only.")
BYTES_SLACK = 0.05          # over the ring's 2(N-1)/N: Gloo's few header bytes per message
HEADER_BYTES = 2048         # per all-reduce, absolute
DDP_TIMEOUT = 120.0         # seconds for a launch of several trainings on 2 busy cores
FROZEN = ("blocks.0.mlp.fc.weight", "blocks.0.attn.q_proj.bias")


def trainable_params():
    """The parameters DDP trains in this chapter's checks (two frozen, tied embeddings)."""
    return [p for p in build_model(SMALL, frozen=FROZEN).parameters() if p.requires_grad]


def _job(cls, configs, batch):
    """Rank side: train with the reader's class per config; the kernel counts the bytes this
    rank sent from the end of construction (after the initial broadcast) to the end of training."""

    reports = []
    for opt, mb, accum in configs:
        nets = []

        def factory(m, g, mb=mb, nets=nets):           # called in this turn, by train_on_rank
            ddp = cls(m, g, bucket_mb=mb)
            nets.append(netcount.socket_bytes().__enter__())
            return ddp
        report = train_on_rank(factory, optimizer=opt, batch=batch, frozen=FROZEN, accum=accum,
                               bucket_mb=mb)
        if nets:
            nets[-1].__exit__(None, None, None)
            report["sent"] = nets[-1].sent
        reports.append(report)
    return reports


def _assert_bytes(report, buckets, steps: int = 3) -> None:
    if report.get("sent") is None:
        return                                   # NCCL: no TCP counter sees it
    world = report["world"]
    best = steps * sum(ring_bytes_sent_per_rank("all_reduce", b, world) for b in buckets)
    allowed = best * (1 + BYTES_SLACK) + HEADER_BYTES * steps * len(buckets)
    if report["sent"] > allowed:
        fail(f"rank {report['rank']} sent {report['sent']:,} bytes in {steps} steps (the "
             f"kernel's count); {steps} steps of ring all-reduces of the gradient buckets need "
             f"{best:,.0f} (+{BYTES_SLACK:.0%} allowed). Is anything sent twice, or sent "
             f"that is not a gradient of a trainable parameter?")


def _assert_same_everywhere(reports) -> None:
    first = reports[0]["params"]
    for r in reports[1:]:
        if list(r["params"]) == list(first) and not all(
                torch.equal(first[k], r["params"][k]) for k in first):
            fail(f"after training, rank {r['rank']}'s weights differ from rank 0's. The ranks "
                 f"start from different random weights: what must the constructor do so that "
                 f"they all train rank 0's weights?")


DDP_CASES = [(2, 6), (3, 10), (4, 9)]        # (world, global batch); 3 and 4 do not divide it


@graded("2.2")
def bucketed_ddp(cls, cases=DDP_CASES, configs=None):
    """Run the reader's DDP class on real ranks; compare with one process; count all-reduces and
    the bytes on the wire."""

    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(cls))
    params = trainable_params()
    total = sum(p.numel() * p.element_size() for p in params) / 2**20
    several = total * 0.3
    full = [("sgd", several, 1), ("adamw", several, 1), ("sgd", 1e-6, 1), ("sgd", None, 1),
            ("sgd", several, 3)]
    for world, batch in cases:
        hidden = world == 4
        todo = configs or (full[:1] if hidden else full)
        reports, tried = None, False
        refs = {}
        for i, (opt, mb, accum) in enumerate(todo):
            buckets = reference_buckets(params, mb)
            n_buckets = len(buckets)
            label = ("hidden case" if hidden else
                     f"{world} ranks, {opt}, {n_buckets} bucket(s)"
                     + (f", accumulation x{accum} with no_sync" if accum > 1 else ""))
            with c.case(label + ": parameters equal one process on the whole batch"):
                if not tried:
                    tried = True
                    reports = c.launch(_job, world, args=(cls, todo, batch), timeout=DDP_TIMEOUT)
                if reports is None:
                    fail("did not run (see the first case of this world size)")
                if opt not in refs:
                    refs[opt] = train(*spec(optimizer=opt, batch=batch, frozen=FROZEN)).params
                _assert_same_everywhere([r[i] for r in reports])
                for rank_reports in reports:
                    assert_matches(rank_reports[i], refs[opt])
            with c.case(label + ": one all-reduce per bucket"
                        + (", some before backward ends" if n_buckets > 1 else "")
                        + ", bytes within the ring's"):
                if reports is None:
                    fail("did not run (see the case above)")
                for rank_reports in reports:
                    assert_launches(rank_reports[i], expected=n_buckets,
                                    overlapped=True if n_buckets > 1 else None)
                    _assert_bytes(rank_reports[i],
                                  [sum(p.numel() * p.element_size() for p in b) for b in buckets])
    return c.finish()
