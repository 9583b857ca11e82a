"""Exercise 3.2: the reader's whole ZeRO-2 optimizer against one process.

    labkit.check.ch03.zero2_optimizer(MyZeRO2)

What runs on the ranks, and the one-process reference, are in run.py beside this module.
One launch per world size (2 shown; 3 and 4 hidden, the last on another model; most buckets
split unevenly) trains the tiny GPT with AdamW (eps 1e-3, so that a sum in place of the mean
shows) for three steps, the last of two micro-batches, the first under `no_sync()`. At the hidden
world sizes each step's gradient is clipped to a global norm of 0.5 (below the model's, so every
step clips; a norm over shards needs every rank's share), and the bucket cap (`bucket_bytes`) is
smaller than the largest parameters. Before the last step the checker saves the reader's
`state_dict()` with torch.save; afterwards it builds a second model and optimizer, loads the
weights and that state, replays the last step and wants the same parameters, bit for bit.
Seven cases per launch, all graded on its one set of results:
  values: every parameter equals one process's (torch's clip_grad_norm_, then AdamW), and all
      ranks hold the same;
  optimizer state: the storage of every tensor in `self.optimizer`'s state is at most Adam's two
      moments of 1/N of the parameters, 8 * (ceil(Ψ / N) + one element of padding per parameter)
      bytes;
  gradients during backward: the checker's own post-accumulate-grad hooks, registered after the
      reader's, add up the storage of every full gradient (p.grad) alive at that moment; a
      bucketed reduce-scatter in backward never holds more than half of them (plain steps only:
      under no_sync every full gradient is kept on purpose);
  traffic: the bytes each rank sent in a plain step (forward, backward, step), counted by the
      kernel (observe.netcount), at most a reduce-scatter + an all-gather of every padded bucket,
      fp32, plus Gloo's headers (HEADER_BYTES per ring step of each collective the dispatcher saw
      in that step: measured about 220). An all-reduce, or Gloo's own reduce_scatter_tensor
      (which all-reduces), sends about 1.5x and fails;
  buckets: the reductions each synchronising backward ran, observed by the dispatcher
      (labkit.observe.dispatch.CollectiveLog: a collective is one, a ring is N-1 sends), equal the
      number of buckets the book's one rule gives for `bucket_bytes` (labkit.buckets: chapter
      02's DDP, labkit's ZeRO-2 and PyTorch's reducer: a bucket closes once it holds the cap);
  no_sync: the backward under no_sync() dispatches no collective and no send, and its rank's
      sockets send no byte (kernel count);
  state_dict: the saved state is at most 12 bytes per element of this rank's shards (Adam's two
      moments, and the shard's weights if you keep them) + 8 KiB of torch.save's framing, read
      back with torch.load(weights_only=True), and the replayed step matches bit for bit.
labkit.zero and torch's ZeroRedundancyOptimizer / FSDP are refused by reading the code.
"""
from __future__ import annotations

import math
from functools import partial

from labkit.buckets import assign_buckets
from labkit.check import Checker, Forbidden, fail, graded
from labkit.check.ch03.common import HEADER_BYTES, assert_matches_reference, assert_ranks_agree
from labkit.check.ch03.zero2.run import config, reference, zero2_job
from labkit.flat import chunk_size
from labkit.model import GPT

EXERCISE, TITLE, POINTS = ("3.2", "a ZeRO-2 optimizer: buckets, flat shards, no_sync, a sharded "
                           "state_dict", 7)
FORBIDDEN = Forbidden(("labkit.zero", "torch.distributed.optim", "torch.distributed.fsdp",
                       "torch.distributed._composable", "torch.nn.parallel"),
                      frozenset({"ZeRO1", "ZeRO2", "ZeRO3", "ZeroRedundancyOptimizer",
                                 "fully_shard", "shard_optimizer", "reduce_scatter_mean_many",
                                 "reduce_scatter_mean", "DistributedDataParallel"}),
                      why="that is the answer already written. Build the buckets, shards, hooks "
                          "and collectives yourself (chapter 01's ring_reduce_scatter is allowed).")
# world -> (model config, max_grad_norm, bucket_bytes). Config None: labkit.labs.zero.train.TINY
# (18,500 parameters; its largest are 10,000 bytes). 2 ranks unclipped (clipping to a norm would
# hide a sum where the mean belongs); 3 and 4 (hidden) clipped to a global norm of 0.5, below the
# tiny GPT's, and with caps smaller than the largest parameters (a bucket of their own)
WORLDS = {2: (None, None, 8192), 3: (None, 0.5, 2048),
          4: (dict(vocab_size=96, block_size=16, n_layer=1, n_head=3, n_embd=21), 0.5, 4096)}
