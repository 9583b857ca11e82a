"""What every ZeRO stage needs from real training code: parameter groups, frozen parameters,
gradients that may be missing, and clipping by the global norm of sharded gradients.

    groups, frozen = param_groups(model.parameters())                 # or torch-style dicts
    groups, frozen = param_groups(weight_decay_groups(model, 0.1))    # no decay on norms/biases

- A frozen parameter (requires_grad=False) gets no gradient, no update, no weight decay and no
  optimizer state: it is left out of the groups (returned apart, so ZeRO-3 can still shard it).
- The same tensor registered twice, or parameters on different devices: a ValueError that names
  them (tied weights are ONE tensor: model.parameters() lists it once).
- A parameter no rank used this step has gradient None, and must stay None: a zero gradient is
  not "no gradient" (SGD momentum and AdamW move a parameter whose gradient is zero). Every rank
  sends a 0/1 has-grad flag per parameter inside the gradient's own collective (`with_flags`),
  so one message still carries everything.
- Clipping: the global norm is sqrt(sum over ALL elements of g^2). With sharded gradients each
  rank sums the squares of its own chunk and one all-reduce adds them (padding is zero); with
  full gradients (DP) the local norm already is the global one.
"""
from __future__ import annotations

import torch

from labkit import reference
from labkit.observe import commlog


def param_groups(params) -> tuple[list, list]:
    """(groups, frozen): groups = [{"params": [trainable tensors], **options}], frozen = [...].

    params: a module, an iterable of tensors, or torch.optim-style dicts {"params": [...], ...}."""
    if hasattr(params, "parameters"):
        params = params.parameters()
    params = list(params)
    raw = params if params and isinstance(params[0], dict) else [{"params": params}]
    seen, groups, frozen, devices = {}, [], [], {}
    for gi, g in enumerate(raw):
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        for p in ps:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameter group {gi} holds a {type(p).__name__}, not a tensor")
            if id(p) in seen:
                raise ValueError(
                    f"the same parameter (shape {tuple(p.shape)}) is registered twice (groups "
                    f"{seen[id(p)]} and {gi}); tied weights are one tensor: pass it once")
            seen[id(p)] = gi
            devices.setdefault(str(p.device), tuple(p.shape))
        trainable = [p for p in ps if p.requires_grad]
        frozen += [p for p in ps if not p.requires_grad]
        if trainable:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": trainable})
    if len(devices) > 1:
        raise ValueError(f"parameters are on different devices {sorted(devices)}: move the "
                         f"model to one device (this rank's: labkit.launch.device()) first")
    return groups, frozen


def flat_params(groups) -> list:
    return [p for g in groups for p in g["params"]]


def weight_decay_groups(model, weight_decay: float, named=None) -> list:
    """labkit.reference.weight_decay_groups over the model's named parameters: matrices decay,
    1-D tensors do not. Frozen parameters stay in the groups: an optimizer skips them (no
    gradient; param_groups sets them apart), and ZeRO-1/2 with a policy must be given them to
    cast them to param_dtype with the rest."""
    return reference.weight_decay_groups(model.named_parameters() if named is None else named,
                                         weight_decay)


def with_flags(params, grads, world: int) -> list:
    """The gradients (zeros where missing) plus one tensor of has-grad flags repeated world times,
    so that after a reduce-scatter (or an all-reduce, world=1) every rank holds, per parameter,
    the mean over ranks of "had a gradient": > 0 means some rank used it. Returns a list one
    longer than params."""
    flags = torch.tensor([float(g is not None) for g in grads],
                         device=params[0].device if params else None)   # (P,)
    fulls = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    return fulls + [flags.repeat(world)]                              # last: (N*P,)


def require_grads(params, grads) -> None:
    """find_unused_parameters=False (the default, as in torch DDP: no flags sent): a parameter
    without a gradient is an error, never silently a zero gradient (which momentum and AdamW's
    decay would turn into an update)."""
    missing = [tuple(p.shape) for p, g in zip(params, grads) if g is None]
    if missing:
        raise RuntimeError(
            f"{len(missing)} trainable parameter(s) got no gradient this step (shapes "
            f"{missing[:4]}): pass find_unused_parameters=True (sends one has-grad flag per "
            f"parameter with the gradients) or freeze them (requires_grad_(False))")


def grad_norm(grads, group=None, sharded: bool = True, replicated=(),
              device=None) -> torch.Tensor:
    """The global L2 norm of gradients (None skipped). sharded: each rank holds its own chunks,
    so the squares are summed over ranks (one all-reduce of one element). replicated: full
    gradients every rank holds alike (ZeRO-3's replicate=), added once, after the sum.
    device: where the one element is all-reduced (offload keeps gradients in CPU memory, and
    NCCL reduces only GPU tensors); default the gradients' own."""
    grads = [g for g in grads if g is not None]
    sq = torch.zeros((), device=grads[0].device if grads else device)
    if grads:
        sq = torch.stack([g.detach().float().norm() ** 2 for g in grads]).sum()
    if sharded:
        sq = sq.reshape(1).to(device or sq.device)
        commlog.all_reduce(sq, group=group, where="ZeRO grad norm")
    for g in replicated:
        if g is not None:
            sq = sq + (g.detach().float().norm() ** 2).to(sq.device)
    return sq.sqrt().reshape(())


def clip_(grads, max_norm: float, group=None, sharded: bool = True,
          replicated=(), device=None) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most max_norm (torch's
    clip_grad_norm_ rule: coef = max_norm / (norm + 1e-6), clamped at 1). Returns the norm.
    device: see grad_norm."""
    replicated = list(replicated)
    norm = grad_norm(grads, group, sharded, replicated, device)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in list(grads) + replicated:
        if g is not None:
            g.mul_(coef.to(g.device, g.dtype))
    return norm
