"""Rooflines: labkit.costs.roofline's formulas against hand counts, labkit.roofline's measurement
(positive, finite), the figure placing points where the formulas say, the calculator's text, and
exercise 0.4's checker on right and wrong answers. About 10 s, most of it the timed kernels."""
import math
import subprocess
import sys

import pytest

from labkit.costs import chips
from labkit.costs import roofline as rl


def test_matmul_counts_two_flops_per_term_and_each_tensor_once():
    op = rl.matmul_mkn(2, 3, 4, "fp32")
    assert op.flops == 2 * 2 * 3 * 4 == 48
    assert op.bytes == 4 * (2 * 3 + 3 * 4 + 2 * 4) == 104
    assert op.intensity == pytest.approx(48 / 104)
    # (b, s, h) x (h, h'): the b*s tokens are the rows
    assert rl.matmul(2, 5, 8, 16, "bf16") == rl.matmul_mkn(10, 8, 16, "bf16", "matmul")
    # few tokens: intensity -> 2 * tokens / itemsize (here 2 * 1 / 2 = 1 FLOP/byte, bf16)
    assert rl.matmul(1, 1, 8192, 8192, "bf16").intensity == pytest.approx(1.0, rel=1e-3)


def test_attention_fused_keeps_the_scores_off_memory():
    b, s, heads, d = 1, 16, 2, 4                     # h = 8
    flops = 4 * b * heads * s * s * d                # QK^T and PV, 2 FLOPs per term each
    fused = rl.attention(b, s, heads, d, "fp16", fused=True)
    unfused = rl.attention(b, s, heads, d, "fp16", fused=False)
    assert fused.flops == unfused.flops == flops == 8192
    assert fused.bytes == 2 * 4 * b * s * heads * d == 1024                    # Q, K, V, O
    assert unfused.bytes == 1024 + 2 * 4 * b * heads * s * s == 1024 + 4096    # + 4 passes of S
    assert fused.intensity == 8 and unfused.intensity == 1.6


def test_elementwise_layernorm_and_adam_by_hand():
    add = rl.elementwise(1000, "fp32", 1, reads=2)
    assert (add.flops, add.bytes) == (1000, 12000)
    ln = rl.layernorm(2, 3, 4, "bf16")
    assert (ln.flops, ln.bytes) == (8 * 24, 2 * 2 * 24)
    adam = rl.adam_step(10)
    assert (adam.flops, adam.bytes) == (120, 280) and adam.intensity == pytest.approx(12 / 28)


def test_roofline_attainable_ridge_and_bound():
    peak, bw = 100.0, 10.0                           # ridge at 10 FLOPs/byte
    assert rl.ridge(peak, bw) == 10
    assert rl.attainable(2, peak, bw) == 20          # memory roof: I * W
    assert rl.attainable(50, peak, bw) == 100        # compute roof
    assert rl.bound(2, peak, bw) == "memory" and rl.bound(10, peak, bw) == "compute"
    assert rl.seconds(rl.Op("x", 400, 10), peak, bw) == 4       # compute: 400 / 100
    assert rl.seconds(rl.Op("y", 100, 100), peak, bw) == 10     # memory: 100 / 10
    # MFU ceiling: 400 FLOPs in 4 s + 100 FLOPs in 10 s -> 500 / (100 * 14)
    assert rl.mfu_ceiling([rl.Op("x", 400, 10), rl.Op("y", 100, 100)], peak, bw) == \
        pytest.approx(500 / 1400)
    with pytest.raises(ValueError):
        rl.attainable(0, peak, bw)


def test_datasheet_chips_and_their_ridges():
    h100, a100 = chips.CHIPS["H100 80GB"], chips.CHIPS["A100 80GB"]
    assert h100.peak_flops("bf16") == 989.5e12 and h100.bandwidth == 3.35e12
    assert h100.ridge("bf16") == pytest.approx(295.4, abs=0.1)
    assert a100.ridge("bf16") == pytest.approx(312e12 / 2.039e12)
    assert rl.bound(rl.matmul(1, 4096, 4096, 4096).intensity, "H100 80GB", "bf16") == "compute"
    assert rl.bound(rl.matmul(1, 1, 4096, 4096).intensity, "H100 80GB", "bf16") == "memory"
    with pytest.raises(KeyError, match="choose one of"):
        a100.peak_flops("fp8")


