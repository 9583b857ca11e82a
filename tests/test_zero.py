"""labkit.zero: every stage equals one process, shards what it claims, moves 2Ψ or 3Ψ; and
PyTorch's own FSDP2 / ZeroRedundancyOptimizer give the same parameters.

One launch per world size runs everything (process start-up is the expensive part)."""
import math

import pytest
import torch

from labkit.check import ch03
from labkit.flat import chunk_size, padded_flat, shard_of
from labkit.labs.zero.measure import LAB_MODEL, moved_numel, predicted_sent
from labkit.labs.zero.train import TINY, make_stage, sharded_train
from labkit.launch import run
from labkit.model import GPT
from labkit.reference import TrainSpec, train

STEPS = 3


def _step_wrong(params, shards, optimizer, group=None):
    """A typical mistake: step with the SUM of the gradients over ranks, not their mean."""
    import torch.distributed as dist

    from labkit.flat import all_gather_full, reduce_scatter_mean

    n = dist.get_world_size(group)
    for p, s in zip(params, shards):
        s.grad = reduce_scatter_mean(p.grad, group) * n
    optimizer.step()
    with torch.no_grad():
        for p, s in zip(params, shards):
            p.copy_(all_gather_full(s, p.shape, group))


def _reduce_scatter_paths():
    """labkit's ring and the backend's reduce-scatter give the same chunk (odd sizes too)."""
    import torch.distributed as dist

    from labkit.flat import reduce_scatter_algorithm, reduce_scatter_sum

    n, out = dist.get_world_size(), {"algorithm": reduce_scatter_algorithm()}
    for c in (1, 7, 1000):
        flat = torch.randn(n * c, generator=torch.Generator().manual_seed(dist.get_rank()))
        ring = reduce_scatter_sum(flat, algorithm="ring")
        backend = reduce_scatter_sum(flat, algorithm="backend")
        out[c] = (ring - backend).abs().max().item()
    return out


def _everything(world):
    from labkit.labs.zero.fsdp import fsdp2_train, zero_redundancy_train

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
    out["rs_paths"] = _reduce_scatter_paths()
    return out


@pytest.fixture(scope="module", params=[2, 3, 4])
def runs(request):
    world = request.param
    per_rank = run(_everything, world, args=(world,), timeout=180, echo=False)
    refs = {opt: train(TINY, TrainSpec(steps=STEPS, batch=12, optimizer=opt)).as_dict()
            for opt in ("sgd", "adamw")}
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


def test_bytes_sent_counted_by_the_kernel_match_labkit_costs(runs):
    """2(N-1)/N Ψ for stages 0-2, 3(N-1)/N Ψ for stage 3: counted by the kernel's socket
    counters (observe.netcount), not by the code under test. The only excess allowed is Gloo's
    message headers: under 300 bytes per rank per ring step (48-byte headers and ready-to-receive
    notices, measured in tests/test_netcount.py); on this tiny model that is up to 6%."""
    world, per_rank, _ = runs
    for st in range(4):
        want = predicted_sent(TINY, st, world)
        for rank, r in enumerate(per_rank):
            res = r[(st, "adamw")]
            assert res["sent"] is not None, res["wire_reason"]
            steps = sum(calls * (world - 1) * (2 if op == "all_reduce" else 1)
                        for op, (calls, _) in res["logged"].items())
            assert want <= res["sent"] <= want + 300 * steps, (
                f"ZeRO-{st}, rank {rank} of {world}: the kernel counted {res['sent']} bytes "
                f"sent, labkit.costs predicts {want:.0f} (+ headers of {steps} ring steps)")
    naive = per_rank[0]["naive1"]["sent"]
    assert naive > 1.4 * per_rank[0][(1, "adamw")]["sent"]          # 3Ψ vs 2Ψ


def test_exercise_traffic_check_passes_a_ring_step_and_fails_an_all_reduce(runs):
    """Checker 3.2's kernel-counted bound: the optimum plus headers, not 1.5x."""
    world, per_rank, _ = runs
    numels = [p.numel() for p in GPT(TINY).parameters()]
    ch03.assert_optimal_traffic([r[(1, "adamw")] for r in per_rank], world, numels)
    with pytest.raises(AssertionError, match="x the optimum"):
        ch03.assert_optimal_traffic([r["naive1"] for r in per_rank], world, numels)


