"""costs.hiding: each axis's crossover against numbers worked by hand, and the lab's fit."""
import math

import pytest

from labkit.costs import hiding, scaling
from labkit.labs._crossover import measured_crossover

C, BW = 500e12, 450e9          # FLOP/s and bytes/s per direction: C/bw = 1111.1 FLOPs per byte


def test_intensity_is_flops_per_byte():
    assert hiding.intensity(C, BW) == pytest.approx(1111.111, rel=1e-6)
    with pytest.raises(ValueError, match="bandwidth"):
        hiding.intensity(C, 0)


def test_dp_crossover_is_c_over_bw_for_16_bit_gradients():
    # 7B params, 8 ranks, bf16 grads: comm = 2*7/8*14e9 B / 450e9 = 0.05444 s;
    # backward 4*7e9/500e12 = 5.6e-5 s a token; 0.05444 / 5.6e-5 = 972.2 = 7/8 * 1111.1
    x = hiding.dp(7e9, 8, C, BW, reduce_dtype="bf16")
    assert x.value == pytest.approx(972.22, rel=1e-4)
    assert x.binds.startswith("bandwidth") and x.hides(1000) and not x.hides(900)
    # fp32 gradients double it; alpha adds n_buckets * 2(N-1) alpha = 10 * 14 * 5us = 0.7 ms
    assert hiding.dp(7e9, 8, C, BW, grad_bytes=4).value == pytest.approx(2 * 972.22, rel=1e-4)
    lat = hiding.dp(7e9, 8, C, BW, alpha=5e-6, grad_bytes=2, n_buckets=10)
    assert lat.value == pytest.approx((0.054444 + 0.0007) / 5.6e-5, rel=1e-4)
    # a tiny model on a slow-latency link: alpha binds
    assert hiding.dp(1e3, 8, C, BW, alpha=1e-3, grad_bytes=2).binds.startswith("latency")
    assert hiding.dp(7e9, 1, C, BW).value == 0


def test_dp_step_time_matches_scaling_step_time():
    # 2000 tokens: forward 2*7e9*2000/C = 0.056 s, backward 0.112 > comm 0.0544: all hidden
    p = hiding.dp_step_time(2000, 7e9, 8, C, BW, grad_bytes=2, slowdown=scaling.OVERLAP_SLOWDOWN)
    assert p["exposed"] == 0
    assert p["step"] == pytest.approx(0.056 + 0.112 + 0.189 * 0.054444, rel=1e-4)
    # 500 tokens: backward 0.028 s < comm 0.0544: the rest is exposed
    q = hiding.dp_step_time(500, 7e9, 8, C, BW, reduce_dtype="bf16")
    assert q["exposed"] == pytest.approx(0.054444 - 0.028, rel=1e-4)
    assert q["step"] == pytest.approx(0.014 + 0.054444, rel=1e-4)


def test_zero3_is_dp_per_micro_batch():
    # forward: all-gather 7/8*14e9/450e9 = 0.027222 s under 2P/C a token -> 972.2 tokens;
    # backward: all-gather + reduce-scatter under 4P/C -> the same 972.2
    z = hiding.zero3(7e9, 8, C, BW, reduce_dtype="bf16")
    assert z.value == pytest.approx(972.22, rel=1e-4)
    assert z.terms["forward_tokens"] == pytest.approx(z.terms["backward_tokens"])
    # fp32 gradients: only the backward grows, (14e9 + 28e9) * 7/8 / 450e9 * C / (4 * 7e9)
    z32 = hiding.zero3(7e9, 8, C, BW, grad_bytes=4)
    assert z32.binds.startswith("backward")
    assert z32.value == pytest.approx(1458.33, rel=1e-4)


