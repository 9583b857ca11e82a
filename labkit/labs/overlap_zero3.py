"""Lab 03, part 2: when does ZeRO-3's all-gather hide? Predict the micro-batch, then sweep it.

    labkit run overlap_zero3 --nproc 2 [--rows 1 2 4 8 16 32] [--rounds 3] [--json z3.json]

On the same N processes: (1) the backend's all-gather timed over sizes and fitted to the ring's
alpha-beta model (labkit.labs.intro); (2) the machine's FLOP/s on the model's own matmul shapes
(labkit.ddp.crossover.matmul_rate); (3) ZeRO3 steps with prefetch at several per-rank
micro-batches, read from ZeRO-3's own timeline and commlog records (labkit.zero.crossover).
From (1) and (2), costs.hiding.zero3 predicts the tokens per rank per micro-batch at which the
two all-gathers and the reduce-scatter take as long as the forward and backward; (3) measures
where they do: the collectives' busy time against the compute's, their ratio fitted as a power
of the batch and solved for 1 (labkit.labs.overlap.measured_crossover, as the DP lab). A second
prediction takes the compute from the sweep itself (a line through its times).
"""
from __future__ import annotations

import json
import os
import statistics

from labkit.cliargs import ArgParser, count

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank
ROWS = (1, 2, 4, 8, 16, 32)               # per-rank micro-batch, sequences of block_size tokens
SIZES_KIB = (64, 256, 1024, 4096, 16384)  # all-gather outputs for the fit: the units' range
FIELDS = ("forward", "backward", "compute", "comm", "gather", "exposed", "step")


