"""Lab 01: labkit's ring all-reduce, the parameter server and the built-in, measured.

    labkit run ring --nproc 4 --sizes-mib 1 16
    torchrun --nproc-per-node 4 -m labkit run ring --sizes-mib 1 16     # one rank per process

Prints, per size and algorithm, time, bus bandwidth, the ratio to dist.all_reduce, and the
bytes the busiest rank received (the root of the parameter server vs a ring rank). One launch per
size (labkit.bench.collectives.measure), so a line shows as each size is done.
"""
import argparse
import os

from labkit.bench.collectives import measure
from labkit.costs import comm
from labkit.labs import ran_on

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank


def main(argv=()):
    from labkit.progress import Progress

    p = argparse.ArgumentParser(prog="labkit run ring")
    p.add_argument("--nproc", type=int, default=int(os.environ.get("WORLD_SIZE", 4)))
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(list(argv))
    bad = [s for s in args.sizes_mib if s <= 0]
    if bad or args.repeats < 1:
        raise ValueError(f"--sizes-mib must be positive (got {bad}) and --repeats >= 1 "
                         f"(got {args.repeats})")
    prog = Progress("ring", total=len(args.sizes_mib))
    rows = []
    for mib in args.sizes_mib:
        got = measure(args.nproc, [int(mib * comm.MiB)], repeats=args.repeats)
        rows += got
        prog.done(f"{mib:g} MiB: " + ", ".join(
            f"{r['algorithm'].replace('_', ' ')} {r['seconds'] * 1e3:.2f} ms" for r in got))
    if os.environ.get("RANK", "0") == "0":
        print(f"all-reduce on {args.nproc} ranks, {ran_on(rows[0]['backend'], rows[0]['device'])}")
        print(f"{'size':>9} {'algorithm':>17} {'time ms':>8} {'busbw GB/s':>10} "
              f"{'vs built-in':>11} {'max bytes received by a rank':>29}")
        for r in rows:
            got = "(not visible)" if r["max_received"] is None else f"{r['max_received']:,}"
            print(f"{r['bytes'] / comm.MiB:>5.3g} MiB {r['algorithm']:>17} {r['seconds'] * 1e3:>8.2f}"
                  f" {r['busbw'] / comm.GB:>10.3f} {r['busbw_ratio_to_builtin']:>10.2f}x {got:>29}")
    return 0
