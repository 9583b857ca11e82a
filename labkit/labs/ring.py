"""Lab 01: labkit's ring all-reduce, the parameter server and the built-in, timed and counted.

    labkit run ring --nproc 4 --sizes-mib 1 16
    labkit run ring --nproc 4 --sizes-mib 4 --bandwidth-mbs 100     # each rank's link limited
    torchrun --nproc-per-node 4 -m labkit run ring --sizes-mib 1 16  # one rank per process

Prints, per size and algorithm, the median time over repeats (a repeat's time is its slowest
rank's), the bytes the busiest rank sent and received as the kernel counted them on its TCP
sockets (labkit.observe.netcount: a counter the code under test does not write), and the formula's
bytes. With --bandwidth-mbs every rank's link is limited to that many MB/s each way
(labkit.shaped: emulated by pacing, since one host's loopback has no per-link limit), and the
formula's time is printed beside the measured one. The chapter's notebook calls `sweep`.
"""
import os
import statistics

import torch
import torch.distributed as dist

from labkit.cliargs import count, lab_parser, positive
from labkit.collectives import parameter_server_all_reduce, ring_all_reduce
from labkit.costs import comm
from labkit.labs import ran_on
from labkit.launch import device, run
from labkit.observe import netcount
from labkit.observe.measured import Measured
from labkit.progress import Progress
from labkit.shaped import Shaper
from labkit.timing import now

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank
ALGORITHMS = ("builtin", "ring", "parameter_server")


def _call(algorithm, x, p2p):


    if algorithm == "builtin":
        dist.all_reduce(x)
    elif algorithm == "ring":
        ring_all_reduce(x, p2p=p2p)
    else:
        parameter_server_all_reduce(x, p2p=p2p)


def time_and_count(numel, algorithms=ALGORITHMS, repeats=5, bandwidth=None) -> dict:
    """Rank side: seconds of each repeat of each algorithm on this rank (interleaved, each repeat
    started by a barrier), then one more call of each inside labkit.observe.netcount's counter.
    `bandwidth` (bytes/s): every timed call goes through a fresh labkit.shaped.Shaper link."""


    dev = device()
    n = dist.get_world_size()
    x = torch.ones(numel, device=dev)  # (numel,) float32

    def link():
        return Shaper(bandwidth).exchange if bandwidth else None

    for a in algorithms:  # warm-up: connections, allocations
        _call(a, x, None)
    seconds = {a: [] for a in algorithms}
    wrong = []
    for _ in range(repeats):
        for a in algorithms:  # interleaved: drifting load hits every algorithm alike
            x.fill_(1.0)
            p2p = link()
            dist.barrier()
            start = now(dev)
            _call(a, x, p2p)
            seconds[a].append(now(dev) - start)
            if x[0].item() != n or x[-1].item() != n:
                wrong.append(a)
    counted = {}
    for a in algorithms:  # unshaped: pacing changes when the bytes move, not how many
        dist.barrier()
        with netcount.socket_bytes() as c:
            _call(a, x, None)
        counted[a] = {"sent": c.sent, "received": c.received, "reason": c.reason}
    return {"seconds": seconds, "counted": counted, "wrong": sorted(set(wrong)),
            "backend": dist.get_backend(), "device": str(dev)}


def predicted_bytes(algorithm, nbytes, n) -> dict:
    """The formula's bytes: the busiest rank's sent and received, and all ranks' total sent."""
    if algorithm == "ring":
        per = comm.ring_bytes_sent_per_rank("all_reduce", nbytes, n)
        return {"max_sent": per, "max_received": per, "total_sent": n * per}
    if algorithm == "parameter_server":
        ps = comm.parameter_server_bytes(nbytes, n)
        return {"max_sent": ps["root_sent"], "max_received": ps["root_received"],
                "total_sent": ps["root_sent"] + (n - 1) * ps["other_sent"]}
    return {"max_sent": None, "max_received": None, "total_sent": None}  # Gloo's own algorithm


def predicted_seconds(algorithm, nbytes, n, bandwidth):
    """The bandwidth term alone (alpha = 0): what a limited link costs; None without a limit."""
    if not bandwidth or algorithm == "builtin":
        return None
    return comm.time_of(algorithm, nbytes, n, 0.0, bandwidth)


def rows_of(per_rank, n, nbytes, bandwidth=None) -> list:
    """One row per algorithm from every rank's time_and_count result."""
    rows = []
    for a in per_rank[0]["seconds"]:
        # a repeat lasts as long as its slowest rank
        reps = [max(r["seconds"][a][i] for r in per_rank)
                for i in range(len(per_rank[0]["seconds"][a]))]
        counted = [r["counted"][a] for r in per_rank]
        ok = all(c["sent"] is not None for c in counted)
        rows.append({"ranks": n, "bytes": nbytes, "algorithm": a, "bandwidth": bandwidth,
                     "seconds": statistics.median(reps), "repeats": reps,
                     "busbw": comm.busbw("all_reduce", nbytes, n, statistics.median(reps)),
                     "predicted_seconds": predicted_seconds(a, nbytes, n, bandwidth),
                     "max_sent": max(c["sent"] for c in counted) if ok else None,
                     "max_received": max(c["received"] for c in counted) if ok else None,
                     "total_sent": sum(c["sent"] for c in counted) if ok else None,
                     "not_counted": None if ok else counted[0]["reason"],
                     "predicted": predicted_bytes(a, nbytes, n),
                     "correct": not any(a in r["wrong"] for r in per_rank),
                     "backend": per_rank[0]["backend"], "device": per_rank[0]["device"]})
    return rows


