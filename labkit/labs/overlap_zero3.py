"""Lab 03, part 2: when does ZeRO-3's all-gather hide? Predict the micro-batch, then sweep it.

    labkit run overlap_zero3 --nproc 2 [--rows 1 2 4 8 16 32] [--rounds 3] [--json z3.json]

On the same N processes: (1) the backend's all-gather timed over sizes and fitted to the ring's
alpha-beta model (labkit.labs.intro); (2) the machine's FLOP/s on the model's own matmul shapes
(labkit.labs.ddp.crossover.matmul_rate); (3) ZeRO3 steps with prefetch at several per-rank
micro-batches, read from ZeRO-3's own timeline and commlog records (labkit.labs.zero.crossover).
From (1) and (2), costs.hiding.zero3 predicts the tokens per rank per micro-batch at which the
two all-gathers and the reduce-scatter take as long as the forward and backward; (3) measures
where they do: the collectives' busy time against the compute's, their ratio fitted as a power
of the batch and solved for 1 (labkit.labs._crossover.measured_crossover, as the DP lab). A second
prediction takes the compute from the sweep itself (a line through its times).
"""
from __future__ import annotations

from dataclasses import asdict

from labkit.costs import hiding
from labkit.labs import _crossover as cx
from labkit.labs import ran_on, rank_place
from labkit.labs.ddp.crossover import matmul_rate
from labkit.labs.intro import collective_times, medians
from labkit.labs.zero import crossover
from labkit.labs.zero.crossover import WIDE
from labkit.launch import run
from labkit.model import GPTConfig
from labkit.table import table

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank
ROWS = (1, 2, 4, 8, 16, 32)               # per-rank micro-batch, sequences of block_size tokens
SIZES_KIB = (64, 256, 1024, 4096, 16384)  # all-gather outputs for the fit: the units' range
FIELDS = ("forward", "backward", "compute", "comm", "gather", "exposed", "step")


