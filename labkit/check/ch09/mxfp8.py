"""Exercise 9.5: an MXFP8 quantizer whose E8M0 scale is rounded up (no element saturates).

    labkit.check.ch09.mx_quantizer(quantize_mx)

quantize_mx(x) takes x (R, C) fp32 with C a multiple of 32 and returns (q, scales): q (R, C) in
torch.float8_e4m3fn and scales (R, C / 32) in torch.float8_e8m0fnu, with x ~ q * scale. Compared
bit for bit with labkit.precision.mx under Transformer Engine's rule (`rceil`: e =
ceil(log2(amax / 448)), TE's float_to_e8m0(amax * max_norm_rcp)); the spec's floor rule and
torchao's ceil rule are recognised and named in the hint.
"""
from __future__ import annotations

import torch

from labkit.check import Checker, Forbidden, fail, graded
from labkit.precision import mx

EXERCISE, TITLE, POINTS = "9.5", "an MXFP8 quantizer with the scale rounded up", 2
FORBIDDEN = Forbidden(("labkit.precision",), frozenset(), why="derive the scale yourself")


def _cases():
    g = torch.Generator().manual_seed(0)
    gauss = torch.randn(4, 256, generator=g)                            # (4, 256)
    edges = torch.ones(4, 64)
    edges[0, 0] = 448.0                       # amax exactly 448: the scale is 2^0, not 2^1
    edges[1, 0] = 1.9 * 256                   # significand 1.9: the floor rule saturates it
    edges[2, :32] = 0.0                       # an all-zero block: the smallest scale, 2^-127
    edges[3] = torch.linspace(-3e-3, 5e-3, 64)                         # small values
    outl = torch.randn(8, 128, generator=g)
    outl[:, 5] *= 1e3                         # an outlier channel
    return [("N(0, 1), 4 x 256", gauss), ("edge blocks: amax 448, 1.9 * 2^8, zeros, small", edges),
            ("outlier channel x 1000, 8 x 128", outl)]


def _rule_of(e: torch.Tensor, x: torch.Tensor):
    """Which rule's exponents these are, if any (the hint names the mistake)."""
    amax = x.abs().reshape(x.shape[0], -1, mx.BLOCK).amax(-1)
    for rule in mx.RULES:
        if torch.equal(mx.scale_exponent(amax, rule), e.int()):
            return rule
    return None


@graded("9.5")
def mx_quantizer(quantize_mx):
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(quantize_mx, who="your quantizer"))
    for name, x in _cases():
        with c.case(name):
            c.go_on()
            q, s = quantize_mx(x.clone())
            if q.dtype != torch.float8_e4m3fn or s.dtype != torch.float8_e8m0fnu:
                fail(f"q is {q.dtype} and scales {s.dtype}: which torch dtypes hold E4M3 "
                     f"elements and E8M0 scales?")
            want_q, want_e, _ = mx.quantize_mx(x, "rceil")
            if tuple(s.shape) != tuple(want_e.shape):
                fail(f"scales shape {tuple(s.shape)}, expected {tuple(want_e.shape)}: one scale "
                     f"per 32 consecutive elements of a row")
            e = s.view(torch.uint8).int() - mx.E8M0_BIAS                 # the stored exponent
            if not torch.equal(e, want_e):
                rule = _rule_of(e, x)
                fail({"floor": "these are the OCP spec's exponents, floor(log2 amax) - 8: a block "
                               "whose max has a significand above 1.75 lands above 448 and "
                               "saturates. Round the exponent up so the max fits.",
                      "ceil": "these are ceil(log2 amax) - 8: nothing saturates, but the block "
                              "max lands in (128, 256] and E4M3's top binade goes unused. Which "
                              "quotient should the exponent be rounded up from?"}.get(
                    rule, "scales differ: e = ceil(log2(amax / 448)) per block of 32; what does "
                          "an all-zero block get?"))
            if not torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)):
                fail("the scales are right but the elements differ: divide each value by its "
                     "block's scale, clamp to +-448, cast to E4M3")
    return c.finish()
