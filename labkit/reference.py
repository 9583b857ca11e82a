"""The one-process reference every parallel run is compared to, and the one optimizer registry.

    from labkit.reference import make_optimizer, reference_train
    ref = reference_train(GPTConfig(n_layer=2), steps=3, batch_size=8, optimizer="adamw")
    ref["losses"], ref["grads"], ref["params"]   # per step; first step's gradients; after the last

A parallel run (any mesh: labkit.parallel) trains the same GPT (same seed) on the same global
batches (labkit.model.get_batch is deterministic in the step) with the same optimizer from
OPTIMIZERS, so its losses, gradients and parameters must equal these up to float rounding
(labkit.testing.tensors_close says how close is close for each dtype).
"""
from __future__ import annotations

import torch

from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus

# name -> (class, default keyword arguments). Elementwise optimizers only: a shard of a parameter
# updated alone gives the same numbers as the whole (what makes ZeRO's sharded step exact).
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}


def optimizer_spec(name: str, **overrides):
    """(class, kwargs) of a registered optimizer, with `overrides` (e.g. lr=...) applied."""
    if name not in OPTIMIZERS:
        raise KeyError(f"optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    cls, kw = OPTIMIZERS[name]
    return cls, {**kw, **overrides}


def make_optimizer(name: str, params, **overrides) -> torch.optim.Optimizer:
    """The registered optimizer over the parameters that train (frozen ones hold no state)."""
    cls, kw = optimizer_spec(name, **overrides)
    return cls([p for p in params if p.requires_grad], **kw)


def reference_train(cfg: GPTConfig | None, steps: int = 3, batch_size: int = 8,
                    optimizer: str = "adamw", seed: int = 0, capacity_rows=None, model=None,
                    **optimizer_overrides) -> dict:
    """One process, the whole global batch of every step, on the CPU.

    capacity_rows (mixtures of experts only): rows of each group that experts' capacity is counted
    over, in row order (labkit.parallel.Plan.capacity_rows gives a parallel run's groups: each
    replica's rows, or each micro-batch's under a pipeline); None: the whole batch is one group.
    model: a GPT built by the caller (frozen parameters, another dtype) instead of GPT(cfg, seed).

    Returns {"losses": [float per step], "grads": {name: first step's gradient},
    "params": {name: parameter after the last step}}; names as in GPT.named_parameters()
    (a tied embedding appears once)."""
    from labkit.moe.layer import set_token_groups, update_biases

    model = GPT(cfg, seed=seed) if model is None else model
    cfg = model.config
    opt = make_optimizer(optimizer, model.parameters(), **optimizer_overrides)
    tokens, losses, first_grads = tiny_corpus(), [], None
    if capacity_rows is not None:
        set_token_groups(model, [r * cfg.block_size for r in capacity_rows])
    for step in range(steps):
        x, y = get_batch(tokens, batch_size, cfg.block_size, step, seed)   # (B, T)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.grad is not None}
        opt.step()
        update_biases(model)                     # DeepSeek-V3's loss-free balancing, if on
        losses.append(loss.item())
    return {"losses": losses, "grads": first_grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
