"""Chapter 04's exercises 4.3 and 4.4: a reference answer scores full marks, known-wrong answers
lose the right cases with the hint that says why. (4.1/4.2's wrong answers: tests/test_tp.py.)
Most cases run at TP = 2 only (BLOCK_CASES narrowed) to keep the launches few."""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.check import ch04
from labkit.check.ch04 import block as ch04_block

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks get these classes by value


# ----------------------------------------------------------------------------- a reference answer
class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def f(x, group=None):
    return _F.apply(x, group)


def g(x, group=None):
    return _G.apply(x, group)


class MLP(nn.Module):
    bias_before_g = False
    gather = False

    def __init__(self, mlp, group=None):
        super().__init__()
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        m = mlp.fc.out_features
        if m % tp and not self.gather:
            raise ValueError(f"m={m} is not divisible by tp={tp}")
        n, self.group = m // tp, group
        rows = slice(rank * n, (rank + 1) * n)
        self.fc_weight = nn.Parameter(mlp.fc.weight.detach()[rows].clone())         # (m/tp, h)
        self.fc_bias = nn.Parameter(mlp.fc.bias.detach()[rows].clone())
        self.proj_weight = nn.Parameter(mlp.proj.weight.detach()[:, rows].clone())  # (h, m/tp)
        self.proj_bias = nn.Parameter(mlp.proj.bias.detach().clone())

    def forward(self, x):                                                       # (B, T, h)
        a = F.gelu(F.linear(f(x, self.group), self.fc_weight, self.fc_bias))    # (B, T, m/tp)
        if self.gather:        # the naive split: gather the hidden activations, then a full proj
            parts = [torch.empty_like(a) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, a.detach().contiguous(), group=self.group)
        if self.bias_before_g:
            return g(F.linear(a, self.proj_weight, self.proj_bias), self.group)
        return g(F.linear(a, self.proj_weight), self.group) + self.proj_bias


