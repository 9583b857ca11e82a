"""Chapter 07's exercises 7.3 (ring attention forward and backward) and 7.4 (its bytes): a
reference answer scores full marks, known-wrong answers lose the right cases with the hint that
says why. (7.1 and 7.2: tests/test_ch07_context.py.) Most wrong answers run at cp = 2 only."""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit.check import ch07
from labkit.check.ch07 import ring as ch07_ring
from labkit.check.ch07 import ring_wire as ch07_ring_wire
from labkit.collectives import exchange
from labkit.context.layout import positions
from labkit.context.tiled import attend, attend_backward, merge_partials

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks get these by value


def _hop(send, recv, rank, cp, group, tags):
    ops = [(dist.irecv, t, (rank - 1) % cp, group, tag) for t, tag in zip(recv, tags)]
    ops += [(dist.isend, t, (rank + 1) % cp, group, tag) for t, tag in zip(send, tags)]
    return exchange(ops)


def _wait(works):
    for w in works:
        w.wait()


class Ring(torch.autograd.Function):
    """The reference; class attributes switch on one known mistake each (subclasses below)."""
    keep_all = False         # keep every K/V chunk for backward (no second K/V pass)
    no_home = False          # dK/dV never travel: each rank keeps only its own block's share
    local_mask = False       # mask by local positions
    q_buffers = False        # receive buffers shaped like q (wrong with grouped-query)
    gather = False           # all-gather K/V (a collective)

    @classmethod
    def _pos(cls, T, r, cp, n):
        return torch.arange(n) if cls.local_mask else positions(T, r, cp)

    @classmethod
    def _bufs(cls, q, k):
        like = q if cls.q_buffers else k
        return torch.empty_like(like), torch.empty_like(like)

    @staticmethod
    def forward(ctx, q, k, v, group, T):
        cls = ctx._forward_cls
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        n = q.shape[2]
        if cls.gather:
            parts = [torch.empty_like(k) for _ in range(cp)]
            dist.all_gather(parts, k.contiguous(), group=group)
        out = lse = None
        cur_k, cur_v, kept = k, v, []
        for s in range(cp):
            src = (rank - s) % cp
            kept.append((cur_k, cur_v))
            if s < cp - 1:
                nk, nv = cls._bufs(q, k)
                works = _hop([cur_k, cur_v], [nk, nv], rank, cp, group, (1, 2))
            o, o_lse = attend(q, cur_k, cur_v, cls._pos(T, rank, cp, n), cls._pos(T, src, cp, n))
            out, lse = (o, o_lse) if out is None else merge_partials(out, lse, o, o_lse)
            if s < cp - 1:
                _wait(works)
                cur_k, cur_v = nk, nv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.T = group, T
        if cls.keep_all:
            ctx.kept = [t for pair in kept for t in pair]
        return out

    @staticmethod
    def backward(ctx, dout):
        cls = ctx._forward_cls
        q, k, v, out, lse = ctx.saved_tensors
        group, T, dout = ctx.group, ctx.T, dout.contiguous()
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        n = q.shape[2]
        dq, cur_k, cur_v, pending, mine = torch.zeros_like(q), k, v, None, None
        for s in range(cp):
            src = (rank - s) % cp
            if cls.keep_all:
                cur_k, cur_v = ctx.kept[2 * s], ctx.kept[2 * s + 1]
            elif s < cp - 1:
                nk, nv = cls._bufs(q, k)
                kv_works = _hop([cur_k, cur_v], [nk, nv], rank, cp, group, (1, 2))
            dq_s, dk_s, dv_s = attend_backward(q, cur_k, cur_v, out, lse, dout,
                                               cls._pos(T, rank, cp, n), cls._pos(T, src, cp, n))
            dq += dq_s
            if cls.no_home:
                mine = (dk_s, dv_s) if s == 0 else mine
            else:
                if pending is not None:
                    works, (rdk, rdv) = pending
                    _wait(works)
                    dk_s, dv_s = dk_s + rdk, dv_s + rdv
                rdk, rdv = torch.empty_like(k), torch.empty_like(v)
                pending = (_hop([dk_s, dv_s], [rdk, rdv], rank, cp, group, (3, 4)), (rdk, rdv))
            if s < cp - 1 and not cls.keep_all:
                _wait(kv_works)
                cur_k, cur_v = nk, nv
        if cls.no_home:
            return dq, *mine, None, None
        works, (dk, dv) = pending
        _wait(works)
        return dq, dk, dv, None, None


