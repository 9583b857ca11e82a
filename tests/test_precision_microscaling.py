"""MXFP8 and NVFP4 emulation (labkit.precision.mx, .nvfp4): codebooks bit for bit, the scale
rules against Transformer Engine's and torchao's bit-level code, torch's own dtypes where the CPU
build casts them, stochastic rounding's bias, the Hadamard transform, saturation counts."""
import pytest
import torch

from labkit.labs.precision import microscaling
from labkit.precision import mx, nvfp4
from labkit.precision.formats import relative_error


def _amaxes(n=4000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.exp2(torch.empty(n).uniform_(-30, 30, generator=g))      # random magnitudes
    exact = torch.exp2(torch.arange(-20, 21).float())                  # powers of two
    edges = torch.tensor([448.0, 224.0, 896.0, 448.0 * 1.75, 1.75, 1.875, 255.0, 256.0, 257.0])
    return torch.cat([x, exact, exact * 448, exact * 1.75, edges])


def _te_float_to_e8m0(val: torch.Tensor) -> torch.Tensor:
    """transformer_engine/common/util/ptx_arch_spec.cuh, float_to_e8m0, pre-Blackwell branch,
    line for line on the fp32 bits (positive finite inputs): biased exponent, +1 if the mantissa
    is non-zero (and not a subnormal <= 2^-127), saturating at 0xFE."""
    u = val.float().view(torch.int32).long()
    exponent, mantissa = u >> 23, u & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    return exponent + up.long()


def test_rceil_is_transformer_engines_float_to_e8m0_bit_for_bit():
    amax = _amaxes()
    descale = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32)    # TE: amax * max_norm_rcp
    assert torch.equal(mx.scale_exponent(amax, "rceil").long() + 127, _te_float_to_e8m0(descale))


def test_floor_and_ceil_are_torchaos_bit_extraction():
    """torchao/prototype/mx_formats/mx_tensor.py, to_mx: the fp32 exponent field minus the bias,
    (+1 if the mantissa is non-zero for CEIL), minus F8E4M3_MAX_POW2 = 8."""
    amax = _amaxes()
    u = amax.view(torch.int32).long()
    pow2 = ((u >> 23) & 0xFF) - 127
    assert torch.equal(mx.scale_exponent(amax, "floor").long(), pow2 - 8)
    assert torch.equal(mx.scale_exponent(amax, "ceil").long(), pow2 + ((u & 0x7FFFFF) > 0) - 8)


def test_block_max_lands_where_each_rule_says():
    amax = _amaxes()
    for rule, lo, hi in (("floor", 256, 512), ("rceil", 224, 448), ("ceil", 128, 256)):
        r = amax / torch.exp2(mx.scale_exponent(amax, rule).float())
        assert ((r >= lo) & (r <= hi)).all(), rule
    r = amax / torch.exp2(mx.scale_exponent(amax, "rceil").float())
    assert (r > 224).all()            # rounded up by at most one binade: never more room wasted


def test_e8m0_scales_are_powers_of_two_in_torchs_dtype():
    e = torch.arange(-127, 128)
    s = mx.e8m0(e)
    assert s.dtype == torch.float8_e8m0fnu
    assert torch.equal(s.view(torch.uint8).long(), e.long() + 127)       # the E8M0 code: e + 127
    assert torch.equal(s.float(), torch.exp2(e.float()))
    m, _ = torch.frexp(s.float())
    assert (m == 0.5).all()                                              # one bit set: 2^k


def test_mxfp8_round_trip_and_saturation_counts():
    x = torch.tensor([[416.0] + [1.0] * 31, [480.0] + [1.0] * 31])     # 1.625 * 2^8, 1.875 * 2^8
    q, e, sat = mx.quantize_mx(x, "floor")
    assert e.tolist() == [[0], [0]] and sat.sum().item() == 1 and sat[1, 0]
    assert mx.dequantize_mx(q, e)[1, 0].item() == 448.0                 # clamped at E4M3's max
    q, e, sat = mx.quantize_mx(x, "rceil")
    assert sat.sum().item() == 0 and e.tolist() == [[0], [1]]
    assert torch.equal(mx.dequantize_mx(q, e), x)                       # all exactly in E4M3
    with pytest.raises(ValueError, match="multiple of the block"):
        mx.quantize_mx(torch.ones(2, 33))
    with pytest.raises(ValueError, match="rule must be one of"):
        mx.scale_exponent(torch.ones(1), "nearest")


def test_mxfp8_rules_table_floor_saturates_the_others_do_not():
    rows = mx.rule_table(rows=32, cols=256)
    for r in rows:
        assert (r["saturated"] > 0) == (r["rule"] == "floor"), r
        assert r["rel_error"] < 0.05


def test_e2m1_codebook_and_ties_to_even():
    assert nvfp4.E2M1.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    # every value round-trips; halfway points go to the even code (TE's cast_to_fp4x2)
    v = torch.cat([nvfp4.E2M1, -nvfp4.E2M1])
    assert torch.equal(nvfp4.round_e2m1(v), v)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert nvfp4.round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert nvfp4.round_e2m1(-ties).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    near = torch.tensor([0.26, 0.74, 1.3, 2.6, 3.4, 5.1, 0.2])
    assert nvfp4.round_e2m1(near).tolist() == [0.5, 0.5, 1.5, 3.0, 3.0, 6.0, 0.0]


