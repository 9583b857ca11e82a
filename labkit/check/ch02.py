"""Checkers for chapter 02: bucket assignment, bucketed DDP with overlap, and a prediction of a
DDP step's all-reduces and bytes, measured.

The reader writes
    assign_buckets(params, bucket_mb) -> list of buckets (lists of parameters), last-registered
        parameter first, a new bucket when the next would pass bucket_mb MiB; None: one bucket
    MyBucketedDDP(module, group, bucket_mb): the whole wrapper (initial broadcast, buckets,
        gradient hooks that launch each complete bucket's async all-reduce in bucket order,
        no_sync, finish_gradient_synchronization)
    predict_ddp_step(param_bytes, bucket_mb, world, accum, no_sync) -> {"all_reduces",
        "bytes_sent"} of one optimizer step
The DDP class runs on real processes at world sizes 2 and 3 and a hidden 4 (3 and 4 do not divide
their batches) against one process trained on the whole batch, with a frozen weight, a frozen bias
and tied embeddings, under SGD and AdamW and with no_sync accumulation. Every all-reduce is
counted and timed against the moment backward produced its last gradient (a dispatch mode in
labkit.ddp.verify, the same code the tests use), and the bytes each rank sent during the steps
are counted by the kernel (labkit.netcount) against the ring's 2(N-1)/N per gradient byte plus
5%. The reader's code may not use labkit.ddp or torch's DistributedDataParallel.

2.3: labkit's BucketedDDP trains a 108k-parameter GPT (fp32) for one optimizer step on real
processes; its all-reduces are counted by the dispatcher and its bytes by the kernel, and the
reader's prediction is graded exactly (all-reduces) and to 3% (bytes).

Long because: the notebook imports one checker module per chapter; 2.2's wrapper checks and
2.3's counted run share the model, the batches and the byte bound.
"""
from __future__ import annotations

from labkit.check import Checker, fail, graded
from labkit.check.ch02_crossover import EXERCISE as CROSSOVER, crossover_batch  # noqa: F401 (2.4)

EXERCISES = {
    "2.1": ("assign gradients to buckets", 2),
    "2.2": ("bucketed DDP with overlap, the whole wrapper", 7),
    "2.3": ("predict a DDP step's all-reduces and bytes, then measure them", 3),
    "2.4": CROSSOVER,
}

FORBIDDEN = ("labkit.ddp", "torch.nn.parallel")
FORBIDDEN_NAMES = ("DistributedDataParallel", "BucketedDDP")
BYTES_SLACK = 0.05          # over the ring's 2(N-1)/N: Gloo's few header bytes per message
HEADER_BYTES = 2048         # per all-reduce, absolute
DDP_TIMEOUT = 120.0         # seconds for a launch of several trainings on 2 busy cores


def _refusal(objs) -> str:
    from labkit.check.guards import forbidden_used

    bad = forbidden_used(objs, FORBIDDEN, FORBIDDEN_NAMES)
    return (f"your code uses {', '.join(bad)}: that is the exercise done for you. Write it with "
            f"torch.distributed calls (and your own functions) only.") if bad else ""


FROZEN = ("blocks.0.mlp.fc.weight", "blocks.0.attn.q_proj.bias")


def _params():
    from labkit.ddp.verify import SMALL, build_model

    return [p for p in build_model(SMALL, frozen=FROZEN).parameters() if p.requires_grad]


def _ids(buckets):
    return [[id(p) for p in b] for b in buckets]


@graded("2.1")
def assign_buckets(fn):
    """Check the reader's bucket assignment against the rules (and labkit's, on the same input)."""
    from labkit import ddp

    c = Checker("2.1", EXERCISES["2.1"][0], EXERCISES["2.1"][1])
    params = _params()
    total = sum(p.numel() * p.element_size() for p in params) / 2**20
    refuse = _refusal([fn])
    if refuse:
        with c.case("your own bucket assignment"):
            fail(refuse)
        return c.finish()
    with c.case("bucket_mb=None: one bucket, last-registered parameter first"):
        got = fn(params, None)
        if len(got) != 1:
            fail(f"got {len(got)} buckets for bucket_mb=None, expected 1")
        if _ids(got) != [[id(p) for p in reversed(params)]]:
            fail("the bucket lists the parameters in another order. In which order does "
                 "backward produce the gradients, roughly?")
    with c.case("a tiny bucket_mb gives one parameter per bucket"):
        got = fn(params, 1e-6)
        if len(got) != len(params):
            fail(f"got {len(got)} buckets for bucket_mb=1e-6, expected {len(params)}: a "
                 "parameter bigger than the cap still gets a bucket of its own")
    for frac in (0.3, 0.55):
        mb = total * frac
        with c.case(f"bucket_mb={mb:.4f} ({frac:.0%} of all gradients)"):
            got, want = fn(params, mb), ddp.assign_buckets(params, mb)
            if _ids(got) != _ids(want):
                fail(f"got buckets of sizes {[len(b) for b in got]} parameters, expected "
                     f"{[len(b) for b in want]}. When exactly does a bucket close: when it has "
                     "passed the cap, or when the next parameter WOULD pass it? Is a MiB 1e6 "
                     "or 2**20 bytes?")
    with c.case("sizes are counted in bytes (float32 packs twice the elements of float64)"):
        p32 = [p.detach().float() for p in params]
        mb = sum(p.numel() * 4 for p in p32) / 2**20 * 0.3
        got, want = fn(p32, mb), ddp.assign_buckets(p32, mb)
        if _ids(got) != _ids(want):
            fail("with float32 tensors the buckets differ: do you count elements or bytes?")
    return c.finish()


