"""labkit.zero: every stage equals one process, shards what it claims, moves 2Ψ or 3Ψ; and
PyTorch's own FSDP2 / ZeroRedundancyOptimizer give the same parameters.

One launch per world size runs everything (process start-up is the expensive part)."""
import math

import pytest
import torch

from labkit.check import ch03
from labkit.costs import memory
from labkit.costs import zero as costs_zero
from labkit.launch import run
from labkit.model import GPT
from labkit.zero import chunk_size, padded_flat, shard_of
from labkit.zero.train import TINY, make_stage, reference_train, sharded_train

STEPS = 3


def _step_wrong(params, shards, optimizer, group=None):
    """A typical mistake: step with the SUM of the gradients over ranks, not their mean."""
    import torch.distributed as dist

    from labkit.zero import all_gather_full, reduce_scatter_mean

    n = dist.get_world_size(group)
    for p, s in zip(params, shards):
        s.grad = reduce_scatter_mean(p.grad, group) * n
    optimizer.step()
    with torch.no_grad():
        for p, s in zip(params, shards):
            p.copy_(all_gather_full(s, p.shape, group))


def _everything(world):
    from labkit.zero.fsdp import fsdp2_train, zero_redundancy_train

    out = {(st, opt): sharded_train(st, TINY, opt, steps=STEPS)
           for opt in ("sgd", "adamw") for st in range(4)}
    out["naive1"] = sharded_train(1, TINY, "adamw", steps=STEPS, naive=True)
    # gradients accumulated over 2 micro-batches before each step; ZeRO-2 with one bucket that
    # is sent only at the step, so every gradient accumulates while queued
    out[("accumulate", 2)] = sharded_train(2, TINY, "sgd", steps=STEPS, accumulate=2,
                                           stage_kw=dict(bucket_bytes=10**9))
    out[("accumulate", 3)] = sharded_train(3, TINY, "sgd", steps=STEPS, accumulate=2)
    out["wrong_step"] = sharded_train(1, TINY, "sgd", steps=STEPS, step_fn=_step_wrong)
    out["fsdp2"] = fsdp2_train(TINY, "adamw", steps=STEPS)
    out["zero_redundancy"] = zero_redundancy_train(TINY, "adamw", steps=STEPS)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def runs(request):
    world = request.param
    per_rank = run(_everything, world, args=(world,), timeout=180, echo=False)
    refs = {opt: reference_train(TINY, opt, steps=STEPS) for opt in ("sgd", "adamw")}
    return world, per_rank, refs


def _results(per_rank, key):
    return [r[key] for r in per_rank]


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_equals_one_process(runs, stage, opt):
    world, per_rank, refs = runs
    results = _results(per_rank, (stage, opt))
    ch03.assert_matches_reference(results, refs[opt], what=f"ZeRO-{stage}, {opt}, {world} ranks")
    ch03.assert_ranks_agree(results)


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_accumulation_equals_one_process(runs, stage):
    world, per_rank, refs = runs
    ch03.assert_matches_reference(_results(per_rank, ("accumulate", stage)), refs["sgd"],
                                  what=f"ZeRO-{stage}, 2 micro-batches per step")


def test_shared_assertions_fail_a_wrong_step(runs):
    world, per_rank, refs = runs
    with pytest.raises(AssertionError, match="differs at"):
        ch03.assert_matches_reference(_results(per_rank, "wrong_step"), refs["sgd"])


def test_model_state_checker_fails_wrong_code_with_a_hint():
    result = ch03.model_state_bytes(lambda n, s, dp, w, g, o: n * (w + g + o))
    assert result.cases[0]["passed"] and not result.passed
    assert "stage 2 divides optimizer states and gradients by dp=8" in result.cases[1]["message"]


