"""Bytes autograd saves for backward, counted by PyTorch's saved-tensor hooks, next to the formula.

    from labkit.activation_memory import measure_layer, compare, compare_llama_block
    from labkit.model import GPTConfig
    measure_layer(GPTConfig(n_layer=2, n_embd=32, n_head=4, n_kv_head=2), batch=2)
    compare(GPTConfig(n_layer=2, n_embd=32, n_head=4, dropout=0.1), batch=2)
    compare_llama_block(hidden=32, heads=4, kv_heads=2, ffn=88)    # SwiGLU, RMSNorm, native GQA

The counter is torch.autograd.graph.saved_tensors_hooks: its pack hook sees every tensor an
operation keeps for its backward. Each storage is counted once (a view and its base are one
allocation) and the parameters are left out (they exist anyway). Per layer: the bytes of an
n-layer model less those of a 1-layer twin, over n - 1, so the embeddings, the final norm, the
head and the loss cancel. The formula it is checked against is labkit.costs.activations, which
this module does not feed: it only passes the configuration. Three recipes: an fp32 model, the
same model under torch.autocast("cpu", torch.bfloat16), and the model cast to bfloat16.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.costs import activations, models
from labkit.model import GPT, get_batch, tiny_corpus
from labkit.observe.saved import SavedTensors, saved_bytes

__all__ = ["saved_bytes", "measure_layer", "predicted_layer", "compare",
           "LlamaBlock", "compare_llama_block"]


RECIPES = ("fp32", "autocast", "bf16")


def _recipe_context(recipe: str):
    """torch.autocast("cpu", bfloat16) for "autocast"; nothing for an fp32 or a bf16 model."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r}: one of {RECIPES} (e.g. recipe='autocast')")
    if recipe == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return nullcontext()


def measure_layer(cfg, batch: int = 2, n_layer: int = 3, seed: int = 0,
                  recipe: str = "fp32") -> dict:
    """Saved bytes per layer of labkit.model.GPT on this process's default device (the CPU):
    {"per_layer", "one_layer_model", "n_layer_model", "tensors"} (tensors: one layer's storages).
    recipe: "fp32" (an fp32 model), "autocast" (the fp32 model run under
    torch.autocast("cpu", torch.bfloat16)) or "bf16" (the model cast to bfloat16)."""
    if n_layer < 2:
        raise ValueError(f"n_layer={n_layer}: need at least 2 layers to isolate one")
    x, y = get_batch(tiny_corpus(), batch, cfg.block_size, step=0, seed=seed)
    sizes, lists = {}, {}
    for n in (1, n_layer):
        torch.manual_seed(seed)                      # same dropout masks' sizes either way
        model = GPT(replace(cfg, n_layer=n), seed=seed)
        if recipe == "bf16":
            model = model.to(torch.bfloat16)
        with _recipe_context(recipe):
            sizes[n], lists[n] = saved_bytes(model, x, y)
    per_layer, rem = divmod(sizes[n_layer] - sizes[1], n_layer - 1)
    if rem:
        raise RuntimeError(f"layers saved unequal bytes ({sizes[n_layer] - sizes[1]} over "
                           f"{n_layer - 1} layers)")
    return {"per_layer": per_layer, "one_layer_model": sizes[1], "n_layer_model": sizes[n_layer],
            "tensors": _one_block_tensors(model, batch, cfg, recipe)}


def _one_block_tensors(model, batch, cfg, recipe: str = "fp32") -> list:
    """[(shape, dtype, bytes)] that one block saves, its input a leaf (it is the norm's input)."""
    dtype = torch.bfloat16 if recipe == "bf16" else torch.float32
    h = torch.zeros(batch, cfg.block_size, cfg.n_embd, dtype=dtype,
                    requires_grad=True)                                   # (B, T, h)
    with SavedTensors(exclude=model.parameters()) as saved, _recipe_context(recipe):
        model.blocks[0](h)
    return saved.tensors


def predicted_layer(cfg, batch: int = 2, recipe: str = "fp32") -> dict:
    """labkit.costs.activations' terms for the same GPT on the CPU under `recipe`: PyTorch's CPU
    dropout keeps a float mask (M = D), the model repeats GQA's keys and values to all heads
    before attention (kv_expanded), and scaled_dot_product_attention runs its fused kernel
    unless dropout is on (then its math path, which keeps the scores). A bf16 model's LayerNorm
    keeps its statistics in bf16 on the CPU (measured), half the 4 bytes the formula counts: the
    prediction halves that term, a correction below 1% of a layer."""
    spec = models.from_gpt_config(cfg)
    D = activations.RECIPES[recipe][1]
    terms = activations.layer_terms(
        spec, seq_len=cfg.block_size, micro_batch=batch, recipe=recipe, mask_bytes=D,
        attention="eager" if cfg.dropout > 0 else "flash", kv_expanded=True)
    if recipe == "bf16":
        terms["norm statistics"] /= 2
    return terms


def compare(cfg, batch: int = 2, recipe: str = "fp32") -> dict:
    """Measured and predicted bytes per layer, and measured / predicted."""
    got = measure_layer(cfg, batch, recipe=recipe)
    want = sum(predicted_layer(cfg, batch, recipe).values())
    return {"measured": got["per_layer"], "predicted": want, "ratio": got["per_layer"] / want,
            "tensors": got["tensors"]}


class LlamaBlock(nn.Module):
    """A Llama-style block, only to check the formula's Llama terms (labkit.model is a GPT):
    RMSNorm, q/k/v without biases, grouped-query attention run natively (enable_gqa: k and v stay
    kv wide), a SwiGLU MLP down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        kv = kv_heads * self.head_dim
        self.norm_1, self.norm_2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.k, self.v = nn.Linear(hidden, kv, bias=False), nn.Linear(hidden, kv, bias=False)
        self.gate, self.up = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):                                                  # (B, T, h)
        B, T, _ = x.shape
        y = self.norm_1(x)
        q = self.q(y).view(B, T, self.heads, self.head_dim).transpose(1, 2)     # (B, a, T, d)
        k = self.k(y).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, kv, T, d)
        v = self.v(y).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, kv, T, d)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(att.transpose(1, 2).reshape(B, T, -1))              # (B, T, h)
        z = self.norm_2(x)
        return x + self.down(F.silu(self.gate(z)) * self.up(z))           # (B, T, h)


def compare_llama_block(hidden=32, heads=4, kv_heads=2, ffn=88, seq=16, batch=3) -> dict:
    """Bytes one LlamaBlock saves (hooks) against costs.activations for a gated-MLP, RMSNorm,
    native-GQA spec in fp32 (PyTorch's CPU nn.RMSNorm is not fused: fused_norm=False)."""
    block = LlamaBlock(hidden, heads, kv_heads, ffn)
    x = torch.randn(batch, seq, hidden, requires_grad=True)               # (B, T, h)
    with SavedTensors(exclude=block.parameters()) as saved:
        block(x)
    spec = models.ModelSpec("Llama-style block", vocab_size=1, hidden=hidden, n_layers=1,
                            n_heads=heads, n_kv_heads=kv_heads, ffn_hidden=ffn, gated_mlp=True)
    want = activations.layer_bytes(spec, seq_len=seq, micro_batch=batch, dtype_bytes=4,
                                   attention="flash", fused_norm=False)
    got = saved.bytes
    return {"measured": got, "predicted": want, "ratio": got / want}