def sweep(ranks, nbytes, repeats=5, bandwidth=None, algorithms=None) -> list:
    """Rows for every N in `ranks` (one launch each) on a buffer of `nbytes` float32 bytes.
    Without `bandwidth`: builtin, ring, parameter server; with it: ring and parameter server
    over links limited to `bandwidth` bytes/s (the built-in cannot be shaped)."""

    if algorithms is None:
        algorithms = ("ring", "parameter_server") if bandwidth else ALGORITHMS
    if bandwidth and "builtin" in algorithms:
        raise ValueError("the built-in dist.all_reduce cannot go through a shaped link")
    rows = []
    for n in ranks:
        # shaped links are an emulation for one host: Gloo, even where there are GPUs
        per_rank = run(time_and_count, n, args=(int(nbytes) // 4, tuple(algorithms), repeats,
                                                bandwidth), echo=False,
                       backend="gloo" if bandwidth else "auto")
        rows += rows_of(per_rank, n, int(nbytes) // 4 * 4, bandwidth)
    return rows


def _sizes_job(numels, algorithms, repeats):
    return [time_and_count(k, algorithms, repeats) for k in numels]


def size_sweep(n, sizes_bytes, repeats=5, algorithms=("builtin", "ring")) -> list:
    """Rows for every size on `n` ranks, in one launch (links as they are)."""

    numels = [max(1, int(b) // 4) for b in sizes_bytes]
    per_rank = run(_sizes_job, n, args=(numels, tuple(algorithms), repeats), echo=False)
    return [row for i, k in enumerate(numels)
            for row in rows_of([r[i] for r in per_rank], n, 4 * k)]


def main(argv=()):

    p = lab_parser("ring", nproc=4)
    p.add_argument("--sizes-mib", type=positive, nargs="+", default=[1, 16],
                   help="buffer sizes to all-reduce, MiB of float32")
    p.add_argument("--repeats", type=count, default=3, help="timed repeats per size (median)")
    p.add_argument("--bandwidth-mbs", type=positive, default=None,
                   help="limit each rank's link to this many MB/s (1e6 bytes/s), each way")
    args = p.parse_args(list(argv))
    bandwidth = args.bandwidth_mbs * comm.MB if args.bandwidth_mbs else None
    prog = Progress("ring", total=len(args.sizes_mib))
    rows = []
    for mib in args.sizes_mib:
        got = sweep([args.nproc], int(mib * comm.MiB), args.repeats, bandwidth)
        rows += got
        prog.done(f"{mib:g} MiB: " + ", ".join(
            f"{r['algorithm'].replace('_', ' ')} {r['seconds'] * 1e3:.2f} ms" for r in got))
    if os.environ.get("RANK", "0") == "0":
        print(table(rows))
    return 0


def ratio(got, want) -> str:
    """got / want as text; "-" where either is missing, "n.a." where the formula is 0 bytes (one
    rank: nothing to send, so a ratio has no meaning)."""
    if want is None or got is None:
        return "-"
    r = Measured("max bytes received by a rank", got, want, "kernel TCP", "bytes").ratio
    return "n.a." if r is None else f"{r:.3f}"


def table(rows) -> str:
    r0 = rows[0]
    link = (f"each link limited to {r0['bandwidth'] / comm.MB:g} MB/s (labkit.shaped)"
            if r0["bandwidth"] else "links as they are")
    lines = [f"all-reduce on {r0['ranks']} ranks, {ran_on(r0['backend'], r0['device'])}, {link}",
             f"{'size':>9} {'algorithm':>17} {'median ms':>9} {'formula ms':>10} "
             f"{'max bytes received by a rank':>29} {'formula':>12} {'ratio':>6}"]
    for r in rows:
        pred_t = r["predicted_seconds"]
        want = r["predicted"]["max_received"]
        got = r["max_received"]
        lines.append(
            f"{r['bytes'] / comm.MiB:>5.3g} MiB {r['algorithm']:>17} {r['seconds'] * 1e3:>9.2f} "
            f"{'-' if pred_t is None else f'{pred_t * 1e3:.2f}':>10} "
            f"{'(not countable)' if got is None else f'{got:,}':>29} "
            f"{'-' if want is None else f'{want:,.0f}':>12} "
            f"{ratio(got, want):>6}")
    if any(r["predicted"]["max_received"] == 0 for r in rows):
        lines.append("ratio n.a. where the formula predicts 0 bytes: one rank has no peer to "
                     "send to (run --nproc 2 or more to count the ring's bytes)")
    if r0["not_counted"]:
        lines.append(f"bytes not counted: {r0['not_counted']}")
    lines.append("bytes: counted by the kernel on each rank's TCP sockets (observe.netcount); "
                 "Gloo's own algorithm has no formula here")
    return "\n".join(lines)
