"""The one bucket rule (labkit.buckets): PyTorch's reducer's, and the one DDP, ZeRO-2 and the
exercise checkers use. Parity with torch.distributed._compute_bucket_assignment_by_size (the
C++ compute_bucket_assignment_by_size of torch/csrc/distributed/c10d/reducer.cpp) on several
parameter lists; exercise 3.2's checker and labkit's ZeRO-2 agree on every one of its cases."""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from labkit import ddp
from labkit.buckets import assign_buckets, cap_bytes
from labkit.check.ch03 import zero2 as ch03_zero2
from labkit.check.ch03.zero2 import run as ch03_zero2_run
from labkit.launch import run
from labkit.model import GPT, get_batch, tiny_corpus
from labkit.zero import ZeRO2


def test_a_bucket_closes_once_it_holds_the_cap():
    assert assign_buckets([4, 4, 4, 100, 4], 8) == [[0, 1], [2, 3], [4]]
    assert assign_buckets([4, 4, 4], 12) == [[0, 1, 2]]        # reaching the cap closes it
    assert assign_buckets([4, 4, 4], 11) == [[0, 1, 2]]        # passing it by the last one too
    assert assign_buckets([4, 4, 4], 0) == [[0], [1], [2]]
    assert assign_buckets([4, 4, 4], None) == [[0, 1, 2]]
    assert assign_buckets([4, 4, 4, 4], 8, first_cap=4) == [[0], [1, 2], [3]]
    assert assign_buckets([4, 2, 4, 2], 6, keys="abab") == [[0, 2], [1, 3]]
    assert cap_bytes(25.0) == 25 * 2**20 and cap_bytes(None) is None
    with pytest.raises(ValueError, match="bucket_mb=0"):
        cap_bytes(0)
    with pytest.raises(ValueError, match="cap=-1"):
        assign_buckets([4], -1)


def _lists(seed: int, n: int) -> list:
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float64]
    return [[torch.empty(rng.randint(1, 300), dtype=rng.choice(dtypes if k % 2 else dtypes[:1]))
             for _ in range(rng.randint(1, 14))] for k in range(n)]


@pytest.mark.skipif(not hasattr(dist, "_compute_bucket_assignment_by_size"),
                    reason="this torch has no _compute_bucket_assignment_by_size")
def test_equals_torch_ddps_bucket_assignment():
    cases = 0
    for tensors in _lists(0, 60) + [list(GPT(ch03_zero2_run.config(None)).parameters())[::-1]]:
        sizes = [t.numel() * t.element_size() for t in tensors]
        keys = [(t.dtype, t.device) for t in tensors]
        for cap in (1, 64, 600, 4096, sum(sizes)):
            for first in (None, max(1, cap // 3)):
                limits = [cap] if first is None else [first, cap]
                theirs, _ = dist._compute_bucket_assignment_by_size(tensors, limits)
                ours = assign_buckets(sizes, cap, first_cap=first, keys=keys)
                assert ours == [list(b) for b in theirs], (sizes, limits)
                cases += 1
    assert cases == 61 * 10


def _zero2_buckets_job(worlds: dict) -> dict:
    """One rank: labkit's ZeRO-2 and DDP's assign_buckets on every case of exercise 3.2."""
    out = {}
    for world, (cfg_kwargs, _, cap) in worlds.items():
        cfg = ch03_zero2_run.config(cfg_kwargs)
        model = GPT(cfg, seed=0)
        params = list(model.parameters())
        zero = ZeRO2(params, torch.optim.AdamW, bucket_bytes=cap, lr=1e-3)
        x, y = get_batch(tiny_corpus(), 4, cfg.block_size, 0)
        model(x, y)[1].backward()
        in_backward = zero.reductions            # before step(): the buckets backward sent
        zero.step()
        index = {id(p): i for i, p in enumerate(params)}
        out[world] = {"zero2": zero.buckets, "in_backward": in_backward,
                      "after_step": zero.reductions,
                      "ddp": [[index[id(p)] for p in b]
                              for b in ddp.assign_buckets(params, cap / 2**20)]}
    return out


def test_exercise_3_2_checker_and_labkit_zero2_agree_on_every_case():
    got = run(_zero2_buckets_job, 1, args=(ch03_zero2.WORLDS,), timeout=120, echo=False)[0]
    assert sorted(got) == sorted(ch03_zero2.WORLDS)
    for world, (cfg_kwargs, _, cap) in ch03_zero2.WORLDS.items():
        nbytes = [4 * p.numel() for p in GPT(ch03_zero2_run.config(cfg_kwargs)).parameters()]
        want = ch03_zero2.buckets(nbytes, cap)
        assert got[world]["zero2"] == want, world
        assert got[world]["ddp"] == want, world
        # every bucket went in backward, one reduce-scatter each, none left for step()
        assert got[world]["in_backward"] == got[world]["after_step"] == len(want), world
    assert [len(ch03_zero2.buckets(
        [4 * p.numel() for p in GPT(ch03_zero2_run.config(c)).parameters()], cap))
        for c, _, cap in ch03_zero2.WORLDS.values()] == [7, 13, 4]