PEAK_SHARE = 0.5          # of the full gradients' bytes, alive at once during backward
LAUNCH_TIMEOUT = 90.0     # seconds: a busy 2-core machine starts 4 ranks slowly
STATE_BYTES_PER_ELEMENT = 12     # Adam's m and v (8) + the shard's fp32 weights if kept (4)
STATE_FRAMING = 8192             # torch.save's zip framing and the dict's pickle
_REFERENCES: dict = {}    # (model config, max_grad_norm) -> the one-process run


def buckets(nbytes, cap) -> list:
    """The book's one rule (labkit.buckets, as labkit's DDP and ZeRO-2 use it) over parameter
    sizes in registration order: [[index, ...], ...], last parameter first; a bucket closes as
    soon as it holds `cap` bytes or more, so a parameter as large as the cap closes one alone."""
    order = list(reversed(range(len(nbytes))))
    return [[order[j] for j in b] for b in assign_buckets([nbytes[i] for i in order], cap)]


# ----------------------------------------------------------------------------- the cases
def _assert_values(results, ref, world) -> None:
    assert_matches_reference(results, ref, what=f"ZeRO-2 on {world} ranks")
    assert_ranks_agree(results)


def _assert_memory_state(results, world, nbytes) -> None:
    # 1/N of the elements, + at most one element of padding per parameter on each rank
    shard = math.ceil(sum(nbytes) / 4 / world) + len(nbytes)
    for rank, r in enumerate(results):
        if r["state"] is None:
            fail(f"rank {rank}: no torch.optim.Optimizer in `self.optimizer`: keep the AdamW over "
                 "your shards there, as the docstring says")
        limit = 8 * shard
        if r["state"] == 0:
            fail(f"rank {rank}: the optimizer holds no state after 3 steps: does step() call "
                 "self.optimizer.step() on shards that have gradients?")
        if r["state"] > limit:
            fail(f"rank {rank}: the optimizer state takes {r['state']:,} bytes (storage size); "
                 f"Adam's two fp32 moments of this rank's shards are {limit:,}. Is the optimizer "
                 "built over the shards (1/N of each bucket) or over the full parameters?")


def _assert_memory_grads(results) -> None:
    for rank, r in enumerate(results):
        if r["peak"] > PEAK_SHARE * r["full"]:
            fail(f"rank {rank}: during backward {r['peak']:,} bytes of full gradients were alive "
                 f"at once, {r['peak'] / r['full']:.0%} of all of them. ZeRO-2 reduce-scatters a "
                 "bucket as soon as backward has finished its last gradient: which hook tells "
                 "you that, and what do you do with p.grad afterwards?")


def _assert_bucket_traffic(results, world: int, bucket_numels) -> None:
    """Each rank sent at most 2(N-1)/N of the padded buckets (fp32) in the plain step counted,
    plus HEADER_BYTES per ring step of each collective it ran (backward and step()). Where the
    kernel cannot count (NCCL: "sent" is None) there is nothing to check."""

    padded = sum(world * chunk_size(n, world) for n in bucket_numels)
    optimum = 2 * (world - 1) / world * padded * 4
    for rank, res in enumerate(results):
        for s in res["steps"]:
            if "sent" not in s or s["sent"] is None:
                continue
            slack = HEADER_BYTES * (world - 1) * math.ceil(s["collectives"])
            if s["sent"] > optimum + slack:
                fail(f"rank {rank} sent {s['sent']:,} bytes in one step (counted by the kernel); "
                     f"a reduce-scatter + an all-gather of every bucket sends {optimum:,.0f} (+ "
                     f"{slack:,} of message headers for your {s['collectives']:g} collectives): "
                     f"{s['sent'] / optimum:.2f}x the optimum. An all-reduce sends twice a "
                     "reduce-scatter's bytes, and so does Gloo's own dist.reduce_scatter_tensor: "
                     "use a ring reduce-scatter (labkit.collectives.ring_reduce_scatter, "
                     "chapter 01)")


def _assert_buckets(results, nbytes, cap) -> None:
    want = buckets(nbytes, cap)
    sizes = [sum(nbytes[i] for i in b) for b in want]
    for rank, r in enumerate(results):
        for s in r["steps"]:
            got = s.get("reductions", len(want))
            if got == len(want):
                continue
            why = ("one per parameter: put several small gradients into one bucket"
                   if got >= len(nbytes) else
                   "fewer than the buckets: is a bucket sent as soon as its last gradient is "
                   "ready, and does it close as soon as it holds bucket_bytes or more?"
                   if got < len(want) else
                   "more than the buckets: does a bucket close only once it holds "
                   "bucket_bytes or more (not before it would pass them), and is each one "
                   "sent once?")
            fail(f"rank {rank}, step {s['step']}: your backward ran {got:g} reductions "
                 f"(collectives, or rings of N-1 sends, seen by the dispatcher); bucket_bytes="
                 f"{cap} gives {len(want)} buckets (the book's rule, last parameter first; "
                 f"bytes: {sizes}): {why}")


