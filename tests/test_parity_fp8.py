"""FP8 scaling as Transformer Engine's delayed-scaling recipe computes it: the scale is the
correctly rounded fp32 max / amax (checked against numpy's IEEE fp32 division), a zero, inf or NaN
amax keeps the previous scale, a non-finite amax never enters the history, and one inf in a
tensor saturates instead of turning the tensor into NaN."""
import numpy as np
import pytest
import torch

from labkit.precision import fp8, scaling
from labkit.precision.formats import info


def test_scale_is_the_correctly_rounded_quotient():
    g = torch.Generator().manual_seed(0)
    amax = torch.exp(torch.randn(20000, generator=g) * 8)                 # many magnitudes
    for fmt in ("e4m3", "e5m2"):
        got = fp8.tensor_scale(amax, fmt).numpy()
        want = np.float32(info(fmt).max) / amax.numpy().astype(np.float32)  # IEEE fp32 division
        assert np.array_equal(got, want), fmt


def test_zero_inf_nan_amax_keep_the_previous_scale():
    amax = torch.tensor([0.0, float("inf"), float("nan"), 2.0])
    assert fp8.tensor_scale(amax, "e4m3").tolist() == [1.0, 1.0, 1.0, 224.0]
    assert fp8.tensor_scale(amax, "e4m3", previous=3.5).tolist() == [3.5, 3.5, 3.5, 224.0]
    assert fp8.tensor_scale(1e-42, "e4m3").item() == torch.finfo(torch.float32).max


def test_one_inf_saturates_the_rest_stay_finite():
    x = torch.tensor([0.5, -3.0, float("inf"), 100.0])
    y = fp8.fake_tensor(x, "e4m3")
    assert y[2].item() == 448.0 and torch.isfinite(y).all()
    assert torch.equal(y[[0, 1, 3]], torch.tensor([0.5, -3.0, 96.0]))  # scale 1: e4m3 rounding
    yb = fp8.fake_blocks(x.view(1, 4), "e4m3")
    assert torch.isfinite(yb).all()


def test_inf_amax_never_enters_the_history():
    h = fp8.AmaxHistory(16)
    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    fp8.fake(x, "e4m3", "tensor", h)
    bad = x.clone()
    bad[3] = float("inf")
    fp8.fake(bad, "e4m3", "tensor", h)
    fp8.fake(torch.full((4,), float("nan")), "e4m3", "tensor", h)
    assert all(torch.isfinite(v) for v in h.values) and len(h.values) == 1
    for _ in range(16):                                        # the next steps: all finite
        assert torch.isfinite(fp8.fake(x, "e4m3", "tensor", h)).all()


def test_delayed_scaling_carries_the_previous_scale_through_zero_and_inf_steps():
    """As Transformer Engine's delayed-scaling update keeps the old scale where amax is 0 or not
    finite: a history of 2 after a step with amax 2 (scale 224) and then all-zero steps."""
    h = fp8.AmaxHistory(1)
    fp8.fake(torch.tensor([2.0, -1.0]), "e4m3", "tensor", h)   # first step: its own amax, 224
    assert h.scale.item() == 224.0
    fp8.fake(torch.zeros(3), "e4m3", "tensor", h)               # uses amax 2 (recorded before)
    assert h.scale.item() == 224.0
    y = fp8.fake(torch.tensor([0.0, 0.5]), "e4m3", "tensor", h)  # history holds 0: scale kept
    assert h.scale.item() == 224.0 and y.tolist() == [0.0, 0.5]
    fp8.fake(torch.tensor([float("inf")]), "e4m3", "tensor", h)  # history 0.5: 896
    assert h.scale.item() == 896.0
    fp8.fake(torch.tensor([1.0]), "e4m3", "tensor", h)          # inf never entered: 0.5 still
    assert h.scale.item() == 896.0


# Scaling recipes (labkit.precision.scaling) against the sources' formulas and torch's own casts.

def _torchao_rowwise_scale(x):
    """torchao/float8/float8_utils.py, amax_to_scale + _round_scale_down_to_power_of_2, as the
    `rowwise` recipe calls them (axiswise along the last dim, round_scales_to_power_of_2=True)."""
    amax = torch.amax(torch.abs(x), dim=-1, keepdim=True).to(torch.float64)
    res = (torch.finfo(torch.float8_e4m3fn).max / torch.clamp(amax, min=1e-12)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(res)))


def test_rowwise_scales_are_torchaos_and_the_cast_is_torchs():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 256, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 3)
    s = scaling.axis_scale(x)
    assert torch.equal(s, _torchao_rowwise_scale(x))
    assert torch.equal(torch.log2(s), torch.log2(s).round())             # powers of two
    want = (x * s).to(torch.float8_e4m3fn).float() / s                   # torch's cast, in range
    assert torch.equal(scaling.fake_rows(x), want)
    assert ((x * s).abs().amax(-1) <= 448).all() and ((x * s).abs().amax(-1) > 224).all()


def test_current_scaling_is_the_tensors_own_amax_and_delayed_saturates_a_new_outlier():
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(5))
    assert torch.equal(scaling.fake(x, "current", "activation"), fp8.fake_tensor(x, "e4m3"))
    big = x.clone()
    big[0, 0] = 100 * x.abs().max()
    y = scaling.fake(big, "delayed", "activation", history_amax=x.abs().max())
    assert abs(y[0, 0] - x.abs().max()) < 1e-5 * x.abs().max()       # clamped at 448 / s
    assert torch.isfinite(y).all()
    with pytest.raises(ValueError, match="history_amax"):
        scaling.fake(x, "delayed", "activation")
    with pytest.raises(ValueError, match="rowwise"):
        scaling.fake(x, "columnwise", "activation")


def test_power_of_two_block_scales_stay_powers_of_two_and_below_the_fp32_scale():
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(6))
    _, s32 = fp8.quantize_blocks(x, "e4m3", (128, 128))
    s2 = scaling.pow2(s32)
    assert (s2 <= s32).all() and (s2 > s32 / 2).all()
    y = scaling.fake_blocks(x, "e4m3", (128, 128), power_of_2=True)
    full = s2.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(y, (x * full).to(torch.float8_e4m3fn).float() / full)


def test_requantizing_a_1d_scaled_copy_for_the_transpose_costs_a_second_rounding():
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(7))
    e = scaling.transposed_errors(x)
    assert e["requantized"] > 1.2 * e["from_source"] > 0
