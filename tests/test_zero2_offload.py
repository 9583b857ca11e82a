"""ZeRO-2 with CPU offload (ZeRO-Offload, Ren et al. 2021, built on stage 2): equal to plain
PyTorch on one process with real training code (frozen, unused, groups, clipping, no_sync
accumulation) at 2 and 3 ranks; with a bf16 policy bit-identical to ZeRO-2 bf16 without offload;
bytes held, by storage, equal to labkit.costs.memory's offload_optimizer up to the padding.
One launch per world size runs everything."""
import math

import pytest
import torch

from labkit.costs import memory
from labkit.labs.zero.train import TINY, real_reference, sharded_train
from labkit.launch import run
from labkit.model import GPT
from labkit.zero.precision import MixedPrecisionPolicy

REAL = dict(freeze=("wpe.weight",), unused=True, groups=True)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _everything():
    train = dict(steps=2, accumulate=2, no_sync=True)
    out = {"offload": sharded_train(2, TINY, "adamw", stage_kw=dict(max_grad_norm=0.5,
                                                                     offload=True),
                                    **train, **REAL)}
    # ZeRO-1/2 cast the parameters they are given: weight_decay_groups keeps the frozen one
    # in (the optimizer skips it), so it is cast to bf16 with the rest and forward runs
    for name, kw in (("bf16", dict(mp_policy=BF16)), ("offload bf16", dict(mp_policy=BF16,
                                                                         offload=True))):
        out[name] = sharded_train(2, TINY, "adamw", stage_kw=dict(max_grad_norm=0.5, **kw),
                                  **train, **REAL)
    # given model.parameters() instead of groups, the frozen one is cast as well
    out["frozen bf16"] = sharded_train(2, TINY, "adamw", steps=1, freeze=("wpe.weight",),
                                       stage_kw=dict(mp_policy=BF16, offload=True))["losses"]
    for name, kw in (("held", dict(offload=True)), ("held bf16", dict(offload=True,
                                                                      mp_policy=BF16))):
        out[name] = sharded_train(2, TINY, "adamw", steps=1, stage_kw=kw)["held"]
    return out


@pytest.fixture(scope="module")
def runs():
    ref = real_reference(TINY, "adamw", steps=2, max_grad_norm=0.5, **REAL)
    return ref, {w: run(_everything, w, timeout=300, echo=False) for w in (2, 3)}


def _max_diff(a, b):
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("world", [2, 3])
def test_offload_equals_plain_pytorch(runs, world):
    ref, per_world = runs
    for r in per_world[world]:
        o = r["offload"]
        assert _max_diff(o["grads"], ref["grads"]) < 1e-6          # after clipping
        assert _max_diff(o["params"], ref["params"]) < 2e-5
        assert "wpe.weight" not in o["grads"] and "unused_head.weight" not in o["grads"]


@pytest.mark.parametrize("world", [2, 3])
def test_offload_bf16_is_bit_identical_to_bf16_on_the_device(runs, world):
    for r in runs[1][world]:
        a, b = r["bf16"], r["offload bf16"]
        assert _max_diff(a["params"], b["params"]) == 0
        assert _max_diff(a["grads"], b["grads"]) == 0
        assert a["losses"] == b["losses"]
        assert all(math.isfinite(x) for x in r["frozen bf16"] + a["losses"])
        assert "wpe.weight" not in a["grads"] and "unused_head.weight" not in a["grads"]


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_held_match_the_calculator(runs, world):
    params = {id(p): p for p in GPT(TINY).parameters()}.values()
    numel = sum(p.numel() for p in params)
    s = sum(math.ceil(p.numel() / world) for p in params)      # this rank's padded shards
    for r in runs[1][world]:
        # the device: the full parameters (4 or 2 bytes each); full gradients are freed once
        # reduced. The CPU: fp32 masters with Adam's m and v (12), the fp32 gradient shard (4).
        for name, w in (("held", 4), ("held bf16", 2)):
            held = r[name]
            assert held == {"params": w * numel, "grads": 0, "optimizer": 0,
                            "cpu_grads": 4 * s, "cpu_optimizer": 12 * s}, (name, held)
            ms = memory.model_states(numel, recipe=memory.Precision(name, w, 4, 12),
                                     zero=2, dp=world, offload_optimizer=True)
            assert ms.params == held["params"] and ms.grads == 0 and ms.optimizer == 0
            assert ms.cpu_total <= held["cpu_grads"] + held["cpu_optimizer"] \
                < ms.cpu_total + 16 * world * 30