class Attention(nn.Module):
    f_per_projection = False
    check_heads = True
    kv_like_q = False

    def __init__(self, attn, group=None):
        super().__init__()
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        if self.check_heads and (attn.n_head % tp or attn.n_kv_head % tp):
            raise ValueError(f"n_head={attn.n_head} and n_kv_head={attn.n_kv_head} must divide "
                             f"by tp={tp}")
        d, self.group, self.d = attn.head_dim, group, attn.head_dim
        q = slice(rank * attn.n_head // tp * d, (rank + 1) * attn.n_head // tp * d)
        kv = q if self.kv_like_q else slice(rank * attn.n_kv_head // tp * d,
                                            (rank + 1) * attn.n_kv_head // tp * d)
        keep = lambda t: nn.Parameter(t.detach().clone())  # noqa: E731
        self.q_weight, self.q_bias = keep(attn.q_proj.weight[q]), keep(attn.q_proj.bias[q])
        self.k_weight, self.k_bias = keep(attn.k_proj.weight[kv]), keep(attn.k_proj.bias[kv])
        self.v_weight, self.v_bias = keep(attn.v_proj.weight[kv]), keep(attn.v_proj.bias[kv])
        self.o_weight, self.o_bias = keep(attn.o_proj.weight[:, q]), keep(attn.o_proj.bias)

    def forward(self, x):                                                       # (B, T, h)
        B, T, _ = x.shape
        xs = ([f(x, self.group) for _ in range(3)] if self.f_per_projection
              else [f(x, self.group)] * 3)
        q, k, v = (F.linear(xi, w, b).view(B, T, -1, self.d).transpose(1, 2) for xi, w, b in
                   zip(xs, (self.q_weight, self.k_weight, self.v_weight),
                       (self.q_bias, self.k_bias, self.v_bias)))               # (B, n, T, d)
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return g(F.linear(y.reshape(B, T, -1), self.o_weight), self.group) + self.o_bias


def _variant(base, **attrs):
    return type(base.__name__ + "Wrong", (base,), attrs)


def _messages(result) -> dict:
    return {c["name"]: c["message"] for c in result.cases if not c["passed"]}


@pytest.fixture
def tp2_only(monkeypatch):
    monkeypatch.setattr(ch04_block, "BLOCK_CASES", {2: ch04_block.BLOCK_CASES[2]})


# ----------------------------------------------------------------------------- 4.3
def test_reference_scores_full_marks(monkeypatch):
    # TP=3, grouped-query (every world: tests/test_exercises.py grades the solution notebook)
    monkeypatch.setattr(ch04_block, "BLOCK_CASES", {3: ch04_block.BLOCK_CASES[3]})
    assert ch04.tp_block(MLP, Attention).score == ch04.EXERCISES["4.3"][1]


def test_bias_before_g_and_an_f_per_projection(tp2_only):
    res = ch04.tp_block(_variant(MLP, bias_before_g=True),
                        _variant(Attention, f_per_projection=True))
    msgs = _messages(res)
    assert "counted tp times" in msgs["TP=2: MLP: output and every gradient equal one process"]
    comm = next(m for n, m in msgs.items() if "communication" in n)
    assert "Does every projection get its own f" in comm and "3 all-reduces" in comm
    assert not any("attention" in n for n in msgs)             # its numbers are still right
    assert res.score < res.points


def test_an_all_gather_between_the_layers_and_no_size_check(tp2_only):
    res = ch04.tp_block(_variant(MLP, gather=True), _variant(Attention, check_heads=False))
    msgs = _messages(res)
    assert "dist.all_gather" in next(m for n, m in msgs.items() if "communication" in n)
    assert "was accepted" in next(m for n, m in msgs.items() if "refused" in n)


def test_kv_heads_sliced_like_q_fail_a_hidden_grouped_query_case(monkeypatch):
    monkeypatch.setattr(ch04_block, "BLOCK_CASES", {3: ch04_block.BLOCK_CASES[3]})
    res = ch04.tp_block(MLP, _variant(Attention, kv_like_q=True))
    msgs = _messages(res)
    assert len(msgs) == 4 and res.score == 0          # the ranks' shapes disagree: all fail
    # the first says where it broke; the same error again is skipped with that note (one typo,
    # one message: labkit.check)
    first, *rest = msgs.values()
    assert "rank 2 raised" in first, msgs
    assert all("rank 2 raised" in m or "same error as the case above" in m for m in rest), msgs


def test_labkit_tp_is_refused(tp2_only):
    from labkit.tp import TensorParallelMLP

    class Borrowed(MLP):
        def __init__(self, mlp, group=None):
            nn.Module.__init__(self)
            self.inner = TensorParallelMLP.from_mlp(mlp, group)

    res = ch04.tp_block(Borrowed, Attention)
    assert res.score == 0 and all("book's answer" in c["message"] for c in res.cases)


# ----------------------------------------------------------------------------- 4.4
def test_tp_bytes_reference_and_wrong_counts(monkeypatch):
    monkeypatch.setattr(ch04.wire, "WIRE_CASES", ch04.WIRE_CASES[1:2])     # tp=4: 2(tp-1)/tp != 1

    def right(b, s, h, n_layer, tp, e):
        return n_layer * 4 * 2 * (tp - 1) / tp * b * s * h * e

    assert ch04.tp_bytes(right).score == ch04.EXERCISES["4.4"][1]
    wrong = {lambda b, s, h, L, tp, e: right(b, s, h, L, tp, e) / 2: "About half",
             lambda b, s, h, L, tp, e: L * 4 * b * s * h * e: "buffer's size",
             lambda b, s, h, L, tp, e: L * 4 * 2 * (tp - 1) / tp * 12 * h * h * e: "or weights",
             lambda b, s, h, L, tp, e: 2 * right(b, s, h, L, tp, e): "not sent + received"}
    for fn, hint in wrong.items():
        res = ch04.tp_bytes(fn)
        assert res.score == 0 and hint in res.cases[0]["message"], res.cases[0]["message"]
        assert "measured" in res.cases[0]["message"]


def test_stubs_score_zero(tp2_only, monkeypatch):
    monkeypatch.setattr(ch04.wire, "WIRE_CASES", ch04.WIRE_CASES[:2])

    class Stub(nn.Module):
        def __init__(self, mod, group=None):
            raise NotImplementedError("Exercise 4.3: write your code here")

    def stub(*args):
        raise NotImplementedError("Exercise 4.4: write your code here")

    assert ch04.tp_block(Stub, Stub).score == 0
    assert ch04.tp_bytes(stub).score == 0