def test_gradient_reduction_defaults_to_fp32_and_bf16_halves_the_bytes():
    """fp32 reduction is the default (Megatron under --bf16, torchtitan, Llama 3, DDP under
    autocast); bf16 is the opt-in; explicit bytes still work and must agree with a named dtype."""
    assert hiding.dp(7e9, 8, C, BW).value == pytest.approx(2 * 972.22, rel=1e-4)
    assert hiding.dp(7e9, 8, C, BW).terms["grad_bytes"] == 4
    assert hiding.dp(7e9, 8, C, BW, grad_bytes=4).value == hiding.dp(7e9, 8, C, BW).value
    assert hiding.dp(7e9, 8, C, BW, reduce_dtype="bf16").value == pytest.approx(972.22, rel=1e-4)
    # ZeRO-3 with bf16 gathers: the backward moves (2 + e_g) bytes a parameter under 4P/C
    # tokens, so fp32 reduction binds at 1.5 (N-1)/N C/bw, 1.5x bf16's (N-1)/N C/bw
    z32, z16 = hiding.zero3(7e9, 8, C, BW), hiding.zero3(7e9, 8, C, BW, reduce_dtype="bf16")
    assert z32.value == pytest.approx(1.5 * 7 / 8 * C / BW, rel=1e-9)
    assert z16.value == pytest.approx(7 / 8 * C / BW, rel=1e-9)
    with pytest.raises(ValueError, match="reduce_dtype='fp32'"):
        hiding.dp(7e9, 8, C, BW, reduce_dtype="float32")
    with pytest.raises(ValueError, match="disagrees"):
        hiding.zero3(7e9, 8, C, BW, grad_bytes=4, reduce_dtype="bf16")


def test_dp_counts_only_the_backward():
    """Chapter 02's t* = (N-1)/N * (e/2) * C/bw, exactly (alpha = 0): no gradient exists during
    the forward, so the forward's 2P FLOPs a token do not hide the all-reduce."""
    for n in (2, 8, 512):
        for e in (2, 4):
            want = (n - 1) / n * (e / 2) * C / BW
            assert hiding.dp(7e9, n, C, BW, grad_bytes=e).value == pytest.approx(want, rel=1e-12)
    # a rule that let the forward hide it too (6P FLOPs) would be 1.5x lower
    assert hiding.dp(7e9, 8, C, BW, grad_bytes=2).value == pytest.approx(
        1.5 * (2 / 3) * 7 / 8 * C / BW, rel=1e-12)


def test_dp_tail_bucket_is_exposed_at_any_batch():
    """The last bucket (first layers, embedding) is all-reduced after the backward ends: its
    time is exposed however many tokens (referee D8)."""
    tail_bytes = 25 * 2**20
    tail = 2 * 7 / 8 * tail_bytes / BW                       # ring all-reduce, alpha = 0
    x = hiding.dp(7e9, 8, C, BW, tail_bytes=tail_bytes)
    assert x.terms["tail_s"] == pytest.approx(tail, rel=1e-9)
    for tokens in (500, 5000, 50000):
        p = hiding.dp_step_time(tokens, 7e9, 8, C, BW, tail_bytes=tail_bytes)
        assert p["tail"] == pytest.approx(tail, rel=1e-9) and p["exposed"] >= tail
    big = hiding.dp_step_time(50000, 7e9, 8, C, BW, tail_bytes=tail_bytes)
    assert big["step"] == pytest.approx(big["forward"] + big["backward"] + tail, rel=1e-9)


def test_tp_width_crossover_and_largest_degree():
    # alpha = 0: h* = (tp - 1) * e / 6 * C / bw = 7 * 2/6 * 1111.1 = 2592.6 for tp = 8
    t = hiding.tp(8, C, BW)
    assert t.value == pytest.approx(2592.59, rel=1e-4)
    assert t.hides(8192) and not t.hides(2048)
    # at that width the layer's forward matmuls take exactly the two all-reduces' time
    h, tokens = t.value, 4096
    assert 2 * 12 * h * h * tokens / (8 * C) == pytest.approx(t.terms["allreduce_s_at_h"], rel=1e-6)
    # the largest degree at h = 8192: 1 + 12 * 8192 * 450e9 / (2 * 2 * 500e12) = 23.1 -> 23
    assert hiding.tp_max_degree(8192, C, BW) == 23
    # alpha raises the width needed
    assert hiding.tp(8, C, BW, alpha=5e-6, tokens=1024).value > t.value
    assert hiding.tp(1, C, BW).value == 0


