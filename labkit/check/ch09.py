"""Checkers for chapter 09 (mixed precision). tests/test_precision.py uses the same cases.

    labkit.check.ch09.loss_scaler(MyScaler)            # Exercise 9.1
    labkit.check.ch09.block_quantizer(quantize, dequantize)   # Exercise 9.2

9.1: MyScaler(init_scale, growth_factor, backoff_factor, growth_interval) with .scale and
.update(found_inf) -> bool (take the step?), compared decision by decision with
torch.amp.GradScaler on the same gradients. 9.2: quantize(x, block) -> (q in float8_e4m3fn,
scales) and dequantize(q, scales, block) -> fp32, compared with labkit.precision.fp8.
"""
from __future__ import annotations

import torch

from labkit.check import Checker

EXERCISES = {
    "9.1": ("a dynamic loss scaler (grow, skip, back off)", 2),
    "9.2": ("per-block fp8 (e4m3) quantize / dequantize with its scales", 2),
}


def gradscaler_decisions(pattern, init_scale=2.0**4, growth_interval=3):
    """torch.amp.GradScaler's (scale before the step, step taken) for gradients that are finite
    or not as `pattern` says (True = contains inf)."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    gs = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    out = []
    for bad in pattern:
        before = p.detach().clone()
        scale = gs.get_scale()
        p.grad = None
        gs.scale(p.sum()).backward()                                  # grad = scale * 1
        if bad:
            p.grad[0] = float("inf")                                  # an overflowed gradient
        gs.step(opt)
        gs.update()
        out.append((scale, not torch.equal(before, p.detach())))
    return out


def scaler_decisions(cls, pattern, init_scale=2.0**4, growth_interval=3):
    s = cls(init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
            growth_interval=growth_interval)
    out = []
    for bad in pattern:
        scale = float(s.scale)
        out.append((scale, bool(s.update(bool(bad)))))
    return out


PATTERNS = {
    "all finite (growth every 3 steps)": [False] * 8,
    "an overflow at the first step": [True] + [False] * 5,
    "overflows in the middle": [False, False, True, False, False, False, True, True, False],
    "two overflows in a row, then growth": [True, True, False, False, False, False],
}


def loss_scaler(cls):
    c = Checker("9.1", EXERCISES["9.1"][0], EXERCISES["9.1"][1])
    for name, pattern in PATTERNS.items():
        with c.case(name):
            got, want = scaler_decisions(cls, pattern), gradscaler_decisions(pattern)
            for i, ((gs, gt), (ws, wt)) in enumerate(zip(got, want)):
                assert gt == wt, (f"step {i}: you {'took' if gt else 'skipped'} the step, "
                                  f"GradScaler {'took' if wt else 'skipped'} it. Which steps "
                                  f"must an inf or NaN gradient cancel?")
                assert gs == ws, (f"step {i}: your scale is {gs:g}, GradScaler's {ws:g}. After "
                                  f"how many good steps in a row does the scale grow, and what "
                                  f"happens to that count after an overflow?")
    return c.finish()


def _cases():
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(4, 256, generator=g)
    x2 = torch.randn(256, 384, generator=g) * 0.02
    x3 = torch.randn(3, 200, generator=g)
    x3[1, 7] = 1e4                                                  # an outlier in one block
    return [("activations 4x256, blocks 1x128", x1, (1, 128)),
            ("weights 256x384, blocks 128x128", x2, (128, 128)),
            ("3x200 with an outlier, blocks 1x128 (edge block of 72)", x3, (1, 128))]


def block_quantizer(quantize, dequantize):
    from labkit.precision import fp8

    c = Checker("9.2", EXERCISES["9.2"][0], EXERCISES["9.2"][1])
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
