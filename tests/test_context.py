"""labkit.context against one-process references: tiled attention vs softmax attention (outputs,
q/k/v gradients, saved bytes by saved-tensor hooks), Megatron SP vs the one-process GPT at tp = 2,
3, 4 (outputs, every gradient, an optimizer step; bytes on the wire counted by the kernel), ring
and all-gather-K/V attention at cp = 2, 3, 4 with the plain (uneven) and zig-zag layouts; and
labkit.costs.context's formulas."""
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from tp_pairs import grad_pairs, param_pairs

from labkit.context import layout as lay
from labkit.context.tiled import (
    attend,
    growth_exponent,
    merge_partials,
    saved_bytes_table,
    tiled_attention,
)
from labkit.costs import context as cc
from labkit.launch import run
from labkit.testing import tensors_close


# ----------------------------------------------------------------------------- tiled attention
@pytest.mark.parametrize("T,block,dtype", [(1, 4, torch.float32), (37, 8, torch.float32),
                                           (64, 64, torch.float32), (100, 16, torch.float32),
                                           (50, 7, torch.float64)])
def test_tiled_attention_equals_softmax_attention(T, block, dtype):
    g = torch.Generator().manual_seed(T)
    q, k, v, go = (torch.randn(2, 3, T, 8, generator=g, dtype=dtype) for _ in range(4))
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    y = tiled_attention(qa, ka, va, block=block)
    ref = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
    y.backward(go), ref.backward(go)
    tensors_close(y, ref, what="tiled attention output")
    for name, a, b in (("dq", qa, qb), ("dk", ka, kb), ("dv", va, vb)):
        tensors_close(a.grad, b.grad, what=f"tiled attention {name}")


def test_merge_partials_of_two_key_halves_is_attention_over_all_keys():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 10, 4, generator=g, dtype=torch.float64) for _ in range(3))
    whole, lse = attend(q, k, v)
    o1, l1 = attend(q, k[:, :, :3], v[:, :, :3])
    o2, l2 = attend(q, k[:, :, 3:], v[:, :, 3:])
    out, l12 = merge_partials(o1, l1, o2, l2)
    tensors_close(out, whole, what="merged output")
    tensors_close(l12, lse, what="merged log-sum-exp")
    # an empty side (every key in the future: lse = -inf) changes nothing
    pos = torch.arange(10)
    o3, l3 = attend(q, k, v, pos, pos + 100)
    assert torch.isinf(l3).all() and (o3 == 0).all()
    out, l13 = merge_partials(o1, l1, o3, l3)
    tensors_close(out, o1, what="merge with an empty block")


def test_tiled_attention_grouped_query_heads():
    """k, v with 2 heads serving 6 query heads: equal to SDPA on the repeated k, v, and the
    gradients of the unrepeated k, v are summed over each head's query group."""
    g = torch.Generator().manual_seed(2)
    q, go = torch.randn(1, 6, 20, 4, generator=g), torch.randn(1, 6, 20, 4, generator=g)
    k, v = (torch.randn(1, 2, 20, 4, generator=g) for _ in range(2))
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    y = tiled_attention(qa, ka, va, block=8)
    ref = F.scaled_dot_product_attention(qb, kb.repeat_interleave(3, 1),
                                         vb.repeat_interleave(3, 1), is_causal=True)
    y.backward(go), ref.backward(go)
    tensors_close(y, ref, what="GQA output")
    for name, a, b in (("dq", qa, qb), ("dk", ka, kb), ("dv", va, vb)):
        tensors_close(a.grad, b.grad, what=f"GQA {name}")
    with pytest.raises(ValueError, match="q has 6 heads, k and v 4"):
        tiled_attention(q, torch.randn(1, 4, 20, 4), torch.randn(1, 4, 20, 4))


def test_saved_bytes_grow_linearly_for_tiled_and_quadratically_for_naive():
    """Counted by saved_tensors_hooks: naive attention keeps the (T, T) probabilities, the tiled
    one keeps q, k, v, out and lse: (4 d + 1) * B * H * T fp32 values."""
    lengths = (256, 512, 1024)
    rows = saved_bytes_table(lengths, batch=1, heads=2, head_dim=16)
    naive, tiled = [r[1] for r in rows], [r[2] for r in rows]
    assert growth_exponent(lengths, naive) > 1.8, rows
    assert growth_exponent(lengths, tiled) == pytest.approx(1.0, abs=0.02), rows
    for T, _, t, _ in rows:
        assert t == 4 * 2 * T * (4 * 16 + 1), (T, t)      # exactly q, k, v, out, lse
    assert naive[-1] > 10 * tiled[-1]