def _job(cls, configs, batch):
    """Rank side: train with the reader's class per config; the kernel counts the bytes this
    rank sent from the end of construction (after the initial broadcast) to the end of training."""
    from labkit import netcount
    from labkit.ddp.verify import train_on_rank

    reports = []
    for opt, mb, accum in configs:
        nets = []

        def factory(m, g, mb=mb):
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
    from labkit.costs.comm import ring_bytes_sent_per_rank

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
    import torch

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
    from labkit.ddp import assign_buckets as reference_buckets
    from labkit.ddp.verify import assert_launches, assert_matches, reference_train

    c = Checker("2.2", EXERCISES["2.2"][0], EXERCISES["2.2"][1])
    params = _params()
    total = sum(p.numel() * p.element_size() for p in params) / 2**20
    several = total * 0.3
    full = [("sgd", several, 1), ("adamw", several, 1), ("sgd", 1e-6, 1), ("sgd", None, 1),
            ("sgd", several, 3)]
    refuse = _refusal([cls])
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
                if refuse:
                    fail(refuse)
                if not tried:
                    tried = True
                    reports = c.launch(_job, world, args=(cls, todo, batch), timeout=DDP_TIMEOUT)
                if reports is None:
                    fail("did not run (see the first case of this world size)")
                if opt not in refs:
                    refs[opt] = reference_train(optimizer=opt, batch=batch, frozen=FROZEN)
                _assert_same_everywhere([r[i] for r in reports])
                for rank_reports in reports:
                    assert_matches(rank_reports[i], refs[opt])
            with c.case(label + ": one all-reduce per bucket"
                        + (", some before backward ends" if n_buckets > 1 else "")
                        + ", bytes within the ring's"):
                if refuse or reports is None:
                    fail("did not run (see the case above)")
                for rank_reports in reports:
                    assert_launches(rank_reports[i], expected=n_buckets,
                                    overlapped=True if n_buckets > 1 else None)
                    _assert_bytes(rank_reports[i],
                                  [sum(p.numel() * p.element_size() for p in b) for b in buckets])
    return c.finish()


# ----------------------------------------------------------------------------- 2.3
PREDICT_MODEL = dict(n_layer=2, n_embd=64, n_head=4, block_size=32)   # 108,288 parameters
# (world, bucket_mb, accumulation micro-batches, no_sync); one launch per world; 4 is hidden
PREDICT_CASES = [(3, [(0.5, 1, True), (0.1, 2, True), (None, 2, False)]),
                 (4, [(0.2, 3, False), (0.25, 2, True)])]
PREDICT_BATCH = 12
BYTES_TOLERANCE = 0.03


def predict_model_params():
    from labkit.ddp.verify import build_model

    return [p for p in build_model(PREDICT_MODEL, dtype="float32").parameters()
            if p.requires_grad]


def _predict_job(runs):
    """Rank side: one optimizer step of labkit's BucketedDDP per run; all-reduces counted by the
    dispatcher, bytes by the kernel (both from outside the code under test)."""
    import contextlib

    import torch.distributed as dist

    from labkit import netcount
    from labkit.check.guards import CollectiveLog
    from labkit.ddp import BucketedDDP
    from labkit.ddp.verify import build_model
    from labkit.launch import device
    from labkit.model import get_batch, shard_rows, tiny_corpus

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


def costs_prediction(param_bytes, bucket_mb, world, accum, no_sync) -> dict:
    """labkit.costs' answer over labkit's bucket rule: ring bytes of every bucket, per sync."""
    from labkit.costs.comm import ring_bytes_sent_per_rank

    sizes, cur = [], 0
    cap = float("inf") if bucket_mb is None else bucket_mb * 2**20
    for b in reversed(param_bytes):
        if cur and cur + b > cap:
            sizes.append(cur)
            cur = 0
        cur += b
    sizes.append(cur)
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


@graded("2.3")
def predict_ddp_step(fn, cases=PREDICT_CASES):
    """Exercise 2.3: fn(param_bytes, bucket_mb, world, accum, no_sync) -> {"all_reduces",
    "bytes_sent"} for one optimizer step, per rank."""
    c = Checker("2.3", *EXERCISES["2.3"])
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
                    res = c.launch(_predict_job, world, args=(runs,), timeout=DDP_TIMEOUT)
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
                if want["all_reduces"] != measured["all_reduces"] or (
                        measured["bytes_sent"] and abs(want["bytes_sent"] /
                                                       measured["bytes_sent"] - 1) > BYTES_TOLERANCE):
                    fail(f"labkit.costs says {want}, measured {measured}: the checker disagrees "
                         f"with itself (please report)")
                if got["all_reduces"] != measured["all_reduces"]:
                    fail(_predict_hint("all_reduces", got["all_reduces"],
                                       measured["all_reduces"], world, accum, no_sync))
                if measured["bytes_sent"] and abs(got["bytes_sent"] / measured["bytes_sent"] - 1) \
                        > BYTES_TOLERANCE:
                    fail(_predict_hint("bytes_sent", got["bytes_sent"], measured["bytes_sent"],
                                       world, accum, no_sync))
                if not measured["bytes_sent"] and abs(got["bytes_sent"] / want["bytes_sent"] - 1) \
                        > BYTES_TOLERANCE:        # NCCL: no kernel count, labkit.costs decides
                    fail(_predict_hint("bytes_sent", got["bytes_sent"], want["bytes_sent"],
                                       world, accum, no_sync))
    return c.finish()