def test_pp_and_pp_vs_zero3():
    # h * L_s >= e C / (24 bw): 2 * 1111.1 / 24 / 10 layers = 9.26
    assert hiding.pp(10, C, BW).value == pytest.approx(9.259, rel=1e-3)
    # ZeRO-3 over 8: 3 * 7/8 * 2 * 1e9 bytes; PP: 2 * 4096 * 2 bytes a token -> 320,434 tokens
    x = hiding.pp_vs_zero3(4096, 1e9, 8)
    assert x.terms["zero3_bytes"] == pytest.approx(5.25e9)
    assert x.value == pytest.approx(5.25e9 / 16384, rel=1e-9)


def test_cp_sequence_crossover():
    # multi-head, 16-bit: s/cp >= kv/h * e/2 * C/bw = C/bw = 1111.1; GQA with kv = h/8: 138.9
    assert hiding.cp(4, 8192, 8192, C, BW).value == pytest.approx(1111.11, rel=1e-5)
    assert hiding.cp(4, 8192, 1024, C, BW).value == pytest.approx(138.889, rel=1e-5)
    # with alpha, the hop must also pay it: 4 b c^2 h / C = alpha + 2 b c kv e / bw at the root
    c = hiding.cp(4, 8192, 1024, C, BW, alpha=5e-6).value
    assert 4 * c * c * 8192 / C == pytest.approx(5e-6 + 2 * c * 1024 * 2 / BW, rel=1e-9)
    assert hiding.cp(1, 8192, 1024, C, BW).value == 0


def test_measured_crossover_solves_the_fitted_power_law():
    tokens = [8, 16, 32, 64]
    comm = [0.1] * 4
    backward = [0.1 * t / 24 for t in tokens]          # ratio 24/t: exactly 1 at 24 tokens
    assert measured_crossover(tokens, comm, backward) == pytest.approx(24.0, rel=1e-9)
    assert measured_crossover(tokens, backward, comm) is None      # ratio rising: no crossover
    assert math.isfinite(measured_crossover([1, 2], [2.0, 1.1], [1.0, 1.0]))


def _right(n_params, world, flops_per_s, bandwidth, alpha, grad_bytes, n_buckets):
    comm = (n_buckets * 2 * (world - 1) * alpha
            + 2 * (world - 1) / world * n_params * grad_bytes / bandwidth)
    return comm * flops_per_s / (4 * n_params)


def _whole_step(n_params, world, flops_per_s, bandwidth, alpha, grad_bytes, n_buckets):
    return _right(n_params, world, flops_per_s, bandwidth, alpha, grad_bytes, n_buckets) * 4 / 6


def test_exercise_2_4_grades_the_crossover():
    from labkit.check import ch02

    assert ch02.crossover_batch(_right).score == ch02.EXERCISES["2.4"][1]
    res = ch02.crossover_batch(_whole_step)
    assert res.score == 0 and "BACKWARD only" in res.cases[0]["message"]


def test_lab_tables_show_fp32_and_bf16_reduction():
    """The crossover labs' tables (overlap, overlap_zero3) name fp32 reduction, the measured run's,
    and print bf16's prediction beside it."""
    from labkit.labs._crossover import batch_rows

    res = {"cfg": {"block_size": 8}, "predicted_tokens": 200.0,
           "predicted_tokens_bf16_reduce": 100.0, "predicted_timed_tokens": 180.0,
           "backward_fixed_s": 0.01, "measured_tokens": 190.0, "extrapolated": False}
    rows = dict(batch_rows(res, "dp", "backward", "all-reduce", "busy = backward"))
    (fp32,) = [k for k in rows if "fp32 gradient reduction" in k]
    (bf16,) = [k for k in rows if "bf16 gradient reduction" in k]
    assert rows[fp32].startswith("200 tokens") and rows[bf16].startswith("100 tokens")
