"""Chapter 03's exercises 3.2 (a whole ZeRO-2 optimizer) and 3.3 (predict bytes held and sent): a
reference answer scores full marks, known-wrong answers lose the right cases with the hint that
says why. The 3.2 answers share launches: one at 2 ranks and one at 3 run every class in turn
(labkit.check.ch03.zero2.run.zero2_job per class), and the checker grades each class's results."""
import contextlib
import math
import sys
import traceback

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit.check import ch03
from labkit.check.ch03 import zero2 as ch03_zero2
from labkit.check.ch03.zero2 import run as ch03_zero2_run
from labkit.collectives import ring_reduce_scatter
from labkit.launch import run

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks get these classes by value

VALUES = "3 AdamW steps, the last of 2 micro-batches, equal one process on every rank"
VALUES_CLIPPED = VALUES.replace("steps,", "steps (clipped),")
STATE = "optimizer state: this rank's shards only (storage size)"
MEMORY = "full gradients alive during backward: at most 50%"
TRAFFIC = "bytes sent per step: a reduce-scatter + an all-gather (kernel count)"
BUCKETS = "one reduce-scatter per bucket during backward"
NO_SYNC = "no_sync(): nothing sent while micro-batches accumulate"
ROUND_TRIP = "state_dict(): this rank's shard only, and a round trip resumes exactly"


