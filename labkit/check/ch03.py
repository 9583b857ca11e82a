"""Checkers for chapter 03 (ZeRO and FSDP), and the assertions tests/test_zero.py shares.

    labkit.check.ch03.model_state_bytes(my_fn)   # 3.1  bytes per GPU under a ZeRO stage
    labkit.check.ch03.zero2_optimizer(MyZeRO2)   # 3.2  a whole ZeRO-2 optimizer (ch03_zero2)
    labkit.check.ch03.held_and_sent(my_fn)       # 3.3  predict bytes held and sent, then measure

3.2 (labkit.check.ch03_zero2) checks values against one process, optimizer-state and gradient
bytes by storage size, the bytes each step sent, counted by the kernel (labkit.netcount), against
the optimum 2(N-1)/N Ψ plus Gloo's message headers (HEADER_BYTES per message step), the reductions
per backward against the bucket count, silence under no_sync(), and a state_dict round trip.
3.3 grades a prediction of the bytes one rank holds (params, grads, optimizer states, fp32
AdamW) and sends per step against labkit.costs and against labkit.zero's stages run on real
processes (tensor sizes of what each rank keeps; bytes sent counted by the kernel, so always on
Gloo), within 5%.
"""
from __future__ import annotations

import math

from labkit.check import Checker, fail, tensors_close, graded

EXERCISES = {
    "3.1": ("model-state bytes per GPU under ZeRO", 2),
    "3.2": ("a ZeRO-2 optimizer: buckets, flat shards, no_sync, a sharded state_dict", 7),
    "3.3": ("predict what a ZeRO rank holds and sends, then measure it", 3),
}

# fp32 on CPU: the sharded runs differ from one process only in the order of additions in the
# reduction, amplified a little by Adam's division by sqrt(v): 1e-4 relative, 5e-5 absolute.
RTOL, ATOL = 1e-4, 5e-5
# Gloo's per-message cost on the wire: 48-byte headers and ready-to-receive notices, under 300
# bytes per rank per ring step (tests/test_netcount.py, tests/test_zero.py)
HEADER_BYTES = 300


# ----------------------------------------------------------------------------- shared assertions
def assert_matches_reference(results, ref, what="parameters", rtol=RTOL, atol=ATOL) -> None:
    """Every rank's full parameters equal the one-process reference's."""
    for rank, res in enumerate(results):
        for name, expected in ref["params"].items():
            if name not in res["params"]:
                fail(f"rank {rank} has no parameter {name!r}")
            tensors_close(res["params"][name], expected, rtol=rtol, atol=atol,
                          what=f"rank {rank}'s {name} after {len(ref['losses'])} steps ({what})")


def assert_ranks_agree(results) -> None:
    """All ranks hold bitwise the same parameters (they were all-gathered from one update)."""
    for rank, res in enumerate(results[1:], 1):
        for name, t in res["params"].items():
            if not (t == results[0]["params"][name]).all():
                fail(f"rank {rank}'s {name} differs from rank 0's: after the step every rank must "
                     f"hold the same parameters (all-gather the updated shards)")


def assert_state_sharded(result, world: int) -> None:
    """The optimizer keeps state for ceil(numel/N) elements of each parameter, and has some."""
    pairs = result["state_numel"]
    if not any(n for _, n in pairs):
        fail("the optimizer holds no state: call optimizer.step() on the shards")
    total = sum(n for _, n in pairs)
    bound = math.ceil(result["numel"] / world) + len(pairs)
    if total > bound:
        fail(f"the optimizer keeps state for {total} elements per rank; with {world} ranks and "
             f"{result['numel']} parameters a shard is at most about {bound}")


def predicted_held(numel: int, stage: int, world: int) -> dict:
    """labkit.costs.memory's prediction of what a rank keeps, fp32 params/grads, Adam m and v."""
    from labkit.costs import memory

    fp32_adam = memory.Precision("fp32 Adam", 4, 4, 8)
    ms = memory.model_states(numel, recipe=fp32_adam, zero_stage=stage, dp=world)
    return {"params": ms.params, "grads": ms.grads, "optimizer": ms.optimizer}


