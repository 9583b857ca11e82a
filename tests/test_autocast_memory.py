"""The activation recipes (fp32, torch.autocast(bf16), bf16 parameters) against what autograd saves.

The meter is labkit.observe.saved (saved-tensor hooks), which the formula does not write; the
formula is labkit.costs.activations. On the CPU, torch.autocast("cpu", torch.bfloat16) saves the
same storages as CUDA autocast for this model (shared/gpu/README.md, "CPU autocast = CUDA
autocast"); where the two differ (an eager softmax, SDPA's math path with dropout) is said in
costs.activations.autocast_terms and below.
"""
from __future__ import annotations

import pytest

from labkit.activation_memory import compare, measure_layer, predicted_layer
from labkit.costs import activations, memory, models
from labkit.model import GPTConfig

SHAPES = [  # (config, batch): B*T differs from every weight dimension, so shapes tell them apart
    (GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=24), 3),
    (GPTConfig(n_layer=2, n_embd=96, n_head=6, n_kv_head=2, block_size=40), 3),
    (GPTConfig(n_layer=2, n_embd=48, n_head=4, block_size=20, ffn_mult=3, bias=False), 2),
]


CASES = [(0, "autocast"), (1, "autocast"), (2, "autocast"), (0, "bf16"), (1, "bf16"), (2, "fp32")]


@pytest.mark.parametrize("shape,recipe", CASES)
def test_formula_matches_saved_tensors_per_layer(shape, recipe):
    """Several shapes (multi-head and grouped-query attention, biases or not), each recipe."""
    cfg, batch = SHAPES[shape]
    got = compare(cfg, batch, recipe=recipe)
    assert got["measured"] > 0
    assert abs(got["ratio"] - 1) <= 0.02, (recipe, got["measured"], got["predicted"])


@pytest.mark.parametrize("cfg,batch", SHAPES[1:2])
def test_autocast_term_by_term(cfg, batch):
    """Under CPU autocast: the fp32 storages are the residual stream, the norm statistics and
    the log-sum-exp; the bf16 weight copies are the layer's matmul weights, 2 bytes each; the
    rest is bf16 activations. Each group equals its terms of the formula to the byte."""
    tensors = measure_layer(cfg, batch, recipe="autocast")["tensors"]
    terms = predicted_layer(cfg, batch, recipe="autocast")
    h, kv, f = cfg.n_embd, cfg.kv_heads * cfg.head_dim, cfg.ffn_mult * cfg.n_embd
    weight_shapes = {(h, h), (kv, h), (h, kv), (f, h), (h, f)}
    fp32 = sum(n for shape, dt, n in tensors if dt == "float32")
    copies = sum(n for shape, dt, n in tensors
                 if dt == "bfloat16" and len(shape) == 2 and shape in weight_shapes)
    bf16 = sum(n for shape, dt, n in tensors if dt == "bfloat16") - copies
    fp32_terms = ("norm inputs (fp32 residual stream)", "norm statistics", "log-sum-exp")
    assert fp32 == sum(terms[k] for k in fp32_terms)
    assert copies == terms["bf16 weight copies"] == 2 * activations.matmul_weights(
        models.from_gpt_config(cfg))
    assert bf16 == sum(v for k, v in terms.items()
                       if k not in fp32_terms and k != "bf16 weight copies")
    assert sum(n for _, _, n in tensors) == sum(terms.values())


def test_cpu_math_path_with_dropout_differs_and_is_not_the_formula():
    """With dropout, SDPA on the CPU takes its math path, which computes a bf16 attention in
    fp32 (q, k, v and the probabilities saved as fp32): more than the formula, which counts a
    fused GPU kernel (the fp32 recipe is exact there: tests/test_memory.py)."""
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, dropout=0.1)
    got = compare(cfg, 3, recipe="bf16")
    assert got["ratio"] > 1.02
    assert any(dt == "float32" and len(shape) == 4 for shape, dt, _ in got["tensors"])