def _assert_no_sync(results) -> None:
    for rank, r in enumerate(results):
        for s in r["steps"]:
            if "accum_calls" not in s:
                continue
            calls = [c for c in s["accum_calls"] if c != "barrier"]
            if calls or (s["accum_sent"] or 0) > 0:
                fail(f"rank {rank}: the backward under no_sync() called {calls or 'nothing'} and "
                     f"sent {s['accum_sent']:,} bytes (kernel count). A micro-batch under "
                     "no_sync() only accumulates p.grad on this rank: what must your hook do "
                     "while it is active, and which backward sends the sum?")


def _assert_round_trip(results, world, nbytes, cap) -> None:
    shard = sum(math.ceil(sum(nbytes[i] for i in b) / 4 / world) for b in buckets(nbytes, cap))
    limit = STATE_BYTES_PER_ELEMENT * shard + STATE_FRAMING
    for rank, r in enumerate(results):
        if r["saved_bytes"] > limit:
            fail(f"rank {rank}: your state_dict() takes {r['saved_bytes']:,} bytes once saved; "
                 f"this rank's shards hold {shard:,} elements, so Adam's moments (and the "
                 f"weights) are at most {limit:,}. Each rank saves its own shard only: what "
                 "does every rank need to resume on the same world size?")
        for name, t in r["params"].items():
            if not (r["resumed"][name] == t).all():
                fail(f"rank {rank}: after load_state_dict the replayed last step gives another "
                     f"{name} ({(r['resumed'][name] - t).abs().max():.2e} apart). What does "
                     "AdamW's state hold besides the moments, and does load_state_dict put all "
                     "of it back into self.optimizer?")


@graded("3.2")
def zero2_optimizer(cls, launched=None):
    """Exercise 3.2: cls(params, group, bucket_bytes=, max_grad_norm=, **adamw_kwargs), with
    step(), zero_grad(), no_sync(), state_dict(), load_state_dict(). launched: {world: per-rank
    results} to grade instead of launching (the tests run several classes on one launch)."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(cls))
    for world, (cfg_kwargs, max_norm, cap) in WORLDS.items():
        label = f"{world} ranks" if world == 2 else f"hidden case, {world} ranks"
        cfg = config(cfg_kwargs)
        nbytes = [4 * p.numel() for p in GPT(cfg).parameters()]
        key = (repr(cfg_kwargs), max_norm)
        ref = _REFERENCES[key] = _REFERENCES.get(key) or reference(cfg, max_norm)
        bucket_numels = [sum(nbytes[i] for i in b) // 4 for b in buckets(nbytes, cap)]
        # partial binds this world's sizes now (cases_on_one_launch runs them at once)
        checks = ((f"3 AdamW steps{' (clipped)' if max_norm else ''}, the last of 2 micro-"
                   "batches, equal one process on every rank",
                   partial(_assert_values, ref=ref, world=world)),
                  ("optimizer state: this rank's shards only (storage size)",
                   partial(_assert_memory_state, world=world, nbytes=nbytes)),
                  (f"full gradients alive during backward: at most {PEAK_SHARE:.0%}",
                   _assert_memory_grads),
                  ("bytes sent per step: a reduce-scatter + an all-gather (kernel count)",
                   partial(_assert_bucket_traffic, world=world, bucket_numels=bucket_numels)),
                  ("one reduce-scatter per bucket during backward",
                   partial(_assert_buckets, nbytes=nbytes, cap=cap)),
                  ("no_sync(): nothing sent while micro-batches accumulate",
                   _assert_no_sync),
                  ("state_dict(): this rank's shard only, and a round trip resumes exactly",
                   partial(_assert_round_trip, world=world, nbytes=nbytes, cap=cap)))
        if launched is not None:
            launch = partial(_given, launched[world])
        else:
            launch = partial(c.launch, zero2_job, world, args=(cls, cfg_kwargs, max_norm, cap),
                             timeout=LAUNCH_TIMEOUT)
        c.cases_on_one_launch(label, checks, launch)
    return c.finish()


def _given(results):
    if isinstance(results, BaseException):
        raise results
    return results