def assert_held_bytes(held: dict, numel: int, n_tensors: int, stage: int, world: int) -> None:
    """Measured bytes per rank = prediction, up to the padding (< N elements per tensor)."""
    pred = predicted_held(numel, stage, world)
    for part, want in pred.items():
        slack = 4 * world * n_tensors * (2 if part == "optimizer" else 1)
        got = held[part]
        if not (want - 1e-6 <= got <= want + slack):
            fail(f"ZeRO-{stage} at {world} ranks holds {got:.0f} bytes of {part}; the model "
                 f"predicts {want:.0f} (+ at most {slack} of padding): this stage does not "
                 f"shard its {part} as it claims")


# ----------------------------------------------------------------------------- 3.1
@graded("3.1")
def model_state_bytes(fn):
    """fn(n_params, stage, dp, weights, grads, optimizer) -> bytes per GPU."""
    from labkit.costs import memory

    c = Checker("3.1", EXERCISES["3.1"][0], EXERCISES["3.1"][1])
    cases = [("13B, stage 0, 12-byte recipe", (13e9, 0, 1, 2, 2, 8)),
             ("13B, ZeRO-2 over 8, 12-byte recipe", (13e9, 2, 8, 2, 2, 8)),
             ("13B, ZeRO-3 over 8, 12-byte recipe", (13e9, 3, 8, 2, 2, 8)),
             ("7B, ZeRO-1 over 64, 16-byte recipe", (7e9, 1, 64, 2, 2, 12)),
             ("70B, ZeRO-2 over 3, 18-byte recipe", (70e9, 2, 3, 2, 4, 12))]
    for name, (n, stage, dp, w, g, o) in cases:
        with c.case(name):
            got = fn(n, stage, dp, w, g, o)
            want = memory.model_states(n, recipe=memory.Precision("r", w, g, o), zero_stage=stage,
                                       dp=dp).total
            if not isinstance(got, (int, float)):
                fail(f"return a number of bytes, got {type(got).__name__}")
            if not math.isclose(got, want, rel_tol=1e-9):
                which = ["nothing", "the optimizer states", "optimizer states and gradients",
                         "everything"][stage]
                fail(f"got {got / 1e9:.4g} GB, expected {want / 1e9:.4g} GB: stage {stage} "
                     f"divides {which} by dp={dp}")
    return c.finish()


def assert_optimal_traffic(results, world: int, numels) -> None:
    """Each rank sent at most 2(N-1)/N of the padded Ψ (fp32) per step, plus headers for one
    reduce-scatter and one all-gather per parameter tensor (numels: their sizes). Where the
    kernel cannot count (NCCL: "sent" is None) there is nothing to check."""
    from labkit.zero.shard import chunk_size

    padded = sum(world * chunk_size(n, world) for n in numels)
    optimum = 2 * (world - 1) / world * padded * 4
    slack = 2 * len(numels) * (world - 1) * HEADER_BYTES
    for rank, res in enumerate(results):
        if res.get("sent") is None:
            return
        if res["sent"] > optimum + slack:
            fail(f"rank {rank} sent {res['sent']:,} bytes in one step (counted by the kernel); "
                 f"a reduce-scatter + all-gather sends {optimum:,.0f} (+ at most {slack:,} of "
                 f"message headers): {res['sent'] / optimum:.2f}x the optimum. An all-reduce "
                 f"sends twice a reduce-scatter's bytes, and so does Gloo's own "
                 f"dist.reduce_scatter_tensor: use a ring reduce-scatter "
                 f"(labkit.collectives.ring_reduce_scatter, chapter 01)")


# ----------------------------------------------------------------------------- 3.2
@graded("3.2")
def zero2_optimizer(cls, launched=None):
    """Exercise 3.2 (labkit.check.ch03_zero2): the reader's ZeRO-2 optimizer at 2, 3, 4 ranks."""
    from labkit.check.ch03_zero2 import zero2_optimizer as check

    return check(cls, launched)


# ----------------------------------------------------------------------------- 3.3
# (stage, world): the first shown, the rest hidden
HELD_CASES = [(2, 3), (3, 2), (1, 4)]
HELD_TOLERANCE = 0.05
_MEASURED: dict = {}   # (stage, world) -> per-rank results: labkit's run does not depend on fn
PARTS = ("params", "grads", "optimizer", "sent")