def test_losses_are_the_global_loss(runs):
    world, per_rank, refs = runs
    for stage in range(4):
        local = [r[(stage, "adamw")]["losses"] for r in per_rank]
        mean = [sum(ls[i] for ls in local) / world for i in range(STEPS)]
        assert mean == pytest.approx(refs["adamw"]["losses"], rel=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_measured_bytes_match_the_memory_model(runs, stage):
    world, per_rank, _ = runs
    n_tensors = len(list(GPT(TINY).parameters()))
    for r in per_rank:
        res = r[(stage, "adamw")]
        ch03.assert_held_bytes(res["held"], res["numel"], n_tensors, stage, world)


def test_held_bytes_check_catches_a_stage_that_does_not_shard(runs):
    world, per_rank, _ = runs
    res = per_rank[0][(0, "adamw")]   # plain DP's bytes, claimed as ZeRO-2
    with pytest.raises(AssertionError, match="does not shard its grads"):
        ch03.assert_held_bytes(res["held"], res["numel"], 30, 2, world)


def test_optimizer_state_is_sharded(runs):
    world, per_rank, _ = runs
    for stage in (1, 2, 3):
        for r in per_rank:
            ch03.assert_state_sharded(r[(stage, "adamw")], world)
    with pytest.raises(AssertionError, match="keeps state for"):
        ch03.assert_state_sharded(per_rank[0][(0, "adamw")], world)


def test_traffic_is_2psi_for_stages_0_to_2_and_3psi_for_stage_3(runs):
    world, per_rank, _ = runs
    model = GPT(TINY)
    psi = sum(p.numel() for p in model.parameters())
    padded = sum(world * chunk_size(p.numel(), world) for p in model.parameters())
    ring = (world - 1) / world * 4                      # bytes sent per value, one ring phase
    sent = {st: per_rank[0][(st, "adamw")]["sent"] for st in range(4)}
    assert sent[0]["all_reduce"] == pytest.approx(2 * ring * psi)
    for st in (1, 2):
        assert sent[st]["reduce_scatter"] == pytest.approx(ring * padded)
        assert sent[st]["all_gather"] == pytest.approx(ring * padded)
    # stage 3: two all-gathers and one reduce-scatter; the tied embedding is used by two units
    # (input embedding and output head), so it is gathered and reduced once more per use
    tied = world * chunk_size(TINY.vocab_size * TINY.n_embd, world)
    assert sent[3]["all_gather"] == pytest.approx(2 * ring * (padded + tied))
    assert sent[3]["reduce_scatter"] == pytest.approx(ring * (padded + tied))
    formula = costs_zero.comm_per_rank(psi, 3, world, bytes_per_value=4)["total"]
    assert sum(sent[3].values()) == pytest.approx(formula * (padded + tied) / psi)
    naive = per_rank[0]["naive1"]["sent"]
    assert sum(naive.values()) > 1.4 * sum(sent[1].values())      # 3Ψ vs 2Ψ


def test_pytorch_fsdp2_and_zero_redundancy_agree(runs):
    world, per_rank, refs = runs
    for key in ("fsdp2", "zero_redundancy"):
        ch03.assert_matches_reference(_results(per_rank, key), refs["adamw"], what=key)
    # ours and FSDP2 keep the same number of parameter elements per rank, up to padding
    ours = per_rank[0][(3, "adamw")]["held"]["params"] / 4
    fsdp2 = per_rank[0]["fsdp2"]["local_numel"]
    psi = per_rank[0][(3, "adamw")]["numel"]
    assert abs(ours - fsdp2) < 0.1 * psi / world


# ----------------------------------------------------------------------------- no processes
@pytest.mark.parametrize("numel, world", [(10, 3), (9, 3), (1, 4), (625, 2)])
def test_shards_cover_the_tensor_once(numel, world):
    t = torch.arange(numel, dtype=torch.float32)
    c = chunk_size(numel, world)
    assert padded_flat(t, world).numel() == world * c
    joined = torch.cat([shard_of(t, r, world) for r in range(world)])
    assert torch.equal(joined[:numel], t) and not joined[numel:].any()
    assert c == math.ceil(numel / world)


def test_bad_stage_is_named():
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3, got 5"):
        make_stage(5, GPT(TINY), "adamw")
    with pytest.raises(KeyError, match="sgd, adamw"):
        make_stage(1, GPT(TINY), "lamb")
