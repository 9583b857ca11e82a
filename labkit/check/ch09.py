"""Checkers for chapter 09 (mixed precision). tests/test_precision.py uses the same cases.

    labkit.check.ch09.loss_scaler(MyScaler)            # Exercise 9.1
    labkit.check.ch09.block_quantizer(quantize, dequantize)   # Exercise 9.2
    labkit.check.ch09.mixed_precision_trainer(MixedPrecisionTrainer)   # 9.3, real processes
    labkit.check.ch09.state_bytes(predict)             # Exercise 9.4, storage sizes

9.1: MyScaler(init_scale, growth_factor, backoff_factor, growth_interval) with .scale and
.update(found_inf) -> bool (take the step?), compared decision by decision with
torch.amp.GradScaler on the same gradients. 9.2: quantize(x, block) -> (q in float8_e4m3fn,
scales) and dequantize(q, scales, block) -> fp32, compared with labkit.precision.fp8.

9.3 (labkit.check.ch09_trainer): the reader's data-parallel mixed-precision trainer, written
from a stub class (fp32 masters and an fp16 or bf16 compute copy, its own dynamic loss scaler for
fp16 and none for bf16, gradients all-reduced in the half dtype or in fp32, unscaled before a
global-norm clip, overflowed steps skipped on every rank), trained on 2 and (hidden) 3 real
processes with overflows injected on one rank; graded on storage, the loss scale each backward
used, bit-identical masters, tracking of fp32 SGD, and the bytes on the wire (the kernel's count).

9.4: the reader predicts the bytes of weights, gradients and optimizer state a recipe holds
for n parameters; the checker runs one real AdamW step of the book's GPT held that way and reads
storage sizes (untyped_storage().nbytes()); within STATE_TOLERANCE, shown beside labkit.costs.

Long because: the notebook imports one checker module per chapter.
"""
from __future__ import annotations

import torch

from labkit.check import Checker, fail, graded

