"""Lab 05: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2 and ZB-V on real processes; bubble
measured vs formula.

    labkit run pipeline --nproc 4 [--K 8] [--v 2] [--pad-ms 5 10] [--batch 16]
    labkit run pipeline --nproc 4 --K 6 --schedules interleaved zb-v
    torchrun --nproc-per-node 4 -m labkit run pipeline --K 8
    labkit run pipeline --nproc 2 --schedules 1f1b --trace traces/pipeline   # + profiler traces

Splits labkit.model's GPT (8 blocks) into one stage per process (interleaved: v chunks per stage,
ZB-V: 2), runs one training step of each schedule, checks the loss and every gradient against
the one-process reference, and prints step time, measured and formula bubble, and the
activations each schedule keeps on stage 0. Every schedule labkit.pipeline.schedules.make builds
is run (--schedules picks some). A schedule that cannot run at these sizes (interleaved's K
rounds, P*v chunks more than the 8 blocks) is refused before any process starts, in one line
naming P, K and v and sizes that work; with the default --schedules (all) it is skipped with that
line instead, and the others run. With --trace DIR each schedule runs one more step under
torch.profiler (labkit.profiling.jobs.pipeline_job): DIR/<schedule>/rank<r>.pt.trace.json, and
rank 0 prints the bubble read back from those files next to the one measured on labkit's clocks.

The experiments beside the lab (labkit.pipeline holds schedules, validator, simulator, executor):
    measure        schedules timed on real processes: measured vs simulated vs formula
    back_to_back   steps back to back (no flush) against steps with a flush (`labkit bench
                   pipeline --back-to-back`)
    versus_zero3   bytes on the wire of a pipeline step and a ZeRO-3 step (chapter 05)
"""
from __future__ import annotations

from labkit.cliargs import count, lab_parser
from labkit.labs import ran_on
from labkit.labs.pipeline import measure
from labkit.launch import run
from labkit.pipeline import executor, schedules
from labkit.profiling import folder, jobs, read
from labkit.profiling.folder import check_folder
from labkit.progress import Progress, is_rank_zero

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v")


def chunks_per_stage(name: str, v: int) -> int:
    """v for the schedule: interleaved's --v, ZB-V's fixed 2, 1 for the rest."""
    return v if name == "interleaved" else 2 if name == "zb-v" else 1


def why_not(name: str, P: int, K: int, v: int, n_layer: int) -> str | None:
    """None when the schedule runs at these sizes; else one line naming P, K, v and what works."""

    v = chunks_per_stage(name, v)
    if P * v > n_layer:
        fit = n_layer // v
        return (f"{name} with P={P}, K={K}, v={v} needs P*v = {P * v} model chunks but the GPT "
                f"has {n_layer} blocks; use --nproc {fit} or fewer"
                + (f", or --v {n_layer // P}" if name == "interleaved" and n_layer >= P else ""))
    try:
        schedules.make(name, P, K, v)
    except ValueError as err:
        return f"--schedules {name} at --nproc {P} --K {K}: " + " ".join(str(err).split())
    return None


def parse(argv):
    """The lab's options, checked (ValueError: one line, exit 2, before any process starts)."""

    p = lab_parser("pipeline", nproc=4,
                   nproc_help="pipeline stages P (processes; under torchrun: its world size)")
    p.add_argument("--K", type=count, default=8, help="micro-batches per step")
    p.add_argument("--v", type=count, default=2, help="chunks per stage for the interleaved run")
    p.add_argument("--batch", type=count, default=16, help="rows in the global batch (>= K)")
    p.add_argument("--pad-ms", type=float, nargs=2, default=[5.0, 10.0], metavar=("F", "B"),
                   help="stand-in compute slept per forward/backward (0 0: real compute only)")
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=None,
                   help="which schedules to run (default: all six; one that cannot run at "
                        "these sizes is then skipped with a line saying why)")
    p.add_argument("--trace", type=check_folder, default=None, metavar="DIR",
                   help="also write a torch.profiler trace of one step per schedule and stage here")
    a = p.parse_args(list(argv))
    P, K, v = a.nproc, a.K, a.v
    if P < 2:
        raise ValueError(f"a pipeline needs at least 2 stages: --nproc {P}; use --nproc 2 or more")
    if v < 1:
        raise ValueError(f"--v {v}: interleaved needs at least 1 chunk per stage; use --v 2")
    if K < 1 or a.batch < K:
        raise ValueError(f"--K {K} micro-batches of a --batch {a.batch} rows: need "
                         f"1 <= K <= batch; use --batch {max(K, 1)} or more")
    if min(a.pad_ms) < 0:
        raise ValueError(f"--pad-ms {a.pad_ms[0]:g} {a.pad_ms[1]:g}: sleeps cannot be negative; "
                         f"use --pad-ms 0 0 (real compute only) or more")
    n_layer = executor.DEFAULT_CFG.n_layer
    names = a.schedules or list(SCHEDULES)
    reasons = {n: why_not(n, P, K, v, n_layer) for n in names}
    refused = [n for n in names if reasons[n]]
    if a.schedules and refused:                       # asked for by name: refuse, one line
        raise ValueError(reasons[refused[0]])
    if len(refused) == len(names):
        raise ValueError(f"no schedule runs at P={P}, K={K}, v={v}: {reasons[refused[0]]}")
    a.specs = [(n, K, chunks_per_stage(n, v)) for n in names if not reasons[n]]
    a.skipped = [reasons[n] for n in refused]
    return a


