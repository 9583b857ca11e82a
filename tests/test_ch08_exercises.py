"""Chapter 08's exercises 8.2 and 8.3: the reference solutions score full marks, the stubs score
zero, and known-wrong answers lose points for the reason they are wrong (the hint says which).
Most wrong answers run on the first case only (one 2-rank launch each), to stay cheap."""
import math
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from grading_helpers import assert_reference_full_stub_zero

from labkit.check import ch08

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks get these classes by value


# ----------------------------------------------------------------------------- 8.2 reference
def keep_within_capacity(expert, n_expert, cap):
    n, k = expert.shape
    kept, used = torch.zeros(n, k, dtype=torch.bool), [0] * n_expert
    for j in range(k):                      # all first choices, then all second choices
        for t in range(n):
            e = int(expert[t, j])
            if used[e] < cap:
                used[e] += 1
                kept[t, j] = True
    return kept


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class Layer(nn.Module):
    def __init__(self, router, experts, k, capacity_factor=None, group=None):
        super().__init__()
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        E = len(experts)
        if E % ep:
            raise ValueError(f"{E} experts cannot be split evenly over ep={ep} ranks")
        self.group, self.ep, self.k, self.E = group, ep, k, E
        self.capacity_factor, self.per_rank = capacity_factor, E // ep
        self.first = rank * self.per_rank
        self.router = router
        self.local_experts = nn.ModuleList(experts[self.first:self.first + self.per_rank])

    def gates(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        w, expert = probs.topk(self.k, dim=-1)
        return (w / w.sum(-1, keepdim=True) if self.k > 1 else w), expert

    def keep(self, expert, n):
        if self.capacity_factor is None:
            return torch.ones_like(expert, dtype=torch.bool)
        cap = math.ceil(self.capacity_factor * n * self.k / self.E)
        return keep_within_capacity(expert, self.E, cap)

    def exchange(self, x, r, s):
        return AllToAll.apply(x, r, s, self.group)

    def forward(self, x):
        w, expert = self.gates(x)
        kept = self.keep(expert, x.shape[0])
        tok, slot = torch.nonzero(kept, as_tuple=True)
        e = expert[tok, slot]
        order = torch.argsort(e, stable=True)
        tok, slot, e = tok[order], slot[order], e[order]
        send = torch.bincount(e // self.per_rank, minlength=self.ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        s, r = send.tolist(), recv.tolist()
        ids = e.new_empty(sum(r))
        dist.all_to_all_single(ids, e, r, s, group=self.group)
        rows = self.exchange(x[tok], r, s)
        out = rows * 0
        for j, m in enumerate(self.local_experts):
            idx = torch.nonzero(ids == self.first + j, as_tuple=True)[0]
            if idx.numel():
                out = out.index_copy(0, idx, m(rows[idx]))
        back = self.exchange(out, s, r)
        return torch.zeros_like(x).index_add(0, tok, back * w[tok, slot].unsqueeze(-1))


# ----------------------------------------------------------------------------- 8.2 wrong answers
class NoRenormalization(Layer):             # the k chosen probabilities used as they are
    def gates(self, x):
        return F.softmax(self.router(x), dim=-1).topk(self.k, dim=-1)


class TokenMajorCapacity(Layer):            # token 0's second choice before token 1's first
    def keep(self, expert, n):
        cap = math.ceil(self.capacity_factor * n * self.k / self.E)
        kept, used = torch.zeros_like(expert, dtype=torch.bool), [0] * self.E
        for t in range(n):
            for j in range(self.k):
                e = int(expert[t, j])
                if used[e] < cap:
                    used[e] += 1
                    kept[t, j] = True
        return kept


class NoAutogradExchange(Layer):            # the rows cross outside autograd: no gradients home
    def exchange(self, x, r, s):
        out = x.new_empty((sum(r),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.detach().contiguous(), r, s, group=self.group)
        return out


class GatherEverything(Layer):              # all_gather every token, run my experts, all_reduce
    def forward(self, x):
        w, expert = self.gates(x)
        kept = self.keep(expert, x.shape[0])
        gate = torch.zeros(x.shape[0], self.E).scatter(1, expert, w * kept)   # (n, E)
        y = torch.zeros_like(x)
        for j, m in enumerate(self.local_experts):
            y = y + gate[:, self.first + j, None] * m(x)
        dist.all_reduce(y, group=self.group)   # wrong anyway: adds other ranks' tokens
        return y


class AllExpertsLocally(Layer):             # no communication: every rank runs every expert
    def __init__(self, router, experts, k, capacity_factor=None, group=None):
        super().__init__(router, experts, k, capacity_factor, group)
        self.all_experts = nn.ModuleList(experts)

    def forward(self, x):
        w, expert = self.gates(x)
        kept = self.keep(expert, x.shape[0])
        y = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(self.k):
                if kept[t, j]:
                    y = y.index_add(0, torch.tensor([t]),
                                    w[t, j] * self.all_experts[int(expert[t, j])](x[t:t + 1]))
        return y


class RowsToEveryRank(Layer):              # every kept row to every rank: right values, 2x bytes
    def forward(self, x):
        w, expert = self.gates(x)
        kept = self.keep(expert, x.shape[0])
        tok, slot = torch.nonzero(kept, as_tuple=True)
        e = expert[tok, slot]
        A = tok.numel()
        send = torch.full((self.ep,), A, dtype=torch.long)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        s, r = send.tolist(), recv.tolist()
        ids = e.new_empty(sum(r))
        dist.all_to_all_single(ids, e.repeat(self.ep), r, s, group=self.group)
        rows = self.exchange(x[tok].repeat(self.ep, 1), r, s)
        out = rows * 0
        for j, m in enumerate(self.local_experts):
            idx = torch.nonzero(ids == self.first + j, as_tuple=True)[0]
            if idx.numel():
                out = out.index_copy(0, idx, m(rows[idx]))
        back = self.exchange(out, s, r)                           # (ep * A, h): zeros but mine
        gate = w[tok, slot].unsqueeze(-1).repeat(self.ep, 1)
        return torch.zeros_like(x).index_add(0, tok.repeat(self.ep), back * gate)


class NoDivisibilityCheck(Layer):
    def __init__(self, router, experts, k, capacity_factor=None, group=None):
        ep = dist.get_world_size(group)
        super().__init__(router, experts[:len(experts) // ep * ep], k, capacity_factor, group)
        self.E = len(experts)


class UsesLabkitRouter(Layer):
    def gates(self, x):
        from labkit.moe.router import route
        r = route(self.router(x), self.k)
        return r.weight, r.expert


# ----------------------------------------------------------------------------- 8.2 tests
def _messages(res):
    return "\n".join(c["message"] for c in res.cases if not c["passed"])


@pytest.fixture
def first_case_only(monkeypatch):
    monkeypatch.setattr(ch08.expert_parallel, "LAYER_CASES", ch08.LAYER_CASES[:1])


def test_layer_reference_scores_full():
    res = ch08.expert_parallel_layer(Layer)
    assert res.score == res.points == 6, res.table()


def test_layer_stub_scores_zero():
    class Stub(nn.Module):
        def __init__(self, *args):
            super().__init__()
            raise NotImplementedError("Exercise 8.2: write your code here")
    assert ch08.expert_parallel_layer(Stub).score == 0


@pytest.mark.parametrize("cls,needle", [
    (NoRenormalization, "renormalized gate"),
    (TokenMajorCapacity, "first choices before second ones"),
    (NoAutogradExchange, "torch.autograd.Function"),
    (GatherEverything, "all-to-alls only"),
    (AllExpertsLocally, "which other ranks own"),
    (UsesLabkitRouter, "without labkit.moe"),
    (RowsToEveryRank, "the kernel's count"),
])
def test_layer_wrong_answers_fail_with_their_hint(first_case_only, cls, needle):
    res = ch08.expert_parallel_layer(cls)
    assert not res.cases[0]["passed"] and needle in res.cases[0]["message"], res.table()


def test_layer_without_the_divisibility_error_loses_that_case(first_case_only):
    res = ch08.expert_parallel_layer(NoDivisibilityCheck)
    assert res.cases[0]["passed"] and not res.cases[1]["passed"], res.table()
    assert "did not raise" in res.cases[1]["message"]


def test_forbidden_used_reads_methods():
    assert ch08.FORBIDDEN.used(UsesLabkitRouter) and not ch08.FORBIDDEN.used(Layer)


# ----------------------------------------------------------------------------- 8.3
def _leave_arrive(routing, n_expert, ep):
    per = n_expert // ep
    leave, arrive = [0] * ep, [0] * ep
    for r, (expert, kept) in enumerate(routing):
        owner = expert[kept] // per
        leave[r] += int((owner != r).sum())
        for q in range(ep):
            if q != r:
                arrive[q] += int((owner == q).sum())
    return leave, arrive


def predict(routing, n_expert, ep, h, dtype_bytes):
    leave, arrive = _leave_arrive(routing, n_expert, ep)
    return [2 * (leave[r] + arrive[r]) * h * dtype_bytes for r in range(ep)]


def predict_forward_only(routing, n_expert, ep, h, dtype_bytes):
    return [b / 2 for b in predict(routing, n_expert, ep, h, dtype_bytes)]


def predict_elements(routing, n_expert, ep, h, dtype_bytes):
    return predict(routing, n_expert, ep, h, 1)


def predict_with_dropped(routing, n_expert, ep, h, dtype_bytes):
    return predict([(e, torch.ones_like(k)) for e, k in routing], n_expert, ep, h, dtype_bytes)


def predict_symmetric(routing, n_expert, ep, h, dtype_bytes):   # received = sent, assumed
    leave, _ = _leave_arrive(routing, n_expert, ep)
    return [4 * leave[r] * h * dtype_bytes for r in range(ep)]


def predict_uniform_formula(routing, n_expert, ep, h, dtype_bytes):  # the average, not this routing
    from labkit.costs import moe
    return [moe.alltoall_bytes_per_layer(e.shape[0], e.shape[1], h, ep, dtype_bytes)
            for e, _ in routing]


def test_alltoall_bytes_reference_full_stub_zero():
    assert_reference_full_stub_zero(ch08.alltoall_bytes, predict, 3, "8.3")


@pytest.mark.parametrize("fn,needle,first_passes", [
    (predict_forward_only, "Only the forward", False),
    (predict_elements, "Elements or bytes", False),
    (predict_with_dropped, "dropped assignments", True),
    (predict_symmetric, "uneven", True),
    (predict_uniform_formula, "evenly over the experts", True),
])
def test_alltoall_bytes_wrong_answers(fn, needle, first_passes):
    res = ch08.alltoall_bytes(fn)
    assert res.cases[0]["passed"] == first_passes and not res.cases[1]["passed"], res.table()
    assert needle in res.cases[1]["message"], res.table()
