"""Exercise 9.2: per-block fp8 (e4m3) quantize / dequantize with its scales.

    labkit.check.ch09.block_quantizer(quantize, dequantize)

quantize(x, block) -> (q in float8_e4m3fn, scales) and dequantize(q, scales, block) -> fp32,
compared with labkit.precision.fp8.
"""
from __future__ import annotations

import torch

from labkit.check import Checker, graded
from labkit.precision import fp8

EXERCISE, TITLE, POINTS = "9.2", "per-block fp8 (e4m3) quantize / dequantize with its scales", 2


def _cases():
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(4, 256, generator=g)
    x2 = torch.randn(256, 384, generator=g) * 0.02
    x3 = torch.randn(3, 200, generator=g)
    x3[1, 7] = 1e4                                                  # an outlier in one block
    return [("activations 4x256, blocks 1x128", x1, (1, 128)),
            ("weights 256x384, blocks 128x128", x2, (128, 128)),
            ("3x200 with an outlier, blocks 1x128 (edge block of 72)", x3, (1, 128))]


@graded("9.2")
def block_quantizer(quantize, dequantize):
    c = Checker(EXERCISE, TITLE, POINTS)
    for name, x, block in _cases():
        with c.case(name):
            q, s = quantize(x.clone(), block)
            assert q.dtype == torch.float8_e4m3fn, (f"q is {q.dtype}: which dtype holds e4m3 "
                                                    f"values in torch?")
            rq, rs = fp8.quantize_blocks(x, "e4m3", block)
            s = torch.as_tensor(s, dtype=torch.float32)
            assert s.shape == rs.shape, (f"scales shape {tuple(s.shape)}, expected "
                                         f"{tuple(rs.shape)}: how many blocks of {block} cover a "
                                         f"{tuple(x.shape)} tensor, counting a partial one?")
            assert torch.allclose(s, rs, rtol=1e-6), ("scales differ: which value of the block "
                                                      "should land on 448 after scaling?")
            assert q.float().abs().max() <= 448, "a value beyond 448: what does saturation mean?"
            back = dequantize(q, s, block)
            want = fp8.dequantize_blocks(rq, rs, block)
            assert torch.allclose(back.float(), want, rtol=1e-6, atol=0), (
                "dequantized values differ: multiply or divide by the scale?")
            err = (back.float() - x).abs() / x.abs().clamp(min=1e-30)
            big = x.abs() >= rs.repeat_interleave(block[0], 0).repeat_interleave(
                block[1], 1)[:x.shape[0], :x.shape[1]].reciprocal() * 2.0**-6
            assert (err[big] <= 2.0**-4 + 1e-7).all(), "round trip error above e4m3's half ulp"
    return c.finish()
