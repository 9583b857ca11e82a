"""Lab 04, part 2: at what width could TP's all-reduces hide? Predict it, then sweep the width.

    labkit run overlap_tp --nproc 2 [--widths 32 64 128 256 512] [--tokens 1024] [--json PATH]

On the same N processes (the TP group): (1) Gloo's (or NCCL's) all-reduce timed over sizes,
among them each width's (tokens, h) activation, and fitted to the ring's alpha-beta model
(labkit.labs.overlap.fit_link); (2) one rank's forward matmuls of a Megatron layer
(labkit.tp.crossover) at each width, all ranks at once. From the fit and the FLOP/s of (2) at
the middle width, costs.hiding.tp predicts the width at which the layer's matmuls take as long
as its two all-reduces; the measured crossover is where the measured ratio (two all-reduces of
the activation / the matmuls) falls through 1, a power law between the two widths around it
(labkit.labs.overlap.first_crossing). Plain Megatron's f and
g block, so the crossover says where a collective matmul (async TP) COULD hide the traffic.
"""
from __future__ import annotations

import json
import os
import statistics

from labkit.cliargs import ArgParser, count

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank
WIDTHS = (32, 64, 128, 256, 512)        # hidden widths h to sweep
TOKENS = 1024                           # tokens (b * s) in the layer, fixed over the sweep
SIZES_KIB = (64, 1024, 4096)            # more all-reduce sizes for the alpha-beta fit
ACT_BYTES = 4                           # float32 activations on this CPU


def _measure(widths, tokens, rounds, numels):
    """Rank side: the all-reduces first (nothing else running), then the matmul sweep."""
    from labkit.labs import rank_place
    from labkit.labs.intro import all_reduce_times
    from labkit.tp import crossover

    times = all_reduce_times(numels, repeats=max(5, rounds), inner=2)
    return dict(all_reduce=times, compute=crossover.sweep(widths, tokens, rounds),
                ran_on=rank_place())


