"""Lab 02, part 2: when does DDP's all-reduce hide? Predict the per-rank batch, then sweep it.

    labkit run overlap --nproc 2 [--rows 1 2 4 8 16 32] [--rounds 5] [--json overlap.json]

On the same N processes: (1) Gloo's (or NCCL's) all-reduce timed over sizes and fitted to the
ring's alpha-beta model (labkit.labs.intro.fit_ring); (2) the machine's FLOP/s on the model's
own matmul shapes; (3) BucketedDDP steps at several per-rank batches, from labkit's clocks.
From (1) and (2), costs.hiding.dp predicts the tokens per rank at which the all-reduce takes as
long as the backward; (3) measures where it does: the all-reduces' busy time against the
backward's, their ratio fitted as a power of the batch and solved for 1. A second prediction
takes the backward from the sweep itself (a line through its times) instead of from FLOP/s.
"""
from __future__ import annotations

import json
import math
import os

from labkit.cliargs import count, lab_parser, positive

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank
ROWS = (1, 2, 4, 8, 16, 32)               # per-rank batch, sequences of block_size tokens
SIZES_KIB = (64, 1024, 4096, 16384, 32768)  # all-reduce sizes for the alpha-beta fit
FIELDS = ("forward", "backward", "wait", "optimizer", "step", "comm")


