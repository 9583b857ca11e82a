"""Exercise 3.2's run: the checker's training loop on the ranks, with the reader's ZeRO-2
optimizer, and the same loop on one process (the reference: the checker keeps its own on
purpose, to stay independent of labkit.zero, which it would otherwise grade against). The
zero2 package's __init__ grades what this returns.

    zero2_job(MyZeRO2, cfg_kwargs, max_grad_norm, bucket_bytes)   # inside a launched rank

Each rank builds the same tiny GPT, takes its rows of every global batch and runs STEPS steps,
the last of ACCUM micro-batches (all but the last under the reader's no_sync(), each loss divided
by ACCUM), then the state_dict round trip: before the last step the reader's state_dict() is
saved with torch.save; afterwards a second model and optimizer load the weights and that state
(torch.load(weights_only=True)) and replay the last step. On the way it observes, with counters
the reader's code does not write: full gradients alive (its own post-accumulate-grad hooks, after
the reader's), the collectives dispatched (labkit.observe.dispatch.CollectiveLog), the bytes the
sockets sent (labkit.observe.netcount), the storage of the optimizer's state, the saved bytes.
"""
from __future__ import annotations

import contextlib
import io

import torch
import torch.distributed as dist

from labkit.labs.zero.train import TINY
from labkit.launch import device, note
from labkit.model import GPT, GPTConfig, get_batch, shard_rows, tiny_corpus
from labkit.observe import netcount
from labkit.observe.dispatch import CollectiveLog
from labkit.observe.storage import storage_bytes

STEPS, BATCH = 3, 12
ACCUM = 2                 # micro-batches of the last step; all but the last under no_sync()
TRAFFIC_STEP = 1          # the plain step whose bytes the kernel counts
# AdamW with an eps near the gradients' size: a step then depends on their scale, so a sum where
# the mean belongs changes the result (with eps = 1e-8 Adam would hide a factor N)
ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-3)


def micro_batches(step: int) -> int:
    return ACCUM if step == STEPS - 1 else 1


def batch(tokens, cfg, step: int, k: int):
    """The global batch of micro-batch k of `step`: (x, y), each (BATCH, T)."""

    return get_batch(tokens, BATCH, cfg.block_size, 10 * step + k, 0)


def reference(cfg, max_grad_norm) -> dict:
    """One process, the whole global batch of every micro-batch: AdamW after torch's
    clip_grad_norm_ if asked; each micro-batch's loss divided by their number, as the ranks'."""
    model = GPT(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    tokens = tiny_corpus()
    for step in range(STEPS):
        for k in range(micro_batches(step)):
            x, y = batch(tokens, cfg, step, k)                                 # (B, T)
            (model(x, y)[1] / micro_batches(step)).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "losses": [0.0] * STEPS}


def config(kwargs):
    return TINY if kwargs is None else GPTConfig(**kwargs)


def _storage(tensors) -> int:
    return storage_bytes(tensors)


def _train(zero, model, cfg, steps, watch=None, save=None, observe=True):
    """Run `steps` of the checker's loop on the reader's optimizer; per step what was observed
    (observe=False: nothing, for the replay). watch: {"on", "peak"} for the full-gradient hooks
    (on for plain steps only); save: a dict to fill with the state_dict's bytes and the weights
    before the last step. The kernel's counters cost a read of the machine's TCP table each:
    plain step TRAFFIC_STEP and the no_sync micro-batch only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, seen, nothing = tiny_corpus(), [], contextlib.nullcontext()
    for step in steps:
        if save is not None and step == STEPS - 1:
            blob = io.BytesIO()
            torch.save(zero.state_dict(), blob)
            save["blob"] = blob.getvalue()
            save["weights"] = {n: t.detach().clone() for n, t in model.state_dict().items()}
        n_micro, obs = micro_batches(step), {"step": step}
        if watch is not None:
            watch["on"] = n_micro == 1
        dist.barrier()
        with (netcount.socket_bytes() if observe and step == TRAFFIC_STEP else nothing) as wire:
            for k in range(n_micro):
                x, y = batch(tokens, cfg, step, k)                             # (B, T) global
                x, y = (shard_rows(t, rank, world).to(device()) for t in (x, y))  # (B/N, T)
                accumulate = k < n_micro - 1
                loss = model(x, y)[1] / n_micro
                note(f"backward of step {step}, micro-batch {k}"
                     + (" (under your no_sync)" if accumulate else ""))
                with (zero.no_sync() if accumulate else nothing), \
                        (netcount.socket_bytes() if observe and accumulate else nothing) as mw, \
                        (CollectiveLog() if observe and step > 0 else nothing) as log:
                    loss.backward()
                if log is not None and accumulate:
                    obs["accum_calls"], obs["accum_sent"] = log.calls, mw.sent
                elif log is not None:
                    obs["reductions"] = _collectives(log, world)
            note(f"your step() {step}")
            with (CollectiveLog() if wire is not None else nothing) as step_log:
                zero.step()
        if wire is not None:              # the bytes, and the collectives that sent them
            obs["sent"] = wire.sent
            obs["collectives"] = obs["reductions"] + _collectives(step_log, world)
        seen.append(obs)
        zero.zero_grad()
    return seen


def _collectives(log, world) -> float:
    """Collectives in a CollectiveLog: each c10d collective is one, a ring is N-1 sends."""
    return len(log.collectives()) + log.calls.count("send") / max(world - 1, 1)


def zero2_job(cls, cfg_kwargs, max_grad_norm, bucket_bytes):
    """Rank side: the checker's loop with the reader's class, then the state_dict round trip."""
    world = dist.get_world_size()
    cfg = config(cfg_kwargs)
    model = GPT(cfg, seed=0).to(device())           # a GPU under NCCL, else the CPU
    params = list(model.parameters())
    note(f"your constructor, {world} ranks")
    zero = cls(params, None, bucket_bytes=bucket_bytes, max_grad_norm=max_grad_norm, **ADAMW)
    watch, save = {"on": True, "peak": 0}, {}

    def measure(_p):       # runs after the reader's hook on the same parameter
        if watch["on"]:
            watch["peak"] = max(watch["peak"], _storage(p.grad for p in params))

    for p in params:
        p.register_post_accumulate_grad_hook(measure)
    seen = _train(zero, model, cfg, range(STEPS), watch=watch, save=save)
    opt = getattr(zero, "optimizer", None)
    state = None
    if isinstance(opt, torch.optim.Optimizer):
        state = _storage(v for s in opt.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
    out = {"params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
           "losses": [0.0] * STEPS, "peak": watch["peak"],
           "full": 4 * sum(p.numel() for p in params), "state": state, "steps": seen,
           "numels": [p.numel() for p in params],
           "saved_bytes": len(save["blob"])}
    # the round trip: a fresh model and optimizer resume from the saved weights and state
    note("the state_dict round trip: your load_state_dict, then the last step again")
    again = GPT(cfg, seed=1).to(device())
    again.load_state_dict(save["weights"])
    zero2 = cls(list(again.parameters()), None, bucket_bytes=bucket_bytes,
                max_grad_norm=max_grad_norm, **ADAMW)
    zero2.load_state_dict(torch.load(io.BytesIO(save["blob"]), weights_only=True))
    _train(zero2, again, cfg, [STEPS - 1], observe=False)
    out["resumed"] = {n: p.detach().cpu().clone() for n, p in again.named_parameters()}
    return out
