"""Chapter 03's shared assertions (ZeRO's values, sharding, bytes held and sent), used by its
exercises 3.2 and 3.3 and by tests/test_zero.py.
"""
from __future__ import annotations

import math

from labkit.check import fail, tensors_close
from labkit.costs import memory
from labkit.flat import chunk_size

# reduction, amplified a little by Adam's division by sqrt(v): 1e-4 relative, 5e-5 absolute.
RTOL, ATOL = 1e-4, 5e-5
# Gloo's per-message cost on the wire: 48-byte headers and ready-to-receive notices, under 300
# bytes per rank per ring step (tests/test_netcount.py, tests/test_zero.py)
HEADER_BYTES = 300


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


def predicted_held(numel: int, zero: int, world: int) -> dict:
    """labkit.costs.memory's prediction of what a rank keeps, fp32 params/grads, Adam m and v."""

    fp32_adam = memory.Precision("fp32 Adam", 4, 4, 8)
    ms = memory.model_states(numel, recipe=fp32_adam, zero=zero, dp=world)
    return {"params": ms.params, "grads": ms.grads, "optimizer": ms.optimizer}


def assert_held_bytes(held: dict, numel: int, n_tensors: int, zero: int, world: int) -> None:
    """Measured bytes per rank = prediction, up to the padding (< N elements per tensor)."""
    pred = predicted_held(numel, zero, world)
    for part, want in pred.items():
        slack = 4 * world * n_tensors * (2 if part == "optimizer" else 1)
        got = held[part]
        if not (want - 1e-6 <= got <= want + slack):
            fail(f"ZeRO-{zero} at {world} ranks holds {got:.0f} bytes of {part}; the model "
                 f"predicts {want:.0f} (+ at most {slack} of padding): this stage does not "
                 f"shard its {part} as it claims")



def assert_optimal_traffic(results, world: int, numels) -> None:
    """Each rank sent at most 2(N-1)/N of the padded Ψ (fp32) per step, plus headers for one
    reduce-scatter and one all-gather per parameter tensor (numels: their sizes). Where the
    kernel cannot count (NCCL: "sent" is None) there is nothing to check."""

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
