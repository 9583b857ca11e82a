"""Lab 02, part 2: when does DDP's all-reduce hide? Predict the per-rank batch, then sweep it.

    labkit run overlap --nproc 2 [--rows 1 2 4 8 16 32] [--rounds 5] [--json overlap.json]

On the same N processes: (1) Gloo's (or NCCL's) all-reduce timed over sizes and fitted to the
ring's alpha-beta model (labkit.labs.intro.fit_ring); (2) the machine's FLOP/s on the model's
own matmul shapes; (3) BucketedDDP steps at several per-rank batches, from labkit's clocks.
From (1) and (2), costs.hiding.dp predicts the tokens per rank at which the all-reduce takes as
long as the backward; (3) measures where it does: the all-reduces' busy time against the
backward's, their ratio fitted as a power of the batch and solved for 1. A second prediction
takes the backward from the sweep itself (a line through its times) instead of from FLOP/s.
The fits, tables, figure and command line it shares with overlap_zero3, overlap_tp and
overlap_cp are in labkit.labs._crossover.
"""
from __future__ import annotations

import plotly.graph_objects as go

from labkit.cliargs import positive
from labkit.costs import hiding
from labkit.labs import _crossover as cx
from labkit.labs import ran_on, rank_place
from labkit.labs.ddp import crossover
from labkit.labs.ddp.crossover import WIDE
from labkit.labs.intro import all_reduce_times, medians
from labkit.launch import run
from labkit.table import table

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank
ROWS = (1, 2, 4, 8, 16, 32)               # per-rank batch, sequences of block_size tokens
SIZES_KIB = (64, 1024, 4096, 16384, 32768)  # all-reduce sizes for the alpha-beta fit
FIELDS = ("forward", "backward", "wait", "optimizer", "step", "comm")


