"""Lab 10: one model, every parallelism: a DP x TP x PP run through labkit.parallel, trained side
by side with the one-process GPT; losses, gradients and parameters must be equal.

    labkit run hybrid --dp 2 --tp 2 --pp 2          # 8 processes: the 3D run
    labkit run hybrid --nproc 4                      # defaults fit any N (here DP 2 x TP 2)
    labkit run hybrid --dp 2 --tp 2 --zero 1         # ZeRO stages are options of dp
    labkit run hybrid --dp 2 --tp 2 --sp             # + Megatron sequence parallelism
    labkit run hybrid --dp 2 --cp 2                  # + context parallelism (ring attention)
    torchrun --nproc-per-node 8 -m labkit run hybrid --dp 2 --tp 2 --pp 2

Every rank builds the same GPT (seed 0), the mesh (pp, dp, tp; labkit.parallel.build_mesh) and
applies tp, then pp, then dp (labkit.parallel.parallelize). The table shows, per rank, the worst
difference from the reference (labkit.reference), the bytes the step handed to collectives along
each mesh dimension (observe.commlog) beside labkit.costs.parallel's prediction, the bytes the
kernel counted leaving the rank's sockets (labkit.observe.netcount, Gloo only) beside the ring
prediction, and where the step's time went. It exits 1 when any difference is over tolerance.
"""
from __future__ import annotations

import os
import re

from labkit.cliargs import ArgParser, count
from labkit.labs import ran_on
from labkit.labs.parallel.compare import bytes_rows, differences, tolerances
from labkit.labs.parallel.job import train
from labkit.launch import run
from labkit.model import GPTConfig
from labkit.observe.measured import Measured
from labkit.parallel import Plan, check_plan
from labkit.progress import Progress
from labkit.reference import reference_train
from labkit.table import table
from labkit.topology import TopologyError

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank

DEFAULT_CFG = dict(n_layer=4, n_embd=32, n_head=4, block_size=16)