def _held_job(stage):
    from labkit.zero.measure import LAB_MODEL
    from labkit.zero.train import sharded_train

    res = sharded_train(stage, LAB_MODEL, "adamw", steps=1, batch_size=12)
    return {**res["held"], "sent": res["sent"], "numel": res["numel"],
            "reason": res["wire_reason"]}


def costs_held(n_params, stage, world) -> dict:
    """labkit.costs' answer for fp32 AdamW (4 + 4 + 8 bytes per parameter), fp32 on the wire."""
    from labkit.costs import zero as costs_zero

    out = predicted_held(n_params, stage, world)
    out["sent"] = costs_zero.comm_per_rank(n_params, stage, world, bytes_per_value=4)["total"]
    return out


def _held_hint(key, ratio, stage, world) -> str:
    near = lambda x: abs(ratio - x) <= HELD_TOLERANCE * x  # noqa: E731
    if key == "sent":
        if stage == 3 and near(2 / 3):
            return ("ZeRO-3 frees the full parameters after forward: what must happen before "
                    "backward can use them again?")
        if near(2.0):
            return "Only what this rank SENDS, not sent + received."
        if near(0.5) or (stage == 3 and near(1 / 3)):
            return "A reduce-scatter of the gradients AND an all-gather of the parameters."
        return "On a ring of N ranks, what share of a buffer does each rank send per collective?"
    if near(world):
        return f"Stage {stage} shards the {key}: each rank keeps 1/{world} of them."
    if near(1 / world):
        return f"Does stage {stage} shard the {key}, or does every rank keep all of them?"
    return f"How many bytes per parameter are {key} in fp32 AdamW, and which stage splits them?"


@graded("3.3")
def held_and_sent(fn):
    """Exercise 3.3: fn(n_params, stage, world) -> {"params", "grads", "optimizer", "sent"}:
    bytes one rank holds after a step (fp32 AdamW) and sends per step."""
    from labkit.launch import run
    from labkit.model import GPT
    from labkit.zero.measure import LAB_MODEL

    c = Checker("3.3", *EXERCISES["3.3"])
    n = sum(p.numel() for p in GPT(LAB_MODEL).parameters())
    for i, (stage, world) in enumerate(HELD_CASES):
        with c.case(f"ZeRO-{stage}, {world} ranks" if i == 0 else f"hidden case {i}"):
            got = fn(n, stage, world)
            if not (isinstance(got, dict) and all(isinstance(got.get(k), (int, float))
                                                  for k in PARTS)):
                fail('return {"params": B, "grads": B, "optimizer": B, "sent": B}, numbers')
            res = _MEASURED.get((stage, world)) or run(_held_job, world, (stage,), timeout=90,
                                                        echo=False, backend="gloo")
            _MEASURED[(stage, world)] = res
            if any(r["sent"] is None for r in res):
                fail(f"the kernel cannot count this backend's bytes ({res[0]['reason']})")
            measured = {k: max(r[k] for r in res) for k in PARTS}
            want = costs_held(n, stage, world)
            if i == 0:                      # predicted beside measured, in the table
                c.cases[-1]["name"] += "".join(
                    f"\n      {k}: predicted {got[k] / 1e3:.1f} KB, measured "
                    f"{measured[k] / 1e3:.1f} KB, labkit.costs {want[k] / 1e3:.1f} KB"
                    for k in PARTS)
            for k in PARTS:
                if abs(want[k] / measured[k] - 1) > HELD_TOLERANCE:
                    fail(f"labkit.costs says {want[k]:,.0f} B of {k}, measured {measured[k]:,} "
                         "B: the checker disagrees with itself (please report it)")
                ratio = got[k] / measured[k]
                if abs(ratio - 1) > HELD_TOLERANCE:
                    fail(f"{k}: predicted {got[k]:,.0f} B, measured {measured[k]:,.0f} B "
                         f"({ratio:.2f}x). " + _held_hint(k, ratio, stage, world))
    return c.finish()