def measure(nproc: int = 2, widths=WIDTHS, tokens: int = TOKENS, rounds: int = 3,
            sizes_kib=SIZES_KIB) -> dict:
    """Run both measurements and compare: the lab's whole result as a dict (JSON-ready)."""
    from labkit.costs import comm, hiding
    from labkit.labs.intro import medians
    from labkit.labs.overlap import first_crossing, fit_link
    from labkit.launch import run
    from labkit.tp import crossover

    widths = sorted(set(widths))
    acts = {h: crossover.activation_numel(h, tokens) for h in widths}
    numels = sorted(set(acts.values()) | {k * 1024 // 4 for k in sizes_kib})
    per_rank = run(_measure, nproc, args=(widths, tokens, rounds, numels))
    ar = medians([r["all_reduce"] for r in per_rank], numels)
    fit = fit_link(ar, nproc)
    by_bytes = {r["bytes"]: r["median"] for r in ar}
    sweeps = [r["compute"] for r in per_rank]
    compute = {h: statistics.median(crossover.slowest(sweeps, h)) for h in widths}
    mid = widths[len(widths) // 2]
    rate = crossover.layer_flops(mid, nproc, tokens) / compute[mid]
    rows = []
    for h in widths:
        flops = crossover.layer_flops(h, nproc, tokens)
        c = 2 * by_bytes[4 * acts[h]]                  # g after attention and after the MLP
        model = 2 * comm.ring_allreduce_time(ACT_BYTES * acts[h], nproc, fit["alpha"],
                                             fit["bandwidth"])
        rows.append(dict(width=h, compute=compute[h], comm=c, comm_model=model,
                         compute_model=flops / rate, flops_per_s=flops / compute[h],
                         ratio=c / compute[h], ratio_model=model / (flops / rate)))
    pred = hiding.tp(nproc, rate, fit["bandwidth"], fit["alpha"], tokens=tokens,
                     act_bytes=ACT_BYTES)
    bw_only = hiding.tp(nproc, rate, fit["bandwidth"], 0.0, tokens=tokens, act_bytes=ACT_BYTES)
    measured = first_crossing(widths, [r["comm"] for r in rows], [r["compute"] for r in rows])
    return {"nproc": nproc, "tokens": tokens, "rounds": rounds, "act_bytes": ACT_BYTES,
            "rate_width": mid, "flops_per_s": rate, "alpha": fit["alpha"],
            "bandwidth": fit["bandwidth"], "fit_max_residual": fit["max_residual"],
            "fit_clamped": fit["clamped"], "all_reduce": ar, "rows": rows,
            "predicted_width": pred.value, "binds": pred.binds,
            "predicted_width_no_alpha": bw_only.value, "measured_width": measured,
            "ratio": measured / pred.value if measured else None,
            "extrapolated": measured is not None and not widths[0] <= measured <= widths[-1],
            "ran_on": per_rank[0]["ran_on"], "load": os.getloadavg()[0]}


def report(res: dict) -> str:
    from labkit.labs import ran_on
    from labkit.table import table

    head = (f"{res['nproc']} ranks as one TP group, one GPT layer (4h MLP) on {res['tokens']:,} "
            f"tokens, float32; {ran_on(*res['ran_on'])}; load average {res['load']:.1f}")
    fit = (f"measured: {res['flops_per_s'] / 1e9:.1f} GFLOP/s on the layer's matmuls at h = "
           f"{res['rate_width']}, all-reduce alpha {1e6 * res['alpha']:.0f} us, bandwidth "
           f"{res['bandwidth'] / 1e9:.2f} GB/s (fit within {100 * res['fit_max_residual']:.0f}%"
           f"{'; alpha clamped at 0: noisy times' if res['fit_clamped'] else ''})")
    rows = table(res["rows"], [
        ("width h", "width"),
        ("matmuls ms", lambda r: 1e3 * r["compute"], ".2f"),
        ("GFLOP/s", lambda r: r["flops_per_s"] / 1e9, ".1f"),
        ("2 all-reduces ms", lambda r: 1e3 * r["comm"], ".2f"),
        ("alpha-beta ms", lambda r: 1e3 * r["comm_model"], ".2f"),
        ("comm/compute", "ratio", ".2f"),
        ("predicted ratio", "ratio_model", ".2f")],
        title="width sweep: one rank's forward matmuls of a layer vs its two g all-reduces "
              "(medians over rounds of the slowest rank)")

    def w(v):
        return None if v is None else f"h = {v:,.0f}"

    cross = table([
        ("predicted: alpha-beta + FLOP/s (costs.hiding.tp)", w(res["predicted_width"])),
        ("  the same with alpha = 0: (tp-1) e/6 C/bw", w(res["predicted_width_no_alpha"])),
        ("measured: 2 all-reduces = matmuls", w(res["measured_width"])
         + (" (extrapolated)" if res["extrapolated"] else "") if res["measured_width"]
         else "not found: the ratio does not fall with the width")],
        [("crossover", 0), ("width", 1)],
        title=f"where a TP layer turns communication-bound ({res['binds']} binds)")
    tail = f"measured / predicted: {res['ratio']:.2f}" if res["ratio"] else ""
    return "\n".join([head, fit, "", rows, "", cross, tail])


def figure(res: dict):
    """comm / compute against the width, measured and predicted, crossovers marked (plotly)."""
    import plotly.graph_objects as go  # here, not at the top: the CLI never draws

    x = [r["width"] for r in res["rows"]]
    fig = go.Figure()
    fig.add_scatter(x=x, y=[r["ratio"] for r in res["rows"]], name="measured",
                    mode="lines+markers")
    fig.add_scatter(x=x, y=[r["ratio_model"] for r in res["rows"]], mode="lines",
                    name="alpha-beta / (FLOPs / C)", line=dict(dash="dot"))
    fig.add_hline(y=1, line=dict(color="gray", width=1))
    for key, name, color in (("predicted_width", "predicted", "black"),
                             ("measured_width", "measured", "firebrick")):
        if res[key]:
            fig.add_vline(x=res[key], line=dict(color=color, dash="dash"),
                          annotation_text=f"{name}: h = {res[key]:,.0f}")
    fig.update_xaxes(type="log", title="hidden width h")
    fig.update_yaxes(type="log", title="2 all-reduces / layer matmuls (forward)")
    fig.update_layout(title=f"TP {res['nproc']}, {res['tokens']:,} tokens: below the crossover "
                            f"the all-reduces outlast the matmuls", height=420)
    return fig


def main(argv=()):
    from labkit.progress import Progress

    p = ArgParser(prog="labkit run overlap_tp")
    p.add_argument("--nproc", type=count, default=int(os.environ.get("WORLD_SIZE", 2)),
                   help="ranks, the TP degree (processes; under torchrun: its world size)")
    p.add_argument("--widths", type=count, nargs="+", default=list(WIDTHS),
                   help="hidden widths h to sweep, multiples of --nproc; two or more")
    p.add_argument("--tokens", type=count, default=TOKENS, help="tokens in the layer (b * s)")
    p.add_argument("--rounds", type=count, default=3, help="timed passes per width (interleaved)")
    p.add_argument("--sizes-kib", type=count, nargs="+", default=list(SIZES_KIB),
                   help="more all-reduce sizes for the alpha-beta fit, KiB")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON here")
    a = p.parse_args(list(argv))
    if a.nproc < 2:
        p.error(f"argument --nproc: there is no all-reduce to hide on {a.nproc} rank; "
                f"e.g. --nproc 2")
    if len(set(a.widths)) < 2:
        p.error(f"argument --widths: sweep at least two widths (got {a.widths}); "
                f"e.g. --widths 64 256")
    odd = [h for h in a.widths if h % a.nproc]
    if odd:
        p.error(f"argument --widths: {odd} do not split over {a.nproc} ranks; use multiples of "
                f"{a.nproc}, e.g. --widths {64 * a.nproc} {256 * a.nproc}")
    prog = Progress("overlap_tp", total=1)
    res = measure(a.nproc, a.widths, a.tokens, a.rounds, a.sizes_kib)
    prog.done(f"swept {len(res['rows'])} widths x {a.rounds} rounds on {a.nproc} ranks")
    if os.environ.get("RANK", "0") != "0":
        return 0
    print(report(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
