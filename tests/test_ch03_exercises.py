"""Chapter 03's exercises 3.2 (a ZeRO-2 optimizer) and 3.3 (predict bytes held and sent): a
reference answer scores full marks, known-wrong answers lose the right cases with the hint that
says why. Most wrong answers run at 2 ranks only (WORLDS narrowed) to keep the launches few."""
import math
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit.check import ch03, ch03_zero2
from labkit.collectives import ring_reduce_scatter

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks get these classes by value


class ZeRO2:
    """The reference; class attributes switch on one known mistake each (subclasses below)."""
    reduce = "ring"          # "ring" | "all_reduce" | "backend" (Gloo's reduce_scatter_tensor)
    mean = True              # False: the sum over ranks where the mean belongs
    in_backward = True       # False: ZeRO-1's timing, everything reduced in step()
    free_grad = True         # False: p.grad kept after its reduce-scatter
    floor_chunks = False     # c = numel // N: the last elements belong to nobody
    local_norm = False       # clip by this rank's shard norm instead of the global one

    def __init__(self, params, group=None, max_grad_norm=None, **adamw_kwargs):
        self.params, self.group, self.max_norm = list(params), group, max_grad_norm
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.shards = []
        for p in self.params:
            c = p.numel() // world if self.floor_chunks else math.ceil(p.numel() / world)
            flat = torch.zeros(max(world * c, p.numel()), dtype=p.dtype, device=p.device)
            flat[:p.numel()] = p.detach().reshape(-1)
            p.data = flat[:p.numel()].view(p.shape)
            shard = flat[rank * c:(rank + 1) * c].requires_grad_(True)      # (c,)
            self.shards.append(shard)
            if self.in_backward:
                p.register_post_accumulate_grad_hook(self._make_hook(shard))
        self.optimizer = torch.optim.AdamW(self.shards, **adamw_kwargs)

    def _reduce(self, p, shard):
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        c = shard.numel()
        flat = torch.zeros(world * c, dtype=p.dtype, device=p.device)      # (N*c,)
        flat[:min(p.numel(), world * c)] = p.grad.reshape(-1)[:world * c]
        if self.reduce == "all_reduce":
            dist.all_reduce(flat, group=self.group)
            mine = flat[rank * c:(rank + 1) * c].clone()
        elif self.reduce == "backend":
            mine = flat.new_empty(c)
            dist.reduce_scatter_tensor(mine, flat, group=self.group)
        else:
            mine = ring_reduce_scatter(flat, group=self.group)
        mine = mine / world if self.mean else mine
        shard.grad = mine if shard.grad is None else shard.grad + mine
        if self.free_grad:
            p.grad = None

    def _make_hook(self, shard):
        return lambda p: self._reduce(p, shard)

    def step(self):
        if not self.in_backward:
            for p, s in zip(self.params, self.shards):
                self._reduce(p, s)
        if self.max_norm is not None:
            sq = torch.stack([s.grad.pow(2).sum() for s in self.shards]).sum()
            if not self.local_norm:
                dist.all_reduce(sq, group=self.group)
            coef = (self.max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
            for s in self.shards:
                s.grad.mul_(coef)
        self.optimizer.step()
        world = dist.get_world_size(self.group)
        with torch.no_grad():
            for p, s in zip(self.params, self.shards):
                full = torch.empty(world * s.numel(), dtype=p.dtype, device=p.device)
                dist.all_gather_into_tensor(full, s.detach(), group=self.group)
                n = min(p.numel(), full.numel())
                p.reshape(-1)[:n].copy_(full[:n])

    def zero_grad(self):
        for p, s in zip(self.params, self.shards):
            p.grad, s.grad = None, None


def _wrong(**attrs):
    return type("Wrong", (ZeRO2,), attrs)


def _failed(result) -> dict:
    return {c["name"].split(": ", 1)[1]: c["message"] for c in result.cases if not c["passed"]}


@pytest.fixture
def two_ranks(monkeypatch):
    monkeypatch.setattr(ch03_zero2, "WORLDS", {2: ch03_zero2.WORLDS[2]})


# ----------------------------------------------------------------------------- 3.2
def test_reference_scores_full_marks(monkeypatch):
    # 3 ranks, uneven sizes (every world, hidden ones too: tests/test_exercises.py's grading)
    monkeypatch.setattr(ch03_zero2, "WORLDS", {3: ch03_zero2.WORLDS[3]})
    assert ch03.zero2_optimizer(ZeRO2).score == ch03.EXERCISES["3.2"][1]


def test_zero1_timing_or_a_kept_gradient_fail_only_the_gradient_memory(two_ranks):
    for wrong in (_wrong(in_backward=False), _wrong(free_grad=False)):
        failed = _failed(ch03.zero2_optimizer(wrong))
        assert list(failed) == ["full gradients alive during backward: at most 50%"], failed
        assert "which hook" in next(iter(failed.values()))


def test_all_reduce_and_gloos_reduce_scatter_fail_the_traffic(two_ranks):
    for reduce in ("all_reduce", "backend"):
        failed = _failed(ch03.zero2_optimizer(_wrong(reduce=reduce)))
        assert list(failed) == ["bytes sent per step: a reduce-scatter + an all-gather (kernel "
                                "count)"], (reduce, failed)
        assert "x the optimum" in next(iter(failed.values()))


def test_sum_instead_of_mean_changes_the_values(two_ranks):
    failed = _failed(ch03.zero2_optimizer(_wrong(mean=False)))
    assert list(failed) == ["3 AdamW steps equal one process on every rank"], failed


def test_clipping_by_the_local_norm_changes_the_values(monkeypatch):
    monkeypatch.setattr(ch03_zero2, "WORLDS", {3: ch03_zero2.WORLDS[3]})   # clipped
    failed = _failed(ch03.zero2_optimizer(_wrong(local_norm=True)))
    assert list(failed) == ["3 AdamW steps (clipped) equal one process on every rank"], failed


def test_floor_chunks_lose_elements(monkeypatch):
    monkeypatch.setattr(ch03_zero2, "WORLDS", {3: ch03_zero2.WORLDS[3]})   # uneven sizes
    res = ch03.zero2_optimizer(_wrong(floor_chunks=True))
    assert res.score < res.points
    assert "3 AdamW steps (clipped) equal one process on every rank" in _failed(res)


def test_labkit_zero_is_refused_without_a_launch():
    from labkit.zero import ZeRO2 as Theirs

    class Borrowed:
        def __init__(self, params, group=None, max_grad_norm=None, **kw):
            self.inner = Theirs(params, torch.optim.AdamW, group, max_grad_norm=max_grad_norm,
                                **kw)
            self.optimizer = self.inner.optimizer

        def step(self):
            self.inner.step()

        def zero_grad(self):
            self.inner.zero_grad()

    res = ch03.zero2_optimizer(Borrowed)
    assert res.score == 0 and all("labkit.zero" in c["message"] for c in res.cases)


# ----------------------------------------------------------------------------- 3.3
def _right(n, stage, world):
    one = (world - 1) / world * n * 4
    return {"params": 4 * n / (world if stage >= 3 else 1),
            "grads": 4 * n / (world if stage >= 2 else 1),
            "optimizer": 8 * n / (world if stage >= 1 else 1),
            "sent": (3 if stage == 3 else 2) * one}


def test_held_and_sent_reference_and_wrong_predictions(monkeypatch):
    monkeypatch.setattr(ch03, "HELD_CASES", [(3, 2)])
    assert ch03.held_and_sent(_right).score == ch03.EXERCISES["3.3"][1]
    wrong = {
        "ZeRO-3 frees": lambda n, s, w: {**_right(n, s, w), "sent": 2 * (w - 1) / w * n * 4},
        "not sent + received": lambda n, s, w: {**_right(n, s, w),
                                                "sent": 2 * _right(n, s, w)["sent"]},
        "shards the grads": lambda n, s, w: {**_right(n, s, w), "grads": 4 * n},
        "Does stage 3 shard the optimizer": lambda n, s, w: {**_right(n, s, w),
                                                             "optimizer": 8 * n / w / w},
    }
    for hint, fn in wrong.items():
        res = ch03.held_and_sent(fn)
        assert res.score == 0 and hint in res.cases[0]["message"], res.cases[0]["message"]


def test_stubs_score_zero(two_ranks):
    class Stub:
        def __init__(self, params, group=None, **kw):
            raise NotImplementedError("Exercise 3.2: write your code here")

    def stub(*args):
        raise NotImplementedError("Exercise 3.3: write your code here")

    assert ch03.zero2_optimizer(Stub).score == 0
    assert ch03.held_and_sent(stub).score == 0
