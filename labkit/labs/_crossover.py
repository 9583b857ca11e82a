"""What the four crossover labs share: predict where communication stops hiding under compute,
sweep, find the measured crossover, print the table, write JSON, draw the figure.

The labs: overlap (02, DDP's all-reduce), overlap_zero3 (03, ZeRO-3's gathers), overlap_tp (04,
TP's all-reduces), overlap_cp (07, ring attention's K/V hop). Not a lab itself: the underscore
keeps it off `labkit list`.

    fit_link, fit_line, measured_crossover, first_crossing   the fits (pure arithmetic)
    fit_keys, slowest_medians, batch_crossovers, verdict    the sweep's numbers
    header, link_text, ms_columns, found, batch_rows,
    group_rows, crossover_table                             the report's pieces
    ratio_figure, mark_crossovers, log_frame                the figure's
    gpt_parser, parse_gpt, add_fit_options,
    sweep_checks, gpt_checks, finish                        the command line

A lab whose ranks are one group (overlap_tp, overlap_cp) describes its command line and figure
as data: labkit.labs._group_sweep.GroupSweep.
"""
from __future__ import annotations

import json
import math
import os
import statistics

import plotly.graph_objects as go

from labkit.cliargs import ArgParser, count, lab_parser
from labkit.costs import comm
from labkit.labs.intro import fit_ring
from labkit.observe.measured import Measured
from labkit.progress import Progress
from labkit.table import table


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


def fit_keys(fit: dict) -> dict:
    """fit_link's result under the names the labs' JSON gives it."""
    return {"alpha": fit["alpha"], "bandwidth": fit["bandwidth"],
            "fit_max_residual": fit["max_residual"], "fit_clamped": fit["clamped"]}


def slowest_medians(per_rank, b, rounds: int, fields) -> dict:
    """Per field of batch b's steps: each round lasts as long as its slowest rank; then the median
    over rounds (per_rank: every rank's {"steps": {b: [{field: seconds} per round]}})."""
    per_round = [{k: max(r["steps"][b][i][k] for r in per_rank) for k in fields}
                 for i in range(rounds)]
    return {k: statistics.median([p[k] for p in per_round]) for k in fields}


def batch_crossovers(steps, compute: str, flops, comm_model: float, ran_on) -> dict:
    """A batch sweep's crossovers, in tokens, as the JSON's last keys: flops's prediction
    (costs.hiding); `timed`, where a line through the measured `compute` times meets the
    alpha-beta traffic comm_model (None: the compute's fixed part alone outlasts it, hidden at any
    batch), with that line's fixed seconds and seconds per token; `measured`, where the measured
    comm / compute is 1 (measured_crossover); then verdict's keys."""
    tokens = [s["tokens"] for s in steps]
    times = [s[compute] for s in steps]
    c0, k = fit_line(tokens, times)
    timed = (comm_model - c0) / k if k > 0 and comm_model > c0 else None
    measured = measured_crossover(tokens, [s["comm"] for s in steps], times)
    return {"predicted_tokens": flops.value, "binds": flops.binds,
            "predicted_timed_tokens": timed, f"{compute}_fixed_s": c0,
            f"{compute}_s_per_token": k, "measured_tokens": measured,
            **verdict(measured, flops.value, tokens, ran_on)}


def verdict(measured, predicted: float, xs, ran_on) -> dict:
    """The JSON's last keys: measured / predicted, whether the measured crossover lies outside the
    swept xs, where it ran and the load average."""
    return {"ratio": Measured("crossover tokens", measured, predicted, counter="sweep").ratio,
            "extrapolated": measured is not None and not min(xs) <= measured <= max(xs),
            "ran_on": ran_on, "load": os.getloadavg()[0]}


def header(res: dict, setup: str, rate_on: str, link: str, note: str | None = None,
           digits: int = 1) -> list:
    """A report's first two lines: "<nproc> ranks<setup>; load average .." (setup: what ran and
    where, labkit.labs.ran_on) and "measured: .. GFLOP/s on <rate_on>, <link_text(res, link,
    note)>"."""
    return [f"{res['nproc']} ranks{setup}; load average {res['load']:.1f}",
            f"measured: {res['flops_per_s'] / 1e9:.{digits}f} GFLOP/s on {rate_on}, "
            + link_text(res, link, note)]


def link_text(res: dict, what: str, note: str | None = None) -> str:
    """'<what> alpha .. us, bandwidth .. GB/s (fit within ..%<note>)'; the note by default says
    when fit_link clamped alpha."""
    if note is None:
        note = "; alpha clamped at 0: noisy times" if res.get("fit_clamped") else ""
    return (f"{what} alpha {1e6 * res['alpha']:.0f} us, bandwidth {res['bandwidth'] / 1e9:.2f} "
            f"GB/s (fit within {100 * res['fit_max_residual']:.0f}%{note})")