def main(argv=()) -> int:

    a = parse(argv)
    P, specs, cfg = a.nproc, a.specs, executor.DEFAULT_CFG
    if is_rank_zero():
        for line in a.skipped:
            print(f"(skipped: {line})")

    prog = Progress("pipeline", total=2)
    # correctness first: one step of each schedule against the one-process reference
    sched = [schedules.make(n, P, k, vv) for n, k, vv in specs]
    per_rank = run(executor.schedules_job, P, args=(sched, cfg, a.batch), timeout=120, echo=False)
    ref = executor.reference_step(cfg, a.batch)
    for i in range(len(sched)):
        executor.compare_to_reference(executor.merge([r[i] for r in per_rank]), ref)
    names = ", ".join(n for n, _, _ in specs)
    prog.done(f"loss and gradients of {names} equal the one-process step")
    pad = None if max(a.pad_ms) <= 0 else (a.pad_ms[0] / 1e3, a.pad_ms[1] / 1e3)
    # one launch times them all: a launch costs about a second on a small machine
    rows = measure.measure(P, specs, cfg, a.batch, pad=pad)
    prog.done("timed: " + ", ".join(f"{r['schedule']} {r['step_s'] * 1e3:.0f} ms" for r in rows))
    if is_rank_zero():
        print(f"P={P} stages, K={a.K} micro-batches, batch {a.batch}: loss and all gradients "
              f"equal the one-process reference for {names}")
        print(ran_on(rows[0]["backend"], rows[0]["device"]) + " (rank 0)")
        print(measure.table(rows))
        bad = [m for r in rows for m in r["violations"]]
        print("causality (no action started before one it depends on ended) and bubble floor: "
              + ("held in every repeat" if not bad else f"{len(bad)} violations, first: {bad[0]}"))
        print("bubble: measured idle share of P x step time (median of repeats); sim: the "
              "simulator fed the measured durations and latency; floor: the critical path of the "
              "measured durations (no causal run goes below it); formula (P-1)/(vK+P-1) for "
              "gpipe, 1f1b and interleaved, labkit.costs.pipeline's closed form for the "
              "zero-bubble ones ('-' where it has none). peak mb / KiB: activations held on "
              "stage 0.")
    if a.trace:
        _trace(a, pad, {r["schedule"]: r["bubble"] for r in rows})
    return 0


def _trace(a, pad, measured: dict) -> None:

    for name, K, v in a.specs:
        where = a.trace / name
        run(jobs.pipeline_job, a.nproc, args=(str(where),),
            kwargs=dict(schedule=name, K=K, v=v, batch=a.batch, pad=pad), timeout=120, echo=False)
        traces = read.load_folder(where)
        b = read.bubble(traces)
        if is_rank_zero():
            print(f"{name}: one step read from {where}/: step {b['step_s'] * 1e3:.1f} ms, "
                  f"bubble {b['bubble']:.1%} (idle share of P x step, the F/B/W labels as "
                  f"compute; labkit's clocks above: {measured[name]:.1%}, median of repeats)")
    if is_rank_zero():
        print(folder.announce(a.trace / "<schedule>", a.nproc))
