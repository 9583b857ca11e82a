"""FP8 against bf16 on the tiny GPT: error per linear layer, and loss curves of a short run.

Per layer: the fp32 model's own inputs to each linear inside the blocks are captured by forward
hooks; each layer's output is recomputed with its inputs in bf16, in fp8 with per-tensor
scaling, and in fp8 with DeepSeek-V3's block scaling, and compared with fp32 (relative error,
||y - y_fp32|| / ||y_fp32||). Loss curves: the same seed, batches and AdamW for every recipe.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus
from labkit.precision import fp8, scaling
from labkit.precision.formats import relative_error

CONFIG = GPTConfig(n_layer=1, n_head=4, n_embd=128, block_size=32)   # 128: one fp8 block wide


_rel = relative_error


def layer_errors(cfg: GPTConfig = CONFIG, seed: int = 0, batch_size: int = 8,
                 outlier: float = 1.0) -> list[dict]:
    """Relative error of each block linear's output under bf16 and both fp8 recipes. outlier > 1
    multiplies one token's input row by that factor (a "massive activation", as LLMs have on a
    few tokens), which per-tensor scaling must fit into the same 448 as every other token; the
    error is then measured on the other tokens' outputs."""
    model = GPT(cfg, seed=seed)
    x, _ = get_batch(tiny_corpus(), batch_size, cfg.block_size, 0, seed)
    inputs = {}
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: inputs.__setitem__(n, a[0].detach()))
             for n, m in model.blocks.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    rows = []
    for name, mod in model.blocks.named_modules():
        if name not in inputs:
            continue
        a = inputs[name].reshape(-1, inputs[name].shape[-1]).clone()         # (B*T, in)
        a[0] *= outlier
        w = mod.weight.detach()                                              # (out, in)
        ref = a @ w.t()
        bf = (a.bfloat16() @ w.bfloat16().t()).float()
        per_t = fp8.fake_tensor(a, "e4m3") @ fp8.fake_tensor(w, "e4m3").t()
        blk = fp8.fake_blocks(a, "e4m3", (1, 128)) @ fp8.fake_blocks(w, "e4m3", (128, 128)).t()
        k = 1 if outlier != 1.0 else 0          # the other tokens: what an outlier costs them
        rows.append({"layer": name, "bf16": _rel(bf[k:], ref[k:]),
                     "fp8 per tensor": _rel(per_t[k:], ref[k:]),
                     "fp8 block": _rel(blk[k:], ref[k:])})
    return rows


def _loss(model, x, y):
    logits = model(x)[0].float()                                              # (B, T, V)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def train(recipe: str, steps: int = 16, lr: float = 3e-3, cfg: GPTConfig = CONFIG,
          seed: int = 0, batch_size: int = 4) -> list[float]:
    """Losses of a short AdamW run: recipe 'fp32', 'bf16' (bf16 copy, fp32 master), or
    'fp8 per tensor' / 'fp8 block' (fp32 weights, every block linear through fp8)."""
    tokens = tiny_corpus()
    master = GPT(cfg, seed=seed)
    if recipe.startswith("fp8"):
        fp8.to_fp8(master, "tensor" if recipe == "fp8 per tensor" else "block")
    work = copy.deepcopy(master).to(torch.bfloat16) if recipe == "bf16" else master
    opt = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        x, y = get_batch(tokens, batch_size, cfg.block_size, step, seed)
        work.zero_grad(set_to_none=True)
        loss = _loss(work, x, y)
        loss.backward()
        if work is not master:
            for pm, pw in zip(master.parameters(), work.parameters()):
                pm.grad = pw.grad.float()
        opt.step()
        if work is not master:
            with torch.no_grad():
                for pm, pw in zip(master.parameters(), work.parameters()):
                    pw.copy_(pm)
        losses.append(float(loss.detach()))
    return losses


def curves(steps: int = 16, recipes=("fp32", "bf16", "fp8 per tensor", "fp8 block"), **kw):
    return {r: train(r, steps, **kw) for r in recipes}


def recipe_errors(outlier: float = 1.0, cfg: GPTConfig = CONFIG, seed: int = 0,
                  batch_size: int = 8) -> dict:
    """The first block linear's output error under each scaling recipe of
    labkit.precision.scaling, its input taken from the fp32 model (one batch), one token's input
    row multiplied by `outlier`. Delayed scaling's amax history holds the previous batch's input
    amax (no outlier in it). Returns {"others": {recipe: err}, "outlier": {recipe: err}}: the other
    tokens' outputs and the outlier token's own (the same token when outlier = 1)."""
    model = GPT(cfg, seed=seed)
    lin = next(m for m in model.blocks.modules() if isinstance(m, torch.nn.Linear))
    seen = []
    hook = lin.register_forward_hook(lambda m, a, o: seen.append(a[0].detach()))
    tokens = tiny_corpus()
    with torch.no_grad():
        for step in (0, 1):                                   # previous batch, this batch
            model(get_batch(tokens, batch_size, cfg.block_size, step, seed)[0])
    hook.remove()
    prev, a = (t.reshape(-1, t.shape[-1]) for t in seen)                 # (B*T, in) each
    a = a.clone()
    a[0] *= outlier
    w = lin.weight.detach()                                              # (out, in)
    kw = {"a_history": prev.abs().max(), "w_history": w.abs().max()}
    return {"others": scaling.gemm_errors(a, w, rows=slice(1, None), **kw),
            "outlier": scaling.gemm_errors(a, w, rows=slice(0, 1), **kw)}
