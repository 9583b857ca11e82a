"""Lab 09: mixed precision on the tiny GPT; independent experiments shared out over the ranks.

    labkit run precision --nproc 2 [--steps 30] [--microscaling]
    torchrun --nproc-per-node 2 -m labkit run precision      # one rank per process

Experiment i runs on rank i % N (they are independent: the ranks only share the work); rank 0
prints a line as each round finishes and a table at the end:
1. bf16 weights without a master copy: the fraction of updates lost to rounding, against the
   formula |u| < ulp(w)/2, and how far the weights moved, with and without fp32 master weights.
2. fp16 gradients at loss scales 1 .. 2^20 (zeroed, small-gradient error, overflow); a run held
   up by labkit's DynamicLossScaler (scales and skipped steps).
3. fp8 emulated (e4m3 forward, e5m2 backward, fp32 accumulation): error per layer against fp32,
   bf16 beside it, per-tensor and block scaling.
4. bytes per parameter of a real AdamW step with master weights, from storage sizes.
5. fp8 scaling recipes (delayed, current, rowwise, block) with one outlier token x 1e4.
6. fp8 accumulation emulated (fast, split every 128 products) against one H200's measured errors.
7. with --microscaling: MXFP8's scale rounding (OCP floor vs round-up) and NVFP4 (per-tensor
   scale, random Hadamard transform, stochastic rounding), and one GEMM through every recipe
   (labkit.labs.precision.microscaling; emulated, no Blackwell speed).
The numerics run on the CPU on purpose (casts are exact there); the fp8 part emulates the
numerics and says nothing about speed.

The experiments beside the lab (labkit.precision holds the formats, scaler and quantizers):
    master        bf16 weights that stop learning without an fp32 master copy
    lossscale     fp16 gradients that underflow; a run held up by the dynamic loss scaler
    compare       fp8 against bf16: error per linear layer, loss curves
    memory        bytes per parameter of a real optimizer step, from storage sizes
    microscaling  the MXFP8 / NVFP4 experiments as tables (--microscaling)
"""
from __future__ import annotations

import os

import torch.distributed as dist

from labkit.cliargs import count, lab_parser
from labkit.labs import ran_on, rank_place
from labkit.labs.precision import compare, lossscale, master, memory, microscaling
from labkit.launch import run
from labkit.observe.measured import Measured, measured_table
from labkit.precision import accumulate
from labkit.precision.scaler import DynamicLossScaler
from labkit.progress import Progress

BACKEND = "auto"  # the launcher picks it; the experiments themselves compute on the CPU


def _task(kind, arg, steps):

    if kind == "stall":
        return master.run_sgd(arg, steps)
    if kind == "underflow":
        return lossscale.underflow(arg)
    if kind == "scaler":
        return lossscale.train(DynamicLossScaler(2.0**20, growth_interval=10), 2 * steps)
    if kind == "fp8":
        return compare.layer_errors()
    if kind == "recipes":
        return compare.recipe_errors(outlier=arg)
    if kind == "accumulate":
        return [(kind_, mode, K, accumulate.relative_error(kind_, K, mode, M=16),
                 accumulate.MEASURED_H200[(kind_, mode)][K])
                for kind_ in ("zero-mean", "positive-mean") for mode in ("fast", "split")
                for K in (1024, 4096)]
    if kind == "microscaling":
        return microscaling.tables()
    return memory.measure_step()


TASKS = [("stall", False), ("stall", True), ("underflow", 1.0), ("underflow", 2.0**8),
         ("underflow", 2.0**16), ("underflow", 2.0**20), ("scaler", None), ("fp8", None),
         ("memory", None), ("recipes", 1e4), ("accumulate", None)]
MICRO = len(TASKS)                  # TASKS_MICRO[MICRO]: only with --microscaling
TASKS_MICRO = TASKS + [("microscaling", None)]


def share(steps: int, first: int, micro: bool = False) -> list:
    """Rank side: this rank's task of the round starting at tasks[first] (or None)."""


    tasks = TASKS_MICRO if micro else TASKS
    i = first + dist.get_rank()
    end = first + dist.get_world_size()
    mine = [(i, _task(*tasks[i], steps))] if i < min(end, len(tasks)) else []
    return mine + [("ran_on", rank_place())]    # (backend, device), for the report's header


