"""FP8 scaling as Transformer Engine's delayed-scaling recipe computes it: the scale is the
correctly rounded fp32 max / amax (checked against numpy's IEEE fp32 division), a zero, inf or NaN
amax keeps the previous scale, a non-finite amax never enters the history, and one inf in a
tensor saturates instead of turning the tensor into NaN."""
import numpy as np
import torch

from labkit.precision import fp8
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
