"""Lab 08b: MoE dispatch as it runs: the all-to-all under skewed routing against the uniform
α-β model, and the dispatch overlapped with expert compute.

    labkit run moe_dispatch --nproc 4
    labkit run moe_dispatch --nproc 4 --tokens 2048 --hidden 128 --skews 0 1 2

Every rank holds `--tokens` tokens of `--hidden` fp32 values and routes each to k = 2 of
E = 2·N experts (two per rank) drawn from a Zipf popularity: expert e with probability
∝ 1/(e+1)^s (s = 0 is uniform; the popular experts sit on the low ranks, as a router that
favours a few experts would put them). First the ranks fit an α-β line to all_to_all_single
with equal splits (t = α(N-1) + bytes a rank sends / link, α fitted). Every rank has one link of
`--link-mb-s` each way (labkit.shaped paces its sends and receives: one host's loopback has no
per-rank link, and a cluster's NIC is what skew overloads). Then, per skew, the dispatch all-to-all
with the splits the routing gives, timed (the slowest rank, median of repeats), against two
predictions: the uniform model the chapter derives (every rank sends (N-1)/N·k·T·h values) and
the skewed one (labkit.costs.moe.alltoall_seconds_skewed: the rank that sends or receives the
most sets the time). Last, at the largest skew, the dispatch in two halves with the second
half's all-to-all in flight while the experts compute the first half (DeepEP's and Megatron's
"overlap the all-to-all with expert compute"), against dispatch-then-compute.
"""
import os
import statistics
import threading

import torch
import torch.distributed as dist

from labkit.cliargs import BadOption, count, lab_parser
from labkit.costs import moe
from labkit.labs._crossover import fit_line
from labkit.launch import run
from labkit.moe.alltoall import all_to_all
from labkit.progress import Progress
from labkit.shaped import Shaper
from labkit.table import table
from labkit.timing import now

BACKEND = "gloo"   # a CPU lesson: emulated per-rank links (labkit.shaped is Gloo-only)
K = 2


def expert_probs(n_expert: int, skew: float) -> list:
    """Zipf popularity: p_e ∝ 1/(e+1)^skew (skew 0: uniform)."""
    w = [1.0 / (e + 1) ** skew for e in range(n_expert)]
    return [x / sum(w) for x in w]


def route_counts(tokens: int, n_expert: int, skew: float, seed: int) -> list:
    """Rows this rank sends to each expert: k distinct experts per token, drawn by popularity."""

    g = torch.Generator().manual_seed(seed)
    probs = torch.tensor(expert_probs(n_expert, skew))  # cpu: Gloo lab; (E,)
    probs = probs.expand(tokens, n_expert)                                       # (T, E)
    picks = torch.multinomial(probs, K, replacement=False, generator=g)          # (T, k)
    return torch.bincount(picks.reshape(-1), minlength=n_expert).tolist()        # (E,)


