"""Guards for the third referee's items on chapters 00 and 06 (E3, E6, D6, D11; issues #36, #37):
each fixed statement stays fixed, and its printed numbers are still what labkit computes now."""
from __future__ import annotations

import pytest
from saved_notebooks import CHAPTERS, markdown, output

from labkit.costs import chips, comm, hiding, models
from labkit.costs import roofline as rl

CH00 = CHAPTERS / "00_why_distribute.ipynb"
CH06 = CHAPTERS / "06_checkpointing.ipynb"


def test_e6_residual_add_is_one_sixth_of_a_flop_per_byte_in_bf16():
    text = markdown(CH00)
    assert "layernorm, GELU, residual add | a few per element" not in text
    assert "| residual add | 1 per element | 3e per element" in text and "≈ 0.17 in bf16" in text
    add = rl.elementwise(2**20, "bf16", 1, reads=2)
    assert add.intensity == pytest.approx(1 / 6)
    assert f"residual add: 1 FLOPs and 6 bytes per element -> {add.intensity:.2f}" in \
        output(CH00, "rf00a002")


def test_e3_ddp_hides_only_under_the_backward_with_both_gradient_dtypes():
    text = markdown(CH00)
    assert "⅔ · MFU" not in text and "\\tfrac{2}{3}" not in text      # the forward hides nothing
    assert "(N−1)/N · (e/2) · MFU · P / W_link" in text              # chapter 02's condition
    n = models.num_params(models.preset("llama2-7b"))
    link = comm.LINKS["InfiniBand NDR 400 Gb/s"]
    c = 0.5 * chips.CHIPS["H100 80GB"].peak_flops("bf16")
    out = output(CH00, "rf00b002")
    for e, what, gpus in ((2, "bf16", 421), (4, "fp32", 211)):
        t = hiding.dp(n, 512, c, link.bandwidth, link.alpha, grad_bytes=e).value
        assert round(4 * 2**20 / t) == gpus
        assert f"{what} gradients: compute-bound up to ~{gpus:,} GPUs" in out
        assert f"{t:,.0f}" in text                                   # the prose quotes them
    assert "about 421 GPUs with bf16 gradients" in text and "about 211 with fp32" in text


def test_d6_measured_roofs_and_mfu_stand_beside_the_datasheet():
    out = output(CH00, "cal00a01")
    m, sheet = chips.chip("H200 141GB (measured)"), chips.chip("H200 141GB")
    for ratio, printed in ((m.peak["bf16"] / sheet.peak["bf16"], "0.80"),
                           (m.bandwidth / sheet.bandwidth, "0.90")):
        assert f"{ratio:.2f}" == printed and printed in out
    assert "H200 measured" in output(CH00, "rf00a007")
    mfu = output(CH00, "cal00a04")
    assert "52.2%" in mfu and "56.0%" in mfu
    text = markdown(CH00)
    assert "Practical GEMM roofs are about 80%" in text and "HBM roofs about 90%" in text


def test_d11_the_sources_inconsistent_share_is_said():
    text = markdown(CH06)
    assert "148 of the 419 is 35.3%" in text
    assert round(100 * 148 / 419, 1) == 35.3


def test_ch06_cites_the_recompute_factor_measured_on_a_gpu():
    out = output(CH06, "cal06a02")
    r = chips.measurements("H200 141GB (measured)")["recompute_every_block"]["bf16"]
    assert f"{r['measured_factor']:.2f}" == "1.24" and "1.24" in out and "1.32" in out
    assert "1.24× the step under autocast" in markdown(CH06)
