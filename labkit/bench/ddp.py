"""Benchmark: step time of labkit's three DDPs and PyTorch's DDP on the tiny GPT.

    labkit bench ddp [--ranks 2 4] [--batch 8] [--bucket-mb 25] [--rounds 5] [--steps 5]

All four run in the same processes, interleaved, on the same data; each is reported as a ratio
to `torch.nn.parallel.DistributedDataParallel` measured in the same run (lower is faster).
"""
from __future__ import annotations

from labkit.cliargs import add_gpt_size, bench_parser, count, positive
from labkit.labs.ddp.timing import BENCH, time_steps
from labkit.launch import run
from labkit.table import table as format_table

VERSIONS = ("naive", "overlap", "bucketed", "torch")


def _rank(variants, cfg, batch, steps, rounds):

    return time_steps(variants, cfg, batch=batch, steps=steps, rounds=rounds)


def measure(nprocs: int, variants, cfg=None, *, batch=8, steps=5, rounds=5, timeout=600) -> list:
    """Rows {ranks, version, bucket_mb, step_ms, ratio_to_torch, allreduces_per_step}; the
    step time of a variant is the slowest rank's median (a step ends when every rank is done)."""

    per_rank = run(_rank, nprocs, args=(list(variants), cfg or BENCH, batch, steps, rounds),
                   timeout=timeout, echo=False)
    rows = []
    for i, base in enumerate(per_rank[0]):
        step = max(r[i]["step_s"] for r in per_rank)
        rows.append({"ranks": nprocs, "version": base["version"], "bucket_mb": base["bucket_mb"],
                     "step_ms": round(1e3 * step, 3),
                     "allreduces_per_step": base["allreduces_per_step"]})
    torch_ms = {r["bucket_mb"]: r["step_ms"] for r in rows if r["version"] == "torch"}
    ref = torch_ms.get(25.0, next(iter(torch_ms.values()), None))
    for r in rows:
        r["ratio_to_torch"] = round(r["step_ms"] / ref, 3) if ref else None
    return rows


def table(rows) -> str:
    return format_table(rows, [
        ("ranks", "ranks"),
        ("version", "version"),
        ("bucket MiB", lambda r: "all" if r["bucket_mb"] is None else f"{r['bucket_mb']:g}",
         None, ">"),
        ("step ms", "step_ms", ".2f"),
        ("x torch DDP", "ratio_to_torch", ".3f"),
        ("all-reduces/step", "allreduces_per_step", ".0f")])


def options(argv=()):
    """(options, the arguments not taken), checked before any benchmark runs (labkit.bench)."""
    p = bench_parser("ddp", ranks=[2, 4], description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=count, default=8, help="rows per rank per step")
    p.add_argument("--bucket-mb", type=positive, default=25.0, help="gradient bucket size, MiB")
    add_gpt_size(p, n_layer=2, n_embd=64)
    p.add_argument("--steps", type=count, default=5, help="steps per timed block")
    p.add_argument("--rounds", type=count, default=5, help="timed blocks per version (median)")
    return p.parse_known_args(list(argv or ()))


def main(argv=None) -> dict:
    args, _ = options(argv)

    cfg = dict(BENCH, n_layer=args.n_layer, n_embd=args.n_embd)
    variants = [(v, args.bucket_mb) for v in VERSIONS]
    rows = []
    for n in args.ranks:
        rows += measure(n, variants, cfg, batch=args.batch, steps=args.steps, rounds=args.rounds)
    print(table(rows))
    return {"rows": rows, "config": {**cfg, "batch_per_rank": args.batch,
                                     "bucket_mb": args.bucket_mb}}