class ZeRO2:
    """The reference (the solution's design); class attributes switch on one known mistake each."""
    per_parameter = False    # a reduce-scatter per parameter: bucket_bytes ignored
    one_bucket = False       # everything in one bucket: sent after the last gradient of backward
    in_backward = True       # False: ZeRO-1's timing, every bucket reduced in step()
    free_grad = True         # False: p.grad kept after its reduce-scatter
    reduce = "ring"          # "ring" | "all_reduce" | "backend" (Gloo's reduce_scatter_tensor)
    mean = True              # False: the sum over ranks where the mean belongs
    floor_chunks = False     # c = numel // N, no padding: the last elements belong to nobody
    local_norm = False       # clip by this rank's shard norm instead of the global one
    obey_no_sync = True      # False: reduce-scatter every micro-batch (values still right)
    load_state = True        # False: load_state_dict forgets to load
    gather_state = False     # state_dict all-gathers Adam's moments: every rank saves them all

    def __init__(self, params, group=None, bucket_bytes=8192, max_grad_norm=None, **adamw):
        self.params, self.group, self.max_grad_norm = list(params), group, max_grad_norm
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        cap = 0 if self.per_parameter else math.inf if self.one_bucket else bucket_bytes
        nbytes = [p.numel() * p.element_size() for p in self.params]
        self.buckets = [[self.params[i] for i in b] for b in ch03_zero2.buckets(nbytes, cap)]
        self.flats, self.shards, self.bucket_of = [], [], {}
        for b, members in enumerate(self.buckets):
            numel = sum(p.numel() for p in members)
            c = numel // self.world if self.floor_chunks else math.ceil(numel / self.world)
            flat = members[0].new_zeros(max(self.world * c, numel))        # (N*c,)
            offset = 0
            for p in members:
                flat[offset:offset + p.numel()] = p.detach().reshape(-1)
                p.data = flat[offset:offset + p.numel()].view_as(p)
                self.bucket_of[p] = b
                offset += p.numel()
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
            self.flats.append(flat)
            self.shards.append(flat[self.rank * c:(self.rank + 1) * c].requires_grad_(True))
        self.optimizer = torch.optim.AdamW(self.shards, **adamw)
        self._waiting, self._sync = [len(m) for m in self.buckets], True

    @contextlib.contextmanager
    def no_sync(self):
        self._sync = not self.obey_no_sync
        try:
            yield
        finally:
            self._sync = True

    def _on_grad_ready(self, p):
        if not self._sync or not self.in_backward:
            return
        b = self.bucket_of[p]
        self._waiting[b] -= 1
        if self._waiting[b] == 0:
            self._reduce_scatter(b)
            self._waiting[b] = len(self.buckets[b])

    def _reduce_scatter(self, b):
        members, shard = self.buckets[b], self.shards[b]
        c = shard.numel()
        grads = torch.cat([p.grad.reshape(-1) for p in members])[:self.world * c]
        grads = torch.cat([grads, grads.new_zeros(self.world * c - grads.numel())])  # (N*c,)
        if self.reduce == "all_reduce":
            dist.all_reduce(grads, group=self.group)
            mine = grads[self.rank * c:(self.rank + 1) * c].clone()
        elif self.reduce == "backend":
            mine = grads.new_empty(c)
            dist.reduce_scatter_tensor(mine, grads, group=self.group)
        else:
            mine = ring_reduce_scatter(grads, group=self.group)
        mine = mine / self.world if self.mean else mine
        shard.grad = mine if shard.grad is None else shard.grad + mine
        if self.free_grad:
            for p in members:
                p.grad = None

    def step(self):
        if not self.in_backward:
            for b in range(len(self.buckets)):
                self._reduce_scatter(b)
        if self.max_grad_norm is not None:
            sq = torch.stack([s.grad.pow(2).sum() for s in self.shards]).sum()
            if not self.local_norm:
                dist.all_reduce(sq, group=self.group)
            coef = (self.max_grad_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
            for s in self.shards:
                s.grad.mul_(coef)
        self.optimizer.step()
        with torch.no_grad():
            for flat, s in zip(self.flats, self.shards):
                full = flat.new_empty(self.world * s.numel())
                dist.all_gather_into_tensor(full, s.detach().clone(), group=self.group)
                flat[:full.numel()].copy_(full)

    def zero_grad(self):
        for t in self.params + self.shards:
            t.grad = None
        self._waiting = [len(m) for m in self.buckets]

    def state_dict(self):
        state = self.optimizer.state_dict()
        if self.gather_state:                   # every rank's moments, in a copy of the dict
            state = {**state, "state": {i: dict(s) for i, s in state["state"].items()}}
            for s in state["state"].values():
                for key in ("exp_avg", "exp_avg_sq"):
                    full = s[key].new_empty(self.world * s[key].numel())
                    dist.all_gather_into_tensor(full, s[key].contiguous(), group=self.group)
                    s[key + "_all_ranks"] = full
        return {"optimizer": state}

    def load_state_dict(self, state):
        if self.load_state:
            self.optimizer.load_state_dict(state["optimizer"])


def _wrong(**attrs):
    return type("Wrong", (ZeRO2,), attrs)


AT_2 = {  # class -> the cases it must fail (and a phrase of the first failure's hint)
    "reference": (ZeRO2, [], ""),
    "per_parameter": (_wrong(per_parameter=True), [BUCKETS], "one per parameter"),
    "one_bucket_at_the_end": (_wrong(one_bucket=True), [MEMORY, BUCKETS], "which hook"),
    "zero1_timing": (_wrong(in_backward=False), [MEMORY, BUCKETS], "which hook"),
    "kept_gradient": (_wrong(free_grad=False), [MEMORY], "what do you do with p.grad"),
    "all_reduce": (_wrong(reduce="all_reduce"), [TRAFFIC], "x the optimum"),
    "gloo_reduce_scatter": (_wrong(reduce="backend"), [TRAFFIC], "x the optimum"),
    "sum_not_mean": (_wrong(mean=False), [VALUES], "rank 0's"),
    "no_padding": (_wrong(floor_chunks=True), [VALUES], "rank 0's"),
    "communicates_under_no_sync": (_wrong(obey_no_sync=False), [NO_SYNC], "under no_sync()"),
    "load_state_dict_loads_nothing": (_wrong(load_state=False), [ROUND_TRIP],
                                      "after load_state_dict"),
    "state_dict_of_every_rank": (_wrong(gather_state=True), [ROUND_TRIP], "its own shard only"),
}
AT_3 = {   # hidden case: clipped, a cap smaller than the largest parameters, uneven buckets
    "reference": (ZeRO2, [], ""),
    "clipped_by_the_local_norm": (_wrong(local_norm=True), [VALUES_CLIPPED], "rank 0's"),
    "no_padding": (_wrong(floor_chunks=True), [VALUES_CLIPPED], "rank 0's"),
}


def _many_job(classes, case):
    """Rank side: the checker's job for every class in turn on one launch; an exception (the
    same on every rank for these answers) is kept as text and the next class runs."""
    out = []
    for cls in classes:
        try:
            out.append(ch03_zero2_run.zero2_job(cls, *case))
        except Exception:  # noqa: BLE001 - reported through the checker as that class's failure
            out.append(RuntimeError(traceback.format_exc(limit=-3)))
        dist.barrier()
    return out


def _grade_all(answers: dict, world: int) -> dict:
    classes = [cls for cls, _, _ in answers.values()]
    per_rank = run(_many_job, world, (classes, ch03_zero2.WORLDS[world]), timeout=180,
                   echo=False)
    graded = {}
    for i, name in enumerate(answers):
        res = [r[i] for r in per_rank]
        err = next((r for r in res if isinstance(r, BaseException)), None)
        graded[name] = ch03.zero2_optimizer(answers[name][0], launched={world: err or res})
    return graded


@pytest.fixture(scope="module")
def graded_at_2():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ch03_zero2, "WORLDS", {2: ch03_zero2.WORLDS[2]})
        return _grade_all(AT_2, 2)