def default_dims(nproc: int, dp=None, tp=None, pp=None) -> tuple:
    """(dp, tp, pp) for `nproc` ranks, filling what the user left out: tp = 2 when it divides
    (and was not given), pp = 1, dp = what is left. What the user gave is kept as is:
    labkit.parallel.check_plan then says what to change if it does not fit."""

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise TopologyError(f"--nproc must be a positive integer, got {nproc!r}")
    pp = 1 if pp is None else pp
    if tp is None:
        rest = nproc // (pp * (dp or 1)) if nproc % (pp * (dp or 1)) == 0 else 1
        tp = 2 if dp is None and rest % 2 == 0 else max(rest, 1) if dp is not None else 1
    if dp is None:
        dp = max(1, nproc // (tp * pp)) if tp >= 1 and pp >= 1 else 1
    return dp, tp, pp


def main(argv=()):

    p = ArgParser(prog="labkit run hybrid")
    p.add_argument("--nproc", type=count, default=None, help="processes (default: dp*tp*pp*cp "
                   "when dp, tp and pp are given, else WORLD_SIZE or 4)")
    p.add_argument("--dp", type=count, default=None, help="data-parallel replicas (default: what "
                   "is left of --nproc)")
    p.add_argument("--tp", type=count, default=None, help="tensor-parallel shards (default: 2 "
                   "where it divides)")
    p.add_argument("--pp", type=count, default=None, help="pipeline stages (default: 1)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                   help="ZeRO stage over dp")
    p.add_argument("--cp", type=count, default=1, help="context-parallel ranks (ring attention)")
    p.add_argument("--cp-layout", choices=("zigzag", "plain"), default="zigzag",
                   help="how the sequence is cut over cp (zigzag: --cp*2 divides it)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism inside tp")
    p.add_argument("--K", type=count, default=None, help="micro-batches per pipeline step "
                   "(default: pp)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                   help="pipeline schedule over pp")
    p.add_argument("--steps", type=count, default=3, help="optimizer steps")
    p.add_argument("--batch", type=count, default=5, help="global batch (sequences); need not "
                   "divide by dp")
    p.add_argument("--optim", choices=("adamw", "sgd"), default="adamw", help="optimizer")
    a = p.parse_args(list(argv))
    if a.nproc is None:
        given = [a.dp, a.tp, a.pp]
        a.nproc = (a.dp * a.tp * a.pp * a.cp if None not in given
                   else int(os.environ.get("WORLD_SIZE", 4)))
    if a.nproc % a.cp:
        raise ValueError(f"--cp {a.cp} does not divide --nproc {a.nproc}; use --nproc "
                         f"{a.nproc // a.cp * a.cp or a.cp} or a --cp that divides {a.nproc}")
    dp, tp, pp = default_dims(a.nproc // a.cp, a.dp, a.tp, a.pp)
    plan = Plan(dp=dp, tp=tp, pp=pp, zero=a.zero, micro_batches=a.K, schedule=a.schedule,
                cp=a.cp, cp_layout=a.cp_layout, sp=a.sp)
    cfg = GPTConfig(**DEFAULT_CFG)
    try:                                                       # before any process starts
        check_plan(plan, cfg, world=a.nproc, batch_size=a.batch)
    except ValueError as err:                                  # in the flags the reader types
        raise ValueError(re.sub(r"\b(dp|tp|pp|cp)=(\d+)", r"--\1 \2", str(err))) from None
    prog = Progress("hybrid", total=2)
    prog.say(f"{plan.describe()} on {a.nproc} ranks, {a.steps} {a.optim} steps")
    results = run(train, a.nproc, args=(plan, DEFAULT_CFG, a.steps, a.batch, a.optim))
    prog.done(f"{plan.describe()} trained {a.steps} steps, last loss "
              f"{results[0]['losses'][-1]:.4f}")
    ref = reference_train(cfg, a.steps, a.batch, a.optim)
    prog.done(f"one-process reference trained, last loss {ref['losses'][-1]:.4f}")
    diffs = differences(results, ref, a.optim)
    if os.environ.get("RANK", "0") == "0":
        print(report(plan, cfg, a, results, ref, diffs, bytes_rows(results, plan, cfg, a.batch)))
    return 0 if all(d["ok"] for d in diffs) else 1


def report(plan, cfg, a, results, ref, diffs, brows) -> str:

    tol = tolerances(a.optim)
    losses = [(s, lr_, lh) for s, (lr_, lh) in enumerate(zip(ref["losses"], results[0]["losses"]))]
    out = [plan.topology().picture(), "",
           f"GPT {DEFAULT_CFG}, global batch {a.batch}, {a.optim}, fp32; "
           f"{ran_on(*results[0]['ran_on'])} (rank 0)",
           table(losses, ["step", ("loss (1 process)", 1, ".6f"),
                          (f"loss ({plan.describe()})", 2, ".6f")]), "",
           f"worst |difference| from the one-process run (tolerance: loss {tol['loss']:g}, "
           f"first-step gradients {tol['grads']:g}, parameters after {a.steps} {a.optim} steps "
           f"{tol['params']:g}; labkit.labs.parallel.compare says why)",
           table([dict(d, held=r["local_params"]) for d, r in zip(diffs, results)],
                 ["rank", ("(pp,dp,cp,tp)", lambda d: str(tuple(d["coords"][k]
                                                             for k in ("pp", "dp", "cp", "tp")))),
                  ("params held", "held", ","), ("loss", "loss", ".2e"),
                  ("grads", "grads", ".2e"), ("params", "params", ".2e"),
                  ("verdict", lambda d: "equal" if d["ok"] else "DIFFERENT")])]
    if diffs[0].get("missing"):
        out.append(f"no rank returned {diffs[0]['missing']}: a part of the model was left out")
    out += ["", "bytes of the last step, per mesh dimension: payload handed to collectives "
            "(labkit.observe.commlog) vs labkit.costs.parallel",
            table(brows, ["rank", "dim", "calls", ("logged B", "logged", ","),
                          ("predicted B", "predicted", ","),
                          ("ratio", lambda b: Measured(b["dim"], b["logged"], b["predicted"],
                                                       counter="commlog", unit="bytes").ratio,
                           ".3f"), ("blocked s", "seconds", ".4f")])]
    rows = []
    for rank, r in enumerate(results):
        sec = {d: r["comm"].get(d, {}).get("seconds", 0.0) for d in ("tp", "cp", "pp", "dp")}
        sec["dp"] += r["comm"].get("dp_cp", {}).get("seconds", 0.0)
        rows.append({"rank": rank, "step": r["step_seconds"], **sec,
                     "rest": r["step_seconds"] - sum(sec.values()), "kernel": r["kernel_sent"],
                     "wire": sum(b["wire"] for b in brows if b["rank"] == rank)})
    out += ["", "the step's time (s): blocked in logged calls per dimension, and the rest "
            "(compute, and waiting for other ranks); bytes the kernel saw leave the rank's "
            "sockets (observe.netcount; n/a where it cannot count) vs ring collectives' bytes "
            "(the kernel also sees message headers and the loss's own small reductions)",
            table(rows, ["rank", ("step", "step", ".4f"), ("tp", "tp", ".4f"),
                         ("cp", "cp", ".4f"), ("pp", "pp", ".4f"), ("dp", "dp", ".4f"),
                         ("rest", "rest", ".4f"),
                         ("kernel sent B", lambda r: "n/a" if r["kernel"] is None
                          else f"{r['kernel']:,}", None, ">"),
                         ("ring predicts B", "wire", ",.0f"),
                         ("kernel/ring", lambda r: r["kernel"] / r["wire"]
                          if r["kernel"] and r["wire"] else None, ".3f")])]
    ok = all(d["ok"] for d in diffs)
    out += ["", "EQUAL to the one-process run on every rank" if ok else
            "DIFFERENT from the one-process run: see the verdict column"]
    return "\n".join(out)
