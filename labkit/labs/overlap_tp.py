"""Lab 04, part 2: at what width could TP's all-reduces hide? Predict it, then sweep the width.

    labkit run overlap_tp --nproc 2 [--widths 32 64 128 256 512] [--tokens 1024] [--json PATH]

On the same N processes (the TP group): (1) Gloo's (or NCCL's) all-reduce timed over sizes,
among them each width's (tokens, h) activation, and fitted to the ring's alpha-beta model
(labkit.labs._crossover.fit_link); (2) one rank's forward matmuls of a Megatron layer
(labkit.labs.tp.crossover) at each width, all ranks at once. From the fit and the FLOP/s of (2) at
the middle width, costs.hiding.tp predicts the width at which the layer's matmuls take as long
as its two all-reduces; the measured crossover is where the measured ratio (two all-reduces of
the activation / the matmuls) falls through 1, a power law between the two widths around it
(labkit.labs._crossover.first_crossing). Plain Megatron's f and
g block, so the crossover says where a collective matmul (async TP) COULD hide the traffic.
"""
from __future__ import annotations

import statistics

from labkit.cliargs import count
from labkit.costs import comm, hiding
from labkit.labs import _crossover as cx
from labkit.labs import ran_on, rank_place
from labkit.labs._group_sweep import GroupSweep
from labkit.labs.intro import all_reduce_times, medians
from labkit.labs.tp import crossover
from labkit.launch import run
from labkit.table import table

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank
WIDTHS = (32, 64, 128, 256, 512)        # hidden widths h to sweep
TOKENS = 1024                           # tokens (b * s) in the layer, fixed over the sweep
SIZES_KIB = (64, 1024, 4096)            # more all-reduce sizes for the alpha-beta fit
ACT_BYTES = 4                           # float32 activations on this CPU
LAB = GroupSweep("overlap_tp", "TP", "--widths", WIDTHS,
                 "hidden widths h to sweep, multiples of --nproc; two or more", "width",
                 "{name}: h = {value:,.0f}", "hidden width h",
                 "2 all-reduces / layer matmuls (forward)",
                 "TP {nproc}, {tokens:,} tokens: below the crossover the all-reduces outlast the "
                 "matmuls")


def _measure(widths, tokens, rounds, numels):
    """Rank side: the all-reduces first (nothing else running), then the matmul sweep."""

    times = all_reduce_times(numels, repeats=max(5, rounds), inner=2)
    return dict(all_reduce=times, compute=crossover.sweep(widths, tokens, rounds),
                ran_on=rank_place())


def measure(nproc: int = 2, widths=WIDTHS, tokens: int = TOKENS, rounds: int = 3,
            sizes_kib=SIZES_KIB) -> dict:
    """Run both measurements and compare: the lab's whole result as a dict (JSON-ready)."""

    widths = sorted(set(widths))
    acts = {h: crossover.activation_numel(h, tokens) for h in widths}
    numels = sorted(set(acts.values()) | {k * 1024 // 4 for k in sizes_kib})
    per_rank = run(_measure, nproc, args=(widths, tokens, rounds, numels))
    ar = medians([r["all_reduce"] for r in per_rank], numels)
    fit = cx.fit_link(ar, nproc)
    by_bytes = {r["bytes"]: r["median"] for r in ar}
    sweeps = [r["compute"] for r in per_rank]
    compute = {h: statistics.median(crossover.slowest(sweeps, h)) for h in widths}
    mid = widths[len(widths) // 2]
    rate = crossover.matmul_flops(mid, nproc, tokens) / compute[mid]
    rows = []
    for h in widths:
        flops = crossover.matmul_flops(h, nproc, tokens)
        c = 2 * by_bytes[4 * acts[h]]                  # g after attention and after the MLP
        model = 2 * comm.ring_allreduce_time(ACT_BYTES * acts[h], nproc, fit["alpha"],
                                             fit["bandwidth"])
        rows.append(dict(width=h, compute=compute[h], comm=c, comm_model=model,
                         compute_model=flops / rate, flops_per_s=flops / compute[h],
                         ratio=c / compute[h], ratio_model=model / (flops / rate)))
    pred = hiding.tp(nproc, rate, fit["bandwidth"], fit["alpha"], tokens=tokens,
                     act_bytes=ACT_BYTES)
    bw_only = hiding.tp(nproc, rate, fit["bandwidth"], 0.0, tokens=tokens, act_bytes=ACT_BYTES)
    measured = cx.first_crossing(widths, [r["comm"] for r in rows], [r["compute"] for r in rows])
    return {"nproc": nproc, "tokens": tokens, "rounds": rounds, "act_bytes": ACT_BYTES,
            "rate_width": mid, "flops_per_s": rate, **cx.fit_keys(fit), "all_reduce": ar,
            "rows": rows, "predicted_width": pred.value, "binds": pred.binds,
            "predicted_width_no_alpha": bw_only.value, "measured_width": measured,
            **cx.verdict(measured, pred.value, widths, per_rank[0]["ran_on"])}


def report(res: dict) -> str:
    head, fit = cx.header(res, f" as one TP group, one GPT layer (4h MLP) on {res['tokens']:,} "
                               f"tokens, float32; {ran_on(*res['ran_on'])}",
                          f"the layer's matmuls at h = {res['rate_width']}", "all-reduce")
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

    cross = cx.crossover_table(
        cx.group_rows(res, "width", w, "tp", "(tp-1) e/6 C/bw", "2 all-reduces = matmuls",
                      "the width"),
        "width", f"where a TP layer turns communication-bound ({res['binds']} binds)")
    tail = f"measured / predicted: {res['ratio']:.2f}" if res["ratio"] else ""
    return "\n".join([head, fit, "", rows, "", cross, tail])


def figure(res: dict):
    """comm / compute against the width, measured and predicted, crossovers marked (plotly)."""
    return LAB.figure(res)


def main(argv=()):
    p = LAB.parser()
    p.add_argument("--tokens", type=count, default=TOKENS, help="tokens in the layer (b * s)")
    p.add_argument("--rounds", type=count, default=3, help="timed passes per width (interleaved)")
    cx.add_fit_options(p, SIZES_KIB, "more all-reduce sizes for the alpha-beta fit, KiB")
    a = p.parse_args(list(argv))
    cx.sweep_checks(p, a, "there is no all-reduce to hide", "--widths", a.widths, "widths",
                    "--widths 64 256")
    odd = [h for h in a.widths if h % a.nproc]
    if odd:
        p.error(f"argument --widths: {odd} do not split over {a.nproc} ranks; use multiples of "
                f"{a.nproc}, e.g. --widths {64 * a.nproc} {256 * a.nproc}")
    return cx.finish("overlap_tp", lambda: measure(a.nproc, a.widths, a.tokens, a.rounds,
                                                   a.sizes_kib),
                     lambda res: f"swept {len(res['rows'])} widths x {a.rounds} rounds on "
                                 f"{a.nproc} ranks", report, a.json)