def _measure(cfg, rows, rounds, numels):
    """Rank side: the all-gather first (nothing else running), then FLOP/s, then the sweep."""
    from labkit.ddp.crossover import matmul_rate
    from labkit.labs import rank_place
    from labkit.labs.intro import collective_times
    from labkit.zero import crossover

    times = collective_times(numels, "all_gather", repeats=5, inner=2)
    rate = matmul_rate(vars(cfg), cfg.block_size * rows[len(rows) // 2])
    return dict(crossover.sweep(cfg, rows, rounds=rounds), all_gather=times, rate=rate,
                ran_on=rank_place())


def measure(nproc: int = 2, rows=ROWS, cfg=None, rounds: int = 3, sizes_kib=SIZES_KIB) -> dict:
    """Run the three measurements and compare: the lab's whole result as a dict (JSON-ready)."""
    from dataclasses import asdict

    from labkit.costs import hiding
    from labkit.labs.intro import medians
    from labkit.labs.overlap import fit_line, fit_link, measured_crossover
    from labkit.launch import run
    from labkit.zero.crossover import WIDE

    cfg = WIDE if cfg is None else cfg
    rows = sorted(set(rows))
    numels = [k * 1024 // 4 for k in sizes_kib]
    per_rank = run(_measure, nproc, args=(cfg, rows, rounds, numels), timeout=900)
    ag = medians([r["all_gather"] for r in per_rank], numels)
    fit = fit_link(ag, nproc, "all_gather")
    r0 = per_rank[0]
    n_params, units = r0["params"], r0["units"]
    e = r0["param_bytes"] / n_params
    rate = min(r["rate"] for r in per_rank)          # the slowest rank sets the step
    flops = hiding.zero3(n_params, nproc, rate, fit["bandwidth"], fit["alpha"], weight_bytes=e,
                         grad_bytes=e, n_units=units)
    comm_model = 2 * flops.terms["all_gather_s"] + flops.terms["reduce_scatter_s"]
    steps = []
    for b in rows:
        # each round lasts as long as its slowest rank; then the median over rounds
        per_round = [{k: max(r["steps"][b][i][k] for r in per_rank) for k in FIELDS}
                     for i in range(rounds)]
        row = {k: statistics.median([p[k] for p in per_round]) for k in FIELDS}
        tokens = b * cfg.block_size
        steps.append(dict(row, rows=b, tokens=tokens, comm_model=comm_model,
                          compute_model=6 * n_params * tokens / rate,
                          gather_bytes=r0["steps"][b][0]["bytes"]))
    tokens = [s["tokens"] for s in steps]
    c0, k = fit_line(tokens, [s["compute"] for s in steps])
    # None: the compute's fixed part alone outlasts the traffic (hidden at any batch)
    timed = (comm_model - c0) / k if k > 0 and comm_model > c0 else None
    measured = measured_crossover(tokens, [s["comm"] for s in steps],
                                  [s["compute"] for s in steps])
    return {"nproc": nproc, "cfg": asdict(cfg), "rounds": rounds, "params": n_params,
            "units": units, "param_bytes": r0["param_bytes"], "flops_per_s": rate,
            "alpha": fit["alpha"], "bandwidth": fit["bandwidth"],
            "fit_max_residual": fit["max_residual"], "fit_clamped": fit["clamped"],
            "all_gather": ag, "steps": steps, "comm_model_s": comm_model,
            "predicted_tokens": flops.value, "binds": flops.binds,
            "predicted_timed_tokens": timed, "compute_fixed_s": c0,
            "compute_s_per_token": k, "measured_tokens": measured,
            "ratio": measured / flops.value if measured else None,
            "extrapolated": measured is not None and not min(tokens) <= measured <= max(tokens),
            "ran_on": r0["ran_on"], "load": os.getloadavg()[0]}


def report(res: dict) -> str:
    from labkit.labs import ran_on
    from labkit.table import table

    T = res["cfg"]["block_size"]
    head = (f"{res['nproc']} ranks, ZeRO-3 with prefetch, GPT n_layer={res['cfg']['n_layer']} "
            f"n_embd={res['cfg']['n_embd']} T={T}, {res['params']:,} parameters "
            f"({res['param_bytes'] / 2**20:.1f} MiB fp32) in {res['units']} units; "
            f"{ran_on(*res['ran_on'])}; load average {res['load']:.1f}")
    fit = (f"measured: {res['flops_per_s'] / 1e9:.1f} GFLOP/s on the model's matmuls, all-gather "
           f"alpha {1e6 * res['alpha']:.0f} us, bandwidth {res['bandwidth'] / 1e9:.2f} GB/s "
           f"(fit within {100 * res['fit_max_residual']:.0f}%"
           f"{'; alpha clamped at 0: noisy times' if res.get('fit_clamped') else ''}); "
           f"2 gathers + reduce-scatter alone: {1e3 * res['comm_model_s']:.1f} ms a micro-batch")
    steps = table(res["steps"], [
        ("rows/rank", "rows"), ("tokens", "tokens"),
        ("forward ms", lambda s: 1e3 * s["forward"], ".1f"),
        ("backward ms", lambda s: 1e3 * s["backward"], ".1f"),
        ("6Pt/C ms", lambda s: 1e3 * s["compute_model"], ".1f"),
        ("gathers busy ms", lambda s: 1e3 * s["gather"], ".1f"),
        ("all comm busy ms", lambda s: 1e3 * s["comm"], ".1f"),
        ("exposed ms", lambda s: 1e3 * s["exposed"], ".1f"),
        ("step ms", lambda s: 1e3 * s["step"], ".1f"),
        ("comm/compute", lambda s: s["comm"] / s["compute"], ".2f")],
        title="per-rank micro-batch sweep (ZeRO3, prefetch; medians over rounds of the slowest "
              "rank)")

    def tok(v):
        return None if v is None else f"{v:,.0f} tokens = {v / T:.1f} rows"

    rows = [("predicted: alpha-beta + FLOP/s (costs.hiding.zero3)", tok(res["predicted_tokens"])),
            ("predicted: alpha-beta + the sweep's compute line",
             tok(res["predicted_timed_tokens"]) or f"none: the compute's fixed "
             f"{1e3 * res['compute_fixed_s']:.0f} ms alone outlasts the traffic"),
            ("measured: collectives busy = compute", tok(res["measured_tokens"])
             + (" (extrapolated)" if res["extrapolated"] else "") if res["measured_tokens"]
             else "not found: the ratio does not fall with the batch")]
    cross = table(rows, [("crossover", 0), ("per rank per micro-batch", 1)],
                  title=f"where the micro-batch turns communication-bound ({res['binds']} binds)")
    slow = [s["comm"] / s["comm_model"] for s in res["steps"]]
    tail = [f"measured / predicted (FLOP/s route): {res['ratio']:.2f}" if res["ratio"] else "",
            f"the collectives under compute took {min(slow):.1f}x to {max(slow):.1f}x their "
            f"alpha-beta time alone (Gloo's threads and the compute share the CPU cores)"]
    return "\n".join([head, fit, "", steps, "", cross] + tail)


def figure(res: dict):
    """comm / compute against tokens per rank per micro-batch, crossovers marked (plotly)."""
    import plotly.graph_objects as go  # here, not at the top: the CLI never draws

    x = [s["tokens"] for s in res["steps"]]
    fig = go.Figure()
    fig.add_scatter(x=x, y=[s["comm"] / s["compute"] for s in res["steps"]], mode="lines+markers",
                    name="collectives busy / compute (measured)")
    fig.add_scatter(x=x, y=[s["comm_model"] / s["compute_model"] for s in res["steps"]],
                    mode="lines", line=dict(dash="dot"), name="alpha-beta / (6Pt/C) (predicted)")
    fig.add_hline(y=1, line=dict(color="gray", dash="dot"))
    for key, name, color in (("predicted_tokens", "predicted", "black"),
                             ("measured_tokens", "measured", "firebrick")):
        if res[key]:
            fig.add_vline(x=res[key], line=dict(color=color, dash="dash"),
                          annotation_text=f"{name}: {res[key]:,.0f}")
    fig.update_xaxes(type="log", title="tokens per rank per micro-batch")
    fig.update_yaxes(type="log", title="communication / compute")
    fig.update_layout(title=f"ZeRO-3 on {res['nproc']} ranks: where the gathers stop hiding",
                      height=430)
    return fig


def main(argv=()):
    from labkit.model import GPTConfig
    from labkit.progress import Progress

    p = ArgParser(prog="labkit run overlap_zero3")
    p.add_argument("--nproc", type=count, default=int(os.environ.get("WORLD_SIZE", 2)),
                   help="ranks (processes; under torchrun: its world size)")
    p.add_argument("--rows", type=count, nargs="+", default=list(ROWS),
                   help="per-rank micro-batches to sweep (sequences of 8 tokens); two or more")
    p.add_argument("--rounds", type=count, default=3, help="timed steps per batch (interleaved)")
    p.add_argument("--n-embd", type=count, default=512,
                   help="model width (a multiple of 8, the heads); 2 layers")
    p.add_argument("--sizes-kib", type=count, nargs="+", default=list(SIZES_KIB),
                   help="all-gather sizes for the alpha-beta fit, KiB; two or more")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON here")
    a = p.parse_args(list(argv))
    if a.nproc < 2:
        p.error(f"argument --nproc: there is nothing to gather on {a.nproc} rank; e.g. --nproc 2")
    if len(set(a.rows)) < 2:
        p.error(f"argument --rows: sweep at least two batches (got {a.rows}); e.g. --rows 1 4 16")
    if len(set(a.sizes_kib)) < 2:
        p.error(f"argument --sizes-kib: fit needs two or more sizes (got {a.sizes_kib}); "
                f"e.g. --sizes-kib 64 4096")
    if a.n_embd % 8:
        p.error(f"argument --n-embd: must be a multiple of 8, the heads (got {a.n_embd}); "
                f"e.g. --n-embd 512")
    cfg = GPTConfig(vocab_size=96, block_size=8, n_layer=2, n_head=8, n_embd=a.n_embd,
                    tie_weights=False)
    prog = Progress("overlap_zero3", total=1)
    res = measure(a.nproc, a.rows, cfg, a.rounds, a.sizes_kib)
    prog.done(f"swept {len(res['steps'])} micro-batches x {a.rounds} rounds on {a.nproc} ranks")
    if os.environ.get("RANK", "0") != "0":
        return 0
    print(report(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