def test_every_collective_goes_through_the_comm_log(runs):
    """The log sees one call per collective with its payload: what labkit.costs.parallel and
    the timelines read (the bytes on the wire are the kernel's count above)."""
    world, per_rank, _ = runs
    logged = {st: per_rank[0][(st, "adamw")]["logged"] for st in range(4)}
    def grads(st):   # no has-grad flags: find_unused_parameters=False
        return 4 * moved_numel(TINY, st, world)
    assert logged[0] == {"all_reduce": [1, grads(0)]}
    for st in (1, 2):
        assert logged[st]["reduce_scatter"][1] == grads(st)
        assert logged[st]["all_gather"] == [1, 4 * moved_numel(TINY, st, world)]
    units = logged[3]["reduce_scatter"][0]
    assert logged[3]["all_gather"] == [2 * units, 2 * 4 * moved_numel(TINY, 3, world)]
    assert not {"send", "recv"} & set(logged[2]), "the ring's messages are logged twice"


def test_ring_reduce_scatter_is_used_on_gloo_and_equals_the_backend(runs):
    world, per_rank, _ = runs
    for r in per_rank:
        assert r["rs_paths"]["algorithm"] == "ring"
        assert max(v for k, v in r["rs_paths"].items() if k != "algorithm") < 1e-5


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


# ---------------------------------------------------------------- real training code (issue 16)
REAL = dict(freeze=("wpe.weight",), unused=True, groups=True)


def _real(world):
    """Every stage with a frozen parameter, an unused head, the tied embedding, two parameter
    groups, clipping by the global norm, and 2 micro-batches (with and without no_sync)."""
    out = {}
    for st in range(4):
        out[st] = sharded_train(st, TINY, "adamw", steps=2, stage_kw=dict(max_grad_norm=0.5),
                                accumulate=2, no_sync=st >= 2, **REAL)
    out["sgd_unused"] = sharded_train(0, TINY, "sgd", steps=2, unused=True)
    return out


@pytest.fixture(scope="module")
def real_runs():
    from labkit.labs.zero.train import real_reference

    refs = {"adamw": real_reference(TINY, "adamw", steps=2, max_grad_norm=0.5, **REAL),
            "sgd": real_reference(TINY, "sgd", steps=2, unused=True)}
    return refs, {w: run(_real, w, args=(w,), timeout=240, echo=False) for w in (2, 3, 4)}


def _max_diff(a, b):
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_real_model_every_stage_equals_plain_pytorch(real_runs, world, stage):
    refs, runs = real_runs
    for rank_out in runs[world]:
        o = rank_out[stage]
        assert _max_diff(o["grads"], refs["adamw"]["grads"]) < 1e-6     # after clipping
        assert _max_diff(o["params"], refs["adamw"]["params"]) < 2e-5
    # frozen and unused parameters: no gradient, unchanged, no optimizer state
    assert "wpe.weight" not in o["grads"] and "unused_head.weight" not in o["grads"]
    with_state = [(n, s) for n, s in o["state_numel"] if s]
    assert all(n == s for n, s in with_state)    # state for what the rank updates (sharded:
    #                                               test_optimizer_state_is_sharded)
    assert len(with_state) == len(refs["adamw"]["grads"])     # the unused head: none yet
    assert len(o["state_numel"]) == len(refs["adamw"]["grads"]) + 2   # frozen wpe: not there


def test_unused_parameter_is_not_moved_by_momentum(real_runs):
    """A zero gradient is not "no gradient": SGD momentum would move the parameter."""
    refs, runs = real_runs
    for world in (2, 3, 4):
        o = runs[world][0]["sgd_unused"]
        assert _max_diff(o["params"], refs["sgd"]["params"]) < 2e-5


def _bad_inputs():
    from labkit.zero import DataParallel, ZeRO1

    p = torch.nn.Parameter(torch.ones(3))
    errors = []
    for params in ([p, p], [{"params": [p]}, {"params": [p], "lr": 1.0}],
                   [p, torch.nn.Parameter(torch.ones(2, device="meta"))]):
        for cls in (DataParallel, ZeRO1):
            try:
                cls(params, torch.optim.SGD, lr=0.1)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
    q = torch.nn.Parameter(torch.ones(3))             # never used: no gradient
    try:
        DataParallel([q], torch.optim.SGD, lr=0.1).step()
        errors.append(None)
    except RuntimeError as e:
        errors.append(str(e))
    return errors