EXERCISES = {
    "9.1": ("a dynamic loss scaler (grow, skip, back off)", 2),
    "9.2": ("per-block fp8 (e4m3) quantize / dequantize with its scales", 2),
    "9.3": ("a data-parallel mixed-precision trainer: masters, loss scaling, fp16 and bf16", 8),
    "9.4": ("predict the bytes a precision recipe holds per parameter, then measure them", 3),
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


@graded("9.1")
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


@graded("9.2")
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


# ----------------------------------------------------------------------------- 9.3
@graded("9.3")
def mixed_precision_trainer(cls):
    """Exercise 9.3 (labkit.check.ch09_trainer): the reader's data-parallel mixed-precision
    trainer on 2 and (hidden) 3 ranks, fp16 and bf16, against one fp32 process."""
    from labkit.check.ch09_trainer import mixed_precision_trainer as check

    return check(cls, *EXERCISES["9.3"])


# ----------------------------------------------------------------------------- 9.4
def _forbidden(forbidden, *objs) -> list:
    """Which of `forbidden` (dotted module prefixes, or bare names) the reader's code uses."""
    from labkit.check.guards import forbidden_used

    mods = tuple(f for f in forbidden if "." in f)
    return forbidden_used(list(objs), mods, {f for f in forbidden if f not in mods})


STATE_TOLERANCE = 0.02
STATE_CASES = [("fp32", False), ("mixed", False), ("fp32_grads", False),
               ("fp16_fp32_grad_copy", True)]
STATE_MODEL = dict(n_layer=2, n_embd=64, n_head=4, block_size=32)


_MEASURED: dict = {}     # recipe -> bytes: the storage does not depend on the reader's code


def measure_state(recipe: str, cfg_kwargs: dict = STATE_MODEL) -> dict:
    """One real AdamW step of the book's GPT held the way `recipe` says; bytes of what stays
    resident between steps, from storage sizes (untyped_storage().nbytes(), written by torch):
    weights (the model's parameters), grads (the gradient the backward accumulates into) and
    optimizer (fp32 masters, an fp32 gradient copy where the recipe keeps one, Adam's state)."""
    from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus
    from labkit.precision.memory import storage_nbytes

    cfg = GPTConfig(**cfg_kwargs)
    wdtype = {"fp32": torch.float32, "mixed": torch.bfloat16, "fp32_grads": torch.bfloat16,
              "fp16_fp32_grad_copy": torch.float16}[recipe]
    model = GPT(cfg, seed=0).to(wdtype)
    x, y = get_batch(tiny_corpus(), 2, cfg.block_size, 0, 0)
    model(x, y)[1].backward()
    params = list(model.parameters())
    kept = []                                           # optimizer-side buffers besides Adam's
    if recipe == "fp32":
        grads, opt = [p.grad for p in params], torch.optim.AdamW(params, lr=1e-3)
    else:
        masters = [p.detach().float().clone().requires_grad_() for p in params]
        kept += masters
        if recipe == "fp32_grads":                      # Megatron's main_grad: fp32 accumulators
            grads = [p.grad.float() for p in params]
            for p in params:
                p.grad = None
            for m, g in zip(masters, grads):
                m.grad = g                              # the same storage: no copy
        else:
            grads = [p.grad for p in params]
            for m, p in zip(masters, params):
                m.grad = p.grad.float()                 # an fp32 copy for the step
            if recipe == "fp16_fp32_grad_copy":
                kept += [m.grad for m in masters]       # kept as a buffer (Megatron's fp16)
        opt = torch.optim.AdamW(masters, lr=1e-3)
    opt.step()
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    n = sum(p.numel() for p in params)
    return {"n_params": n, "weights": storage_nbytes(params), "grads": storage_nbytes(grads),
            "optimizer": storage_nbytes(kept + state)}


def _state_hint(key: str, got: float, measured: float, recipe: str) -> str:
    said = f"{key}: predicted {got:,.0f} B, measured {measured:,} B. "
    ratio = got / measured if measured else float("inf")
    near = lambda x: abs(ratio - x) <= STATE_TOLERANCE * x  # noqa: E731
    if near(8):
        return said + "Bits or bytes?"
    if key == "optimizer" and recipe != "fp32" and (near(8 / 12) or near(12 / 16)):
        return said + ("Adam's momentum and variance, yes, but the update itself runs on an "
                       "fp32 copy of the weights: where is it counted?")
    if key == "grads" and (near(2) or near(0.5)):
        return said + ("In which dtype does the backward accumulate the gradients under this "
                       "recipe: the weights' dtype or fp32?")
    if near(16 / 2) or near(16 / 4) or near(18 / 2):
        return said + "That looks like the whole state per parameter, not this part of it."
    return said + (f"What does the recipe {recipe!r} keep for each parameter, in which dtype, "
                   f"and which of it is the optimizer's?")


@graded("9.4")
def state_bytes(predict):
    """Exercise 9.4: predict(n_params, recipe) -> {"weights", "grads", "optimizer"} in bytes."""
    from labkit.costs import memory

    c = Checker("9.4", *EXERCISES["9.4"])
    bad = _forbidden(("labkit.costs", "labkit.precision", "get_recipe", "RECIPES"), predict)
    for recipe, hidden in STATE_CASES:
        with c.case("hidden case" if hidden else f"recipe {recipe!r}"):
            if bad:
                fail(f"your prediction uses {', '.join(bad)}: derive the bytes yourself")
            if recipe not in _MEASURED:        # one real step per recipe and process
                _MEASURED[recipe] = measure_state(recipe)
            m = _MEASURED[recipe]
            n = m["n_params"]
            got = predict(n, recipe)
            keys = ("weights", "grads", "optimizer")
            if not (isinstance(got, dict) and all(isinstance(got.get(k), (int, float))
                                                  for k in keys)):
                fail('return {"weights": bytes, "grads": bytes, "optimizer": bytes}, numbers')
            r = memory.get_recipe(recipe)
            for key, per in zip(keys, (r.weights, r.grads, r.optimizer)):
                if abs(per * n / m[key] - 1) > STATE_TOLERANCE:
                    fail(f"labkit.costs says {per * n:,.0f} B for {key}, storage {m[key]:,} B: "
                         f"the checker disagrees with itself (please report it)")
            if not hidden:
                c.cases[-1]["name"] += f" ({n:,} parameters)" + "".join(
                    f"\n      {k}: predicted {got[k] / n:.2f} B/param, measured "
                    f"{m[k] / n:.2f}, labkit.costs {p:g}"
                    for k, p in zip(keys, (r.weights, r.grads, r.optimizer)))
            for key in keys:
                if abs(got[key] / m[key] - 1) > STATE_TOLERANCE:
                    fail(_state_hint(key, got[key], m[key], recipe))
    return c.finish()
