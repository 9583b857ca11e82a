"""Context-parallel attention with a value head size different from the key's (as PyTorch's
scaled_dot_product_attention allows): ring and all-gather versions against one-process SDPA,
output and every gradient."""
import pytest
import torch
import torch.nn.functional as F

from labkit.launch import run


def _job(T, layout, dk, dv):
    import torch.distributed as dist

    from labkit.context.layout import positions
    from labkit.context.ring_attention import all_gather_kv_attention, ring_attention

    rank, cp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(T)
    q = torch.randn(2, 4, T, dk, generator=g)
    k = torch.randn(2, 2, T, dk, generator=g)                         # GQA: 2 kv heads
    v = torch.randn(2, 2, T, dv, generator=g)
    go = torch.randn(2, 4, T, dv, generator=g)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf.repeat_interleave(2, 1),
                                         vf.repeat_interleave(2, 1), is_causal=True)
    ref.backward(go)
    pos = positions(T, rank, cp, layout)
    worst = {}
    for fn in (ring_attention, all_gather_kv_attention):
        ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
        y = fn(ql, kl, vl, None, layout, seq_len=T, block=16)
        y.backward(go[:, :, pos])
        worst[fn.__name__] = max((a - b).abs().max().item() for a, b in (
            (y, ref[:, :, pos]), (ql.grad, qf.grad[:, :, pos]), (kl.grad, kf.grad[:, :, pos]),
            (vl.grad, vf.grad[:, :, pos])))
    return worst


@pytest.mark.parametrize("cp,T,layout", [(2, 32, "zigzag"), (3, 31, "plain")])
def test_value_head_size_differs_from_key(cp, T, layout):
    for worst in run(_job, cp, args=(T, layout, 16, 8), timeout=120):
        assert max(worst.values()) < 1e-5, worst