def test_bad_input_is_a_clear_error():
    errors = run(_bad_inputs, 2, timeout=60, echo=False)[0]
    assert all(e is not None for e in errors), errors
    assert "registered twice" in errors[0] and "registered twice" in errors[2]
    assert "different devices" in errors[4]
    assert "find_unused_parameters=True" in errors[6]    # not silently a zero gradient


def test_accumulation_no_sync_trades_bytes_sent_for_full_gradients_held():
    """ZeRO-2/3 with 4 micro-batches: reduce-scatter every micro-batch sends 3 more
    reduce-scatters (kernel-counted) but holds ~Ψ/N of gradients; no_sync holds all Ψ (by
    storage) and sends one. ZeRO-3 unsharded across the micro-batches (FSDP2's
    set_reshard_after_backward(False) with no_sync) gathers once per step instead of 2k times and
    holds every whole parameter meanwhile."""
    from labkit.labs.zero.measure import accumulation_tradeoff

    world, k = 2, 4
    out = run(accumulation_tradeoff, world, kwargs=dict(micro_batches=k), timeout=200,
              echo=False)
    for r in out:
        for stage in (2, 3):
            every, quiet = r[(stage, "every")], r[(stage, "no_sync")]
            full = 4 * every["numel"]                                   # fp32 Ψ
            rs = (world - 1) / world * full                             # one ring reduce-scatter
            assert quiet["peak_grad_bytes"] >= full
            assert every["peak_grad_bytes"] < 0.8 * full
            if every["sent"] is not None:
                saved = every["sent"] - quiet["sent"]
                assert (k - 1) * rs <= saved <= 1.05 * (k - 1) * rs, (stage, saved, rs)
    r = out[0]
    quiet, kept = r[(3, "no_sync")], r[(3, "unsharded")]
    # parameters kept whole across the micro-batches: the same step, gathered once, not 2k times
    gather = (world - 1) / world * moved_numel(LAB_MODEL, 3, world) * 4      # one ring all-gather
    for name, value in quiet["params"].items():
        assert torch.equal(kept["params"][name], value), name
    if quiet["sent"] is not None:
        saved = quiet["sent"] - kept["sent"]
        assert 2 * (k - 1) * gather <= saved <= 1.05 * 2 * (k - 1) * gather, (saved, gather)
    full = 4 * moved_numel(LAB_MODEL, 3, world)
    assert kept["peak_full_param_bytes"] >= full > 2 * quiet["peak_full_param_bytes"]


def _overlapped(world):
    from labkit.observe import commlog

    out = {}
    for stage in (1, 2):
        for opt in ("sgd", "adamw"):
            out[(stage, opt)] = sharded_train(stage, TINY, opt, steps=STEPS,
                                              overlap_param_gather=True)
    with commlog.record() as log:          # one more step: where the gathers complete
        sharded_train(2, TINY, "sgd", steps=2, overlap_param_gather=True)
    out["events"] = [(e.op, e.where) for e in log.events]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_overlapped_param_gather_equals_one_process(world):
    """ZeRO-1/2 with the parameter all-gather posted after the step and waited for in the next
    forward (Megatron's --overlap-param-gather): the same parameters as one process, the same
    gathers (one per module, posted asynchronously, not one blocking gather after the step)."""
    per_rank = run(_overlapped, world, args=(world,), timeout=180, echo=False)
    refs = {opt: train(TINY, TrainSpec(steps=STEPS, batch=12, optimizer=opt)).as_dict()
            for opt in ("sgd", "adamw")}
    for stage in (1, 2):
        for opt in ("sgd", "adamw"):
            results = [r[(stage, opt)] for r in per_rank]
            ch03.assert_matches_reference(results, refs[opt],
                                          what=f"ZeRO-{stage} overlapped gather, {opt}, {world}")
    events = per_rank[0]["events"]
    overlapped = [w for op, w in events if w == "ZeRO params, overlapped"]
    assert overlapped and all(op == "all_gather" for op, w in events if w == overlapped[0])
    assert not any(w == "ZeRO-2 params" for _, w in events)     # no blocking gather left
