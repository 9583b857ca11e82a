"""fp16 gradients that underflow, and a training run held up by a dynamic loss scaler.

The tiny GPT's gradients, computed in fp32, span many powers of two; fp16 keeps nothing below
2^-24 and only a few bits below 2^-14. Backward through an fp16 model with the loss multiplied by
S shifts every gradient by log2(S) binades: fewer flush to zero, until the largest overflows.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus
from labkit.precision.scaler import DynamicLossScaler

CONFIG = GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=32)


def _loss(model, x, y):
    logits = model(x)[0].float()                                     # (B, T, V)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def grads(dtype=torch.float32, scale: float = 1.0, cfg: GPTConfig = CONFIG, seed: int = 0,
          batch_size: int = 8, step: int = 0) -> torch.Tensor:
    """All parameter gradients of one backward in `dtype` (loss times `scale`), flattened, fp32,
    divided by the scale again (inf stays inf)."""
    model = GPT(cfg, seed=seed).to(dtype)
    x, y = get_batch(tiny_corpus(), batch_size, cfg.block_size, step, seed)
    (_loss(model, x, y) * scale).backward()
    return torch.cat([p.grad.float().flatten() for p in model.parameters()]) / scale


def underflow(scale: float, dtype=torch.float16, **kw) -> dict:
    """Against the fp32 gradients: the fraction of nonzero ones that came out 0, the median
    relative error of the rest and of those below 2^-14 in fp32 (rel_err_small), and whether any
    overflowed."""
    ref, got = grads(torch.float32, 1.0, **kw), grads(dtype, scale, **kw)
    nz = ref != 0
    zero = (got == 0) & nz
    ok = nz & (got != 0) & torch.isfinite(got)
    rel = ((got[ok] - ref[ok]).abs() / ref[ok].abs()).median() if ok.any() else torch.tensor(0.)
    small = ok & (ref.abs() < 2.0**-14)              # below fp16's smallest normal number
    rel_small = ((got[small] - ref[small]).abs() / ref[small].abs()).median() if small.any() \
        else torch.tensor(0.)
    return {"scale": scale, "zeroed": float(zero.sum() / nz.sum()), "rel_err": float(rel),
            "rel_err_small": float(rel_small),
            "overflow": bool((~torch.isfinite(got)).any())}


def train(scaler: DynamicLossScaler | None, steps: int = 60, lr: float = 1e-3,
          dtype=torch.float16, cfg: GPTConfig = CONFIG, seed: int = 0, batch_size: int = 8) -> dict:
    """AdamW on fp32 master weights; forward and backward on a `dtype` copy, with the loss
    scaled by `scaler` (None: no scaling, e.g. bf16). Returns losses, scales, skipped steps."""
    tokens = tiny_corpus()
    master = GPT(cfg, seed=seed)
    work = copy.deepcopy(master).to(dtype)
    opt = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.0)
    out = {"loss": [], "scale": [], "skipped": []}
    for step in range(steps):
        x, y = get_batch(tokens, batch_size, cfg.block_size, step, seed)
        work.zero_grad(set_to_none=True)
        loss = _loss(work, x, y)
        (scaler.scale_loss(loss) if scaler else loss).backward()
        for pm, pw in zip(master.parameters(), work.parameters()):
            pm.grad = pw.grad.float()                                # fp32 gradient for the step
        out["scale"].append(scaler.scale if scaler else 1.0)
        took = scaler.step(opt, list(master.parameters())) if scaler else (opt.step() or True)
        out["skipped"].append(not took)
        out["loss"].append(float(loss.detach()))
        with torch.no_grad():
            for pm, pw in zip(master.parameters(), work.parameters()):
                pw.copy_(pm)                                          # round the master to dtype
    return out
