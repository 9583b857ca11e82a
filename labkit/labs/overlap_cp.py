"""Lab 07, part 2: at what sequence per rank does ring attention's K/V hop hide? Predict, sweep.

    labkit run overlap_cp --nproc 2 [--chunks 16 32 64 128 256 512] [--json PATH]

On the same N processes (the CP group): (1) one ring hop (K and V sent right, received from the
left, as ring attention posts them) timed over sizes and fitted to t = alpha + bytes / bandwidth
(costs.comm.fit_alpha_beta); (2) per tokens per rank c, the block of attention a rank computes
while a hop is in flight (labkit.context.tiled.attend, the ring's own kernel, unmasked: 4 c^2 h
FLOPs), the hop alone, and ring_attention's forward with its blocked wait read by commlog
(labkit.labs.context.crossover). From (1) and the attention FLOP/s of (2) at the middle c,
costs.hiding.cp predicts the c at which the block takes as long as the hop; the measured
crossover is where the measured hop / block ratio falls through 1, a power law between the two
sizes around it (labkit.labs._crossover.first_crossing).
"""
from __future__ import annotations

import math
import statistics

from labkit.cliargs import count
from labkit.costs import comm, hiding
from labkit.labs import _crossover as cx
from labkit.labs import ran_on, rank_place
from labkit.labs._group_sweep import GroupSweep
from labkit.labs.context import crossover
from labkit.labs.intro import medians
from labkit.launch import run
from labkit.table import table

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank
CHUNKS = (16, 32, 64, 128, 256, 512)  # tokens per rank, s / cp
SIZES_KIB = (4, 64, 256, 1024, 2048)    # more hop sizes (K + V) for the alpha-beta fit: about
# the sweep's range (a Gloo hop of 4 MiB on loopback was 5x slower per byte here: it set the fit)
ACT_BYTES = 4                           # float32 on this CPU
LAB = GroupSweep("overlap_cp", "CP", "--chunks", CHUNKS,
                 "tokens per rank (s / cp) to sweep; two or more", "chunk", "{name}: {value:,.0f}",
                 "tokens per rank s/cp", "K/V hop / attention block",
                 "Ring attention on {nproc} ranks: below the crossover the K/V hop outlasts the "
                 "block")


def _measure(chunks, heads, head_dim, kv_heads, rounds, numels):
    """Rank side: lone hops over sizes first (nothing else running), then the sweep."""

    return dict(hops=crossover.hop_times(numels, repeats=max(9, rounds)),
                sweep=crossover.sweep(chunks, heads, head_dim, kv_heads, rounds),
                ran_on=rank_place())


def _slowest_median(per_rank, c, key):
    """Median over rounds of the slowest rank's seconds (a hop ends when both ends are done)."""
    rounds = len(per_rank[0]["sweep"][c][key])
    return statistics.median(max(r["sweep"][c][key][i] for r in per_rank) for i in range(rounds))


