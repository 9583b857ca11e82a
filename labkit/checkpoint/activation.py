"""Activation checkpointing (recomputation): keep only each block's input, redo its forward in
backward. Memory for activations drops from every block's intermediates to one tensor per block
(plus one block's intermediates while it is recomputed); the price is one extra forward pass of
the blocks: step time x (f + b + f)/(f + b) = 4/3 when backward costs two forwards.
(Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost".)

    with_recompute(model)               # every GPT block runs under torch.utils.checkpoint
    saved_activation_bytes(model, x, y) # bytes autograd keeps for backward after the forward

Memory is measured by counting what autograd saves for backward (saved-tensor hooks), storage by
storage: exact, deterministic and the same on CPU and GPU; the parameters it also references are
left out (they exist anyway).
"""
from __future__ import annotations

import time

import torch
from torch.utils.checkpoint import checkpoint


def with_recompute(model) -> None:
    """Run each of model.blocks under non-reentrant torch.utils.checkpoint (in place; the state
    dict's names do not change)."""
    for block in model.blocks:
        if getattr(block, "_recompute", False):
            continue
        plain = block.forward
        block.forward = lambda x, _f=plain: checkpoint(_f, x, use_reentrant=False)
        block._recompute = True


def saved_activation_bytes(model, x, y) -> int:
    """Bytes of the tensors autograd saves for backward during one forward (parameters excluded),
    each storage counted once. Runs backward afterwards so nothing leaks."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(x, y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def step_time(model, x, y, repeats: int = 5) -> float:
    """Median seconds of forward + backward."""
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return sorted(times[1:])[repeats // 2]  # the first one warms up


def predicted_block_bytes(batch: int, seq: int, n_embd: int, dtype_bytes: int = 4) -> int:
    """What recomputation keeps per block: its input, (B, T, h) elements."""
    return batch * seq * n_embd * dtype_bytes


def measure(cfg=None, batch: int = 8, repeats: int = 5, seed: int = 0) -> dict:
    """Saved activation bytes (total and per block) and fwd+bwd time, with and without
    recomputation. Per-block bytes come from the difference between cfg and a 1-layer twin, so
    the embedding / head / loss part (never recomputed) is separated out."""
    from dataclasses import replace

    from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus

    cfg = cfg or GPTConfig(n_layer=4, n_embd=64, n_head=4, block_size=64)
    if cfg.n_layer < 2:
        raise ValueError(f"n_layer={cfg.n_layer}: use at least 2 layers to separate per-block bytes")
    x, y = get_batch(tiny_corpus(), batch, cfg.block_size, step=0, seed=seed)
    out = {"n_layer": cfg.n_layer, "predicted_factor": 4 / 3,
           "predicted_block_bytes_recompute": predicted_block_bytes(batch, cfg.block_size,
                                                                    cfg.n_embd)}
    for mode in ("plain", "recompute"):
        sizes = {}
        for n_layer in (1, cfg.n_layer):
            model = GPT(replace(cfg, n_layer=n_layer), seed=seed)
            if mode == "recompute":
                with_recompute(model)
            sizes[n_layer] = saved_activation_bytes(model, x, y)
        per_block = (sizes[cfg.n_layer] - sizes[1]) // (cfg.n_layer - 1)
        out[mode] = {"saved_bytes": sizes[cfg.n_layer], "per_block_bytes": per_block,
                     "other_bytes": sizes[1] - per_block, "step_s": step_time(model, x, y, repeats)}
    out["time_factor"] = out["recompute"]["step_s"] / out["plain"]["step_s"]
    # peak while backward recomputes one block: the kept inputs + that block's intermediates
    out["recompute"]["peak_bytes"] = out["recompute"]["saved_bytes"] + out["plain"]["per_block_bytes"]
    return out
