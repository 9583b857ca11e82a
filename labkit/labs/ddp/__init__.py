"""Lab 02: naive, per-parameter-overlap, bucketed and PyTorch's DDP, trained side by side.

    labkit run ddp --nproc 3 --steps 3 --bucket-mb 0.01
    labkit run ddp --versions bucketed --trace traces/ddp     # + a torch.profiler trace per rank
    torchrun --nproc-per-node 3 -m labkit run ddp --steps 3        # one rank per process

Every version trains the tiny GPT (tied embeddings, a frozen bias) from different initial weights
per rank; rank 0 prints, per version, the largest parameter difference from one process trained
on the whole batch, the all-reduces launched per step and how many started before backward
produced its last gradient. With --trace DIR each version trains one more step under
torch.profiler, writing DIR/<version>/rank<r>.pt.trace.json, and rank 0 prints, read back from
those files (labkit.profiling), compute, communication, and how much of it overlapped compute.

Beside it, chapter 02's experiments (the algorithm is labkit.ddp's):
  verify     train a DDP version on real ranks, compare with one process (lab, checker, tests)
  timing     step times (benchmark, bucket sweep) and one step's timeline
  stepmodel  the step-time model's pieces, measured, against the measured step
  crossover  FLOP/s and a per-rank batch sweep (the overlap lab's)
"""
import os

from labkit.cliargs import count, lab_parser, positive
from labkit.labs import ran_on, rank_place
from labkit.labs.ddp.verify import spec, train_on_rank
from labkit.launch import run
from labkit.profiling import folder, jobs, read
from labkit.profiling.folder import check_folder
from labkit.progress import Progress
from labkit.reference import train

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank
FROZEN = ("blocks.0.attn.q_proj.bias",)


KINDS = ("naive", "overlap", "bucketed", "torch")


def _train(kind, steps, batch, bucket_mb):

    res = train_on_rank(kind, steps=steps, batch=batch, bucket_mb=bucket_mb, frozen=FROZEN)
    return dict(res, ran_on=rank_place())       # (backend, device) for the table's header


def main(argv=()):

    p = lab_parser("ddp", nproc=2)
    p.add_argument("--steps", type=count, default=3, help="SGD steps")
    p.add_argument("--batch", type=count, default=7, help="global batch (rows); need not divide")
    p.add_argument("--bucket-mb", type=positive, default=0.01,
                   help="bucket size of the bucketed and torch versions, MiB")
    p.add_argument("--versions", nargs="+", choices=KINDS, default=list(KINDS),
                   help="which DDP versions to train (default: all)")
    p.add_argument("--trace", type=check_folder, default=None, metavar="DIR",
                   help="also write a torch.profiler trace of one step per version and rank here")
    args = p.parse_args(list(argv))
    prog = Progress("ddp", total=len(args.versions) + 1)
    ref = train(*spec(steps=args.steps, batch=args.batch, frozen=FROZEN)).params
    prog.done(f"one process, whole batch: {args.steps} steps")
    per_rank = [{} for _ in range(args.nproc)]
    for kind in args.versions:  # one launch per version: a line as each one finishes
        got = run(_train, args.nproc, args=(kind, args.steps, args.batch, args.bucket_mb))
        for r, res in enumerate(got):
            per_rank[r][kind] = res
        diff = max((res["params"][n] - ref[n]).abs().max().item() for res in got for n in ref)
        prog.done(f"{kind} DDP on {args.nproc} ranks: max |param - one process| {diff:.1e}")
    if os.environ.get("RANK", "0") != "0":
        return 0

    first = per_rank[0][args.versions[0]]
    print(f"{args.nproc} ranks, {args.steps} SGD steps, global batch {args.batch}, "
          f"bucket {args.bucket_mb:g} MiB (float64); {ran_on(*first['ran_on'])} (rank 0)")
    print(f"{'version':<9} {'max |param - one process|':>26} {'all-reduces/step':>17} "
          f"{'before last grad':>17}")
    for kind in per_rank[0]:
        diff = max((r[kind]["params"][n] - ref[n]).abs().max().item()
                   for r in per_rank for n in ref)
        s = per_rank[0][kind]["steps"][-1]
        calls = "(C++)" if kind == "torch" else str(s["allreduces"])
        early = "(C++)" if kind == "torch" else str(s["before_last_grad"])
        print(f"{kind:<9} {diff:>26.2e} {calls:>17} {early:>17}")
    if args.trace:
        _trace(args)
    return 0


def _trace(args) -> None:

    for kind in args.versions:
        where = args.trace / kind
        run(jobs.ddp_job, args.nproc, args=(str(where),),
            kwargs=dict(kind=kind, batch=max(1, args.batch // args.nproc),
                        bucket_mb=args.bucket_mb))
        print(read.summary(read.load_folder(where),
                           title=f"{kind}: one step, read from the trace files in {where}/"))
    print(folder.announce(args.trace / "<version>", args.nproc))