def found(value, text, extrapolated: bool, over: str) -> str:
    """The measured crossover's cell: text(value), marked when extrapolated, or why none."""
    if not value:
        return f"not found: the ratio does not fall with {over}"
    return text(value) + (" (extrapolated)" if extrapolated else "")


def batch_rows(res: dict, route: str, compute: str, traffic: str, equal: str) -> list:
    """A batch sweep's crossover rows (batch_crossovers' keys), in tokens and rows per rank: the
    FLOP/s route (costs.hiding.<route>; the labs' models are fp32, so their gradients are reduced
    in fp32, the common stacks' default), the same with bf16 reduction when res holds
    "predicted_tokens_bf16_reduce", the sweep's `compute` line route, the measured one."""
    T = res["cfg"]["block_size"]

    def tok(v):
        return None if v is None else f"{v:,.0f} tokens = {v / T:.1f} rows"

    bf16 = ([("  the same with bf16 gradient reduction (the opt-in: half the gradient bytes)",
              tok(res["predicted_tokens_bf16_reduce"]))]
            if res.get("predicted_tokens_bf16_reduce") else [])
    return [(f"predicted: alpha-beta + FLOP/s (costs.hiding.{route}), fp32 gradient reduction",
             tok(res["predicted_tokens"])), *bf16,
            (f"predicted: alpha-beta + the sweep's {compute} line",
             tok(res["predicted_timed_tokens"]) or f"none: the {compute}'s fixed "
             f"{1e3 * res[f'{compute}_fixed_s']:.0f} ms alone outlasts the {traffic}"),
            (f"measured: {equal}",
             found(res["measured_tokens"], tok, res["extrapolated"], "the batch"))]


def ms_columns(*columns, fmt: str = ".1f") -> list:
    """table columns of seconds shown in ms: (heading, key) each."""
    return [(heading, lambda s, key=key: 1e3 * s[key], fmt) for heading, key in columns]


def group_rows(res: dict, x: str, text, route: str, formula: str, equal: str, over: str) -> list:
    """A group lab's crossover rows (overlap_tp's widths, overlap_cp's chunks): the FLOP/s route
    (costs.hiding.<route>), the same with alpha = 0 (its closed form), the measured one."""
    return [(f"predicted: alpha-beta + FLOP/s (costs.hiding.{route})", text(res[f"predicted_{x}"])),
            (f"  the same with alpha = 0: {formula}", text(res[f"predicted_{x}_no_alpha"])),
            (f"measured: {equal}", found(res[f"measured_{x}"], text, res["extrapolated"], over))]


def crossover_table(rows, unit: str, title: str) -> str:
    """The predicted and measured crossovers, one (name, value) row each."""
    return table(rows, [("crossover", 0), (unit, 1)], title=title)


def _positive(fig, letter: str) -> list:
    """Every positive number the figure's traces hold on axis `letter` ("x" or "y")."""
    vals = []
    for tr in fig.data:
        vals += [float(v) for v in (getattr(tr, letter, None) or ())
                 if isinstance(v, (int, float)) and v > 0]
    return vals


def log_frame(lo: float, hi: float, pad: float = 0.06) -> list:
    """A log axis's range, in log10 units as plotly wants it, framing lo..hi with `pad` of the
    span (at least a tenth of a decade) either side."""
    a, b = math.log10(lo), math.log10(hi)
    margin = max(pad * (b - a), 0.1)
    return [a - margin, b + margin]


def mark_crossovers(fig, res: dict, keys, label: str = "{name}: {value:,.0f}",
                    within: float = 2.0) -> None:
    """A dashed vertical line at each (key, name, color) crossover res holds, drawn as a trace
    named in the legend (plotly): an add_vline's annotation_text on a log axis lands at 10**value
    (plotly places annotations in log10 units but shapes in data units) and its autorange then
    ran to 1e113, the data in a sliver. The x axis is framed on the data; a crossover up to
    `within` times the data's log span beyond it widens the frame, one further off is named in
    the legend as off the plot, so that the data always fill most of the width."""
    xs, ys = _positive(fig, "x"), _positive(fig, "y")
    if not xs or not ys:
        return
    lo, hi = min(xs), max(xs)
    span = max(math.log10(hi / lo), 0.5)
    y0, y1 = min(ys), max(ys)
    for key, name, color in keys:
        v = res.get(key)
        if not v:
            continue
        text = label.format(name=name, value=v)
        near = -within * span <= math.log10(v / lo) <= (1 + within) * span
        if near:
            lo, hi = min(lo, v), max(hi, v)
        else:
            text += " (off the plot)"
        fig.add_scatter(x=[v, v], y=[y0, y1], mode="lines", name=text, hoverinfo="name",
                        line=dict(color=color, dash="dash", width=1.5))
    fig.update_xaxes(range=log_frame(lo, hi))


