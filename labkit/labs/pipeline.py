"""Lab 05: GPipe, 1F1B and interleaved 1F1B on real processes; bubble measured vs formula.

    labkit run pipeline --nproc 4 [--K 8] [--v 2] [--pad-ms 5 10] [--batch 16]
    torchrun --nproc-per-node 4 -m labkit run pipeline --K 8

Splits labkit.model's GPT (8 blocks) into one stage per process, runs one training step of each
schedule, checks the loss and every gradient against the one-process reference, and prints
step time, measured and formula bubble, and the activations each schedule keeps on stage 0.
"""
from __future__ import annotations

import argparse
import os

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank


def main(argv=()) -> int:
    from labkit.progress import is_rank_zero
    from labkit.labs import ran_on
    from labkit.launch import run
    from labkit.pipeline import executor, measure, schedules
    from labkit.progress import Progress

    p = argparse.ArgumentParser(prog="labkit run pipeline")
    p.add_argument("--nproc", type=int, default=int(os.environ.get("WORLD_SIZE", 4)),
                   help="pipeline stages P (processes; under torchrun: its world size)")
    p.add_argument("--K", type=int, default=8, help="micro-batches per step")
    p.add_argument("--v", type=int, default=2, help="chunks per stage for the interleaved run")
    p.add_argument("--batch", type=int, default=16, help="rows in the global batch (>= K)")
    p.add_argument("--pad-ms", type=float, nargs=2, default=[5.0, 10.0], metavar=("F", "B"),
                   help="stand-in compute slept per forward/backward (0 0: real compute only)")
    args = p.parse_args(list(argv))
    P, K, v = args.nproc, args.K, args.v
    if P < 2:
        raise ValueError(f"a pipeline needs at least 2 stages: --nproc {P}; use --nproc 2 or more")
    if K < 1 or args.batch < K:
        raise ValueError(f"--K {K} micro-batches of a --batch {args.batch} rows: need "
                         f"1 <= K <= batch; use --batch {max(K, 1)} or more")
    cfg = measure.DEFAULT_CFG
    specs = [("gpipe", K, 1), ("1f1b", K, 1)]
    if K % P == 0 and cfg.n_layer >= P * v:
        specs.append(("interleaved", K, v))
    elif is_rank_zero():
        print(f"(interleaved skipped: needs K a multiple of P (K={K}, P={P}) and n_layer="
              f"{cfg.n_layer} >= P*v = {P * v})")

    prog = Progress("pipeline", total=1 + len(specs))
    # correctness first: one step of each schedule against the one-process reference
    sched = [schedules.make(n, P, k, vv) for n, k, vv in specs]
    per_rank = run(executor.schedules_job, P, args=(sched, cfg, args.batch), timeout=120, echo=False)
    ref = executor.reference_step(cfg, args.batch)
    for i, s in enumerate(sched):
        executor.compare_to_reference(executor.merge([r[i] for r in per_rank]), ref)
    prog.done(f"loss and gradients of {', '.join(n for n, _, _ in specs)} equal the "
              f"one-process step")
    pad = None if max(args.pad_ms) <= 0 else (args.pad_ms[0] / 1e3, args.pad_ms[1] / 1e3)
    rows = []
    for spec in specs:  # one launch per schedule: a line as each one is timed
        row = measure.measure(P, [spec], cfg, args.batch, pad=pad)[0]
        rows.append(row)
        prog.done(f"{spec[0]} timed: step {row['step_s'] * 1e3:.0f} ms, bubble "
                  f"{row['bubble']:.0%} (formula {row['formula_bubble']:.0%})")
    if is_rank_zero():
        print(f"P={P} stages, K={K} micro-batches, batch {args.batch}: loss and all gradients "
              f"equal the one-process reference for {', '.join(n for n, _, _ in specs)}")
        print(ran_on(rows[0]["backend"], rows[0]["device"]) + " (rank 0)")
        print(measure.table(rows))
        bad = [m for r in rows for m in r["violations"]]
        print("causality (no action started before one it depends on ended) and bubble floor: "
              + ("held in every repeat" if not bad else f"{len(bad)} violations, first: {bad[0]}"))
        print("bubble: measured idle share of P x step time (median of repeats); sim: the simulator "
              "fed the measured durations and latency; floor: the critical path of the measured "
              "durations (no causal run goes below it); formula (P-1)/(vK+P-1). "
              "peak mb / KiB: activations held on stage 0.")
    return 0
