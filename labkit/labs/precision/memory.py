"""Bytes per parameter of a real mixed-precision optimizer step, from storage sizes.

The model holds bf16 weights and receives bf16 gradients; torch.optim.AdamW steps an fp32 master
copy (fp32 gradients copied in), whose state is exp_avg and exp_avg_sq in fp32 plus a one-element
step counter per tensor. Every byte is read from `untyped_storage().nbytes()`, which torch writes,
not from a formula.
"""
from __future__ import annotations

import torch

from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus
from labkit.observe.storage import storage_bytes


def measure_step(cfg: GPTConfig | None = None, dtype=torch.bfloat16, seed: int = 0,
                 master: bool = True) -> dict:
    """One AdamW step with (master=True) or without fp32 master weights; bytes by category and
    per parameter. cfg: the model (None: GPTConfig()'s tiny default)."""
    cfg = GPTConfig() if cfg is None else cfg
    model = GPT(cfg, seed=seed).to(dtype)
    x, y = get_batch(tiny_corpus(), 4, cfg.block_size, 0, seed)
    model(x, y)[1].backward()
    params = list(model.parameters())
    if master:
        masters = [p.detach().float().clone().requires_grad_() for p in params]
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
        opt = torch.optim.AdamW(masters, lr=1e-3)
    else:
        masters = []
        opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    n = sum(p.numel() for p in params)
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    out = {"params": n, "weights": storage_bytes(params),
           "grads": storage_bytes(p.grad for p in params), "master": storage_bytes(masters),
           "master_grads": storage_bytes(m.grad for m in masters),
           "optimizer_state": storage_bytes(state)}
    out["per_param"] = {k: out[k] / n for k in ("weights", "grads", "master", "master_grads",
                                                "optimizer_state")}
    # the fp32 gradient copy is transient (freed after the step) in a real loop: not counted
    out["resident_per_param"] = (out["weights"] + out["grads"] + out["master"]
                                 + out["optimizer_state"]) / n
    return out
