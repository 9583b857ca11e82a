"""labkit's loss scalers against torch.amp.GradScaler, step for step and bit for bit: the scale
(an fp32 number), skipped steps, unscaled gradients, the cap at fp32's range, fp16 refused."""
import pytest
import torch

from labkit.precision.scaler import DynamicLossScaler
from labkit.zero.scaling import ShardedLossScaler


def _pair(pattern, grads_of, **kw):
    """Run GradScaler and DynamicLossScaler side by side on the same gradients: per step, both
    scales (bits), whether each stepped, and both unscaled gradients."""
    gs = torch.amp.GradScaler("cpu", **kw)
    mine = DynamicLossScaler(**kw)
    p, q = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opt_p, opt_q = torch.optim.SGD([p], lr=0.0), torch.optim.SGD([q], lr=0.0)
    out = []
    for i, bad in enumerate(pattern):
        gs.scale(torch.zeros(()))              # GradScaler makes its fp32 scale tensor lazily
        s_torch, s_mine = gs.get_scale(), mine.scale
        p.grad = grads_of(i, s_torch)
        q.grad = p.grad.clone()
        if bad:
            p.grad[0] = q.grad[0] = float("inf")
        gs.unscale_(opt_p)
        stepped_torch = not sum(v.item() for v in gs._per_optimizer_states[id(opt_p)]
                                ["found_inf_per_device"].values())
        gs.step(opt_p)
        gs.update()
        stepped_mine = mine.step(opt_q, [q])
        out.append((s_torch, s_mine, stepped_torch, stepped_mine, p.grad.clone(), q.grad.clone()))
    return out


def _check(rows):
    for i, (st, sm, tt, tm, gp, gq) in enumerate(rows):
        assert st == sm, f"step {i}: GradScaler's scale {st!r}, labkit's {sm!r}"
        assert tt == tm, f"step {i}: stepped {tt} vs {tm}"
        assert torch.equal(gp.nan_to_num(), gq.nan_to_num()), f"step {i}: {gp} vs {gq}"


def _grads(i, scale):
    g = torch.tensor([0.3, 1e-3, 7.0]) * (1 + i)
    return (g.double() * scale).float()


def test_scale_capped_at_fp32_range_as_gradscaler():
    rows = _pair([False] * 6, lambda i, s: torch.ones(3), init_scale=2.0**126, growth_interval=1)
    _check(rows)
    assert rows[-1][1] == 2.0**127 and all(r[3] for r in rows)   # never 2^128, never skipped


@pytest.mark.parametrize("growth,backoff,interval", [(1.7, 0.3, 1), (3.1, 0.77, 2), (2.0, 0.5, 3)])
def test_odd_factors_match_bit_for_bit(growth, backoff, interval):
    pattern = [False, False, True, False, False, False, True, True] + [False] * 12
    rows = _pair(pattern, _grads, init_scale=1000.3, growth_factor=growth,
                 backoff_factor=backoff, growth_interval=interval)
    _check(rows)


def test_tiny_scale_underflow_matches():
    rows = _pair([True] * 12, _grads, init_scale=2.0**-120, backoff_factor=0.25)
    _check(rows)


def test_fp16_gradients_refused_as_gradscaler_refuses_them():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    p.grad = torch.full((2,), 1000.0, dtype=torch.float16)
    opt = torch.optim.SGD([p], lr=0.0)
    gs = torch.amp.GradScaler("cpu")
    gs.scale(torch.zeros(()))
    with pytest.raises(ValueError, match="FP16 gradients"):
        gs.unscale_(opt)
    with pytest.raises(ValueError, match="FP16 gradients"):
        DynamicLossScaler().unscale_([p.grad])


def test_fp16_gradients_allowed_unscale_in_fp32_like_torchs_kernel():
    """ShardedGradScaler's path: torch._amp_foreach_non_finite_check_and_unscale_ on fp16 grads.
    1000 / 2^25 is about 3e-5, an fp16 subnormal: not 0 (2^-25 itself is 0 in fp16)."""
    g = torch.tensor([1000.0, 3.0, 65504.0], dtype=torch.float16)
    want, found = g.clone(), torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_([want], found,
                                                     torch.full((), 2.0**-25))
    for cls in (lambda: DynamicLossScaler(init_scale=2.0**25, allow_fp16=True),
                lambda: ShardedLossScaler(init_scale=2.0**25)):
        got = g.clone()
        assert cls().unscale_([got]) is False and found.item() == 0
        assert torch.equal(got, want) and got[0] > 0