def test_e2m1_codes_match_torchs_float4_layout_where_the_cpu_build_decodes_it():
    """The 4-bit codes sign<<3 | index packed two per byte (low nibble first, as torchao's
    pack_uint4) in torch.float4_e2m1fn_x2; this torch's CPU build stores the dtype but may not
    convert it, in which case the decode half of the check is skipped."""
    v = torch.cat([nvfp4.E2M1, -nvfp4.E2M1[1:], torch.tensor([0.0])])  # 16 values
    c = nvfp4.codes(v)
    assert c.tolist() == list(range(8)) + list(range(9, 16)) + [0]
    packed = (c[1::2] << 4) | c[::2]                                    # (8,) uint8
    f4 = packed.view(torch.float4_e2m1fn_x2)
    assert f4.dtype == torch.float4_e2m1fn_x2 and f4.shape == (8,)
    try:
        decoded = f4.float()
    except (RuntimeError, NotImplementedError):
        pytest.skip("this CPU build of torch cannot convert float4_e2m1fn_x2")
    assert decoded.numel() == 16 and torch.equal(decoded, v)


def test_stochastic_rounding_is_unbiased_and_nearest_is_not():
    """v = 1.2 lies 0.4 of the way from 1 to 1.5: SR gives 1.5 with probability 0.4, so the mean
    of n draws is 1.2 within 5 standard errors, 0.5 * sqrt(0.4 * 0.6 / n); RN always gives 1."""
    n = 200_000
    g = torch.Generator().manual_seed(0)
    for v in (1.2, -2.7, 0.1, 5.5):
        draws = nvfp4.round_e2m1(torch.full((n,), v), stochastic=True, generator=g)
        lo_hi = torch.unique(draws)
        assert lo_hi.numel() == 2                                       # only the two neighbours
        gap = float(lo_hi[1] - lo_hi[0])
        p = (abs(v) - float(lo_hi.abs().min())) / gap
        se = gap * (p * (1 - p) / n) ** 0.5
        assert abs(draws.mean().item() - v) < 5 * se, v
    assert nvfp4.round_e2m1(torch.tensor([1.2])).item() == 1.0


def test_hadamard_is_orthogonal_and_round_trips():
    h = nvfp4.hadamard()
    assert torch.allclose(h @ h.t(), torch.eye(16), atol=1e-6)
    assert set((h * 4).abs().unique().tolist()) == {1.0}                # +-1 / sqrt(16)
    assert torch.equal(torch.sign(h[:, 0]) * 4 * h[0, 0], nvfp4.TE_SIGNS)
    x = torch.randn(8, 64)
    assert torch.allclose(nvfp4.rht(nvfp4.rht(x), h.t()), x, atol=1e-5)
    a, b = torch.randn(32, 64), torch.randn(16, 64)
    assert torch.allclose(nvfp4.rht(a) @ nvfp4.rht(b).t(), a @ b.t(), atol=1e-4)
    with pytest.raises(ValueError, match="power of two"):
        nvfp4.hadamard(12)


def test_nvfp4_two_level_scale_and_block_shapes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g)
    t = nvfp4.quantize(x)
    assert t["s_block"].dtype == torch.float8_e4m3fn and t["s_block"].shape == (32, 4)
    assert t["s_global"].item() == pytest.approx(x.abs().max().item() / (448 * 6))
    assert set(t["q"].abs().unique().tolist()) <= set(nvfp4.E2M1.tolist())
    assert relative_error(nvfp4.dequantize(t), x) < 0.15
    w = nvfp4.quantize(x, block2d=True)["s_block"]                      # one scale per 16x16
    assert torch.equal(w, w[::16].repeat_interleave(16, 0))
    # tiny tensors: without the per-tensor scale every block scale underflows E4M3
    small = x * 1e-6
    assert relative_error(nvfp4.fake(small, per_tensor=False), small) == 1.0
    assert relative_error(nvfp4.fake(small), small) < 0.15


def test_nvfp4_saturation_is_the_block_scale_rounded_down():
    """A block of 16 equal values 1.0 except a max m: s_block = m/6 in E4M3; where that rounds
    down, m * enc > 6 and m clamps (saturated), where it rounds up nothing does."""
    down, up = 6 * 1.06, 6 * 1.1                                       # 1.06 -> 1.0, 1.1 -> 1.125
    x = torch.ones(2, 16)
    x[0, 0], x[1, 0] = down, up
    sat = nvfp4.quantize(x, per_tensor=False)["saturated"]
    assert sat[0, 0] and sat.sum().item() == 1


def test_microscaling_experiments_small():
    rows = microscaling.rounding(draws=16)
    sr = next(r for r in rows if r["rounding"] == "stochastic")
    rn = next(r for r in rows if r["rounding"] == "nearest")
    assert sr["mean"] < rn["mean"] and sr["one"] > rn["one"]
    g = microscaling.gemm(T=32, K=256, out=32)
    err = {r["recipe"]: r["gaussian"] for r in g}
    assert err["bf16"] < err["MXFP8 rceil (TE)"] < err["NVFP4 1x16 / 16x16"]


@pytest.mark.full
def test_lab_prints_the_microscaling_tables():
    """`labkit run precision --microscaling`: the twelfth experiment's five tables (about 30 s
    on two ranks: the full lane)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-m", "labkit", "run", "precision", "--nproc", "2",
                          "--steps", "2", "--microscaling"], cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    for line in ("7. MXFP8 and NVFP4", "the scale's rounding rule", "MXFP8 rceil (TE)",
                 "NVFP4 1x16 / 16x16", "random Hadamard", "stochastic"):
        assert line in out.stdout, line
