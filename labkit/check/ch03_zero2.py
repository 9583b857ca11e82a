"""Exercise 3.2's checker: the reader's ZeRO-2 optimizer against one process.

    labkit.check.ch03.zero2_optimizer(MyZeRO2)

One launch per world size (2 shown; 3 and 4 hidden, the last on another model) trains the tiny GPT
three steps with AdamW (eps 1e-3, so that a sum in place of the mean shows); at the hidden world
sizes each step's gradient is clipped to a global norm of 0.5 (a norm over shards needs every
rank's share): every rank builds the same model, takes its rows of the global batch,
runs backward and the reader's step() / zero_grad(). Four cases per world:
  values: every parameter equals one process's (torch's clip_grad_norm_, then AdamW), and all
      ranks hold the same;
  optimizer state: the storage of every tensor in `self.optimizer`'s state is at most Adam's two
      moments of this rank's shard, 8 * sum(ceil(numel / N)) bytes (+ scalar steps);
  gradients during backward: the checker's own post-accumulate-grad hooks, registered after the
      reader's, add up the storage of every full gradient (p.grad) alive at that moment; ZeRO-2
      never holds more than half of them (a per-parameter or bucketed reduce-scatter in backward
      holds one parameter or one bucket);
  traffic: the bytes each rank sent in a whole step (forward, backward, step), counted by the
      kernel (labkit.netcount), at most a reduce-scatter + an all-gather of the padded Ψ, fp32,
      plus Gloo's headers (labkit.check.ch03.assert_optimal_traffic). An all-reduce, or Gloo's own
      reduce_scatter_tensor (which all-reduces), sends about 1.5x and fails.
labkit.zero and torch's ZeroRedundancyOptimizer / FSDP are refused by reading the code.
"""
from __future__ import annotations

import math

from labkit.check import Checker, fail
from labkit.check.guards import forbidden_used

FORBIDDEN_MODULES = ("labkit.zero", "torch.distributed.optim", "torch.distributed.fsdp",
                     "torch.distributed._composable")
FORBIDDEN_NAMES = {"ZeRO1", "ZeRO2", "ZeRO3", "ZeroRedundancyOptimizer", "fully_shard",
                   "shard_optimizer", "reduce_scatter_mean_many", "reduce_scatter_mean"}
# world -> (model config, max_grad_norm). Config None: labkit.zero.train.TINY, whose tensors mostly
# split unevenly. 2 ranks unclipped (clipping to a norm would hide a sum where the mean belongs);
# 3 and 4 (hidden) clipped to a global norm of 0.5, below the tiny GPT's: every step is clipped
WORLDS = {2: (None, None), 3: (None, 0.5),
          4: (dict(vocab_size=96, block_size=16, n_layer=1, n_head=3, n_embd=21), 0.5)}
STEPS, BATCH = 3, 12
# AdamW with an eps near the gradients' size: a step then depends on their scale, so a sum where
# the mean belongs changes the result (with eps = 1e-8 Adam would hide a factor N)
ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-3)


def reference(cfg, max_grad_norm) -> dict:
    """One process, the whole global batch: AdamW, after torch's clip_grad_norm_ if asked."""
    import torch

    from labkit.model import GPT, get_batch, tiny_corpus

    model = GPT(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    tokens = tiny_corpus()
    for step in range(STEPS):
        x, y = get_batch(tokens, BATCH, cfg.block_size, step, 0)              # (B, T)
        model(x, y)[1].backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "losses": [0.0] * STEPS}
PEAK_SHARE = 0.5          # of the full gradients' bytes, alive at once during backward
LAUNCH_TIMEOUT = 90.0     # seconds: a busy 2-core machine starts 4 ranks slowly


def _config(kwargs):
    from labkit.model import GPTConfig
    from labkit.zero.train import TINY

    return TINY if kwargs is None else GPTConfig(**kwargs)


def _storage(tensors) -> int:
    from labkit.zero.shard import storage_bytes   # each storage once, by the size torch keeps

    return storage_bytes(tensors)


