"""Lab 02: naive, per-parameter-overlap, bucketed and PyTorch's DDP, trained side by side.

    labkit run ddp --nproc 3 --steps 3 --bucket-mb 0.01
    torchrun --nproc-per-node 3 -m labkit run ddp --steps 3        # one rank per process

Every version trains the tiny GPT (tied embeddings, a frozen bias) from different initial weights
per rank; rank 0 prints, per version, the largest parameter difference from one process trained
on the whole batch, the all-reduces launched per step and how many started before backward
produced its last gradient.
"""
import argparse
import os

FROZEN = ("blocks.0.attn.q_proj.bias",)


def _train_all(steps, batch, bucket_mb):
    from labkit.ddp.verify import train_on_rank

    return {kind: train_on_rank(kind, steps=steps, batch=batch, bucket_mb=bucket_mb,
                                frozen=FROZEN)
            for kind in ("naive", "overlap", "bucketed", "torch")}


def main(argv=()):
    from labkit.ddp.verify import reference_train
    from labkit.launch import run

    p = argparse.ArgumentParser(prog="labkit run ddp")
    p.add_argument("--nproc", type=int, default=int(os.environ.get("WORLD_SIZE", 2)))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=7, help="global batch (rows); need not divide")
    p.add_argument("--bucket-mb", type=float, default=0.01)
    args = p.parse_args(list(argv))
    per_rank = run(_train_all, args.nproc, args=(args.steps, args.batch, args.bucket_mb))
    if os.environ.get("RANK", "0") != "0":
        return 0
    ref = reference_train(steps=args.steps, batch=args.batch, frozen=FROZEN)
    print(f"{args.nproc} ranks, {args.steps} SGD steps, global batch {args.batch}, "
          f"bucket {args.bucket_mb:g} MiB (float64)")
    print(f"{'version':<9} {'max |param - one process|':>26} {'all-reduces/step':>17} "
          f"{'before last grad':>17}")
    for kind in per_rank[0]:
        diff = max((r[kind]["params"][n] - ref[n]).abs().max().item()
                   for r in per_rank for n in ref)
        s = per_rank[0][kind]["steps"][-1]
        calls = "(C++)" if kind == "torch" else str(s["allreduces"])
        early = "(C++)" if kind == "torch" else str(s["before_last_grad"])
        print(f"{kind:<9} {diff:>26.2e} {calls:>17} {early:>17}")
    return 0
