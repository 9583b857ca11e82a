"""Checkers for chapter 03 (ZeRO and FSDP), and the assertions tests/test_zero.py shares.

    labkit.check.ch03.model_state_bytes(my_fn)   # 3.1  bytes per GPU under a ZeRO stage
    labkit.check.ch03.zero1_step(my_step)        # 3.2  the ZeRO-1 optimizer step

3.2 also checks the bytes the step sent, counted by the kernel (labkit.netcount), against the
optimum 2(N-1)/N Ψ plus Gloo's message headers (HEADER_BYTES per message step): a step that
all-reduces, or uses Gloo's own reduce-scatter (all-reduce bytes), sends about 1.5x and fails.
"""
from __future__ import annotations

import math

from labkit.check import Checker, fail, tensors_close

EXERCISES = {
    "3.1": ("model-state bytes per GPU under ZeRO", 2),
    "3.2": ("the ZeRO-1 optimizer step", 4),
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


# ----------------------------------------------------------------------------- 3.2
def _zero1_job(step_fn, optimizer):
    from labkit.zero.train import TINY, sharded_train

    return sharded_train(1, TINY, optimizer, steps=3, step_fn=step_fn)


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


def zero1_step(fn):
    """fn(params, shards, optimizer, group) performs one ZeRO-1 step on every rank."""
    from labkit.model import GPT
    from labkit.zero.train import TINY, reference_train

    c = Checker("3.2", EXERCISES["3.2"][0], EXERCISES["3.2"][1])
    last = None
    for world, opt in [(2, "sgd"), (3, "adamw")]:
        with c.case(f"{world} ranks, {opt}: 3 steps equal one process"):
            ref = reference_train(TINY, opt, steps=3)
            results = c.launch(_zero1_job, world, args=(fn, opt))
            assert_matches_reference(results, ref, what=f"ZeRO-1 with {opt} on {world} ranks")
            assert_ranks_agree(results)
            last = (world, results)
    with c.case("each rank's optimizer state covers only its shard"):
        if last is None:
            fail("the runs above failed, so there is no state to inspect")
        world, results = last
        for res in results:
            assert_state_sharded(res, world)
    with c.case("bytes sent per step: a reduce-scatter and an all-gather, not more "
                "(counted by the kernel)"):
        if last is None:
            fail("the runs above failed, so there is no traffic to inspect")
        world, results = last
        assert_optimal_traffic(results, world, [p.numel() for p in GPT(TINY).parameters()])
    return c.finish()
