"""Exercise 0.3: the reader's data-parallel trainer against one process.

    labkit.check.ch00.data_parallel(DataParallelTrainer)

One launch per world size (2 and 3 shown, 4 hidden) builds, on every rank, a small float64 MLP
from that rank's OWN seed, then runs two trainers one after the other: one without clipping, one
with a global-norm clip (SGD with momentum: Adam would hide a wrong scale). Batches change from
step to step and include sizes the world size does not divide and fewer rows than ranks (empty
shards and empty micro-batches); the model has a buffer, and two runs freeze a parameter
(requires_grad False); the hidden world also trains on a sub-group (ranks 1-3 of 4, whose group
rank 0 is global rank 1). Five cases per world, each one property:

  replicas: right after __init__ every rank holds group rank 0's initial parameters and buffers,
      and __init__ made exactly one collective, a broadcast of their flat elements;
  rows: a forward pre-hook records every row each forward saw: each rank sees exactly its own
      contiguous shard (the first B % N one row longer), cut into `accumulation` micro-batches
      the same way, and every row of the batch is seen once;
  communication: each step makes exactly ONE collective, an all-reduce of the trainable
      parameters' flat gradients (+ a few scalars: no frozen parameter's); and each rank sends,
      in __init__ and all steps together, at most one broadcast of the state plus the ring's
      2(N-1)/N of the gradients per step, plus 10% and Gloo's headers, counted by the kernel
      (labkit.observe.netcount);
  global mean: the weights after the steps equal one process training group rank 0's initial
      model on the whole batches (to 1e-9), on every rank, and the losses are the whole batch's;
  clipping: the same with the gradient scaled by min(1, max_norm / (norm + 1e-6)) of the WHOLE
      gradient's norm (torch.nn.utils.clip_grad_norm_ on one process).

Known mistakes are named from their results: a mean of per-rank means, the per-rank means summed,
clipping each rank's part before the all-reduce, no clipping.
labkit.ddp, labkit.zero and torch's DDP are refused by reading the code.

Parts: runs.py (the model, the one-process reference and the rank job), checks.py (the five
checks, each with its hints), this module (the cases).
"""
from __future__ import annotations

from labkit.check import Checker, Forbidden, graded
from labkit.check.ch00.trainer.checks import (
    check_clip,
    check_communication,
    check_mean,
    check_replicas,
    check_rows,
)
from labkit.check.ch00.trainer.runs import DP_TIMEOUT, DP_WORLDS, dp_job

EXERCISE, TITLE, POINTS = "0.3", "data-parallel training by hand", 5
FORBIDDEN = Forbidden(("labkit.ddp", "torch.nn.parallel", "labkit.parallel", "labkit.zero"),
                      frozenset({"DistributedDataParallel", "BucketedDDP"}),
                      why="that is the exercise done for you. Write the trainer with "
                          "torch.distributed calls yourself.")
CHECKS = [("replicas start as group rank 0's, one broadcast", check_replicas),
          ("every row once, in its rank's shard and micro-batches", check_rows),
          ("one flat all-reduce per step, bytes within the ring's", check_communication),
          ("the whole batch's mean gradient: weights and losses equal one process", check_mean),
          ("clipping by the whole gradient's norm", check_clip)]


@graded("0.3")
def data_parallel(cls, worlds=None):
    """Exercise 0.3: cls(model, optimizer, loss_fn, group=None, accumulation=1, max_norm=None)
    with .step(x, y) -> loss, on real ranks (2 and 3 shown, 4 hidden)."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(cls))
    for world, label, configs in (DP_WORLDS if worlds is None else worlds):
        clipped = {cfg["max_norm"] is not None for cfg in configs}
        checks = [(name, check) for name, check in CHECKS          # a case only where it is run
                  if check not in (check_mean, check_clip) or (check is check_clip) in clipped]
        c.cases_on_one_launch(
            label, [(name, lambda res, check=check, cf=configs, w=world: check(res, cf, w))
                    for name, check in checks],
            lambda w=world, cf=configs: c.launch(dp_job, w, args=(cls, cf), timeout=DP_TIMEOUT))
    return c.finish()
