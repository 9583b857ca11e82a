"""The rank-side training run that the hybrid lab, the tests and the benchmark share.

    from labkit.launch import run
    from labkit.parallel import Plan
    from labkit.labs.parallel.job import train
    out = run(train, 8, args=(Plan(dp=2, tp=2, pp=2), cfg_kwargs, steps, batch))

Every rank builds the same GPT (seed 0) on labkit.launch.device(), builds the mesh, applies the
transforms (labkit.parallel.parallelize) and trains `steps` steps on the same global batches as
the one-process reference (labkit.reference.reference_train). It returns what the comparison and
the tables need: the loss per step, the first step's whole-batch gradients and the final
parameters of what this rank's stage owns (full, by the one-process names), the comm log's
payload bytes and seconds per mesh dimension for the last step, the step's wall time, and the
kernel's count of bytes this rank sent (labkit.observe.netcount, where it can count).
"""
from __future__ import annotations

import torch

from labkit.launch import device, note
from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus
from labkit.observe import commlog, netcount
from labkit.parallel import build_mesh, parallelize
from labkit.timing import now


def train(plan, cfg_kwargs: dict, steps: int = 3, batch: int = 8, optimizer: str = "adamw",
          capture_grads: bool = True, **optimizer_overrides) -> dict:
    torch.set_num_threads(1)   # many ranks share few cores
    cfg, dev = GPTConfig(**cfg_kwargs), device()
    mesh = build_mesh(plan)
    par = parallelize(GPT(cfg, seed=0).to(dev), mesh, plan, optimizer, **optimizer_overrides)
    tokens, losses, grads, last, times = tiny_corpus(), [], None, None, []
    for step in range(steps):
        note(f"{plan.describe()}: step {step}")
        x, y = get_batch(tokens, batch, cfg.block_size, step)           # (B, T) global batch
        counter = _socket_counter()
        with counter, commlog.record() as log:
            t0 = now(dev)
            losses.append(par.train_step(x, y, capture_grads=capture_grads and step == 0))
            seconds = now(dev) - t0
        times.append(seconds)
        if step == 0 and capture_grads:
            grads = par.captured_grads()
        last = (log, seconds, counter)
    log, seconds, counter = last
    return {"coords": mesh.coords, "losses": losses, "grads": grads,
            "params": par.full_params(), "step_seconds": seconds, "step_times": times,
            "comm": _per_dim(log), "kernel_sent": getattr(counter, "sent", None),
            "local_params": sum(p.numel() for p in par.owned.values()),
            "ran_on": (torch.distributed.get_backend(), str(dev))}


def _per_dim(log) -> dict:
    """{dim: {"bytes", "calls", "seconds"}} of the step's logged calls; pp counts what was sent,
    and the loss's own reduction is left out (labkit.costs.parallel does the same); seconds are
    the time the rank was blocked in calls (a posted send or receive counts only its wait)."""
    out = {}
    for e in log.events:
        if e.where == "loss":
            continue
        row = out.setdefault(e.dim, {"bytes": 0, "calls": 0, "seconds": 0.0})
        row["seconds"] += e.blocked
        if e.op != "recv":
            row["bytes"] += e.bytes
            row["calls"] += 1
    return out


class _NoCounter:
    sent = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _socket_counter():
    """The kernel's per-socket byte counter (observe.netcount) where it exists and can count."""
    try:
        return netcount.socket_bytes()
    except Exception:          # a backend the kernel counter cannot see (NCCL): no count
        return _NoCounter()