@pytest.fixture(scope="module")
def graded_at_3():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ch03_zero2, "WORLDS", {3: ch03_zero2.WORLDS[3]})
        return _grade_all(AT_3, 3)


def _failed(result) -> dict:
    return {c["name"].split(": ", 1)[1]: c["message"] for c in result.cases if not c["passed"]}


def _assert_fails_as_expected(result, cases, phrase):
    failed = _failed(result)
    assert sorted(failed) == sorted(cases), failed
    if cases:
        assert phrase in failed[cases[0]], failed[cases[0]]
    else:
        assert result.score == result.points


# ----------------------------------------------------------------------------- 3.2
@pytest.mark.parametrize("name", list(AT_2))
def test_zero2_answers_at_2_ranks(graded_at_2, name):
    _assert_fails_as_expected(graded_at_2[name], *AT_2[name][1:])


@pytest.mark.parametrize("name", list(AT_3))
def test_zero2_answers_at_3_ranks_hidden_case(graded_at_3, name):
    _assert_fails_as_expected(graded_at_3[name], *AT_3[name][1:])


def test_bucket_rule_is_the_books_one():
    # last parameter first; a bucket closes once it holds the cap (PyTorch's reducer's >=)
    assert ch03_zero2.buckets([4, 4, 4, 100, 4], 10) == [[4, 3], [2, 1, 0]]
    assert ch03_zero2.buckets([4, 4, 4, 4], 8) == [[3, 2], [1, 0]]
    assert ch03_zero2.buckets([4, 4, 4], 0) == [[2], [1], [0]]
    assert ch03_zero2.buckets([4, 4, 4], math.inf) == [[2, 1, 0]]


def test_labkit_zero_is_refused_without_a_launch():
    from labkit.zero import ZeRO2 as Theirs

    class Borrowed:
        def __init__(self, params, group=None, bucket_bytes=8192, max_grad_norm=None, **kw):
            self.inner = Theirs(params, torch.optim.AdamW, group, bucket_bytes=bucket_bytes,
                                max_grad_norm=max_grad_norm, **kw)
            self.optimizer = self.inner.optimizer

        def step(self):
            self.inner.step()

        def zero_grad(self):
            self.inner.zero_grad()

    res = ch03.zero2_optimizer(Borrowed)
    assert res.score == 0 and all("labkit.zero" in c["message"] for c in res.cases)


# ----------------------------------------------------------------------------- 3.3
def _right(n, zero, world):
    one = (world - 1) / world * n * 4
    return {"params": 4 * n / (world if zero >= 3 else 1),
            "grads": 4 * n / (world if zero >= 2 else 1),
            "optimizer": 8 * n / (world if zero >= 1 else 1),
            "sent": (3 if zero == 3 else 2) * one}


def test_held_and_sent_reference_and_wrong_predictions(monkeypatch):
    monkeypatch.setattr(ch03.held, "HELD_CASES", [(3, 2)])
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


def test_stubs_score_zero(monkeypatch):
    monkeypatch.setattr(ch03_zero2, "WORLDS", {2: ch03_zero2.WORLDS[2]})

    class Stub:
        def __init__(self, params, group=None, bucket_bytes=8192, max_grad_norm=None, **kw):
            raise NotImplementedError("Exercise 3.2: write your code here")

    def stub(*args):
        raise NotImplementedError("Exercise 3.3: write your code here")

    assert ch03.zero2_optimizer(Stub).score == 0
    assert ch03.held_and_sent(stub).score == 0