def _measure(cfg, rows, bucket_mb, rounds, numels):
    """Rank side: the all-reduce first (nothing else running), then FLOP/s, then the sweep."""
    from labkit.ddp import crossover
    from labkit.labs import rank_place
    from labkit.labs.intro import all_reduce_times

    times = all_reduce_times(numels, repeats=5, inner=2)
    rate = crossover.matmul_rate(cfg, cfg["block_size"] * rows[len(rows) // 2])
    return dict(crossover.sweep(cfg, rows, bucket_mb=bucket_mb, rounds=rounds),
                all_reduce=times, rate=rate, ran_on=rank_place())


def _median(xs):
    xs = sorted(xs)
    return 0.5 * (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2])


def fit_line(xs, ys):
    """Least-squares (intercept, slope) of ys against xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def measured_crossover(tokens, comm, backward):
    """Tokens at which comm / backward = 1: log(ratio) fitted as a line in log(tokens) (a power
    law; noise in one point moves it less than interpolating between two). None if the ratio does
    not fall with the batch."""
    a, b = fit_line([math.log(t) for t in tokens],
                    [math.log(c / w) for c, w in zip(comm, backward)])
    return math.exp(-a / b) if b < 0 else None


def first_crossing(xs, comm, compute):
    """Where comm / compute first falls through 1, interpolated as a power law between the two
    points around it: over a wide sweep the ratio is not one power law (a CPU's FLOP rate changes
    with the size), and a line through all of it misplaces the crossing. Falls back to
    measured_crossover over every point (an extrapolation) when the ratio never falls through 1."""
    r = [c / w for c, w in zip(comm, compute)]
    for i in range(len(xs) - 1):
        if r[i] >= 1 > r[i + 1]:
            return measured_crossover(xs[i:i + 2], comm[i:i + 2], compute[i:i + 2])
    return measured_crossover(xs, comm, compute)


def fit_link(ar, n: int, op: str = "all_reduce") -> dict:
    """fit_ring's alpha and bandwidth; when noise makes its best alpha negative, a plain least
    squares line with alpha clamped at 0 (costs.comm.fit_alpha_beta), said in "clamped"."""
    from labkit.costs import comm
    from labkit.labs.intro import fit_ring

    nbytes, seconds = [r["bytes"] for r in ar], [r["median"] for r in ar]
    try:
        return dict(fit_ring(nbytes, seconds, n, op), clamped=False)
    except ValueError:
        per_rank = [comm.ring_bytes_sent_per_rank(op, b, n) for b in nbytes]
        a, bw = comm.fit_alpha_beta(per_rank, seconds)
        alpha = a / comm.ring_steps(op, n)
        model = [comm.ring_time(op, b, n, alpha, bw) for b in nbytes]
        return {"alpha": alpha, "bandwidth": bw, "clamped": True,
                "max_residual": max(abs(m - t) / t for m, t in zip(model, seconds))}


def measure(nproc: int = 2, rows=ROWS, cfg: dict | None = None, bucket_mb: float = 4.0,
            rounds: int = 5, sizes_kib=SIZES_KIB) -> dict:
    """Run the three measurements and compare: the lab's whole result as a dict (JSON-ready)."""
    from labkit.costs import hiding
    from labkit.ddp.crossover import WIDE
    from labkit.labs.intro import medians
    from labkit.launch import run

    cfg = dict(WIDE if cfg is None else cfg)
    rows = sorted(set(rows))
    numels = [k * 1024 // 4 for k in sizes_kib]
    per_rank = run(_measure, nproc, args=(cfg, rows, bucket_mb, rounds, numels))
    ar = medians([r["all_reduce"] for r in per_rank], numels)
    fit = fit_link(ar, nproc)
    r0 = per_rank[0]
    n_params, e_g, buckets = r0["params"], r0["grad_bytes"] / r0["params"], r0["buckets"]
    rate = min(r["rate"] for r in per_rank)          # the slowest rank sets the step
    link = dict(n=nproc, flops_per_s=rate, bandwidth=fit["bandwidth"], alpha=fit["alpha"],
                grad_bytes=e_g, n_buckets=buckets)
    steps = []
    for b in rows:
        # each round lasts as long as its slowest rank; then the median over rounds
        per_round = [{k: max(r["steps"][b][i][k] for r in per_rank) for k in FIELDS}
                     for i in range(rounds)]
        row = {k: _median([p[k] for p in per_round]) for k in FIELDS}
        tokens = b * cfg["block_size"]
        pred = hiding.dp_step_time(tokens, n_params, **link)
        steps.append(dict(row, rows=b, tokens=tokens, comm_model=pred["comm"],
                          backward_model=pred["backward"], step_model=pred["step"]))
    flops = hiding.dp(n_params, **link)
    tokens = [s["tokens"] for s in steps]
    b0, k = fit_line(tokens, [s["backward"] for s in steps])
    # None: the backward's fixed part alone outlasts the all-reduce (hidden at any batch)
    timed = (flops.terms["comm_s"] - b0) / k if k > 0 and flops.terms["comm_s"] > b0 else None
    measured = measured_crossover(tokens, [s["comm"] for s in steps],
                                  [s["backward"] for s in steps])
    return {"nproc": nproc, "cfg": cfg, "bucket_mb": bucket_mb, "rounds": rounds,
            "params": n_params, "grad_bytes": r0["grad_bytes"], "buckets": buckets,
            "flops_per_s": rate, "alpha": fit["alpha"], "bandwidth": fit["bandwidth"],
            "fit_max_residual": fit["max_residual"], "fit_clamped": fit["clamped"],
            "all_reduce": ar, "steps": steps,
            "predicted_tokens": flops.value, "binds": flops.binds,
            "predicted_timed_tokens": timed, "backward_fixed_s": b0,
            "backward_s_per_token": k, "measured_tokens": measured,
            "ratio": measured / flops.value if measured else None,
            "extrapolated": measured is not None and not min(tokens) <= measured <= max(tokens),
            "ran_on": r0["ran_on"], "load": os.getloadavg()[0]}


def report(res: dict) -> str:
    from labkit.labs import ran_on
    from labkit.table import table

    T = res["cfg"]["block_size"]
    head = (f"{res['nproc']} ranks, GPT {res['cfg']}, {res['params']:,} parameters, "
            f"{res['grad_bytes'] / 2**20:.1f} MiB of fp32 gradients in {res['buckets']} buckets; "
            f"{ran_on(*res['ran_on'])}; load average {res['load']:.1f}")
    fit = (f"measured: {res['flops_per_s'] / 1e9:.1f} GFLOP/s on the model's matmuls, all-reduce "
           f"alpha {1e6 * res['alpha']:.0f} us, bandwidth {res['bandwidth'] / 1e9:.2f} GB/s "
           f"(fit within {100 * res['fit_max_residual']:.0f}%"
           f"{'; alpha clamped at 0: noisy times' if res.get('fit_clamped') else ''})")
    steps = table(res["steps"], [
        ("rows/rank", "rows"), ("tokens", "tokens"),
        ("forward ms", lambda s: 1e3 * s["forward"], ".1f"),
        ("backward ms", lambda s: 1e3 * s["backward"], ".1f"),
        ("all-reduce busy ms", lambda s: 1e3 * s["comm"], ".1f"),
        ("alpha-beta ms", lambda s: 1e3 * s["comm_model"], ".1f"),
        ("exposed (wait) ms", lambda s: 1e3 * s["wait"], ".1f"),
        ("step ms", lambda s: 1e3 * s["step"], ".1f"),
        ("comm/backward", lambda s: s["comm"] / s["backward"], ".2f")],
        title="per-rank batch sweep (BucketedDDP; medians over rounds of the slowest rank)")

    def tok(v):
        return None if v is None else f"{v:,.0f} tokens = {v / T:.1f} rows"

    rows = [("predicted: alpha-beta + FLOP/s (costs.hiding.dp)", tok(res["predicted_tokens"])),
            ("predicted: alpha-beta + the sweep's backward line",
             tok(res["predicted_timed_tokens"]) or f"none: the backward's fixed "
             f"{1e3 * res['backward_fixed_s']:.0f} ms alone outlasts the all-reduce"),
            ("measured: all-reduce busy = backward", tok(res["measured_tokens"])
             + (" (extrapolated)" if res["extrapolated"] else "") if res["measured_tokens"]
             else "not found: the ratio does not fall with the batch")]
    ratio = res["ratio"]
    cross = table(rows, [("crossover", 0), ("per rank", 1)],
                  title=f"where the step turns communication-bound ({res['binds']} binds)")
    slow = [s["comm"] / s["comm_model"] for s in res["steps"]]
    tail = [f"measured / predicted (FLOP/s route): {ratio:.2f}" if ratio else "",
            f"the all-reduces under backward took {min(slow):.1f}x to {max(slow):.1f}x their "
            f"alpha-beta time alone: overlap is not free (here Gloo's threads and the backward "
            f"share the CPU cores)"]
    return "\n".join([head, fit, "", steps, "", cross] + tail)


def figure(res: dict):
    """Step, backward and all-reduce time against tokens per rank, crossovers marked (plotly)."""
    import plotly.graph_objects as go  # here, not at the top: the CLI never draws

    x = [s["tokens"] for s in res["steps"]]
    fig = go.Figure()
    for key, name, dash in (("step", "step (measured)", None), ("backward", "backward (measured)",
                            None), ("comm", "all-reduce busy (measured)", None),
                            ("comm_model", "all-reduce alone (alpha-beta)", "dot"),
                            ("step_model", "step (costs.hiding.dp_step_time)", "dot")):
        fig.add_scatter(x=x, y=[1e3 * s[key] for s in res["steps"]], name=name,
                        mode="lines+markers", line=dict(dash=dash))
    for key, name, color in (("predicted_tokens", "predicted crossover", "black"),
                             ("measured_tokens", "measured crossover", "firebrick")):
        if res[key]:
            fig.add_vline(x=res[key], line=dict(color=color, dash="dash"),
                          annotation_text=f"{name}: {res[key]:,.0f} tokens")
    fig.update_xaxes(type="log", title="tokens per rank per step")
    fig.update_yaxes(type="log", title="ms")
    fig.update_layout(title=f"DDP on {res['nproc']} ranks: where the all-reduce stops hiding",
                      height=430)
    return fig


def main(argv=()):
    from labkit.progress import Progress

    p = lab_parser("overlap", nproc=2)
    p.add_argument("--rows", type=count, nargs="+", default=list(ROWS),
                   help="per-rank batches to sweep (sequences of 8 tokens); two or more")
    p.add_argument("--rounds", type=count, default=5, help="timed steps per batch (interleaved)")
    p.add_argument("--bucket-mb", type=positive, default=4.0, help="DDP bucket size, MiB")
    p.add_argument("--n-embd", type=count, default=512,
                   help="model width (a multiple of 8, the heads); 2 layers")
    p.add_argument("--sizes-kib", type=count, nargs="+", default=list(SIZES_KIB),
                   help="all-reduce sizes for the alpha-beta fit, KiB; two or more")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON here")
    a = p.parse_args(list(argv))
    if a.nproc < 2:
        p.error(f"argument --nproc: there is no all-reduce to hide on {a.nproc} rank; "
                f"e.g. --nproc 2")
    if len(set(a.rows)) < 2:
        p.error(f"argument --rows: sweep at least two batches (got {a.rows}); e.g. --rows 1 4 16")
    if len(set(a.sizes_kib)) < 2:
        p.error(f"argument --sizes-kib: fit needs two or more sizes (got {a.sizes_kib}); "
                f"e.g. --sizes-kib 64 4096")
    if a.n_embd % 8:
        p.error(f"argument --n-embd: must be a multiple of 8, the heads (got {a.n_embd}); "
                f"e.g. --n-embd 512")
    cfg = dict(n_layer=2, n_embd=a.n_embd, n_head=8, block_size=8)
    prog = Progress("overlap", total=1)
    res = measure(a.nproc, a.rows, cfg, a.bucket_mb, a.rounds, a.sizes_kib)
    prog.done(f"swept {len(res['steps'])} batches x {a.rounds} rounds on {a.nproc} ranks")
    if os.environ.get("RANK", "0") != "0":
        return 0
    print(report(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
