"""Exercise 9.5 (an MXFP8 quantizer with the scale rounded up): the reference scores full marks,
the stub zero, and the OCP floor rule, torchao's ceil rule and a wrong element cast each fail
with the hint that names them."""
import torch
from grading_helpers import assert_case_fails, assert_reference_full_stub_zero

from labkit.check import ch09

E4M3_MAX = 448.0


def _exponent(x, rule):
    amax = x.abs().reshape(x.shape[0], -1, 32).amax(-1)                 # (R, C/32)
    m, e = torch.frexp(amax)                                            # amax = m 2^e, m in [.5, 1)
    if rule == "floor":
        e = e - 1 - 8
    elif rule == "ceil":
        e = torch.where(m == 0.5, e - 1, e) - 8
    else:
        md, ed = torch.frexp(amax * torch.tensor(1 / E4M3_MAX, dtype=torch.float32))
        e = torch.where(md == 0.5, ed - 1, ed)
    return torch.where(amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)


def _quantizer(rule, clamp=True):
    def quantize_mx(x):
        e = _exponent(x, rule)                                          # (R, C/32)
        inv = torch.exp2(-e.float()).repeat_interleave(32, 1)           # (R, C)
        v = x * inv
        v = v.clamp(-E4M3_MAX, E4M3_MAX) if clamp else v
        q = v.to(torch.float8_e4m3fn)
        return q, torch.exp2(e.float()).to(torch.float8_e8m0fnu)
    return quantize_mx


def test_reference_full_marks_and_stub_zero():
    assert_reference_full_stub_zero(ch09.mx_quantizer, _quantizer("rceil"), 2, "9.5")


def test_the_ocp_floor_rule_is_named():
    res = ch09.mx_quantizer(_quantizer("floor"))
    assert_case_fails(res, 1, "OCP spec")


def test_torchaos_ceil_rule_is_named():
    res = ch09.mx_quantizer(_quantizer("ceil"))
    assert_case_fails(res, 0, "top binade")


def test_wrong_scale_dtype_is_caught():
    def f32_scales(x):
        q, s = _quantizer("rceil")(x)
        return q, s.float()
    res = ch09.mx_quantizer(f32_scales)
    assert_case_fails(res, 0, "scales torch.float32")


def test_using_labkits_own_quantizer_is_refused():
    from labkit.precision import mx

    def cheat(x):
        q, e, _ = mx.quantize_mx(x, "rceil")
        return q, mx.e8m0(e)
    assert ch09.mx_quantizer(cheat).score == 0