def _zero2_job(cls, cfg_kwargs, max_grad_norm):
    """Rank side: 3 AdamW steps with the reader's class; what the checker measures on the way."""
    import torch
    import torch.distributed as dist

    from labkit import netcount
    from labkit.launch import device, note
    from labkit.model import GPT, get_batch, shard_rows, tiny_corpus

    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    cfg = _config(cfg_kwargs)
    model = GPT(cfg, seed=0).to(dev)
    params = list(model.parameters())
    note(f"your constructor, {world} ranks")
    zero = cls(params, None, max_grad_norm=max_grad_norm, **ADAMW)
    peak = [0]

    def measure(_p):       # runs after the reader's hook on the same parameter
        peak[0] = max(peak[0], _storage(p.grad for p in params))

    for p in params:
        p.register_post_accumulate_grad_hook(measure)
    tokens, sent = tiny_corpus(), []
    for step in range(STEPS):
        x, y = get_batch(tokens, BATCH, cfg.block_size, step, 0)               # (B, T) global
        x, y = shard_rows(x, rank, world).to(dev), shard_rows(y, rank, world).to(dev)  # (B/N, T)
        dist.barrier()
        with netcount.socket_bytes() as wire:
            note(f"backward of step {step} (your hooks)")
            model(x, y)[1].backward()
            note(f"your step() {step}")
            zero.step()
        sent.append(wire.sent)
        zero.zero_grad()
    opt = getattr(zero, "optimizer", None)
    state = None
    if isinstance(opt, torch.optim.Optimizer):
        state = _storage(v for s in opt.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
            "losses": [0.0] * STEPS, "peak": peak[0], "full": 4 * sum(p.numel() for p in params),
            "state": state, "sent": None if None in sent else max(sent),
            "numels": [p.numel() for p in params]}


def _assert_memory_state(results, world) -> None:
    for rank, r in enumerate(results):
        if r["state"] is None:
            fail(f"rank {rank}: no torch.optim.Optimizer in `self.optimizer`: keep the AdamW over "
                 "your shards there, as the docstring says")
        shard = sum(math.ceil(n / world) for n in r["numels"])
        limit = 8 * shard
        if r["state"] == 0:
            fail(f"rank {rank}: the optimizer holds no state after 3 steps: does step() call "
                 "self.optimizer.step() on shards that have gradients?")
        if r["state"] > limit:
            fail(f"rank {rank}: the optimizer state takes {r['state']:,} bytes (storage size); "
                 f"Adam's two fp32 moments of this rank's shard are {limit:,}. Is the optimizer "
                 "built over the shards (1/N of each parameter) or over the full parameters?")


def _assert_memory_grads(results) -> None:
    for rank, r in enumerate(results):
        if r["peak"] > PEAK_SHARE * r["full"]:
            fail(f"rank {rank}: during backward {r['peak']:,} bytes of full gradients were alive "
                 f"at once, {r['peak'] / r['full']:.0%} of all of them. ZeRO-2 reduce-scatters a "
                 "gradient as soon as backward has finished it: which hook tells you that, and "
                 "what do you do with p.grad afterwards?")


def zero2_optimizer(cls):
    """Exercise 3.2: cls(params, group, max_grad_norm, **adamw_kwargs), step(), zero_grad()."""
    from labkit.check.ch03 import (EXERCISES, assert_matches_reference, assert_optimal_traffic,
                                   assert_ranks_agree)

    c = Checker("3.2", *EXERCISES["3.2"])
    bad = forbidden_used([cls], FORBIDDEN_MODULES, FORBIDDEN_NAMES)
    refuse = (f"your code uses {', '.join(bad)}: that is the answer already written. Build the "
              "shards, hooks and collectives yourself (chapter 01's ring_reduce_scatter is "
              "allowed).") if bad else ""
    for world, (cfg_kwargs, max_norm) in WORLDS.items():
        label = f"{world} ranks" if world == 2 else f"hidden case, {world} ranks"
        ref = reference(_config(cfg_kwargs), max_norm)
        checks = ((f"3 AdamW steps{' (clipped)' if max_norm else ''} equal one process on every "
                   "rank",
                   lambda r: (assert_matches_reference(r, ref, what=f"ZeRO-2 on {world} ranks"),
                              assert_ranks_agree(r))),
                  ("optimizer state: this rank's shard only (storage size)",
                   lambda r: _assert_memory_state(r, world)),
                  (f"full gradients alive during backward: at most {PEAK_SHARE:.0%}",
                   _assert_memory_grads),
                  ("bytes sent per step: a reduce-scatter + an all-gather (kernel count)",
                   lambda r: assert_optimal_traffic(r, world, r[0]["numels"])))
        c.cases_on_one_launch(label, checks, lambda: c.launch(
            _zero2_job, world, args=(cls, cfg_kwargs, max_norm), timeout=LAUNCH_TIMEOUT),
            refuse=refuse)
    return c.finish()
