"""Benchmark: one model, several meshes: step time against the same model's one-process step,
and bytes per mesh dimension against labkit.costs.parallel.

    labkit bench parallel [--steps 6] [--batch 8] [--n-layer 4] [--n-embd 64]

Every plan trains the same GPT on the same global batches through labkit.parallel (the one-process
row is the same code on a world of 1). Step time is the median over steps after the first (the
slowest rank's); bytes are the payload the step handed to collectives (observe.commlog) on rank 0,
and the ratio to labkit.costs.parallel's prediction. On one CPU machine the ranks share its
cores, so a parallel step is slower than the one-process step: the ratio says what the
communication and the sharing cost here, not what a GPU cluster would see.
"""
from __future__ import annotations

import statistics

from labkit.cliargs import BadOption, add_gpt_size, bench_parser, count
from labkit.labs.parallel.compare import bytes_rows
from labkit.labs.parallel.job import train
from labkit.launch import run
from labkit.model import GPTConfig
from labkit.parallel import Plan, check_plan
from labkit.table import table

PLANS = [dict(), dict(dp=2, tp=2), dict(dp=2, pp=2), dict(tp=2, pp=2), dict(dp=2, tp=2, pp=2),
         dict(dp=2, tp=2, sp=True), dict(dp=2, cp=2), dict(tp=2, cp=2)]


def options(argv=()):
    """(options, the arguments not taken), checked before any benchmark runs (labkit.bench)."""
    p = bench_parser("parallel")
    p.add_argument("--steps", type=count, default=6, help="timed steps")
    p.add_argument("--batch", type=count, default=8, help="sequences per step")
    add_gpt_size(p, n_layer=4, n_embd=64)
    a, rest = p.parse_known_args(list(argv or ()))
    cfg = GPTConfig(**_cfg_kw(a))
    for kw in PLANS:
        plan = _plan(kw)
        try:
            check_plan(plan, cfg, plan.world, a.batch)
        except ValueError as err:
            raise BadOption(" ".join(str(err).split())) from None
    return a, rest


def _cfg_kw(a) -> dict:
    return dict(n_layer=a.n_layer, n_embd=a.n_embd, n_head=4, block_size=32)


def _plan(kw: dict):
    return Plan(**kw, micro_batches=2 if kw.get("pp") else None)


def main(argv=()) -> dict:
    a, _ = options(argv)
    cfg_kw = _cfg_kw(a)
    cfg = GPTConfig(**cfg_kw)
    rows = []
    for kw in PLANS:
        plan = _plan(kw)
        res = run(train, plan.world, args=(plan, cfg_kw, a.steps, a.batch, "sgd", False),
                  echo=False)
        per_step = [max(r["step_times"][i] for r in res) for i in range(1, a.steps)]
        brows = [b for b in bytes_rows(res, plan, cfg, a.batch) if b["rank"] == 0]
        rows.append({"plan": plan.describe(), "ranks": plan.world,
                     "step_s": statistics.median(per_step),
                     "bytes": {b["dim"]: b["logged"] for b in brows},
                     "predicted": {b["dim"]: b["predicted"] for b in brows}})
    base = rows[0]["step_s"]
    for r in rows:
        r["vs_one_process"] = r["step_s"] / base
    print(table(rows, [("plan", "plan", "<"), "ranks",
                       ("step ms", lambda r: 1e3 * r["step_s"], ".1f"),
                       ("vs 1 process", "vs_one_process", lambda v: f"{v:.2f}x"),
                       ("bytes logged / predicted by labkit.costs (rank 0)",
                        lambda r: "  ".join(f"{d} {r['bytes'][d]:,}/{r['predicted'][d]:,}"
                                            for d in r["bytes"]) or "-")],
                title=f"GPT {cfg_kw}, global batch {a.batch}, SGD, median of {a.steps - 1} steps"))
    return {"rows": rows, "config": cfg_kw, "batch": a.batch}