def _fn(cls):
    def ring(q, k, v, group, T):
        return cls.apply(q, k, v, group, T)
    return ring


def _wrong(**attrs):
    return _fn(type("Wrong", (Ring,), attrs))


def _messages(result) -> list:
    return [c["message"] for c in result.cases if not c["passed"]]


@pytest.fixture
def cp2_only(monkeypatch):
    monkeypatch.setattr(ch07_ring, "RING_CASES", ch07_ring.RING_CASES[:1])


# ----------------------------------------------------------------------------- 7.3
def test_reference_scores_full_marks(monkeypatch):
    # cp=3, grouped-query (every case: tests/test_exercises.py grades the solution notebook)
    monkeypatch.setattr(ch07_ring, "RING_CASES", ch07_ring.RING_CASES[1:2])
    assert ch07.ring_attention(_fn(Ring)).score == ch07.EXERCISES["7.3"][1]


def test_keeping_every_chunk_fails_only_the_saved_bytes(cp2_only):
    inner = _wrong(keep_all=True)

    def wrapped(q, k, v, group, T):           # an op after the Function: the graph is walked
        return inner(q, k, v, group, T).view_as(q)

    res = ch07.ring_attention(wrapped)
    msgs = _messages(res)
    assert len(msgs) == 1 and "kept" in msgs[0] and "own chunks" in msgs[0], msgs


def test_dk_dv_that_never_travel_home(cp2_only):
    msgs = _messages(ch07.ring_attention(_wrong(no_home=True)))
    assert any("dk is wrong" in m and "come home" in m for m in msgs), msgs


def test_local_positions_give_wrong_values(cp2_only):
    msgs = _messages(ch07.ring_attention(_wrong(local_mask=True)))
    assert any("wrong output" in m and "GLOBAL" in m for m in msgs), msgs


def test_a_collective_is_refused_on_the_ranks(cp2_only):
    res = ch07.ring_attention(_wrong(gather=True))
    assert res.score == 0 and "collective dist.all_gather" in res.cases[0]["message"]


def test_receive_buffers_shaped_like_q_fail_the_grouped_query_case(monkeypatch):
    monkeypatch.setattr(ch07_ring, "RING_CASES", ch07_ring.RING_CASES[1:2])   # H=4, Hk=2
    res = ch07.ring_attention(_wrong(q_buffers=True))
    assert res.score == 0 and "raised" in res.cases[0]["message"]


def test_labkit_ring_is_refused_without_a_launch():
    def borrowed(q, k, v, group, T):
        from labkit.context import ring_attention
        return ring_attention(q, k, v, group, "zigzag", seq_len=T)

    res = ch07.ring_attention(borrowed)
    assert res.score == 0 and all("ring_attention" in c["message"] for c in res.cases)


# ----------------------------------------------------------------------------- 7.4
def _right(b, s, H, Hk, d, cp, e):
    chunk = 2 * b * s / cp * Hk * d * e
    return (cp - 1) * chunk + (2 * cp - 1) * chunk


def test_ring_bytes_reference_and_wrong_counts(monkeypatch):
    # cp=3, H=4, Hk=2
    monkeypatch.setattr(ch07_ring_wire, "BYTES_CASES", ch07_ring_wire.BYTES_CASES[1:2])
    assert ch07.ring_bytes(_right).score == ch07.EXERCISES["7.4"][1]
    chunk = lambda b, s, H, Hk, d, cp, e: 2 * b * s / cp * Hk * d * e  # noqa: E731
    wrong = {
        lambda *a: (a[5] - 1) * chunk(*a): "Forward only",
        lambda *a: 2 * (a[5] - 1) * chunk(*a): "dK/dV accumulators travel",
        lambda b, s, H, Hk, d, cp, e: _right(b, s, H, H, d, cp, e): "fewer than q's H",
        lambda *a: _right(*a) / 2: "K and V (two tensors)",
    }
    for fn, hint in wrong.items():
        res = ch07.ring_bytes(fn)
        assert res.score == 0 and hint in res.cases[0]["message"], res.cases[0]["message"]


def test_stubs_score_zero(cp2_only):
    def stub(*args):
        raise NotImplementedError("Exercise 7.3: write your code here")

    assert ch07.ring_attention(stub).score == 0
    assert ch07.ring_bytes(stub).score == 0