def main(argv=()) -> int:

    p = lab_parser("precision", nproc=2, nproc_help="ranks the experiments are shared out over")
    p.add_argument("--steps", type=count, default=30,
                   help="training steps of the master-weight runs (the scaler run: twice)")
    p.add_argument("--microscaling", action="store_true",
                   help="also run experiment 7: MXFP8 scale rounding and NVFP4, emulated")
    a = p.parse_args(list(argv))
    tasks = TASKS_MICRO if a.microscaling else TASKS
    rounds = range(0, len(tasks), a.nproc)
    prog = Progress("precision", total=len(rounds))
    res = {}
    for first in rounds:
        for per_rank in run(share, a.nproc, args=(a.steps, first, a.microscaling), echo=False):
            got = dict(per_rank)
            res.setdefault("ran_on", got.pop("ran_on"))     # the first launch's rank 0
            res.update(got)
        prog.done(f"experiments {first + 1}-{min(first + a.nproc, len(tasks))} of {len(tasks)}")
    if os.environ.get("RANK", "0") != "0":
        return 0

    print(f"\n{a.nproc} ranks, {len(tasks)} experiments; {ran_on(*res['ran_on'])} (rank 0's "
          f"launch; the numerics themselves compute on the CPU)")
    print("1. master weights (Adam, lr 3e-5, bf16 compute)")
    for i, name in ((0, "bf16 weights"), (1, "fp32 master")):
        r = res[i]
        lost = sum(r["frac_lost"]) / len(r["frac_lost"])
        theory = sum(r["frac_lost_theory"]) / len(r["frac_lost_theory"])
        print(f"  {name:<13} loss {r['loss'][0]:.4f} -> {r['loss'][-1]:.4f}; bf16 copy unchanged "
              f"by {lost:.1%} of updates (|u| < ulp/2: {theory:.1%}); "
              f"weights moved {r['moved']:.4f}")
    print("2. fp16 gradients vs fp32")
    for i in (2, 3, 4, 5):
        u = res[i]
        print(f"  S={u['scale']:<9g} zeroed {u['zeroed']:.4%}, median rel err of small grads "
              f"{u['rel_err_small']:.4f}, overflow {u['overflow']}")
    run16 = res[6]
    print(f"  dynamic loss scaler: {sum(run16['skipped'])} skipped of {len(run16['skipped'])}, "
          f"scale {run16['scale'][0]:g} -> {run16['scale'][-1]:g}, "
          f"loss {run16['loss'][0]:.3f} -> {run16['loss'][-1]:.3f}")
    print("3. fp8 (emulated) relative error per layer, vs fp32")
    for row in res[7]:
        print(f"  {row['layer']:<16} bf16 {row['bf16']:.4f}  fp8 tensor "
              f"{row['fp8 per tensor']:.4f}  fp8 block {row['fp8 block']:.4f}")
    m = res[8]
    print("4. one AdamW step with fp32 master weights, storage bytes per parameter")
    for k, v in m["per_param"].items():
        print(f"  {k:<16} {v:.4f}")
    print(f"  resident bytes/param (weights + grads + master + optimizer): "
          f"{m['resident_per_param']:.3f}")
    r = res[9]
    print("5. fp8 scaling recipes, one token's input x 1e4: output error of the other tokens / "
          "of that token")
    for k in r["others"]:
        print(f"  {k:<8} {r['others'][k]:.4f} / {r['outlier'][k]:.4f}")
    print(measured_table([Measured(f"{kind}, {mode}, K={K}", h, e, "one H200 (shared/gpu)")
                          for kind, mode, K, e, h in res[10]], indent="  ",
                         title="6. fp8 accumulation, relative error: measured on one H200 vs "
                               "predicted by the emulation (14-bit sum)"))
    if a.microscaling:
        print("7. MXFP8 and NVFP4, emulated (values exact, no Blackwell speed)\n")
        print(res[MICRO])
    return 0
