"""The same few training steps for every ZeRO stage, and the one-process reference they must equal.

    from labkit.launch import run
    from labkit.reference import TrainSpec, train
    from labkit.labs.zero.train import TINY, sharded_train
    ref = train(TINY, TrainSpec(steps=3, batch=12, optimizer="adamw"))   # the one reference
    out = run(sharded_train, 3, args=(2, TINY, "adamw"), kwargs=dict(steps=3))
    # out[r]["params"] equals ref.params; out[r]["held"] is what rank r kept

Data: every rank builds the same global batch (labkit.model.get_batch) and takes its own rows;
the global batch divides by the world size, so the mean over ranks of each rank's mean loss is
the global mean loss, and the gradients match the reference's.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit import reference as _reference
from labkit.flat import all_gather_full
from labkit.launch import device, note
from labkit.model import GPT, GPTConfig, get_batch, shard_rows, tiny_corpus
from labkit.observe import commlog, netcount
from labkit.observe.storage import storage_bytes
from labkit.reference import OPTIMIZERS, make_optimizer, optimizer_spec  # noqa: F401 (one registry)
from labkit.zero import DataParallel, ZeRO1, ZeRO2, ZeRO3
from labkit.zero.param_gather import OverlappedParamGather
from labkit.zero.params import weight_decay_groups

# n_embd 25, 5 heads: most parameters (625, 25, 2400, 400 elements ...) split unevenly in 2 or 3
TINY = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=5, n_embd=25)



def real_model(cfg: GPTConfig, seed: int = 0, freeze=(), unused: bool = False):
    """The tiny GPT as real training code meets it: parameters named in `freeze` frozen, and with
    unused=True a head that forward never calls (its gradient is None on every step)."""
    model = GPT(cfg, seed=seed)
    if unused:
        torch.manual_seed(seed + 1)
        model.unused_head = nn.Linear(cfg.n_embd, 3)                 # never called
    for name, p in model.named_parameters():
        if name in freeze:
            p.requires_grad_(False)
    return model


def real_reference(cfg: GPTConfig, optimizer: str, steps: int = 3, batch_size: int = 12,
                   seed: int = 0, freeze=(), unused=False, groups=False,
                   max_grad_norm=None) -> dict:
    """The one-process reference (labkit.reference.train) on real_model: torch param groups (no
    decay on 1-D tensors), torch's clip_grad_norm_. {"params", "losses", "grads" (first step,
    after clipping)}."""
    spec = _reference.TrainSpec(steps=steps, batch=batch_size, optimizer=optimizer, seed=seed,
                                decay_groups=groups, max_grad_norm=max_grad_norm)
    return _reference.train(real_model(cfg, seed, freeze, unused), spec).as_dict()


def make_stage(stage: int, model, optimizer: str, group=None, naive: bool = False,
               groups: bool = False, **stage_kw):
    """DataParallel / ZeRO1 / ZeRO2 / ZeRO3 over `model` with a named optimizer.

    groups: two parameter groups, no weight decay on 1-D tensors (norms, biases). stage_kw go to
    the stage's class (max_grad_norm for all; bucket_bytes for ZeRO2; reduce_scatter="backend"
    for ZeRO2 and ZeRO3: the backend's own reduce-scatter instead of labkit's choice;
    mp_policy and replicate for ZeRO3)."""

    opt_class, kw = optimizer_spec(optimizer)
    params = weight_decay_groups(model, kw.get("weight_decay", 0.0)) if groups \
        else model.parameters()
    if stage == 0:
        return DataParallel(params, opt_class, group, **stage_kw, **kw)
    if stage == 1:
        return ZeRO1(params, opt_class, group, naive=naive, **stage_kw, **kw)
    if stage == 2:
        return ZeRO2(params, opt_class, group, **stage_kw, **kw)
    if stage == 3:
        return ZeRO3(model, opt_class, group, param_groups=params if groups else None,
                     **stage_kw, **kw)
    raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")


def full_params(zero, model) -> dict:
    """name -> full parameter tensor on this rank (gathered for ZeRO-3)."""
    if getattr(zero, "stage", None) == 3:
        return zero.full_parameters()
    if getattr(zero, "param_dtype", None) is not None or getattr(zero, "offload", False):
        # ZeRO-1/2 with mp_policy or offload: the masters (fp32, or in CPU memory)
        names = {id(p): n for n, p in model.named_parameters()}
        out = {n: p.detach().clone() for n, p in model.named_parameters()}   # frozen: as is
        out.update({names[id(p)]: all_gather_full(s.detach().to(p.device), p.shape,
                                                  zero.group).clone()
                    for p, s in zip(zero.params, zero.shards)})
        return out
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def gradient_bytes_held(zero) -> int:
    """Bytes of gradient storage this rank holds now, by storage size: full gradients (p.grad;
    ZeRO-3's no_sync buffers) plus the shards' reduced chunks. Shared storage counted once."""
    tensors = [p.grad for p in zero.params] + [s.grad for s in getattr(zero, "shards", [])]
    tensors += list(getattr(zero, "_held", {}).values())
    return storage_bytes(tensors)


def gathered_grads(zero, model) -> dict:
    """name -> the mean gradient this stage used in its step (after clipping), full size; a
    parameter without one is left out. Collective for stages 1-3 (all-gathers the chunks)."""

    names = {id(p): n for n, p in model.named_parameters()}
    if zero.stage == 0:
        return {names[id(p)]: p.grad.clone() for p in zero.params if p.grad is not None}
    out = {}
    for p, s in zip(zero.params, zero.shards):
        if s.grad is None:          # the same on every rank (from the reduced has-grad flags)
            continue
        if id(p) in getattr(zero, "replicated", ()):   # ZeRO-3 replicate=: already whole
            out[names[id(p)]] = s.grad.detach().clone()
            continue
        shape = zero.shapes[id(p)] if zero.stage == 3 else p.shape
        device = getattr(zero, "device", None) or s.grad.device   # offload: gather on the device
        out[names[id(p)]] = all_gather_full(s.grad.detach().to(device), shape, zero.group).clone()
    return out


def sharded_train(stage: int, cfg: GPTConfig, optimizer: str, steps: int = 3,
                  batch_size: int = 12, seed: int = 0, group=None, naive: bool = False,
                  step_fn=None, accumulate: int = 1, stage_kw=None, freeze=(),
                  unused: bool = False, groups: bool = False, no_sync: bool = False,
                  overlap_param_gather: bool = False) -> dict:
    """Run on every rank (via labkit.launch.run): train `steps` steps with a ZeRO stage.

    Returns {"params", "losses" (this rank's local losses), "held" (bytes kept after the last
    step, before zero_grad), "sent"/"received" (bytes this rank's sockets moved in the last step,
    counted by the kernel: observe.netcount; None where it cannot count, "wire_reason" says why),
    "logged" ({op: [calls, payload bytes]} of the last step, labkit.observe.commlog), "numel"}.
    step_fn(params, shards, optimizer, group) replaces ZeRO-1's step (the exercise).
    accumulate: split this rank's rows into that many micro-batches, one backward each, before
    the step (gradient accumulation; the losses are scaled so the sum is the mean); no_sync: all
    but the last micro-batch inside zero.no_sync() (ZeRO-2/3: hold full gradients, send once).
    freeze, unused: labkit.labs.zero.train.real_model; groups: no decay on 1-D tensors. stage_kw for
    ZeRO-3 also takes mp_policy= (labkit.zero.MixedPrecisionPolicy) and replicate= (e.g.
    labkit.zero.one_dimensional); both are off by default. Also returns
    "grads": the first step's mean gradient per name (gathered from the shards; None-free),
    "peak_grad_bytes": the most gradient storage held after any micro-batch's backward,
    "peak_full_param_bytes": ZeRO-3's whole parameters held after any micro-batch (0 elsewhere).
    overlap_param_gather (ZeRO-1/2): labkit.zero.param_gather, the step's all-gather waited for
    in the next forward (the last step's is completed inside its own byte count)."""


    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = device()  # this rank's GPU under NCCL, else the CPU
    if batch_size % world:
        raise ValueError(f"batch_size={batch_size} must divide by the world size {world} so "
                         f"that every rank's mean loss weighs the same")
    model = real_model(cfg, seed, freeze, unused).to(dev)
    numel = sum(p.numel() for p in model.parameters())
    stage_kw = {**({"find_unused_parameters": True} if unused else {}), **(stage_kw or {})}
    zero = make_stage(stage, model, optimizer, group, naive=naive, groups=groups, **stage_kw)
    zero.keep_shard_grads = True    # ZeRO-1: keep the reduced chunks until zero_grad
    overlapped = OverlappedParamGather(model, zero) if overlap_param_gather else None
    first_grads, peak_grads, peak_full = None, 0, 0
    tokens, losses = tiny_corpus(), []
    for step in range(steps):
        note(f"ZeRO-{stage} step {step}")
        x, y = get_batch(tokens, batch_size, cfg.block_size, step, seed)   # (B, T) global
        x, y = shard_rows(x, rank, world).to(dev), shard_rows(y, rank, world).to(dev)  # (B/N, T)
        loss = 0.0
        # the whole step: ZeRO-2 and -3 communicate during forward and backward too
        with netcount.socket_bytes(group) as wire, commlog.record() as log:
            micro = list(zip(x.chunk(accumulate), y.chunk(accumulate)))   # (B/N/k, T) each
            for i, (xm, ym) in enumerate(micro):
                quiet = no_sync and i < len(micro) - 1 and hasattr(zero, "no_sync")
                with zero.no_sync() if quiet else contextlib.nullcontext():
                    part = model(xm, ym)[1] * (xm.shape[0] / x.shape[0])
                    part.backward()
                loss = loss + part.detach()
                peak_grads = max(peak_grads, gradient_bytes_held(zero))
                if hasattr(zero, "full_buffers"):     # ZeRO-3: whole parameters kept between
                    peak_full = max(peak_full, storage_bytes(zero.full_buffers()))
            if step_fn is not None:
                step_fn(zero.params, zero.shards, zero.optimizer, group)
            else:
                zero.step()
            if overlapped is not None and step == steps - 1:
                overlapped.finish()       # no next forward: complete the gathers in this step
        held = zero.held_bytes()
        if first_grads is None:
            first_grads = gathered_grads(zero, model)
        zero.zero_grad()
        losses.append(loss.item())
    logged = {}                                  # {op: [calls, payload bytes]}, last step
    for e in log.events:
        calls, nbytes = logged.get(e.op, (0, 0))
        logged[e.op] = [calls + 1, nbytes + e.bytes]
    return {"params": full_params(zero, model), "losses": losses, "held": held,
            "grads": first_grads, "peak_grad_bytes": peak_grads,
            "peak_full_param_bytes": peak_full,
            "sent": wire.sent, "received": wire.received, "wire_reason": wire.reason,
            "logged": logged, "numel": numel, "state_numel": state_numel(zero.optimizer)}


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
