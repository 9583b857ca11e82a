"""Exercise 9.4: predict the bytes a precision recipe holds per parameter, then measure them.

    labkit.check.ch09.state_bytes(predict)   # predict(n_params, recipe) -> {"weights", "grads",
                                             #   "optimizer"} in bytes

The checker runs one real AdamW step of the book's GPT held the recipe's way and reads storage
sizes (untyped_storage().nbytes()); within STATE_TOLERANCE, shown beside labkit.costs.
"""
from __future__ import annotations

import torch

from labkit.check import Checker, Forbidden, fail, graded
from labkit.check.mistakes import diagnose
from labkit.costs import memory
from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus
from labkit.observe.storage import storage_bytes

EXERCISE, TITLE, POINTS = ("9.4", "predict the bytes a precision recipe holds per parameter, then "
                           "measure them", 3)
FORBIDDEN = Forbidden(("labkit.costs", "labkit.precision"), frozenset({"get_recipe", "RECIPES"}),
                      why="derive the bytes yourself")
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
    return {"n_params": n, "weights": storage_bytes(params), "grads": storage_bytes(grads),
            "optimizer": storage_bytes(kept + state)}


def state_mistakes(key: str, recipe: str) -> list:
    """(predicted / measured, hint) of the known wrong answers for one part."""
    whole = "That looks like the whole state per parameter, not this part of it."
    master = ("Adam's momentum and variance, yes, but the update itself runs on an fp32 copy of "
              "the weights: where is it counted?")
    dtype = ("In which dtype does the backward accumulate the gradients under this recipe: the "
             "weights' dtype or fp32?")
    return ([(8, "Bits or bytes?")]
            + ([(8 / 12, master), (12 / 16, master)] if key == "optimizer" and recipe != "fp32"
               else [])
            + ([(2, dtype), (0.5, dtype)] if key == "grads" else [])
            + [(16 / 2, whole), (16 / 4, whole), (18 / 2, whole)])


def _state_hint(key: str, got: float, measured: float, recipe: str) -> str:
    said = f"{key}: predicted {got:,.0f} B, measured {measured:,} B. "
    ratio = got / measured if measured else float("inf")
    return said + diagnose(ratio, state_mistakes(key, recipe),
                           f"What does the recipe {recipe!r} keep for each parameter, in which "
                           f"dtype, and which of it is the optimizer's?", STATE_TOLERANCE)


@graded("9.4")
def state_bytes(predict):
    """Exercise 9.4: predict(n_params, recipe) -> {"weights", "grads", "optimizer"} in bytes."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(predict, who="your prediction"))
    for recipe, hidden in STATE_CASES:
        with c.case("hidden case" if hidden else f"recipe {recipe!r}"):
            c.go_on()                          # a refused answer starts no measurement
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