def dispatch_job(tokens: int, hidden: int, skews, sizes_kib, repeats: int,
                 link: float) -> dict:
    """Rank side, every rank with one link of `link` bytes/s each way (labkit.shaped: a NIC,
    which one host's loopback does not have): the α-β fit's points, and per skew the splits and
    the dispatch all-to-all's seconds; the overlap comparison at the last skew."""



    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    nic = Shaper(link)

    def dispatch(x, recv, send):     # every message posted at once, each paced on its links
        return all_to_all(x, recv, send, schedule="naive", p2p=nic.exchange)

    def timed(fn) -> float:
        ts = []
        for _ in range(repeats):
            dist.barrier()
            t0 = now()
            fn()
            ts.append(now() - t0)
        return statistics.median(ts)

    fit = []
    for kib in sizes_kib:                        # equal splits: the α-β line
        per_peer = max(1, int(kib * 1024 // 4))
        x, even = torch.ones(n * per_peer), [per_peer] * n  # cpu: Gloo lab
        fit.append({"sent": (n - 1) * per_peer * 4,
                    "seconds": timed(lambda x=x, even=even: dispatch(x, even, even))})
    runs = []
    for skew in skews:
        per_expert = route_counts(tokens, 2 * n, skew, seed=1000 * rank + int(10 * skew))
        send = [per_expert[2 * r] + per_expert[2 * r + 1] for r in range(n)]   # rows per rank
        counts_in = torch.empty(n, dtype=torch.long)  # cpu: Gloo lab
        dist.all_to_all_single(counts_in, torch.tensor(send))  # cpu: Gloo lab; the counts go first
        recv = counts_in.tolist()
        x = torch.randn(sum(send), hidden)  # cpu: Gloo lab; (rows, h)
        seconds = timed(lambda x=x, recv=recv, send=send: dispatch(x, recv, send))
        runs.append({"skew": skew, "send": send, "recv": recv, "seconds": seconds})
    overlap = _overlap(runs[-1]["send"], runs[-1]["recv"], hidden, timed, dispatch)
    return {"fit": fit, "runs": runs, "overlap": overlap}


def _overlap(send, recv, hidden: int, timed, dispatch) -> dict:
    """Dispatch then compute, against the second half's all-to-all running on a thread of its
    own (a GPU's communication stream, DeepEP's SMs) while the first half's expert MLP runs:
    seconds of each, the same rows and the same compute."""


    w1 = torch.randn(hidden, 4 * hidden) / hidden ** 0.5  # cpu: Gloo lab; (h, 4h)
    w2 = torch.randn(4 * hidden, hidden) / (4 * hidden) ** 0.5  # cpu: Gloo lab; (4h, h)

    def experts(rows):
        return torch.relu(rows @ w1) @ w2                                     # (rows, h)

    halves = [[s // 2 for s in send], [s - s // 2 for s in send]]
    halves_in = [[r // 2 for r in recv], [r - r // 2 for r in recv]]
    xs = [torch.randn(sum(h), hidden) for h in halves]  # cpu: Gloo lab

    def serial():
        outs = [dispatch(x, r, s) for x, r, s in zip(xs, halves_in, halves)]
        for out in outs:
            experts(out)

    def overlapped():
        first = dispatch(xs[0], halves_in[0], halves[0])
        box = {}
        second = threading.Thread(target=lambda: box.update(
            out=dispatch(xs[1], halves_in[1], halves[1])))
        second.start()                            # the second half travels ...
        experts(first)                            # ... while the experts run the first
        second.join()
        experts(box["out"])

    rows = [torch.randn(sum(h), hidden) for h in halves_in]  # cpu: Gloo lab
    return {"serial": timed(serial), "overlapped": timed(overlapped),
            "compute": timed(lambda: [experts(r) for r in rows])}


def report(got: list, hidden: int, link: float) -> dict:
    """α from the equal-split all-to-alls with β fixed to the emulated link (t = α(N-1) +
    bytes/link, least squares in α alone), the line's own bandwidth beside it, and per skew the
    measured time (slowest rank) beside both models at that α and the link's bandwidth."""

    n = len(got)
    points = [(p["sent"], max(g["fit"][i]["seconds"] for g in got))
              for i, p in enumerate(got[0]["fit"])]
    alpha = max(0.0, sum(t - b / link for b, t in points) / len(points) / (n - 1))
    _, slope = fit_line([b for b, _ in points], [t for _, t in points])
    rows = []
    for i, one in enumerate(got[0]["runs"]):
        sent = [g["runs"][i]["send"] for g in got]        # sent[src][dst] rows
        matrix = [[r * hidden * 4 if src != dst else 0 for dst, r in enumerate(row)]
                  for src, row in enumerate(sent)]
        per_rank = sum(map(sum, matrix)) / n
        loads = [sum(sent[src][dst] for src in range(n)) for dst in range(n)]
        rows.append({"skew": one["skew"], "imbalance": max(loads) / (sum(loads) / n),
                     "measured": max(g["runs"][i]["seconds"] for g in got),
                     "uniform": moe.alltoall_seconds_skewed(moe.uniform_matrix(per_rank, n),
                                                            alpha, link),
                     "skewed": moe.alltoall_seconds_skewed(matrix, alpha, link)})
    ov = {k: max(g["overlap"][k] for g in got) for k in got[0]["overlap"]}
    return {"alpha": alpha, "line_bandwidth": 1 / slope if slope > 0 else None, "rows": rows,
            "overlap": ov}


def skew_table(res: dict) -> str:
    """report()'s rows as the lab prints them."""

    return table(res["rows"], [
        ("Zipf s", "skew", ".1f"), ("max/mean load", "imbalance", ".2f"),
        ("measured ms", lambda r: 1e3 * r["measured"], ".2f"),
        ("uniform model ms", lambda r: 1e3 * r["uniform"], ".2f"),
        ("skewed model ms", lambda r: 1e3 * r["skewed"], ".2f"),
        ("measured/uniform", lambda r: r["measured"] / r["uniform"], ".2f"),
        ("measured/skewed", lambda r: r["measured"] / r["skewed"], ".2f")],
        title="dispatch all-to-all under skewed routing (slowest rank, median)")


def hidden_share(overlap: dict) -> float:
    """Of the all-to-all's exposed time in dispatch-then-compute, the share overlapping hid."""
    comm = max(overlap["serial"] - overlap["compute"], 1e-12)
    return min(1.0, max(0.0, (overlap["serial"] - overlap["overlapped"]) / comm))


def overlap_text(res: dict, skew: float) -> str:
    ov = res["overlap"]
    return (f"uniform model: every rank sends (N-1)/N of its k·T rows (the chapter's formula); "
            f"skewed model: labkit.costs.moe.alltoall_seconds_skewed, the busiest rank's bytes in "
            f"or out. Overlap at s = {skew:g}: dispatch then compute {ov['serial'] * 1e3:.2f} ms, "
            f"second half in flight during the first half's experts {ov['overlapped'] * 1e3:.2f}"
            f" ms, compute alone {ov['compute'] * 1e3:.2f} ms: {hidden_share(ov):.0%} of the "
            f"all-to-all's time hidden (at most the first half's compute can hide the second "
            f"half's transfer)")


def main(argv=()):
    # here, not at the top: `labkit list` and bad options import no torch

    p = lab_parser("moe_dispatch", nproc=4)
    p.add_argument("--tokens", type=count, default=1024, help="tokens per rank")
    p.add_argument("--hidden", type=count, default=256, help="hidden size h (fp32 values)")
    p.add_argument("--skews", type=float, nargs="+", default=[0.0, 0.5, 1.0, 1.5, 2.0],
                   help="Zipf exponents of the experts' popularity (0: uniform)")
    p.add_argument("--sizes-kib", type=float, nargs="+", default=[16, 64, 256, 1024],
                   help="KiB per peer of the equal-split all-to-alls the α-β line is fitted to")
    p.add_argument("--repeats", type=count, default=5, help="timed repeats (median)")
    p.add_argument("--link-mb-s", type=float, default=100.0,
                   help="each rank's link, MB/s each way (emulated: labkit.shaped)")
    a = p.parse_args(list(argv))
    if a.nproc < 2:
        raise BadOption(f"--nproc {a.nproc}: an all-to-all needs peers; use --nproc 4")
    if any(s < 0 for s in a.skews):
        raise BadOption(f"--skews {' '.join(map(str, a.skews))}: exponents are >= 0; "
                        "use --skews 0 1 2")
    if not a.link_mb_s > 0:
        raise BadOption(f"--link-mb-s {a.link_mb_s}: a link needs a bandwidth; use --link-mb-s 100")
    if len(a.sizes_kib) < 2 or any(s <= 0 for s in a.sizes_kib):
        raise BadOption("--sizes-kib needs two or more sizes > 0 to fit a line; "
                        "use --sizes-kib 16 256")
    prog = Progress("moe_dispatch", total=1)
    got = run(dispatch_job, a.nproc, args=(a.tokens, a.hidden, a.skews, a.sizes_kib, a.repeats,
                                           a.link_mb_s * 1e6), backend=BACKEND, timeout=300)
    prog.done(f"α-β fit, {len(a.skews)} routings and the overlap on {a.nproc} ranks")
    if os.environ.get("RANK", "0") != "0":
        return 0
    res = report(got, a.hidden, a.link_mb_s * 1e6)
    print(f"{a.nproc} ranks (backend gloo, device cpu), each with a {a.link_mb_s:g} MB/s link "
          f"(labkit.shaped); {a.tokens} tokens per rank, top-{K} of {2 * a.nproc} experts, "
          f"h = {a.hidden} fp32; equal-split all-to-alls: α = {res['alpha'] * 1e6:.0f} µs per "
          f"peer at the link's bandwidth (a free line through them: "
          f"{(res['line_bandwidth'] or 0) / 1e6:,.0f} MB/s, every rank busy at once)")
    print(skew_table(res))
    print(overlap_text(res, a.skews[-1]))
    return 0