# ----------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("T,cp,layout", [(16, 4, "zigzag"), (18, 3, "zigzag"), (17, 4, "plain"),
                                         (5, 5, "plain"), (12, 1, "zigzag")])
def test_layout_covers_every_position_once(T, cp, layout):
    allpos = torch.cat([lay.positions(T, r, cp, layout) for r in range(cp)])
    assert sorted(allpos.tolist()) == list(range(T))
    assert sum(lay.causal_work(T, cp, layout)) == T * (T + 1) // 2


def test_zigzag_balances_causal_work_and_plain_does_not():
    plain, zig = lay.causal_work(4096, 4, "plain"), lay.causal_work(4096, 4, "zigzag")
    assert len(set(zig)) == 1 and lay.imbalance(zig) == 1.0
    assert plain[-1] / plain[0] == pytest.approx(7, rel=0.01)   # (2cp - 1) for cp = 4
    assert lay.imbalance(plain) == pytest.approx(1.75, rel=0.01)


def test_tiles_computed_per_rank_follow_the_same_balance():
    """With 64-token tiles the diagonal tiles are computed whole: a little more than the causal
    pairs, and still balanced by the zig-zag layout (chunks of 512 are whole tiles)."""
    zig = lay.computed_work(4096, 4, "zigzag", block=64)
    plain = lay.computed_work(4096, 4, "plain", block=64)
    exact = lay.causal_work(4096, 4, "zigzag")
    assert len(set(zig)) == 1 and exact[0] < zig[0] < 1.02 * exact[0]
    assert lay.imbalance(plain) == pytest.approx(1.75, rel=0.01)
    assert sum(lay.computed_work(100, 1, "plain", block=100)) == 100 * 100  # one tile, masked


def test_layout_errors_name_the_factors():
    with pytest.raises(ValueError, match=r"T=30 is not divisible by 2\*cp=8 \(cp=4\)"):
        lay.positions(30, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        lay.positions(8, 0, 2, "ring")


# ----------------------------------------------------------------------------- ring attention
def _cp_job(cases):
    """Every (T, layout, fn) case on this cp group vs one-process causal attention."""
    import torch.distributed as dist

    from labkit.context.layout import positions
    from labkit.context.ring_attention import all_gather_kv_attention, ring_attention
    from labkit.context.tiled import saved_bytes
    from labkit.launch import device
    from labkit.observe import netcount

    rank, cp = dist.get_rank(), dist.get_world_size()
    dev = device()
    out = {}
    for T, layout, fn in cases:
        g = torch.Generator().manual_seed(T)
        q, go = (torch.randn(2, 4, T, 16, generator=g).to(dev) for _ in range(2))
        k, v = (torch.randn(2, 2, T, 16, generator=g).to(dev) for _ in range(2))  # GQA: 2 kv heads
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qf, kf.repeat_interleave(2, 1),
                                             vf.repeat_interleave(2, 1), is_causal=True)
        ref.backward(go)
        pos = positions(T, rank, cp, layout, device=dev)
        ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
        dist.barrier()
        with netcount.socket_bytes() as c:
            attention = {"ring_attention": ring_attention,
                         "all_gather_kv_attention": all_gather_kv_attention}[fn]
            y = attention(ql, kl, vl, None, layout, seq_len=T, block=16)
            y.backward(go[:, :, pos])
        out[(T, layout, fn)] = {"pairs": [(y, ref[:, :, pos]), (ql.grad, qf.grad[:, :, pos]),
                                          (kl.grad, kf.grad[:, :, pos]),
                                          (vl.grad, vf.grad[:, :, pos])],
                                "sent": c.sent, "why": c.reason,
                                "saved": saved_bytes(partial(attention, layout=layout, seq_len=T),
                                                     ql, kl, vl)}
    try:
        ring_attention(*(torch.zeros(1, 1, 3, 4, device=dev) for _ in range(3)), None)
    except ValueError as e:
        out["error"] = str(e)
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_and_all_gather_attention_equal_one_process(cp):
    cases = [(T, layout, fn) for T, layout in ((32 * cp, "zigzag"), (32 * cp + 1, "plain"))
             for fn in ("ring_attention", "all_gather_kv_attention")]
    per_rank = run(_cp_job, cp, args=(cases,), timeout=300)
    for rank, res in enumerate(per_rank):
        for case in cases:
            for name, (a, b) in zip(("output", "dq", "dk", "dv"), res[case]["pairs"]):
                tensors_close(a, b, what=f"{case} rank {rank} {name}")
        assert f"not divisible by 2*cp={2 * cp}" in res["error"]
        # saved-tensor hooks: the ring keeps its own K/V chunk, the all-gather version the whole
        # K and V: (T - T_r) more keys and values (B=2, 2 kv heads, d=16, fp32)
        for T, layout in ((32 * cp, "zigzag"), (32 * cp + 1, "plain")):
            T_r = res[(T, layout, "ring_attention")]["pairs"][0][0].shape[2]
            extra = res[(T, layout, "all_gather_kv_attention")]["saved"] - res[
                (T, layout, "ring_attention")]["saved"]
            assert extra == 2 * (T - T_r) * 2 * 2 * 16 * 4, (T, layout, extra)
        # bytes on the wire (kernel socket counters) vs labkit.costs.context, zig-zag: equal
        # chunks. Excess allowed: Gloo's headers, < 300 bytes per message.
        T = 32 * cp
        ring = res[(T, "zigzag", "ring_attention")]
        assert ring["sent"] is not None, ring["why"]
        want = cc.cp_ring_layer_bytes(2, T, 2 * 16, cp, 4)["total"]
        messages = 2 * (cp - 1) + 2 * (cp - 1) + 2 * cp
        assert want <= ring["sent"] <= want + 300 * messages, (rank, ring["sent"], want)
        ag = res[(T, "zigzag", "all_gather_kv_attention")]
        want = cc.cp_all_gather_layer_bytes(2, T, 2 * 16, cp, 4)["total"]
        assert want <= ag["sent"] <= want + 300 * 5 * (cp - 1), (rank, ag["sent"], want)