def measure(nproc: int = 2, chunks=CHUNKS, heads: int = 4, head_dim: int = 32,
            kv_heads: int | None = None, rounds: int = 3, sizes_kib=SIZES_KIB) -> dict:
    """Run both measurements and compare: the lab's whole result as a dict (JSON-ready)."""

    kv_heads = heads if kv_heads is None else kv_heads
    chunks = sorted(set(chunks))
    h, kv = heads * head_dim, kv_heads * head_dim
    numels = sorted({c * kv for c in chunks} | {k * 1024 // (2 * ACT_BYTES) for k in sizes_kib})
    per_rank = run(_measure, nproc, args=(chunks, heads, head_dim, kv_heads, rounds, numels))
    hops = [dict(r, bytes=2 * r["bytes"]) for r in medians([r["hops"] for r in per_rank], numels)]
    try:
        alpha, bw = comm.fit_alpha_beta([r["bytes"] for r in hops], [r["median"] for r in hops])
        flat = False
    except ValueError:              # no growth with size within the noise: latency alone
        alpha, bw, flat = statistics.median(r["median"] for r in hops), math.inf, True
    fit_err = max(abs(alpha + r["bytes"] / bw - r["median"]) / r["median"] for r in hops)
    mid = chunks[len(chunks) // 2]
    rate = crossover.block_flops(mid, heads, head_dim) / _slowest_median(per_rank, mid, "block")
    rows = []
    for c in chunks:
        block, hop = (_slowest_median(per_rank, c, k) for k in ("block", "hop"))
        nbytes = crossover.hop_bytes(c, kv_heads, head_dim, ACT_BYTES)
        flops = crossover.block_flops(c, heads, head_dim)
        model = alpha + nbytes / bw
        rows.append(dict(chunk=c, block=block, hop=hop, hop_bytes=nbytes, hop_model=model,
                         flops_per_s=flops / block, ratio=hop / block,
                         ratio_model=model / (flops / rate),
                         ring=_slowest_median(per_rank, c, "ring"),
                         wait=_slowest_median(per_rank, c, "wait")))
    pred = hiding.cp(nproc, h, kv, rate, bw, alpha, act_bytes=ACT_BYTES)
    bw_only = hiding.cp(nproc, h, kv, rate, bw, 0.0, act_bytes=ACT_BYTES)
    measured = cx.first_crossing(chunks, [r["hop"] for r in rows], [r["block"] for r in rows])
    return {"nproc": nproc, "heads": heads, "head_dim": head_dim, "kv_heads": kv_heads,
            "hidden": h, "kv": kv, "rounds": rounds, "act_bytes": ACT_BYTES, "rate_chunk": mid,
            "flops_per_s": rate, "alpha": alpha, "bandwidth": bw, "fit_max_residual": fit_err,
            "fit_flat": flat,
            "hops": hops, "rows": rows, "predicted_chunk": pred.value, "binds": pred.binds,
            "predicted_chunk_no_alpha": bw_only.value, "measured_chunk": measured,
            **cx.verdict(measured, pred.value, chunks, per_rank[0]["ran_on"])}


def report(res: dict) -> str:
    head, fit = cx.header(
        res, f" as one CP ring; attention with {res['heads']} query heads and {res['kv_heads']} "
             f"K/V heads of {res['head_dim']} (h = {res['hidden']}, kv = {res['kv']}), float32; "
             f"{ran_on(*res['ran_on'])}", f"an attention block at c = {res['rate_chunk']}",
        "one hop", "; hop time did not grow with size: alpha alone" if res["fit_flat"] else "",
        digits=2)
    rows = table(res["rows"], [
        ("tokens/rank c", "chunk"),
        ("block ms", lambda r: 1e3 * r["block"], ".2f"),
        ("GFLOP/s", lambda r: r["flops_per_s"] / 1e9, ".2f"),
        ("K/V KiB", lambda r: r["hop_bytes"] / 1024, ",.0f"),
        ("hop ms", lambda r: 1e3 * r["hop"], ".2f"),
        ("alpha-beta ms", lambda r: 1e3 * r["hop_model"], ".2f"),
        ("hop/block", "ratio", ".2f"),
        ("predicted", "ratio_model", ".2f"),
        ("ring fwd ms", lambda r: 1e3 * r["ring"], ".2f"),
        ("ring wait ms", lambda r: 1e3 * r["wait"], ".2f")],
        title="sequence-per-rank sweep: one hop's K/V send vs the block of attention under it "
              "(medians over rounds of the slowest rank)")

    def c(v):
        return None if v is None else f"{v:,.0f} tokens"

    cross = cx.crossover_table(
        cx.group_rows(res, "chunk", c, "cp", "kv/h e/2 C/bw", "hop = block", "c"),
        "tokens per rank s/cp", f"where a ring hop stops hiding ({res['binds']} binds)")
    tail = [f"measured / predicted: {res['ratio']:.2f}" if res["ratio"] else "",
            "ring wait: ring_attention's forward blocked on its K/V (commlog); at cp = 2 the hop "
            "runs under the causal diagonal block, half the full block's FLOPs"]
    return "\n".join([head, fit, "", rows, "", cross] + tail)


def figure(res: dict):
    """hop / block against tokens per rank, measured and predicted, crossovers marked (plotly)."""
    return LAB.figure(res)


def main(argv=()):
    p = LAB.parser()
    p.add_argument("--heads", type=count, default=4, help="query heads")
    p.add_argument("--head-dim", type=count, default=32, help="size of one head")
    p.add_argument("--kv-heads", type=count, help="K/V heads, dividing --heads (default: "
                   "--heads; fewer is grouped-query attention)")
    p.add_argument("--rounds", type=count, default=3, help="timed hops per size (interleaved)")
    cx.add_fit_options(p, SIZES_KIB, "more hop sizes (K + V) for the alpha-beta fit, KiB")
    a = p.parse_args(list(argv))
    cx.sweep_checks(p, a, "there is no ring", "--chunks", a.chunks, "sizes", "--chunks 64 512")
    if a.kv_heads is not None and a.heads % a.kv_heads:
        p.error(f"argument --kv-heads: {a.kv_heads} does not divide --heads {a.heads}; "
                f"e.g. --kv-heads 1")
    return cx.finish("overlap_cp", lambda: measure(a.nproc, a.chunks, a.heads, a.head_dim,
                                                   a.kv_heads, a.rounds, a.sizes_kib),
                     lambda res: f"swept {len(res['rows'])} sequence lengths x {a.rounds} rounds "
                                 f"on {a.nproc} ranks", report, a.json)
