"""fp16 under ZeRO: labkit.zero.ShardedLossScaler skips the same steps on every rank (an inf in
one rank's shard is enough), and ZeRO-3 with an fp16 or bf16 policy equals PyTorch's FSDP2 with
the same policy (fp16: with its ShardedGradScaler) step for step, skipped steps and scales
included. The 50-step curves against the fp32 reference are chapter 03's (too slow for here)."""
import pytest
import torch

from labkit.launch import run
from labkit.zero.train import TINY

STEPS = 6


def _overflow_on_one_rank(stage: int) -> dict:
    """Two steps; on the first, rank 1 alone puts an inf in a gradient it holds before the step."""
    import torch.distributed as dist

    from labkit.model import GPT, get_batch, shard_rows, tiny_corpus
    from labkit.zero import ShardedLossScaler
    from labkit.zero.scaling import grads_before_step
    from labkit.zero.train import make_stage

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
    from labkit.zero.tracking import CURVE_MODEL, policy_curves

    return {"overflow": {st: _overflow_on_one_rank(st) for st in (0, 1, 2, 3)},
            "curves": policy_curves(CURVE_MODEL, steps=STEPS)}


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