def _measure(cfg, rows, bucket_mb, rounds, numels):
    """Rank side: the all-reduce first (nothing else running), then FLOP/s, then the sweep."""

    times = all_reduce_times(numels, repeats=5, inner=2)
    rate = crossover.matmul_rate(cfg, cfg["block_size"] * rows[len(rows) // 2])
    return dict(crossover.sweep(cfg, rows, bucket_mb=bucket_mb, rounds=rounds),
                all_reduce=times, rate=rate, ran_on=rank_place())


def measure(nproc: int = 2, rows=ROWS, cfg: dict | None = None, bucket_mb: float = 4.0,
            rounds: int = 5, sizes_kib=SIZES_KIB) -> dict:
    """Run the three measurements and compare: the lab's whole result as a dict (JSON-ready)."""

    cfg = dict(WIDE if cfg is None else cfg)
    rows = sorted(set(rows))
    numels = [k * 1024 // 4 for k in sizes_kib]
    per_rank = run(_measure, nproc, args=(cfg, rows, bucket_mb, rounds, numels))
    ar = medians([r["all_reduce"] for r in per_rank], numels)
    fit = cx.fit_link(ar, nproc)
    r0 = per_rank[0]
    n_params, e_g, buckets = r0["params"], r0["grad_bytes"] / r0["params"], r0["buckets"]
    rate = min(r["rate"] for r in per_rank)          # the slowest rank sets the step
    link = dict(n=nproc, flops_per_s=rate, bandwidth=fit["bandwidth"], alpha=fit["alpha"],
                grad_bytes=e_g, n_buckets=buckets)
    steps = []
    for b in rows:
        tokens = b * cfg["block_size"]
        pred = hiding.dp_step_time(tokens, n_params, **link)
        steps.append(dict(cx.slowest_medians(per_rank, b, rounds, FIELDS), rows=b, tokens=tokens,
                          comm_model=pred["comm"], backward_model=pred["backward"],
                          step_model=pred["step"]))
    flops = hiding.dp(n_params, **link)
    bf16 = hiding.dp(n_params, **dict(link, grad_bytes=None), reduce_dtype="bf16")
    return {"nproc": nproc, "cfg": cfg, "bucket_mb": bucket_mb, "rounds": rounds,
            "params": n_params, "grad_bytes": r0["grad_bytes"], "buckets": buckets,
            "flops_per_s": rate, **cx.fit_keys(fit), "all_reduce": ar, "steps": steps,
            "predicted_tokens_bf16_reduce": bf16.value,
            **cx.batch_crossovers(steps, "backward", flops, flops.terms["comm_s"], r0["ran_on"])}


def report(res: dict) -> str:
    head, fit = cx.header(res, f", GPT {res['cfg']}, {res['params']:,} parameters, "
                               f"{res['grad_bytes'] / 2**20:.1f} MiB of fp32 gradients "
                               f"(all-reduced in fp32) in {res['buckets']} buckets; "
                               f"{ran_on(*res['ran_on'])}", "the model's matmuls", "all-reduce")
    steps = table(res["steps"], [
        ("rows/rank", "rows"), ("tokens", "tokens"),
        *cx.ms_columns(("forward ms", "forward"), ("backward ms", "backward"),
                       ("all-reduce busy ms", "comm"), ("alpha-beta ms", "comm_model"),
                       ("exposed (wait) ms", "wait"), ("step ms", "step")),
        ("comm/backward", lambda s: s["comm"] / s["backward"], ".2f")],
        title="per-rank batch sweep (BucketedDDP; medians over rounds of the slowest rank)")

    rows = cx.batch_rows(res, "dp", "backward", "all-reduce", "all-reduce busy = backward")
    ratio = res["ratio"]
    cross = cx.crossover_table(
        rows, "per rank", f"where the step turns communication-bound ({res['binds']} binds)")
    slow = [s["comm"] / s["comm_model"] for s in res["steps"]]
    tail = [f"measured / predicted (FLOP/s route): {ratio:.2f}" if ratio else "",
            f"the all-reduces under backward took {min(slow):.1f}x to {max(slow):.1f}x their "
            f"alpha-beta time alone: overlap is not free (here Gloo's threads and the backward "
            f"share the CPU cores)"]
    return "\n".join([head, fit, "", steps, "", cross] + tail)


def figure(res: dict):
    """Step, backward and all-reduce time against tokens per rank, crossovers marked (plotly)."""

    x = [s["tokens"] for s in res["steps"]]
    fig = go.Figure()
    for key, name, dash in (("step", "step (measured)", None), ("backward", "backward (measured)",
                            None), ("comm", "all-reduce busy (measured)", None),
                            ("comm_model", "all-reduce alone (alpha-beta)", "dot"),
                            ("step_model", "step (costs.hiding.dp_step_time)", "dot")):
        fig.add_scatter(x=x, y=[1e3 * s[key] for s in res["steps"]], name=name,
                        mode="lines+markers", line=dict(dash=dash))
    fig.update_xaxes(type="log", title="tokens per rank per step")
    cx.mark_crossovers(fig, res, (("predicted_tokens", "predicted crossover", "black"),
                                  ("measured_tokens", "measured crossover", "firebrick")),
                       "{name}: {value:,.0f} tokens")
    fig.update_yaxes(type="log", title="ms")
    cx.phone_layout(fig, f"DDP on {res['nproc']} ranks: where the all-reduce stops hiding", 480)
    return fig


def main(argv=()):
    p = cx.gpt_parser("overlap", "batches", 5, ROWS)
    p.add_argument("--bucket-mb", type=positive, default=4.0, help="DDP bucket size, MiB")
    a = cx.parse_gpt(p, argv, "all-reduce", SIZES_KIB, "there is no all-reduce to hide")
    cfg = dict(n_layer=2, n_embd=a.n_embd, n_head=8, block_size=8)
    return cx.finish("overlap", lambda: measure(a.nproc, a.rows, cfg, a.bucket_mb, a.rounds,
                                                a.sizes_kib),
                     lambda res: f"swept {len(res['steps'])} batches x {a.rounds} rounds on "
                                 f"{a.nproc} ranks", report, a.json)