def ratio_figure(x, measured, model, names, res: dict, keys, label: str, xtitle: str,
                 ytitle: str, title: str, hline: dict, height: int = 480):
    """comm / compute against the swept size, measured and predicted (names), ratio 1 marked by
    a horizontal line (hline: its style) and the crossovers (mark_crossovers) (plotly)."""

    fig = go.Figure()
    fig.add_scatter(x=x, y=measured, name=names[0], mode="lines+markers")
    fig.add_scatter(x=x, y=model, mode="lines", name=names[1], line=dict(dash="dot"))
    fig.add_hline(y=1, line=dict(color="gray", **hline))
    fig.update_xaxes(type="log", title=xtitle)
    mark_crossovers(fig, res, keys, label)
    fig.update_yaxes(type="log", title=ytitle)
    phone_layout(fig, title, height)
    return fig


def phone_layout(fig, title: str, height: int) -> None:
    """Title and legend that fit a 390 px phone as well as a notebook: the title broken after
    its first colon, the legend in rows under the plot (on the right it would take the plot's
    width), no fixed width (the page sizes the figure)."""
    fig.update_layout(title=title.replace(": ", ":<br>", 1), height=height, autosize=True,
                      legend=dict(orientation="h", yanchor="top", y=-0.22, x=0),
                      margin=dict(l=60, r=20, t=70, b=40))


def gpt_parser(name: str, batches: str, rounds: int, rows) -> ArgParser:
    """lab_parser with --rows and --rounds, for a lab sweeping a GPT's per-rank `batches`."""
    p = lab_parser(name, nproc=2)
    p.add_argument("--rows", type=count, nargs="+", default=list(rows),
                   help=f"per-rank {batches} to sweep (sequences of 8 tokens); two or more")
    p.add_argument("--rounds", type=count, default=rounds,
                   help="timed steps per batch (interleaved)")
    return p


def parse_gpt(p: ArgParser, argv, op: str, sizes_kib, alone: str):
    """--n-embd and add_fit_options (`op`'s sizes) added to gpt_parser's p, argv parsed and
    checked (sweep_checks, gpt_checks)."""
    p.add_argument("--n-embd", type=count, default=512,
                   help="model width (a multiple of 8, the heads); 2 layers")
    add_fit_options(p, sizes_kib, f"{op} sizes for the alpha-beta fit, KiB; two or more")
    a = p.parse_args(list(argv))
    sweep_checks(p, a, alone, "--rows", a.rows, "batches", "--rows 1 4 16")
    gpt_checks(p, a)
    return a


def add_fit_options(p, sizes_kib, sizes_help: str) -> None:
    """--sizes-kib (sizes for the alpha-beta fit) and --json, every crossover lab's last two."""
    p.add_argument("--sizes-kib", type=count, nargs="+", default=list(sizes_kib), help=sizes_help)
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON here")


def sweep_checks(p, a, alone: str, flag: str, values, what: str, example: str) -> None:
    """One rank has no traffic to hide (`alone` says which); a sweep wants two sizes or more."""
    if a.nproc < 2:
        p.error(f"argument --nproc: {alone} on {a.nproc} rank; e.g. --nproc 2")
    if len(set(values)) < 2:
        p.error(f"argument {flag}: sweep at least two {what} (got {values}); e.g. {example}")


def gpt_checks(p, a) -> None:
    """The GPT labs' (overlap, overlap_zero3) fit sizes and width."""
    if len(set(a.sizes_kib)) < 2:
        p.error(f"argument --sizes-kib: fit needs two or more sizes (got {a.sizes_kib}); "
                f"e.g. --sizes-kib 64 4096")
    if a.n_embd % 8:
        p.error(f"argument --n-embd: must be a multiple of 8, the heads (got {a.n_embd}); "
                f"e.g. --n-embd 512")


def finish(name: str, measure, done, report, json_path: str | None) -> int:
    """Run measure(), say done(res) on the progress line; rank 0 prints report(res) and writes
    the result to json_path (if given)."""
    prog = Progress(name, total=1)
    res = measure()
    prog.done(done(res))
    if os.environ.get("RANK", "0") != "0":
        return 0
    print(report(res))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    return 0
