"""Lab 03: ZeRO stages 0-3 on N processes: equal to one process, bytes held, bytes sent.

    labkit run zero --nproc 4
    torchrun --nproc-per-node 4 -m labkit run zero            # one rank per process
    labkit run zero --stages 3 --trace traces/zero            # + a ZeRO-3 profiler trace per rank

Every stage trains the tiny GPT (fp32, AdamW) for a few steps; rank 0 prints, per stage, the
largest difference from one process, the bytes each rank keeps in parameters, gradients and
optimizer state next to labkit.costs.memory's prediction, and the bytes each rank sent in one
step, counted by the kernel's socket counters (labkit.observe.netcount, not by labkit), next to
labkit.costs.zero's 2(N-1)/N Ψ for stages 0-2 and 3(N-1)/N Ψ for stage 3, with their ratio.
With --trace DIR (stage 3 among --stages) one more ZeRO-3 step runs under torch.profiler
(labkit.profiling.jobs.zero3_job), one trace per rank in DIR, and rank 0 prints compute,
communication and their overlap read back from those files.

Beside it, chapter 03's experiments (the algorithm is labkit.zero's):
  train     sharded_train: the same few steps for every stage, and the one-process references
  fsdp      the same training with PyTorch's FSDP2 fully_shard and ZeroRedundancyOptimizer
  measure   bytes held and sent per stage next to labkit.costs (this lab, bench, chapter)
  overlap   ZeRO-3's prefetch measured: a step's timeline, hidden share, peak unsharded bytes
  backward  what ZeRO-3's backward keeps and runs, next to FSDP2
  tracking  50 steps under bf16 / fp16 policies vs the fp32 reference and FSDP2
  crossover where a ZeRO-3 step turns communication-bound (the overlap_zero3 lab's sweep)
"""
import os

from labkit.cliargs import BadOption, at_least_zero, count, lab_parser
from labkit.labs import ran_on, rank_place
from labkit.labs.zero.measure import LAB_MODEL, rows, table
from labkit.labs.zero.train import sharded_train
from labkit.launch import run
from labkit.profiling.folder import check_folder
from labkit.progress import Progress
from labkit.reference import TrainSpec, train

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank


def _lab(stage, steps, batch):

    res = sharded_train(stage, LAB_MODEL, "adamw", steps=steps, batch_size=batch)
    return dict(res, ran_on=rank_place())       # (backend, device) for the table's header


def main(argv=()):

    p = lab_parser("zero", nproc=2)
    p.add_argument("--steps", type=count, default=3, help="AdamW steps")
    p.add_argument("--batch", type=at_least_zero, default=0,
                   help="global batch (0: 2 per rank)")
    p.add_argument("--stages", type=int, nargs="+", choices=(0, 1, 2, 3), default=[0, 1, 2, 3],
                   help="which ZeRO stages to train (default: all)")
    p.add_argument("--trace", type=check_folder, default=None, metavar="DIR",
                   help="also write a torch.profiler trace of one ZeRO-3 step per rank here")
    args = p.parse_args(list(argv))
    if args.trace and 3 not in args.stages:
        stages = " ".join(map(str, args.stages))
        raise BadOption(f"--trace records a ZeRO-3 step but --stages {stages} has no 3; "
                        f"use --stages {stages} 3")
    batch = args.batch or 2 * args.nproc
    prog = Progress("zero", total=len(args.stages) + 1)
    ref = train(LAB_MODEL, TrainSpec(steps=args.steps, batch=batch, optimizer="adamw")).params
    prog.done(f"one process, whole batch: {args.steps} AdamW steps")
    per_rank = [{} for _ in range(args.nproc)]
    for st in args.stages:  # one launch per stage: a line as each one finishes
        got = run(_lab, args.nproc, args=(st, args.steps, batch))
        for r, res in enumerate(got):
            per_rank[r][st] = res
        held = max(sum(res["held"].values()) for res in got)
        prog.done(f"ZeRO-{st} on {args.nproc} ranks: {held / 1e3:.1f} KB of model states on "
                  f"the largest rank")
    if os.environ.get("RANK", "0") != "0":
        return 0

    first = per_rank[0][args.stages[0]]
    print(f"{args.nproc} ranks, {args.steps} AdamW steps, global batch {batch}, fp32, "
          f"Ψ = {first['numel']:,} parameters; {ran_on(*first['ran_on'])} (rank 0)")
    for st in per_rank[0]:
        diff = max((r[st]["params"][n] - ref[n]).abs().max().item() for r in per_rank for n in ref)
        print(f"  ZeRO-{st}: max |param - one process| = {diff:.1e}")
    print(table(rows(per_rank)))
    n = args.nproc
    print(f"KB = 1e3 bytes, largest rank. sent: bytes this rank's sockets sent in one step, "
          f"counted by the kernel (labkit.observe.netcount); predicted: labkit.costs.zero (ring "
          f"collectives); ratio = sent / predicted, the excess being Gloo's message headers. "
          f"'Ψ vals': sent / (4 bytes x Ψ); the ring predicts 2(N-1)/N = {2 * (n - 1) / n:.2f} "
          f"for stages 0-2 and 3(N-1)/N = {3 * (n - 1) / n:.2f} for stage 3")
    if args.trace:
        # here: the profiler and its readers load only when --trace asks for them
        from labkit.profiling import folder, jobs, read

        run(jobs.zero3_job, n, args=(str(args.trace),), kwargs=dict(batch=max(1, batch // n)))
        print(read.summary(read.load_folder(args.trace), title=(
            f"ZeRO-3, one step, read from the trace files in {args.trace}/ (gathers blocking: "
            f"no overlap expected)")))
        print(folder.announce(args.trace, n))
    return 0