def test_costs_roofline_imports_no_torch():
    """The website runs labkit.costs in Pyodide, where there is no torch."""
    code = "import sys, labkit.costs.roofline; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.fixture(scope="module")
def measured():
    from labkit import roofline as here

    return here.measure(sizes=(64, 128), nbytes=4 * 2**20, min_run_time=0.01)


def test_measurement_gives_positive_finite_roofs(measured):
    assert set(measured.peak) == {"fp32"}
    for v in [*measured.peak.values(), measured.bandwidth]:
        assert math.isfinite(v) and v > 0
    assert measured.peak["fp32"] == max(f for _, _, f in measured.matmuls)
    assert measured.bandwidth == max(bw for _, _, bw in measured.copies)
    assert [w for w, _, _ in measured.copies] == ["read", "copy", "add"]


def test_figure_places_predicted_on_the_roof_and_measured_at_flops_over_seconds(measured):
    from labkit.widgets import roofline as rw

    points = [(rl.matmul_mkn(1, 64, 64, "fp32", "matvec"), 1e-5),
              (rl.matmul_mkn(64, 64, 64, "fp32", "square"), 1e-4)]
    gpu_ops = [rl.adam_step(1e6)]
    fig = rw.figure(measured, points, gpu_ops)
    traces = {t.name: t for t in fig.data}
    peak, bw = measured.peak["fp32"], measured.bandwidth
    pred = traces["here: predicted"]
    assert list(pred.x) == [o.intensity for o, _ in points]
    assert list(pred.y) == [rl.attainable(o.intensity, peak, bw) for o, _ in points]
    assert list(traces["here: measured"].y) == [o.flops / t for o, t in points]
    h100 = chips.CHIPS["H100 80GB"]
    assert list(traces["ops on H100 80GB (predicted)"].y) == [h100.bandwidth * 12 / 28]


def test_calculator_text_comes_from_costs():
    from labkit.widgets import roofline as rw

    op = rl.matmul(4, 512, 4096, 4 * 4096, "bf16")
    line = rw.verdict("MLP up (matmul)", 4, 512, 4096, "A100 80GB")
    assert f"{op.intensity:,.1f} FLOPs/byte" in line and "compute-bound" in line
    assert "memory-bound" in rw.verdict("layernorm", 4, 512, 4096, "H100 80GB")
    assert rw.layer_op("attention (fused)", 1, 512, 4096) == rl.attention(1, 512, 32, 128)


def _predict(m, k, n, itemsize, peak, bandwidth, half_flops=False, no_output=False):
    flops = (1 if half_flops else 2) * m * k * n
    nbytes = itemsize * (m * k + k * n + (0 if no_output else m * n))
    i = flops / nbytes
    return {"flops": flops, "bytes": nbytes, "intensity": i,
            "bound": "compute" if i >= peak / bandwidth else "memory",
            "seconds": max(flops / peak, nbytes / bandwidth)}


@pytest.mark.parametrize("wrong, hint", [
    (dict(), None), (dict(half_flops=True), "2*m*k*n"), (dict(no_output=True), "output")])
def test_exercise_0_4_checker(wrong, hint):
    from labkit.check.ch00 import roofline as ch00_roofline

    result = ch00_roofline.roofline_matmul(lambda *a: _predict(*a, **wrong),
                                           cases=[(64, 256, 64)])
    msgs = "\n".join(c["message"] for c in result.cases)
    if hint is None:
        assert result.score == 2 and "measured" in result.cases[0]["name"], msgs
    else:
        assert result.score == 0 and hint in msgs, msgs
