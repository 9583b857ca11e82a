"""Bytes per parameter by precision recipe: labkit.costs.memory's recipes, plus fp8 weights.

The recipes themselves (12, 16, 18 bytes/param and the rest) live in labkit.costs.memory.RECIPES;
this module names the choices chapter 09 explains and adds the fp8 variants as memory.Precision
objects, which memory.model_states accepts as they are.

    from labkit.costs import precision
    precision.bytes_per_param("mixed")                         # 16.0
    precision.bytes_per_param(precision.recipe(grads="fp32"))  # 18.0 (2 + 4 + 12)
"""
from __future__ import annotations

from labkit.costs import memory
from labkit.costs.dtypes import BYTES

# fp8_weights is labkit's illustration of what fp8 storage changes, not a published recipe:
# DeepSeek-V3 (report section 3.3) keeps fp32 master weights and gradients and bf16 AdamW moments.
FP8_RECIPES = {
    "fp8_weights": memory.Precision(
        "fp8_weights", 1, 2, 12,
        "weights kept for the matmuls in fp8 (1 byte), bf16 gradients, fp32 master weights, "
        "momentum and variance"),
}


def recipe(weights: str = "bf16", grads: str = "bf16", master: bool = True,
           moments: str = "fp32") -> memory.Precision:
    """A recipe from its four choices: Adam keeps two moments, plus the master copy if any."""
    o = 2 * BYTES[moments] + (4 if master else 0)
    name = f"{weights} weights, {grads} grads, {'fp32 master, ' if master else ''}{moments} moments"
    return memory.Precision(name, BYTES[weights], BYTES[grads], o, name)


def get(r) -> memory.Precision:
    return FP8_RECIPES[r] if isinstance(r, str) and r in FP8_RECIPES else memory.get_recipe(r)


def bytes_per_param(r) -> float:
    return get(r).total


def table(names=("fp32", "no_master", "mixed", "fp32_grads", "fp16_fp32_grad_copy",
                 "fp8_weights")) -> list[dict]:
    """Rows (recipe, weights, grads, optimizer, total) for the chapter's table and widget."""
    return [{"recipe": n, "weights": get(n).weights, "grads": get(n).grads,
             "optimizer": get(n).optimizer, "total": get(n).total} for n in names]


def model_bytes(n_params: float, r, **kw) -> float:
    """Model-state bytes of a model under recipe r (ZeRO stage and dp as in memory.model_states)."""
    return memory.model_states(n_params, recipe=get(r), **kw).total
