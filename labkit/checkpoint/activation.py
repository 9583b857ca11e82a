"""Activation checkpointing (recomputation): keep only each block's input, redo its forward in
backward. Memory for activations drops from every block's intermediates to one tensor per block
(plus one block's intermediates while it is recomputed); the price is one extra forward pass of
the blocks: step time x (f + b + f)/(f + b) = 4/3 when backward costs two forwards.
(Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost".)

    with_recompute(model)               # every GPT block runs under torch.utils.checkpoint
    saved_activation_bytes(model, x, y) # bytes autograd keeps for backward after the forward
    count_work(model, x, y)             # FLOPs and operator calls of fwd+bwd, counted by torch

Memory is measured by counting what autograd saves for backward (saved-tensor hooks), storage by
storage: exact, deterministic and the same on CPU and GPU; the parameters it also references are
left out (they exist anyway).
"""
from __future__ import annotations

import statistics
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus
from labkit.observe.saved import saved_bytes
from labkit.timing import now


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
    return saved_bytes(model, x, y, train=None)[0]


def step_time(model, x, y, repeats: int = 5) -> float:
    """Median seconds of forward + backward (the first run warms up and is dropped)."""
    return step_times({"m": model}, x, y, repeats)["m"]["step"]


def step_times(models: dict, x, y, repeats: int = 5, threads: int | None = 1) -> dict:
    """Median seconds of forward + backward ("step") and of the forward alone ("forward", with
    autograd recording, as a recomputed forward runs) of each model, in interleaved rounds (round r
    times every model once, so drifting load hits each alike), with `threads` intra-op threads for
    the measurement (restored after; None: leave as is). One thread by default: on a machine busier
    than its cores, each op's parallel region waits for a descheduled helper thread, and which model
    happens to run while the load peaks decides the ratio (this was ch06's 6.8x)."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        times = {k: ([], []) for k in models}
        for _ in range(repeats + 1):
            for k, model in models.items():
                t0 = now(x.device)
                _, loss = model(x, y)
                t1 = now(x.device)
                loss.backward()
                times[k][0].append(now(x.device) - t0)
                times[k][1].append(t1 - t0)
                model.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(old)
    return {k: {"step": statistics.median(s[1:]), "forward": statistics.median(f[1:])}
            for k, (s, f) in times.items()}


def count_work(model, x, y) -> dict:
    """FLOPs (torch's FlopCounterMode: matmuls and convolutions) and aten operator calls of one
    forward + backward. Counted by torch's dispatcher, not by labkit: a recomputed forward shows
    up as the ops it really runs again."""
    class _Ops(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Ops.calls += 1
            return func(*args, **(kwargs or {}))

    flops = FlopCounterMode(display=False)
    with flops, _Ops():
        _, loss = model(x, y)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return {"flops": flops.get_total_flops(), "ops": _Ops.calls}


def predicted_block_bytes(batch: int, seq: int, n_embd: int, dtype_bytes: int = 4) -> int:
    """What recomputation keeps per block: its input, (B, T, h) elements."""
    return batch * seq * n_embd * dtype_bytes


def measure(cfg=None, batch: int = 8, repeats: int = 5, seed: int = 0, threads: int | None = 1,
            device=None) -> dict:
    """Saved activation bytes (total and per block), FLOPs and operator calls counted by torch,
    and fwd+bwd time (interleaved medians), with and without recomputation. Per-block bytes come
    from the difference between cfg and a 1-layer twin, so the embedding / head / loss part
    (never recomputed) is separated out. `device`: where the models run (default the CPU; the
    clock synchronizes a GPU)."""
    cfg = cfg or GPTConfig(n_layer=4, n_embd=64, n_head=4, block_size=64)
    if cfg.n_layer < 2:
        raise ValueError(f"n_layer={cfg.n_layer}: use at least 2 layers to separate per-block "
                         f"bytes")
    dev = torch.device(device or "cpu")
    x, y = (t.to(dev) for t in get_batch(tiny_corpus(), batch, cfg.block_size, step=0, seed=seed))
    out = {"n_layer": cfg.n_layer, "predicted_factor": 4 / 3,
           "predicted_block_bytes_recompute": predicted_block_bytes(batch, cfg.block_size,
                                                                    cfg.n_embd)}
    models = {}
    for mode in ("plain", "recompute"):
        sizes = {}
        for n_layer in (1, cfg.n_layer):
            model = GPT(replace(cfg, n_layer=n_layer), seed=seed).to(dev)
            if mode == "recompute":
                with_recompute(model)
            sizes[n_layer] = saved_activation_bytes(model, x, y)
        per_block = (sizes[cfg.n_layer] - sizes[1]) // (cfg.n_layer - 1)
        out[mode] = {"saved_bytes": sizes[cfg.n_layer], "per_block_bytes": per_block,
                     "other_bytes": sizes[1] - per_block, **count_work(model, x, y)}
        models[mode] = model
    for mode, t in step_times(models, x, y, repeats, threads).items():
        out[mode]["step_s"], out[mode]["forward_s"] = t["step"], t["forward"]
    for key in ("flops", "ops"):
        out[f"{key}_factor"] = out["recompute"][key] / out["plain"][key]
    out["time_factor"] = out["recompute"]["step_s"] / out["plain"]["step_s"]
    # (f + b + f)/(f + b) with this machine's own f and b, not b = 2f (an upper bound: the
    # embedding, head and loss are part of f but are not recomputed)
    f, total = out["plain"]["forward_s"], out["plain"]["step_s"]
    out["b_over_f"] = (total - f) / f
    out["predicted_time_factor"] = (total + f) / total
    # peak while backward recomputes one block: the kept inputs + that block's intermediates
    out["recompute"]["peak_bytes"] = (out["recompute"]["saved_bytes"]
                                      + out["plain"]["per_block_bytes"])
    return out