# ----------------------------------------------------------------------------- sequence parallel
SP_CFGS = {2: dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16),
           3: dict(n_layer=2, n_head=6, n_kv_head=3, n_embd=48, block_size=16),
           4: dict(n_layer=2, n_head=4, n_kv_head=4, n_embd=32, block_size=16)}


def _sp_model_run(sp, ref, T, dev):
    """Two SGD steps of `sp` and `ref` on the same batches: every compared pair and the last log."""
    from labkit.model import get_batch, tiny_corpus
    from labkit.observe import commlog

    opt_r = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt_s = torch.optim.SGD(sp.parameters(), lr=0.5)
    pairs = {}
    for step in range(2):
        x, y = (t.to(dev) for t in get_batch(tiny_corpus(), 3, T, step))
        logits_r, loss_r = ref(x, y)
        loss_r.backward()
        with commlog.record() as log:
            logits_s, loss_s = sp(x, y)
            loss_s.backward()
        pairs[f"step {step} logits"] = (logits_s.detach(), logits_r.detach())
        pairs.update(grad_pairs(sp, ref, f"step {step}"))
        opt_r.step(), opt_s.step(), opt_r.zero_grad(), opt_s.zero_grad()
    pairs.update(param_pairs(sp, ref, "param after 2 steps"))
    return pairs, {"by_op": log.by_dim()["world"],
                   "where": {w: log.count(where=w) for w in {e.where for e in log.events}}}


def _block_saved_bytes(model, T, dev):
    """Bytes one block keeps for backward on this rank (saved-tensor hooks; parameters left out)."""
    from labkit.model import get_batch, tiny_corpus
    from labkit.observe.saved import SavedTensors

    x, _ = get_batch(tiny_corpus(), 4, T, 0)
    h = (model.wte(x.to(dev)) + model.wpe(torch.arange(T, device=dev))).detach().requires_grad_()
    with SavedTensors(exclude=model.parameters()) as saved:
        model.blocks[0](h)                                   # the first block scatters h
    return saved.bytes


