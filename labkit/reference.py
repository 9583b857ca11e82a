"""The one-process reference every parallel run is compared to, and the one optimizer registry.

    from labkit.reference import TrainSpec, train
    ref = train(GPTConfig(n_layer=2), TrainSpec(steps=3, batch=8, optimizer="adamw"))
    ref.losses, ref.grads, ref.params    # per step; first step's gradients; after the last step
    compare_dicts(run["params"], ref.params, what="rank 1")   # labkit.testing: the comparator

A parallel run (any mesh: labkit.parallel) trains the same GPT (same seed) on the same global
batches (labkit.model.get_batch is deterministic in the step) with the same optimizer from
OPTIMIZERS, so its losses, gradients and parameters must equal these up to float rounding
(labkit.testing.tensors_close says how close is close for each dtype). This is the one reference
training entry: the DDP, ZeRO and pipeline runs build a TrainSpec for it
(labkit.labs.ddp.verify.spec, labkit.labs.zero.train.real_reference); `reference_train` is the
same with the options as keywords, kept for chapters 08 and 10 and the hybrid, context and MoE
labs.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from labkit.model import GPT, GPTConfig, get_batch, shard_rows, tiny_corpus
from labkit.moe.layer import set_token_groups, update_biases

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


def weight_decay_groups(named, weight_decay: float) -> list:
    """Two torch-style groups of (name, parameter) pairs: matrices decay, 1-D tensors (norm
    weights, biases) do not (the usual GPT recipe). Frozen parameters stay in: the optimizer
    skips them (they get no gradient)."""
    named = list(named)
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


@dataclass(frozen=True)
class TrainSpec:
    """How the reference trains. Every field has the default most labs use."""
    steps: int = 3                     # optimizer steps
    batch: int = 8                     # rows of the global batch of each step
    micro_batches: int = 1             # the batch's rows cut in K (labkit.shard); one step each K
    optimizer: str | None = "adamw"    # a name in OPTIMIZERS; None: no step (gradients only)
    optimizer_options: dict = field(default_factory=dict)   # overrides of its defaults (lr=...)
    decay_groups: bool = False         # no weight decay on 1-D tensors (weight_decay_groups)
    max_grad_norm: float | None = None  # torch.nn.utils.clip_grad_norm_ before each step
    dtype: str | None = None           # "float64": the model cast before training
    seed: int = 0                      # the model's initial weights
    data_seed: int | None = None       # the batches (labkit.model.get_batch); None: seed
    frozen: tuple = ()                 # names of parameters that do not train
    capacity_rows: tuple | None = None  # MoE only: rows of each capacity group (Plan.capacity_rows)

    def with_(self, **changes) -> TrainSpec:
        return replace(self, **changes)


@dataclass
class Trace:
    """What the reference did: losses per step, the first step's loss (a tensor) and gradients
    (after clipping), the parameters after the last step; names as in GPT.named_parameters()
    (a tied embedding appears once). t["losses"] works as well as t.losses."""
    losses: list
    loss: torch.Tensor
    grads: dict
    params: dict

    def __getitem__(self, key: str):
        return getattr(self, key)

    def as_dict(self) -> dict:
        return {"losses": self.losses, "grads": self.grads, "params": self.params}


def build(model_or_cfg, spec: TrainSpec) -> GPT:
    """The model the reference trains: GPT(cfg, spec.seed) (or the one given), cast to spec.dtype,
    spec.frozen not training."""
    model = GPT(model_or_cfg, seed=spec.seed) if isinstance(model_or_cfg, GPTConfig) \
        else model_or_cfg
    if spec.dtype is not None:
        model = model.to(getattr(torch, spec.dtype))
    names = dict(model.named_parameters())
    for name in spec.frozen:
        if name not in names:
            raise ValueError(f"no parameter named {name!r}; choose from {sorted(names)}")
        names[name].requires_grad_(False)
    return model


def _optimizer(model, spec: TrainSpec):
    if spec.optimizer is None:
        return None
    if not spec.decay_groups:
        return make_optimizer(spec.optimizer, model.parameters(), **spec.optimizer_options)
    cls, kw = optimizer_spec(spec.optimizer, **spec.optimizer_options)
    return cls(weight_decay_groups(model.named_parameters(), kw.get("weight_decay", 0.0)), **kw)


def train(model_or_cfg, spec: TrainSpec = TrainSpec()) -> Trace:
    """One process, the whole global batch of every step, on the CPU (or where the model is)."""
    model = build(model_or_cfg, spec)
    cfg = model.config
    opt = _optimizer(model, spec)
    data_seed = spec.seed if spec.data_seed is None else spec.data_seed
    tokens, losses, first = tiny_corpus(), [], None
    if spec.capacity_rows is not None:
        set_token_groups(model, [r * cfg.block_size for r in spec.capacity_rows])
    dev = next(model.parameters()).device
    for step in range(spec.steps):
        x, y = get_batch(tokens, spec.batch, cfg.block_size, step, data_seed)   # (B, T)
        x, y = x.to(dev), y.to(dev)
        model.zero_grad(set_to_none=True)
        K, loss = spec.micro_batches, None
        for k in range(K):   # each micro-batch's mean loss weighted by its rows: the batch mean
            xk, yk = (x, y) if K == 1 else (shard_rows(x, k, K), shard_rows(y, k, K))
            _, part = model(xk, yk)
            part = part if K == 1 else part * (xk.shape[0] / spec.batch)
            part.backward()
            loss = part.detach() if loss is None else loss + part.detach()
        if spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                           spec.max_grad_norm)
        if first is None:
            first = (loss, {n: p.grad.detach().clone() for n, p in model.named_parameters()
                            if p.grad is not None})
        if opt is not None:
            opt.step()
            update_biases(model)                 # DeepSeek-V3's loss-free balancing, if on
        losses.append(float(loss))
    return Trace(losses, first[0] if first else None, first[1] if first else {},
                 {n: p.detach().clone() for n, p in model.named_parameters()})


def reference_train(cfg: GPTConfig | None, steps: int = 3, batch_size: int = 8,
                    optimizer: str = "adamw", seed: int = 0, capacity_rows=None, model=None,
                    **optimizer_overrides) -> dict:
    """train() with the options as keywords: {"losses", "grads", "params"} (chapters 08 and 10
    and the hybrid, context and MoE labs call it). model: a GPT built by the caller instead of
    GPT(cfg, seed)."""
    spec = TrainSpec(steps=steps, batch=batch_size, optimizer=optimizer, seed=seed,
                     optimizer_options=optimizer_overrides,
                     capacity_rows=None if capacity_rows is None else tuple(capacity_rows))
    return train(cfg if model is None else model, spec).as_dict()