def _measure(cfg, rows, rounds, numels):
    """Rank side: the all-gather first (nothing else running), then FLOP/s, then the sweep."""

    times = collective_times(numels, "all_gather", repeats=5, inner=2)
    rate = matmul_rate(vars(cfg), cfg.block_size * rows[len(rows) // 2])
    return dict(crossover.sweep(cfg, rows, rounds=rounds), all_gather=times, rate=rate,
                ran_on=rank_place())


def measure(nproc: int = 2, rows=ROWS, cfg=None, rounds: int = 3, sizes_kib=SIZES_KIB) -> dict:
    """Run the three measurements and compare: the lab's whole result as a dict (JSON-ready)."""


    cfg = WIDE if cfg is None else cfg
    rows = sorted(set(rows))
    numels = [k * 1024 // 4 for k in sizes_kib]
    per_rank = run(_measure, nproc, args=(cfg, rows, rounds, numels), timeout=900)
    ag = medians([r["all_gather"] for r in per_rank], numels)
    fit = cx.fit_link(ag, nproc, "all_gather")
    r0 = per_rank[0]
    n_params, units = r0["params"], r0["units"]
    e = r0["param_bytes"] / n_params
    rate = min(r["rate"] for r in per_rank)          # the slowest rank sets the step
    flops = hiding.zero3(n_params, nproc, rate, fit["bandwidth"], fit["alpha"], weight_bytes=e,
                         grad_bytes=e, n_units=units)
    bf16 = hiding.zero3(n_params, nproc, rate, fit["bandwidth"], fit["alpha"], weight_bytes=e,
                        n_units=units, reduce_dtype="bf16")
    comm_model = 2 * flops.terms["all_gather_s"] + flops.terms["reduce_scatter_s"]
    steps = []
    for b in rows:
        tokens = b * cfg.block_size
        steps.append(dict(cx.slowest_medians(per_rank, b, rounds, FIELDS), rows=b, tokens=tokens,
                          comm_model=comm_model, compute_model=6 * n_params * tokens / rate,
                          gather_bytes=r0["steps"][b][0]["bytes"]))
    return {"nproc": nproc, "cfg": asdict(cfg), "rounds": rounds, "params": n_params,
            "units": units, "param_bytes": r0["param_bytes"], "flops_per_s": rate,
            **cx.fit_keys(fit), "all_gather": ag, "steps": steps, "comm_model_s": comm_model,
            "predicted_tokens_bf16_reduce": bf16.value,
            **cx.batch_crossovers(steps, "compute", flops, comm_model, r0["ran_on"])}


def report(res: dict) -> str:
    T = res["cfg"]["block_size"]
    head = (f"{res['nproc']} ranks, ZeRO-3 with prefetch, GPT n_layer={res['cfg']['n_layer']} "
            f"n_embd={res['cfg']['n_embd']} T={T}, {res['params']:,} parameters "
            f"({res['param_bytes'] / 2**20:.1f} MiB fp32; gathered and reduce-scattered in fp32) "
            f"in {res['units']} units; "
            f"{ran_on(*res['ran_on'])}; load average {res['load']:.1f}")
    fit = (f"measured: {res['flops_per_s'] / 1e9:.1f} GFLOP/s on the model's matmuls, "
           f"{cx.link_text(res, 'all-gather')}; 2 gathers + reduce-scatter alone: "
           f"{1e3 * res['comm_model_s']:.1f} ms a micro-batch")
    steps = table(res["steps"], [
        ("rows/rank", "rows"), ("tokens", "tokens"),
        *cx.ms_columns(("forward ms", "forward"), ("backward ms", "backward"),
                       ("6Pt/C ms", "compute_model"), ("gathers busy ms", "gather"),
                       ("all comm busy ms", "comm"), ("exposed ms", "exposed"),
                       ("step ms", "step")),
        ("comm/compute", lambda s: s["comm"] / s["compute"], ".2f")],
        title="per-rank micro-batch sweep (ZeRO3, prefetch; medians over rounds of the slowest "
              "rank)")

    rows = cx.batch_rows(res, "zero3", "compute", "traffic", "collectives busy = compute")
    cross = cx.crossover_table(
        rows, "per rank per micro-batch",
        f"where the micro-batch turns communication-bound ({res['binds']} binds)")
    slow = [s["comm"] / s["comm_model"] for s in res["steps"]]
    tail = [f"measured / predicted (FLOP/s route): {res['ratio']:.2f}" if res["ratio"] else "",
            f"the collectives under compute took {min(slow):.1f}x to {max(slow):.1f}x their "
            f"alpha-beta time alone (Gloo's threads and the compute share the CPU cores)"]
    return "\n".join([head, fit, "", steps, "", cross] + tail)


def figure(res: dict):
    """comm / compute against tokens per rank per micro-batch, crossovers marked (plotly)."""
    steps = res["steps"]
    return cx.ratio_figure(
        [s["tokens"] for s in steps], [s["comm"] / s["compute"] for s in steps],
        [s["comm_model"] / s["compute_model"] for s in steps],
        ("collectives busy / compute (measured)", "alpha-beta / (6Pt/C) (predicted)"), res,
        (("predicted_tokens", "predicted", "black"), ("measured_tokens", "measured", "firebrick")),
        "{name}: {value:,.0f}", "tokens per rank per micro-batch", "communication / compute",
        f"ZeRO-3 on {res['nproc']} ranks: where the gathers stop hiding", dict(dash="dot"))


def main(argv=()):

    p = cx.gpt_parser("overlap_zero3", "micro-batches", 3, ROWS)
    a = cx.parse_gpt(p, argv, "all-gather", SIZES_KIB, "there is nothing to gather")
    cfg = GPTConfig(vocab_size=96, block_size=8, n_layer=2, n_head=8, n_embd=a.n_embd,
                    tie_weights=False)
    return cx.finish("overlap_zero3", lambda: measure(a.nproc, a.rows, cfg, a.rounds, a.sizes_kib),
                     lambda res: f"swept {len(res['steps'])} micro-batches x {a.rounds} rounds "
                                 f"on {a.nproc} ranks", report, a.json)
