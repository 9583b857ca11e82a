"""The same few training steps for every ZeRO stage, and the one-process reference they must equal.

    from labkit.launch import run
    from labkit.zero.train import TINY, reference_train, sharded_train
    ref = reference_train(TINY, "adamw", steps=3)
    out = run(sharded_train, 3, args=(2, TINY, "adamw"), kwargs=dict(steps=3))
    # out[r]["params"] equals ref["params"]; out[r]["held"] is what rank r kept

Data: every rank builds the same global batch (labkit.model.get_batch) and takes its own rows;
the global batch divides by the world size, so the mean over ranks of each rank's mean loss is
the global mean loss, and the gradients match the reference's.
"""
from __future__ import annotations

import torch

from labkit.model import GPT, GPTConfig, get_batch, shard_rows, tiny_corpus

# n_embd 25, 5 heads: most parameters (625, 25, 2400, 400 elements ...) split unevenly in 2 or 3
TINY = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=5, n_embd=25)

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}


def optimizer_spec(name: str):
    if name not in OPTIMIZERS:
        raise KeyError(f"optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def reference_train(cfg: GPTConfig, optimizer: str, steps: int = 3, batch_size: int = 12,
                    seed: int = 0) -> dict:
    """One process, the whole global batch: {"params": {name: tensor}, "losses": [...]}."""
    opt_class, kw = optimizer_spec(optimizer)
    model = GPT(cfg, seed=seed)
    opt = opt_class(model.parameters(), **kw)
    tokens, losses = tiny_corpus(), []
    for step in range(steps):
        x, y = get_batch(tokens, batch_size, cfg.block_size, step, seed)   # (B, T)
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "losses": losses}


def make_stage(stage: int, model, optimizer: str, group=None, naive: bool = False, **stage_kw):
    """DataParallel / ZeRO1 / ZeRO2 / ZeRO3 over `model` with a named optimizer.

    stage_kw go to the stage's class (e.g. bucket_bytes for ZeRO2)."""
    from labkit.zero import DataParallel, ZeRO1, ZeRO2, ZeRO3

    opt_class, kw = optimizer_spec(optimizer)
    if stage == 0:
        return DataParallel(model.parameters(), opt_class, group, **kw)
    if stage == 1:
        return ZeRO1(model.parameters(), opt_class, group, naive=naive, **kw)
    if stage == 2:
        return ZeRO2(model.parameters(), opt_class, group, **stage_kw, **kw)
    if stage == 3:
        return ZeRO3(model, opt_class, group, **kw)
    raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")


def full_params(zero, model) -> dict:
    """name -> full parameter tensor on this rank (gathered for ZeRO-3)."""
    if getattr(zero, "stage", None) == 3:
        return zero.full_parameters()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def sharded_train(stage: int, cfg: GPTConfig, optimizer: str, steps: int = 3,
                  batch_size: int = 12, seed: int = 0, group=None, naive: bool = False,
                  step_fn=None, accumulate: int = 1, stage_kw=None) -> dict:
    """Run on every rank (via labkit.launch.run): train `steps` steps with a ZeRO stage.

    Returns {"params", "losses" (this rank's local losses), "held" (bytes kept after the last
    step, before zero_grad), "sent" (bytes sent per step, by collective), "numel"}.
    step_fn(params, shards, optimizer, group) replaces ZeRO-1's step (the exercise).
    accumulate: split this rank's rows into that many micro-batches, one backward each, before
    the step (gradient accumulation; the losses are scaled so the sum is the mean)."""
    import torch.distributed as dist

    from labkit.launch import device, note

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = device()  # this rank's GPU under NCCL, else the CPU
    if batch_size % world:
        raise ValueError(f"batch_size={batch_size} must divide by the world size {world} so "
                         f"that every rank's mean loss weighs the same")
    model = GPT(cfg, seed=seed).to(dev)
    numel = sum(p.numel() for p in model.parameters())
    zero = make_stage(stage, model, optimizer, group, naive=naive, **(stage_kw or {}))
    tokens, losses = tiny_corpus(), []
    for step in range(steps):
        note(f"ZeRO-{stage} step {step}")
        zero.counter.reset()  # ZeRO-2 and -3 communicate during forward and backward too
        x, y = get_batch(tokens, batch_size, cfg.block_size, step, seed)   # (B, T) global
        x, y = shard_rows(x, rank, world).to(dev), shard_rows(y, rank, world).to(dev)  # (B/N, T)
        loss = 0.0
        for xm, ym in zip(x.chunk(accumulate), y.chunk(accumulate)):    # (B/N/k, T) each
            part = model(xm, ym)[1] * (xm.shape[0] / x.shape[0])
            part.backward()
            loss = loss + part.detach()
        if step_fn is not None:
            step_fn(zero.params, zero.shards, zero.optimizer, group)
        else:
            zero.step()
        held = zero.held_bytes()
        zero.zero_grad()
        losses.append(loss.item())
    return {"params": full_params(zero, model), "losses": losses, "held": held,
            "sent": dict(zero.counter.sent), "numel": numel,
            "state_numel": state_numel(zero.optimizer)}


def state_numel(optimizer) -> list:
    """Elements of optimizer state per parameter it updates: [(param numel, state numel)]."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            n = max((v.numel() for v in st.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0), default=0)
            out.append((p.numel(), n))
    return out
