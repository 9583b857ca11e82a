"""Mixed precision and fp16 under ZeRO: labkit.zero.ShardedLossScaler skips the same steps on every
rank (an inf in one rank's shard is enough); ZeRO-3 with an fp16 or bf16 policy equals PyTorch's
FSDP2 with the same policy (fp16: with its ShardedGradScaler) step for step, skipped steps and
scales included; ZeRO-1 and ZeRO-2 with the bf16 policy (a bf16 model, fp32 master shards) equal
ZeRO-3's, and hold the bytes the calculator's recipes say. The 50-step curves against the fp32
reference are chapter 03's (too slow for here)."""
import dataclasses
import math

import pytest
import torch

from labkit.costs import memory
from labkit.labs.zero.train import TINY
from labkit.launch import run
from labkit.model import GPT
from labkit.zero.precision import MixedPrecisionPolicy

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
UNTIED = dataclasses.replace(TINY, tie_weights=False)

STEPS = 6


def _overflow_on_one_rank(stage: int) -> dict:
    """Two steps; on the first, rank 1 alone puts an inf in a gradient it holds before the step."""
    import torch.distributed as dist

    from labkit.labs.zero.train import make_stage
    from labkit.model import GPT, get_batch, shard_rows, tiny_corpus
    from labkit.zero import ShardedLossScaler
    from labkit.zero.scaling import grads_before_step

    rank, world = dist.get_rank(), dist.get_world_size()
    model = GPT(TINY)
    zero = make_stage(stage, model, "adamw")
    scaler = ShardedLossScaler(init_scale=2.0**10)
    out = {"stepped": [], "scales": [], "changed": []}
    for step in range(2):
        x, y = get_batch(tiny_corpus(), 12, TINY.block_size, step)                # (B, T)
        x, y = shard_rows(x, rank, world), shard_rows(y, rank, world)
        before = [s.detach().clone() for s in zero.shards] if stage else \
            [p.detach().clone() for p in zero.params]
        scaler.scale_loss(model(x, y)[1]).backward()
        if step == 0 and rank == 1:
            next(g for g in grads_before_step(zero) if g is not None).view(-1)[0] = float("inf")
        out["stepped"].append(scaler.step(zero))
        zero.zero_grad()
        after = zero.shards if stage else zero.params
        out["changed"].append(any(not torch.equal(a, b) for a, b in zip(before, after)))
        out["scales"].append(scaler.scale)
    return out


def _everything():
    from labkit.labs.zero.tracking import CURVE_MODEL, policy_curves
    from labkit.labs.zero.train import sharded_train

    return {"overflow": {st: _overflow_on_one_rank(st) for st in (0, 1, 2, 3)},
            "curves": policy_curves(CURVE_MODEL, steps=STEPS),
            "bf16": {st: sharded_train(st, UNTIED, "adamw", steps=3, stage_kw=dict(mp_policy=BF16))
                     for st in (1, 2, 3)}}


@pytest.fixture(scope="module")
def runs():
    return run(_everything, 2, timeout=300, echo=False)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(runs, stage):
    for r in runs:
        o = r["overflow"][stage]
        assert o["stepped"] == [False, True]
        assert o["changed"] == [False, True]           # skipped: nothing moved, then it did
        assert o["scales"] == [2.0**9, 2.0**9]         # halved once, on every rank alike


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_policy_equals_fsdp2_step_for_step(runs, dtype):
    for r in runs:
        ours, torchs = r["curves"][("labkit", dtype)], r["curves"][("fsdp2", dtype)]
        assert ours["losses"] == torchs["losses"]       # bit-identical
        assert ours["scales"] == torchs["scales"]       # fp16: the same skips; bf16: none
    if dtype == "float16":      # 4.6 x 2^16 overflows fp16 in backward: step 0 skipped by both
        assert runs[0]["curves"][("labkit", dtype)]["skipped"] == 1
        assert runs[0]["curves"][("fsdp2", dtype)]["scales"][:2] == [2.0**16, 2.0**15]


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_bf16_equals_zero3_bf16(runs, stage):
    """The same casts (bf16 compute from fp32 masters, fp32 reduce): bit-identical masters and
    losses to ZeRO-3's policy, which equals FSDP2's."""
    for r in runs:
        ours, z3 = r["bf16"][stage], r["bf16"][3]
        assert ours["losses"] == z3["losses"]
        assert all(torch.equal(ours["params"][k], z3["params"][k]) for k in z3["params"])
        assert all(v.dtype == torch.float32 for v in ours["params"].values())   # the masters


@pytest.mark.parametrize("stage, recipe", [(1, (2, 2, 12)), (2, (2, 4, 12))])
def test_zero12_bf16_holds_the_recipes_bytes(runs, stage, recipe):
    """ZeRO-1: bf16 params and grads (2 + 2), fp32 master + m + v sharded (12/N): the ZeRO
    paper's mixed precision, 4Ψ + 12Ψ/N. ZeRO-2 reduces in fp32 into the shards: 2Ψ + 16Ψ/N."""
    params = list(GPT(UNTIED).parameters())
    psi = sum(p.numel() for p in params)
    c = sum(math.ceil(p.numel() / 2) for p in params)                # this rank's padded chunks
    ms = memory.model_states(psi, recipe=memory.Precision("bf16", *recipe), zero=stage,
                             dp=2)
    for r in runs:
        held = r["bf16"][stage]["held"]
        grads = 2 * psi if stage == 1 else 4 * c
        assert held == {"params": 2 * psi, "grads": grads, "optimizer": 12 * c}, held
        assert ms.total <= sum(held.values()) <= ms.total + 16 * 2 * len(params)


def test_zero12_policy_bad_input_is_a_clear_error():
    from labkit.zero import ZeRO1, ZeRO2

    for cls, kw, says in ((ZeRO1, dict(naive=True), "flat=True"),
                          (ZeRO2, dict(mp_policy=MixedPrecisionPolicy(
                              param_dtype=torch.bfloat16, output_dtype=torch.float32)),
                           "output_dtype")):
        kw = {"mp_policy": BF16, **kw}
        with pytest.raises(ValueError, match=says):
            cls(GPT(TINY).parameters(), torch.optim.SGD, lr=0.1, **kw)
