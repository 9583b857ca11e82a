"""Checkers for chapter 02: bucket assignment, and bucketed DDP with overlap.

The reader writes
    assign_buckets(params, bucket_mb) -> list of buckets (lists of parameters), last-registered
        parameter first, a new bucket when the next would pass bucket_mb MiB; None: one bucket
    MyBucketedDDP._grad_ready(self, p): the gradient hook that counts ready gradients and
        launches each complete bucket's async all-reduce, in bucket order
The DDP class runs on real processes at world sizes 2 and 3 (3 does not divide the batch of 7)
against one process trained on the whole batch, with a frozen weight, a frozen bias and tied
embeddings, under SGD and AdamW and with no_sync accumulation. Every dist.all_reduce call is
counted and timed against the moment backward produced its last gradient (labkit.ddp.verify,
the same code the tests use).
"""
from __future__ import annotations

from labkit.check import Checker, fail

EXERCISES = {
    "2.1": ("assign gradients to buckets", 3),
    "2.2": ("bucketed DDP with overlap", 7),
}

FROZEN = ("blocks.0.mlp.fc.weight", "blocks.0.attn.q_proj.bias")


def _params():
    from labkit.ddp.verify import SMALL, build_model

    return [p for p in build_model(SMALL, frozen=FROZEN).parameters() if p.requires_grad]


def _ids(buckets):
    return [[id(p) for p in b] for b in buckets]


def assign_buckets(fn):
    """Check the reader's bucket assignment against the rules (and labkit's, on the same input)."""
    from labkit import ddp

    c = Checker("2.1", EXERCISES["2.1"][0], EXERCISES["2.1"][1])
    params = _params()
    total = sum(p.numel() * p.element_size() for p in params) / 2**20
    with c.case("bucket_mb=None: one bucket, last-registered parameter first"):
        got = fn(params, None)
        if len(got) != 1:
            fail(f"got {len(got)} buckets for bucket_mb=None, expected 1")
        if _ids(got) != [[id(p) for p in reversed(params)]]:
            fail("the bucket should list the parameters in reverse registration order "
                 "(the order backward produces their gradients)")
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
                     f"{[len(b) for b in want]}: start a new bucket only when adding the next "
                     "parameter would pass bucket_mb * 2**20 bytes")
    with c.case("sizes are counted in bytes (float32 packs twice the elements of float64)"):
        p32 = [p.detach().float() for p in params]
        mb = sum(p.numel() * 4 for p in p32) / 2**20 * 0.3
        got, want = fn(p32, mb), ddp.assign_buckets(p32, mb)
        if _ids(got) != _ids(want):
            fail("with float32 tensors the buckets differ: size = numel() * element_size()")
    return c.finish()


def _job(factory, configs, batch):
    from labkit.ddp.verify import train_on_rank

    return [train_on_rank(lambda m, g, mb=mb: factory(m, g, bucket_mb=mb), optimizer=opt,
                          batch=batch, frozen=FROZEN, accum=accum, bucket_mb=mb)
            for opt, mb, accum in configs]


def bucketed_ddp(cls):
    """Run the reader's DDP class on real ranks; compare with one process; count all-reduces."""
    from labkit.ddp import assign_buckets as reference_buckets
    from labkit.ddp.verify import assert_launches, assert_matches, reference_train

    c = Checker("2.2", EXERCISES["2.2"][0], EXERCISES["2.2"][1])
    params = _params()
    total = sum(p.numel() * p.element_size() for p in params) / 2**20
    several = total * 0.3
    configs = [("sgd", several, 1), ("adamw", several, 1), ("sgd", 1e-6, 1), ("sgd", None, 1),
               ("sgd", several, 3)]
    for world, batch in [(2, 6), (3, 10)]:  # 10 rows: uneven over 3 ranks and 3 micro-batches
        reports = None
        with c.case(f"{world} ranks: it runs (frozen weight and bias, tied embeddings)"):
            reports = c.launch(_job, world, args=(cls, configs, batch))
        refs = {}
        for i, (opt, mb, accum) in enumerate(configs):
            n_buckets = len(reference_buckets(params, mb))
            label = (f"{world} ranks, {opt}, {n_buckets} bucket(s)"
                     + (f", accumulation x{accum} with no_sync" if accum > 1 else ""))
            with c.case(label + ": parameters equal one process on the whole batch"):
                if reports is None:
                    fail("did not run (see the first case of this world size)")
                if opt not in refs:
                    refs[opt] = reference_train(optimizer=opt, batch=batch, frozen=FROZEN)
                for rank_reports in reports:
                    assert_matches(rank_reports[i], refs[opt])
            with c.case(label + ": one all-reduce per bucket"
                        + (", some before backward ends" if n_buckets > 1 else "")):
                if reports is None:
                    fail("did not run (see the first case of this world size)")
                for rank_reports in reports:
                    assert_launches(rank_reports[i], expected=n_buckets,
                                    overlapped=True if n_buckets > 1 else None)
    return c.finish()
