"""Exercise 2.1: assign gradients to buckets.

    labkit.check.ch02.assign_buckets(assign_buckets)   # (params, bucket_mb) -> [[param, ...], ...]

Last-registered parameter first; a bucket closes as soon as it holds bucket_mb MiB or more
(int(bucket_mb * 2**20) bytes, as PyTorch's bucket_cap_mb; None: one bucket): the book's one rule,
labkit.buckets, PyTorch's reducer's. Checked against those rules and against labkit.ddp's, on
the same input.
"""
from __future__ import annotations

from labkit import ddp
from labkit.check import Checker, Forbidden, fail, graded
from labkit.labs.ddp.verify import SMALL, build_model

EXERCISE, TITLE, POINTS = "2.1", "assign gradients to buckets", 2
FORBIDDEN = Forbidden(("labkit.ddp", "labkit.buckets", "torch.nn.parallel"),
                      frozenset({"DistributedDataParallel", "BucketedDDP",
                                 "_compute_bucket_assignment_by_size"}),
                      why="that is the exercise done for you. Write it with torch.distributed "
                          "calls (and your own functions) only.")
FROZEN = ("blocks.0.mlp.fc.weight", "blocks.0.attn.q_proj.bias")


def trainable_params():
    """The parameters DDP trains in this chapter's checks (two frozen, tied embeddings)."""
    return [p for p in build_model(SMALL, frozen=FROZEN).parameters() if p.requires_grad]


def _ids(buckets):
    return [[id(p) for p in b] for b in buckets]


@graded("2.1")
def assign_buckets(fn):
    """Check the reader's bucket assignment against the rules (and labkit's, on the same input)."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(fn))
    params = trainable_params()
    total = sum(p.numel() * p.element_size() for p in params)   # bytes
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
        mb = int(total * frac) / 2**20     # a whole number of bytes: mb * 2**20 is exact
        with c.case(f"bucket_mb={mb:.4f} ({frac:.0%} of all gradients)"):
            got, want = fn(params, mb), ddp.assign_buckets(params, mb)
            if _ids(got) != _ids(want):
                fail(f"got buckets of sizes {[len(b) for b in got]} parameters, expected "
                     f"{[len(b) for b in want]}. When exactly does a bucket close: before the next "
                     "parameter would pass the cap, or as soon as it holds the cap or more "
                     "(PyTorch's reducer)? Is a MiB 1e6 or 2**20 bytes?")
    with c.case("sizes are counted in bytes (float32 packs twice the elements of float64)"):
        p32 = [p.detach().float() for p in params]
        mb = int(sum(p.numel() * 4 for p in p32) * 0.3) / 2**20
        got, want = fn(p32, mb), ddp.assign_buckets(p32, mb)
        if _ids(got) != _ids(want):
            fail("with float32 tensors the buckets differ: do you count elements or bytes?")
    return c.finish()