# ----------------------------------------------------------------------------- the H200
# Measured on one H200 (torch 2.11, CUDA 13.0), 2026-11-27: shared/gpu/README.md, "Memory: the
# calculator against the CUDA allocator" and "CPU autocast = CUDA autocast"; raw figures in
# shared/gpu/h200-2026-11-27-run1.json (memory_vs_calculator: act_measured_GB, the allocator's
# growth over the forward) and -run2.json (autocast_saved_by_dtype: saved-tensor hooks, one block).
H200_GPT = dict(h=2048, layers=8, heads=16, seq=2048, batch=4, vocab=96)
H200_ACTIVATIONS_GB = {"fp32": 8.73262336, "autocast": 6.287221248}
H200_BLOCK_SAVED_BYTES = {"fp32": 1_074_397_184, "autocast": 772_407_296}


def _h200_spec():
    g = H200_GPT
    return models.ModelSpec("H200 GPT", vocab_size=g["vocab"], hidden=g["h"],
                            n_layers=g["layers"], n_heads=g["heads"], tied_embeddings=True,
                            bias=True, norm="layernorm", max_positions=g["seq"],
                            seq_len=g["seq"])


@pytest.mark.parametrize("recipe", ["fp32", "autocast"])
def test_formula_against_the_h200(recipe):
    """One block to the byte (hooks on the H200), the whole model within 5% of the allocator."""
    spec, g = _h200_spec(), H200_GPT
    block = activations.layer_bytes(spec, seq_len=g["seq"], micro_batch=g["batch"], recipe=recipe)
    assert block == H200_BLOCK_SAVED_BYTES[recipe]
    plan = memory.plan(spec, recipe=recipe, seq_len=g["seq"], micro_batch=g["batch"])
    assert plan.settings["attention"] == "flash"
    assert abs(plan.activations / 1e9 / H200_ACTIVATIONS_GB[recipe] - 1) <= 0.05
    # and the 16-bit count the book used before is 1.46x short under autocast
    if recipe == "autocast":
        old = activations.layer_bytes(spec, seq_len=g["seq"], micro_batch=g["batch"],
                                      dtype_bytes=2) * g["layers"]
        assert H200_ACTIVATIONS_GB["autocast"] * 1e9 / old > 1.4


# ----------------------------------------------------------------------------- plan's recipes
def test_plan_recipes_states_and_activations():
    kw = dict(zero=1, dp=8, seq_len=8192, micro_batch=1)
    fp32, auto, bf16 = (memory.plan("llama3-8b", recipe=r, **kw)
                        for r in ("fp32", "autocast", "mixed"))
    n = fp32.settings["n_params"]
    assert auto.params == 4 * n and auto.grads == 4 * n and auto.optimizer == 8 * n / 8
    assert bf16.params == 2 * n
    assert fp32.activations > auto.activations > bf16.activations
    assert bf16.settings["activation_recipe"] == "bf16"
    assert auto.settings["activation_recipe"] == "autocast"
    # activations= overrides the recipe's own
    over = memory.plan("llama3-8b", recipe="mixed", activations="autocast", **kw)
    assert over.activations == auto.activations and over.params == bf16.params


def test_plan_defaults_to_fused_attention_eager_is_opt_in():
    kw = dict(recipe="mixed", seq_len=8192, micro_batch=1)
    default = memory.plan("llama3-8b", **kw)
    eager = memory.plan("llama3-8b", attention="eager", **kw)
    flash = memory.plan("llama3-8b", attention="flash", **kw)
    sdpa = memory.plan("llama3-8b", attention="sdpa", **kw)
    assert default.activations == flash.activations == sdpa.activations < eager.activations
    assert sdpa.settings["attention"] == "flash"
    spec = models.preset("llama3-8b")
    scores = 2 * spec.n_heads * 8192 ** 2 * spec.n_layers       # bf16 softmax outputs, 32 layers
    assert eager.activations - default.activations == pytest.approx(
        scores - 4 * spec.n_heads * 8192 * spec.n_layers)     # less the log-sum-exps


def test_precision_without_an_activation_recipe_infers_it():
    assert memory.Precision("x", 4, 4, 12).activation_recipe == "fp32"
    assert memory.Precision("x", 2, 4, 12).activation_recipe == "bf16"
    assert memory.get_recipe("fp32_grads").activation_recipe == "bf16"


def test_bad_activation_recipe_is_refused_with_the_names():
    with pytest.raises(ValueError, match="recipe='autocast'"):
        activations.layer_terms(models.preset("llama3-8b"), seq_len=8, recipe="amp")
