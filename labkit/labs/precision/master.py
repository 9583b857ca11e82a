"""Why fp32 master weights: a run of the tiny GPT whose bf16 weights stop learning.

An optimizer adds an update u to each weight (SGD: u = -lr * grad; Adam: |u| about lr). Stored in
bf16 (7 mantissa bits), a weight w can only move to a neighbour 2^(floor(log2|w|) - 7) away, and
round-to-nearest sends w + u back to w whenever

    |u| < ulp(w) / 2.

With |w| ~ 0.02 the spacing is 2^-13 ~ 1.2e-4, so any update below 6e-5 is lost, every step, for
ever: the updates do not accumulate, they vanish. An fp32 master copy (23 mantissa bits) keeps
them; the bf16 weights the matmuls read are rounded from it each step (Micikevicius et al. 2018).

Both runs below compute forward and backward with the same bf16 weights, the same batches and the
same fp32 update; they differ only in where the update is added. Deterministic on CPU.
(The formula is exact but for ties, which round to even, and weights at a power of two moving
down, where the spacing below is half the spacing above.)
"""
from __future__ import annotations

import torch

from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus

STALL_CONFIG = GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=32)


def _loss(model, step, batch_size, cfg, tokens, seed):
    x, y = get_batch(tokens, batch_size, cfg.block_size, step, seed)
    logits = model(x)[0].float()              # (B, T, V): the loss itself in fp32, not bf16
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def run_sgd(master: bool, steps: int = 30, lr: float = 3e-5, batch_size: int = 4,
            cfg: GPTConfig = STALL_CONFIG, seed: int = 0, adam: bool = True) -> dict:
    """Adam (or SGD: adam=False) on the tiny GPT with bf16 weights, with (master=True) or without an
    fp32 master copy.

    Returns per step: 'loss' (of the bf16 model, before the update) and 'frac_lost', the fraction
    of nonzero updates that left the weight a bf16 model computes with unchanged; plus
    'frac_lost_theory', the fraction with |lr*grad| < ulp(w)/2 (the formula above), and 'moved',
    the L2 distance of the bf16 weights from their initial values after the run."""
    tokens = tiny_corpus()
    model = GPT(cfg, seed=seed).to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params] if master else None
    init = [p.detach().float().clone() for p in params]
    mom = [torch.zeros_like(w) for w in init]       # Adam's fp32 moments (adam=True)
    var = [torch.zeros_like(w) for w in init]
    out = {"loss": [], "frac_lost": [], "frac_lost_theory": []}
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        loss = _loss(model, step, batch_size, cfg, tokens, seed)
        loss.backward()
        lost = moved = theory = 0
        with torch.no_grad():
            for i, p in enumerate(params):
                g = p.grad.float()
                if adam:     # Adam (b1 0.9, b2 0.999): |update| ~ lr whatever the gradient's size
                    mom[i].mul_(0.9).add_(g, alpha=0.1)
                    var[i].mul_(0.999).addcmul_(g, g, value=0.001)
                    m_hat = mom[i] / (1 - 0.9 ** (step + 1))
                    v_hat = var[i] / (1 - 0.999 ** (step + 1))
                    u = -lr * m_hat / (v_hat.sqrt() + 1e-8)
                else:
                    u = -lr * g                                            # the fp32 update
                old = p.detach().clone()
                if master:
                    masters[i].add_(u)
                    p.copy_(masters[i])                                    # round to bf16
                else:
                    p.copy_(p.float() + u)                                 # bf16 + update -> bf16
                nz = u != 0
                lost += int(((p == old) & nz).sum())
                moved += int(nz.sum())
                e = torch.floor(torch.log2(old.float().abs().clamp(min=1e-30)))
                theory += int(((u.abs() < 2.0 ** (e - 7) / 2) & nz).sum())
        out["loss"].append(float(loss.detach()))
        out["frac_lost"].append(lost / max(moved, 1))
        out["frac_lost_theory"].append(theory / max(moved, 1))
    with torch.no_grad():   # how far the weights the model computes with have moved
        out["moved"] = float(sum(((p.float() - w0) ** 2).sum()
                                 for p, w0 in zip(params, init)) ** 0.5)
    return out


def stall(steps: int = 30, lr: float = 3e-5, **kw) -> dict:
    """Both runs: {'bf16 weights': ..., 'fp32 master': ...}."""
    return {"bf16 weights": run_sgd(False, steps, lr, **kw),
            "fp32 master": run_sgd(True, steps, lr, **kw)}
