"""Exercise 9.3: the reader's data-parallel mixed-precision trainer against one fp32 process.

    labkit.check.ch09.mixed_precision_trainer(MixedPrecisionTrainer)

One launch per world size (2 shown; 3 hidden, with another growth interval and a NaN) trains a
small MLP (its last bias frozen) three times on every rank, from the same weights, each rank on
its own batches:
    fp16 compute, gradients all-reduced in fp16;  fp16, all-reduced in fp32;  bf16, in bf16;
STEPS steps each, the global gradient norm clipped to MAX_NORM. The loss is multiplied by 2^-24,
so its fp16 gradients underflow unless scaled, and most updates (89% in fp16, 98% in bf16) are
below half the weights' spacing, so they round away unless applied to fp32 masters. In the
fp16 runs one rank's loss overflows at chosen steps (x2^100, or NaN); in the bf16 run one rank's
loss is multiplied by 2^50 at one step (gradients past fp16's max, well inside bf16's range: no
skip, the clip tames it). Seven cases per world size, graded on the one launch:
  storage: the model's parameters are the compute dtype; the masters are fp32 in storage of their
      own (labkit.zero.shard.storage_bytes: 4 bytes per element, no pointer shared); dtype=fp32
      is refused with a ValueError;
  loss scale: the gradient that reaches the loss (a hook the checker registers on the loss tensor
      it returns, a counter the reader's code does not write) is the scale used; it must follow
      GradScaler's rules (x2 after `growth_interval` good steps, x0.5 on an overflow), and step()
      must return False exactly at the overflowed steps, on every rank;
  agreement: every rank's masters are bit-identical after every step (a hash per step), and a
      skipped step leaves them unchanged;
  tracking: the fp16 runs' masters within TRACK of fp32 SGD with the same clip that skips the same
      steps; a failure is compared with the same SGD made with a known mistake (clipping the
      scaled gradient, a sum for the mean, clip_grad_norm_'s epsilon, no clip) to name it;
  wire: the bytes each rank sent during the steps, counted by the kernel (observe.netcount), within
      the ring optimum of the reduce dtype (steps taken .. all steps, plus WIRE_SLACK and Gloo's
      headers): an fp32 all-reduce where fp16 was asked sends twice as much and fails;
  bf16: the gradient reaching the loss is 1 at every step (no loss scale), no step is skipped,
      the masters track fp32 SGD within TRACK;
  resume: the fp16 run's state_dict() after RESUME steps, loaded into a trainer built the same way
      on a fresh model, continues with the same scales, returns and masters (bit-identical): the
      loss scale and its count of good steps are training state.
torch.amp, labkit.precision, labkit.zero (its sharded loss scaler) and DDP wrappers are refused
by reading the code (labkit.check.refusal).

Parts: run.py (the problem, the fp32 references, the rank side), judge.py (the seven checks and
the known mistakes that name a failure), this module (the cases).
"""
from __future__ import annotations

from labkit.check import Checker, Forbidden, graded
from labkit.check.ch09.trainer.judge import (
    check_agreement,
    check_bf16,
    check_resume,
    check_scale,
    check_storage,
    check_tracking,
    check_wire,
    element_bytes,
    ring,
)
from labkit.check.ch09.trainer.run import (
    HIDDEN,
    LAUNCH_TIMEOUT,
    RESUME,
    RUNS,
    STEPS,
    WORLDS,
    train_job,
    train_many_job,
)
from labkit.launch import run as run_ranks

EXERCISE, TITLE, POINTS = ("9.3", "a data-parallel mixed-precision trainer: masters, loss "
                           "scaling, fp16 and bf16", 8)
FORBIDDEN = Forbidden(("torch.amp", "torch.cuda.amp", "torch.cpu.amp", "labkit.precision",
                       "torch.nn.parallel", "labkit.ddp", "labkit.zero"),
                      frozenset({"GradScaler", "autocast", "DistributedDataParallel",
                                 "DynamicLossScaler", "ShardedLossScaler", "MixedPrecisionPolicy"}),
                      why="write the loss scaling, the master weights and the all-reduce yourself")

CHECKS = (("fp16/bf16 compute copy, fp32 masters in their own storage", check_storage),
          ("loss scale: back off and skip on overflow, grow after the interval", check_scale),
          ("every rank skips together; masters bit-identical after every step", check_agreement),
          ("fp16 runs (fp16 and fp32 all-reduce) track fp32 SGD with clipping", check_tracking),
          ("bytes on the wire match the all-reduce dtype (kernel-counted)", check_wire),
          ("bf16: no loss scale, no skipped step, tracks fp32 SGD", check_bf16),
          (f"state_dict() at step {RESUME}, loaded into a fresh trainer: the same steps follow",
           check_resume))


def train_many(classes, world: int) -> list:
    """The rank side of several trainers in ONE launch (the tests' known-wrong answers):
    [per class: [per rank: results]]."""
    per_rank = run_ranks(train_many_job, world, args=(list(classes),), timeout=LAUNCH_TIMEOUT,
                   echo=False)
    return [[r[k] for r in per_rank] for k in range(len(classes))]


@graded("9.3")
def mixed_precision_trainer(cls, launched=None):
    """Exercise 9.3: cls(model, lr, group, dtype, reduce_dtype, max_norm, init_scale,
    growth_interval) with .step(x, y, loss_fn) -> bool and .master_params(). `launched`:
    {world: results} already run (train_many), graded without launching again."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(cls, who="your trainer"))
    for world in (launched or WORLDS):
        label = "hidden case" if world in HIDDEN else f"{world} ranks"
        checks = [(name, lambda res, f=f, w=world: f(res, w)) for name, f in CHECKS]
        got: dict = {}
        launch = (lambda w=world: launched[w]) if launched else (lambda w=world: c.launch(
            train_job, w, args=(cls,), timeout=LAUNCH_TIMEOUT))
        c.cases_on_one_launch(label, checks,        # run at once: bind this world's got, launch
                              lambda got=got, launch=launch: got.setdefault("res", launch()))
        wire = c.cases[-3]
        if wire["passed"] and world not in HIDDEN:       # the kernel's count, shown
            wire["name"] += "".join(
                f"\n      {run['name']}: rank 0 sent {run['sent']:,} B in {STEPS} steps; "
                f"ring all-reduces of {run['trainable']:,} x {element_bytes(r)} B: "
                f"{STEPS * ring(run['trainable'] * element_bytes(r), world):,.0f} B"
                for run, r in zip(got["res"][0]["runs"], RUNS) if run["sent"] is not None)
    return c.finish()
