"""Utilisation from a report's GPU-hours (costs.reported): DeepSeek-V3's pre-training."""
import pytest

from labkit.costs import flops, reported


def test_deepseek_v3_attention_aside_by_hand():
    """6 x 37e9 x 14.8e12 FLOPs over 2.664e6 GPU-hours: 342.6 TFLOP/s per GPU, 34.6% of the
    989.5 TFLOP/s dense BF16 peak and half that of the FP8 peak."""
    row = reported.deepseek_v3()[0]
    by_hand = 6 * 37e9 * 14.8e12 / (2.664e6 * 3600)
    assert row["per_gpu"] == pytest.approx(by_hand) == pytest.approx(342.6e12, rel=1e-3)
    assert row["mfu_bf16"] == pytest.approx(by_hand / 989.5e12)
    assert row["mfu_fp8"] == pytest.approx(row["mfu_bf16"] / 2)
    assert row["mfu_bf16"] < reported.LLAMA3_405B_MFU[0]          # below Llama 3's 38%


def test_attention_uses_the_flops_formula_and_mla_widths():
    """MLA at 4K: 6 L s heads (dqk + dv) per token = 6 x 61 x 4096 x 128 x 320, through
    costs.flops.model_flops_per_token; the causal mask halves that term."""
    rows = reported.deepseek_v3()
    attn = 6 * 61 * 4096 * 128 * (192 + 128)
    assert rows[1]["flops_per_token"] == pytest.approx(6 * 37e9 + attn)
    assert rows[2]["flops_per_token"] == pytest.approx(6 * 37e9 + attn / 2)
    assert rows[1]["flops_per_token"] == flops.model_flops_per_token(37e9, 61, 128 * 160, 4096)
    assert rows[0]["mfu_bf16"] < rows[2]["mfu_bf16"] < rows[1]["mfu_bf16"]


def test_bad_input_names_a_working_value():
    with pytest.raises(ValueError, match="gpu_hours=2.664e6"):
        reported.from_gpu_hours(37e9, 14.8e12, 0, "H800 80GB")