def _sp_job(cfg_kwargs, T, bad_T):
    import torch.distributed as dist

    from labkit.context.sequence_parallel import apply_sp, gather_sequence, reduce_scatter_sequence
    from labkit.launch import device
    from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus
    from labkit.observe import netcount
    from labkit.tp import apply_tp, f, g

    dev, tp = device(), dist.get_world_size()
    cfg = GPTConfig(**cfg_kwargs)
    out = {}
    for regather in (True, False):
        sp = apply_sp(GPT(cfg, seed=0).to(dev), None, regather=regather)
        out[regather] = _sp_model_run(sp, GPT(cfg, seed=0).to(dev), T, dev)
    try:
        sp(*(t.to(dev) for t in get_batch(tiny_corpus(), 3, bad_T, 0)))
    except ValueError as e:
        out["error"] = str(e)
    out["saved"] = {"one process": _block_saved_bytes(GPT(cfg, seed=0).to(dev), T, dev),
                    "TP": _block_saved_bytes(apply_tp(GPT(cfg, seed=0).to(dev), None), T, dev),
                    "TP + SP": _block_saved_bytes(apply_sp(GPT(cfg, seed=0).to(dev), None), T,
                                                  dev),
                    "TP + SP, gathered inputs kept": _block_saved_bytes(
                        apply_sp(GPT(cfg, seed=0).to(dev), None, regather=False), T, dev)}
    # one layer's activation traffic, TP (f, g) vs SP (all-gather, reduce-scatter), by the kernel
    B, h = 4, 256
    W = torch.randn(h, h, generator=torch.Generator().manual_seed(0)).to(dev)
    xs = {"TP": torch.randn(B, 64 * tp, h).to(dev), "SP": torch.randn(B, 64, h).to(dev)}
    layer = {"TP": lambda t: g(f(t) @ W), "SP": lambda t: reduce_scatter_sequence(
        gather_sequence(t, None) @ W, None)}
    out["sent"] = {}
    for name in ("TP", "SP"):
        xx = xs[name].requires_grad_()
        dist.barrier()
        with netcount.socket_bytes() as c:
            layer[name](xx).sum().backward()
        out["sent"][name] = (c.sent, c.reason)
    return out


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_sequence_parallel_gpt_equals_one_process(tp):
    T = 15 if tp == 3 else 16
    per_rank = run(_sp_job, tp, args=(SP_CFGS[tp], T, T - 1), timeout=300)
    n_layer, h = SP_CFGS[tp]["n_layer"], SP_CFGS[tp]["n_embd"]
    for rank, res in enumerate(per_rank):
        for regather in (True, False):
            pairs, log = res[regather]
            for what, (a, b) in pairs.items():
                tensors_close(a, b, what=f"SP tp={tp} regather={regather} rank {rank} {what}")
            # per layer: 2 all-gathers + 2 reduce-scatters forward, the same backward (+ 2
            # re-gathers with regather), the scatter after the embedding and the gather before
            # the head (each one all-gather, forward or backward)
            where = log["where"]
            for w in ("SP all-gather forward", "SP reduce-scatter forward",
                      "SP all-gather backward", "SP reduce-scatter backward"):
                assert where[w] == 2 * n_layer, (w, where)
            assert where.get("SP re-gather backward", 0) == (2 * n_layer if regather else 0)
            boundary = 2 * 3 * T * h * 4                     # two (B, T, h) fp32 gathers
            extra = 2 * n_layer * 3 * T * h * 4 if regather else 0
            assert log["by_op"]["all_gather"][1] == log["by_op"]["reduce_scatter"][1] + (
                boundary + extra)
        assert f"T={T - 1} is not divisible by tp={tp}" in res["error"]
        # saved-tensor hooks: with the re-gather every activation of the block is split by tp
        saved = res["saved"]
        assert saved["TP + SP"] * tp == saved["one process"], saved
        assert saved["TP + SP"] < saved["TP + SP, gathered inputs kept"] < saved["one process"]
        assert saved["TP + SP"] < saved["TP"] < saved["one process"]
        # the kernel's count: SP moves TP's bytes (all-reduce = reduce-scatter + all-gather)
        (tp_sent, why), (sp_sent, _) = res["sent"]["TP"], res["sent"]["SP"]
        assert tp_sent is not None, why
        D = 4 * 64 * tp * 256 * 4
        want = cc.tp_layer_bytes(1, 1, D // 4, tp, 4)["total"] / 2   # one f and one g
        assert want == cc.sp_layer_bytes(1, 1, D // 4, tp, 4)["total"] / 2
        for name, sent in (("TP", tp_sent), ("SP", sp_sent)):
            assert want <= sent <= want * 1.01, (tp, rank, name, sent, want)


# ----------------------------------------------------------------------------- costs
def test_costs_sp_moves_tp_bytes_and_divides_activations():
    for t in (2, 4, 8):
        assert cc.sp_layer_bytes(2, 4096, 8192, t) == cc.tp_layer_bytes(2, 4096, 8192, t)
        more = cc.sp_layer_bytes(2, 4096, 8192, t, regather=True)["total"]
        assert more == pytest.approx(1.25 * cc.tp_layer_bytes(2, 4096, 8192, t)["total"])
        full = cc.activation_bytes(4096, 1, 8192, 64)
        assert cc.activation_bytes(4096, 1, 8192, 64, tp=t, sp=True) == pytest.approx(full / t)
        tp_only = cc.activation_bytes(4096, 1, 8192, 64, tp=t)
        assert tp_only == pytest.approx(4096 * 8192 * (10 + 24 / t + 5 * 64 * 4096 / (8192 * t)))
    s, b, h, a = 2048, 1, 4096, 32
    assert cc.activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert cc.activation_bytes(s, b, h, a, recompute="selective") == 34 * s * b * h
    assert cc.activation_bytes(s, b, h, a, cp=4) == pytest.approx(
        cc.activation_bytes(s, b, h, a) / 4)
    assert sum(cc.activation_terms(s, b, h, a, tp=4, sp=True).values()) == pytest.approx(
        cc.activation_bytes(s, b, h, a, tp=4, sp=True))
    with pytest.raises(ValueError, match="sp=True needs tp > 1"):
        cc.activation_bytes(s, b, h, a, sp=True)


def test_costs_ring_backward_moves_about_twice_the_forward():
    for cp in (2, 4, 8):
        r = cc.cp_ring_layer_bytes(1, 8192, 1024, cp)
        chunk = cc.kv_chunk_bytes(1, 8192, 1024, cp)
        assert r["forward"] == (cp - 1) * chunk
        assert r["backward"] == (2 * cp - 1) * chunk
        ag = cc.cp_all_gather_layer_bytes(1, 8192, 1024, cp)
        assert ag["forward"] == pytest.approx(r["forward"])   # the same K/V reach every rank
    rows = cc.comm_table(1, 4096, 4096, 1024, 4)
    assert [r[0] for r in rows] == ["TP", "TP + SP", "CP ring", "CP all-gather"]
    assert math.isclose(rows[0][3], rows[1][3])


# ----------------------------------------------------------------------------- apply_cp (the GPT)
def _cp_gpt_job(cases, tp):
    """The GPT split over cp (and tp) vs the one-process GPT: logits, loss, every gradient."""
    import torch.distributed as dist

    from labkit.context.context_parallel import apply_cp, average_cp_grads
    from labkit.launch import device
    from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus
    from labkit.tp import apply_tp, gather_tp_grads

    dev, rank = device(), dist.get_rank()
    cp = dist.get_world_size() // tp
    tp_group = cp_group = None
    for c in range(cp):                                      # tp: consecutive ranks
        grp = dist.new_group([c * tp + i for i in range(tp)])
        tp_group = grp if rank // tp == c else tp_group
    for i in range(tp):                                      # cp: strided ranks
        grp = dist.new_group([c * tp + i for c in range(cp)])
        cp_group = grp if rank % tp == i else cp_group
    cfg = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=40)
    out = {}
    for T, layout, method in cases:
        ref, model = GPT(cfg, seed=0).to(dev), GPT(cfg, seed=0).to(dev)
        if tp > 1:
            apply_tp(model, tp_group)
        apply_cp(model, cp_group, layout, method)
        x, y = (t.to(dev) for t in get_batch(tiny_corpus(), 3, T, 0))
        logits_r, loss_r = ref(x, y)
        loss_r.backward()
        logits, loss = model(x, y)
        loss.backward()
        average_cp_grads(model, cp_group)
        grads = (gather_tp_grads(model) if tp > 1
                 else {n: p.grad for n, p in model.named_parameters()})
        pairs = {"logits": (logits.detach(), logits_r.detach()),
                 "loss": (loss.detach(), loss_r.detach())}
        pairs.update({f"grad {n}": (grads[n], p.grad) for n, p in ref.named_parameters()})
        out[(T, layout, method)] = pairs
    zigzag = apply_cp(GPT(cfg, seed=0).to(dev), cp_group, "zigzag")
    try:
        zigzag(*(t.to(dev) for t in get_batch(tiny_corpus(), 3, 2 * cp + 2, 0)))
    except ValueError as e:
        out["error"] = str(e)
    return out


@pytest.mark.parametrize("world,tp", [(2, 1), (3, 1), (4, 1), (4, 2)])
def test_context_parallel_gpt_equals_one_process(world, tp):
    cp = world // tp
    cases = [(8 * cp, "zigzag", "ring"), (8 * cp, "zigzag", "all_gather"),
             (8 * cp + 1, "plain", "ring")]
    per_rank = run(_cp_gpt_job, world, args=(cases, tp), timeout=300)
    for rank, res in enumerate(per_rank):
        for case in cases:
            for what, (a, b) in res[case].items():
                tensors_close(a, b, what=f"CP={cp} TP={tp} rank {rank} {case} {what}")
        assert f"not divisible by 2*cp={2 * cp} (cp={cp})" in res["error"]
