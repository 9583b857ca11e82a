"""Benchmark: ring attention (forward + backward) on a zig-zag split sequence, against the same
attention on the whole sequence in one process; how much of the ring's K/V traffic hides behind
compute; and the bytes each rank sent, counted by the kernel, against labkit.costs.context.

    labkit bench context [--cp 2 4] [--seq 1024] [--heads 4] [--dim 32] [--repeats 10]

Every measurement runs real processes (labkit.launch.run, Gloo), one thread each:

  time     wall time of one forward + backward (median over repeats, after a warm-up; the
           slowest rank's clock per repeat), as a ratio to one process running the same tiled
           attention (labkit.context.tiled_attention) and torch's F.scaled_dot_product_attention
           on the whole sequence, measured in the same run. On a CPU with fewer cores than
           ranks the ranks share the cores: a ratio says what splitting costs here (the
           communication, the merges, the sharing), not the speed-up a GPU cluster would see.
  hidden   per rank, the fraction of the ring's waiting for messages that overlap removes:
               hidden = 1 - exposed / standalone
           exposed: seconds the rank was blocked in wait() on ring attention's K/V and dK/dV
           sends and receives during one forward + backward (labkit.observe.commlog's `blocked`);
           standalone: the same, for the very same hops (same sizes, peers, tags, grouping into
           steps) posted and waited for at once with no compute between (transfer_only, timed
           after an untimed pass that leaves the ranks in step). ring_attention posts the next
           hop before it computes the current block, so the transfer can run meanwhile.
           1: the waits cost nothing; 0: as long as with no overlap; below 0: the rank waited
           longer than the bare transfer takes, for a neighbour still computing (ranks sharing
           cores run unevenly; backward's last dK/dV hop home starts only after the
           neighbour's last block), which is exposed time too. Posting (the calls that hand
           the buffers to Gloo, on the rank's own thread, so never hidden) is in neither and is
           reported on its own: the standalone pass's wall time minus its waits. Per pass
           (forward, backward) from medians over repeats; the total from their sums.
  bytes    payload the rank's TCP sockets sent during one forward + backward (observe.netcount:
           Gloo's data plus its small per-message headers), over labkit.costs.context's
           cp_ring_layer_bytes: (cp - 1) K/V chunks forward, (cp - 1) K/V + cp dK/dV backward.
"""
from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.cliargs import BadOption, bench_parser, count
from labkit.collectives import exchange
from labkit.context import ring_attention, split_sequence, tiled_attention
from labkit.costs.context import cp_ring_layer_bytes
from labkit.launch import device, run
from labkit.observe import commlog, netcount
from labkit.observe.measured import Measured
from labkit.table import table
from labkit.timing import now

LAYOUT = "zigzag"
FORWARD_WHERE = "ring attention k/v"                       # labkit.context.ring_attention's labels
BACKWARD_WHERE = ("ring attention backward k/v", "ring attention dk/dv")
ALONE_FORWARD, ALONE_BACKWARD = "alone: forward k/v", "alone: backward k/v + dk/dv"
TAG_K, TAG_V, TAG_DK, TAG_DV = 1, 2, 3, 4


def check_config(cp_list, seq: int, heads: int, dim: int, repeats: int) -> None:
    """ValueError (one line, what to change) for a configuration the bench cannot run."""
    for name, v in (("--seq", seq), ("--heads", heads), ("--dim", dim), ("--repeats", repeats)):
        if v < 1:
            raise ValueError(f"{name} must be 1 or more (got {v})")
    for cp in cp_list:
        if cp < 2:
            raise ValueError(f"--cp {cp}: ring attention needs at least 2 ranks")
        if seq % (2 * cp):
            raise ValueError(f"--seq {seq} is not divisible by 2*cp = {2 * cp} (cp={cp}): the "
                             f"zig-zag layout cuts the sequence into 2*cp chunks; use a multiple "
                             f"of {2 * cp}")


def _inputs(seq: int, heads: int, dim: int, dev):
    """q, k, v, dout for the whole sequence, the same on every rank (seeded). (1, H, T, d) each."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, seq, dim, generator=g).to(dev) for _ in range(4)]  # (1,H,T,d)


def _fwd_bwd(attn, q, k, v, dout):
    """One forward and backward of attn(q, k, v); returns out, (dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn(q, k, v)                                      # (1, H, T_local, d)
    out.backward(dout)
    return out.detach(), (q.grad, k.grad, v.grad)


def _sdpa(q, k, v):
    """torch's fused attention, causal. (B, H, T, d) -> (B, H, T, d)"""

    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _call_times(fn, repeats: int, dev) -> list:
    """Seconds of each of `repeats` calls of fn, after one warm-up call."""

    times = []
    for i in range(repeats + 1):                             # the first call is the warm-up
        t0 = now(dev)
        fn()
        if i:
            times.append(now(dev) - t0)
    return times


def one_process_job(seq: int, heads: int, dim: int, repeats: int) -> dict:
    """On one rank: seconds per forward + backward of tiled attention and of torch's SDPA."""

    torch.set_num_threads(1)
    dev = device()
    q, k, v, dout = _inputs(seq, heads, dim, dev)            # (1, H, T, d) each
    return {name: _call_times(lambda a=attn: _fwd_bwd(a, q, k, v, dout), repeats, dev)
            for name, attn in (("tiled", tiled_attention), ("sdpa", _sdpa))}


def transfer_only(k, v, group=None) -> None:
    """The ring's hops with no compute between: forward cp-1 K/V hops; backward cp-1 K/V hops,
    each posted with a dK/dV hop, then the last dK/dV hop home. Each step's messages are posted
    as one batch (labkit.collectives.exchange) and waited for at once. k, v: (B, Hk, T/cp, d).
    The messages are labelled ALONE_FORWARD and ALONE_BACKWARD in labkit.observe.commlog."""


    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    right, left = (rank + 1) % cp, (rank - 1) % cp

    def step(send, tags, where):
        recv = [torch.empty_like(t) for t in send]           # (B, Hk, T/cp, d) each
        ops = [(dist.irecv, t, left, group, tag) for t, tag in zip(recv, tags)]
        ops += [(dist.isend, t, right, group, tag) for t, tag in zip(send, tags)]
        for w in exchange(ops, where=where):
            w.wait()
        return recv

    cur = [k, v]
    for _ in range(cp - 1):
        cur = step(cur, (TAG_K, TAG_V), ALONE_FORWARD)
    cur, acc = [k, v], [torch.zeros_like(k), torch.zeros_like(v)]  # (B, Hk, T/cp, d)
    for s in range(cp):
        if s < cp - 1:
            got = step(cur + acc, (TAG_K, TAG_V, TAG_DK, TAG_DV), ALONE_BACKWARD)
            cur, acc = got[:2], got[2:]
        else:
            acc = step(acc, (TAG_DK, TAG_DV), ALONE_BACKWARD)


def _ring_call(q, k, v, dout, group=None):

    return _fwd_bwd(lambda q, k, v: ring_attention(q, k, v, group, layout=LAYOUT), q, k, v, dout)


def _reference(q, k, v, dout, rank: int, cp: int):
    """SDPA on the whole sequence, then this rank's zig-zag rows of out, dq, dk, dv."""

    out, grads = _fwd_bwd(_sdpa, q, k, v, dout)              # (1, H, T, d) each
    return [split_sequence(t, rank, cp, LAYOUT) for t in (out, *grads)]  # (1, H, T/cp, d) each


def ring_job(seq: int, heads: int, dim: int, repeats: int) -> dict:
    """On each rank of a cp group (the world): how far the result is from SDPA on the whole
    sequence, the bytes sent in one ring forward + backward (kernel count), and the timed
    repeats (_timed_repeats)."""


    torch.set_num_threads(1)
    dev, rank, cp = device(), dist.get_rank(), dist.get_world_size()
    whole = _inputs(seq, heads, dim, dev)                    # q, k, v, dout (1, H, T, d)
    q, k, v, dout = (split_sequence(t, rank, cp, LAYOUT) for t in whole)  # (1, H, T/cp, d)
    out, grads = _ring_call(q, k, v, dout)                   # also the warm-up
    ref = _reference(*whole, rank, cp)
    err = max(float((a - b).abs().max()) for a, b in zip((out, *grads), ref))
    dist.barrier()
    with netcount.socket_bytes() as wire:
        _ring_call(q, k, v, dout)
    res = {"rank": rank, "sent": wire.sent, "why_not": wire.reason, "max_err": err}
    res.update(_timed_repeats(q, k, v, dout, repeats, dev))
    return res


def _timed_repeats(q, k, v, dout, repeats: int, dev) -> dict:
    """Per repeat (after a warm-up): wall seconds of one ring forward + backward, its waits
    (forward, backward), the standalone hops' waits (forward, backward), and their posting."""


    res = {"seconds": [], "exposed": [], "standalone": [], "posting": []}
    for i in range(repeats + 1):                             # i = 0: warm-up
        dist.barrier()
        with commlog.record() as log:
            t0 = now(dev)
            _ring_call(q, k, v, dout)
            t1 = now(dev)
        dist.barrier()
        transfer_only(k, v)                                  # untimed: leaves the ranks in step
        with commlog.record() as alone:
            t2 = now(dev)
            transfer_only(k, v)
            t3 = now(dev)
        if i:
            res["seconds"].append(t1 - t0)
            res["exposed"].append((log.seconds(where=FORWARD_WHERE),
                                   sum(log.seconds(where=w) for w in BACKWARD_WHERE)))
            res["standalone"].append((alone.seconds(where=ALONE_FORWARD),
                                      alone.seconds(where=ALONE_BACKWARD)))
            res["posting"].append(t3 - t2 - alone.seconds())
    return res


def measure(cp_list=(2, 4), seq: int = 1024, heads: int = 4, dim: int = 32,
            repeats: int = 10) -> dict:
    """Run the one-process baselines and ring attention at each cp; return the bench's rows."""

    check_config(cp_list, seq, heads, dim, repeats)
    base = run(one_process_job, 1, args=(seq, heads, dim, repeats), echo=False)[0]
    base = {name: statistics.median(ts) for name, ts in base.items()}
    rows, ranks = [], []
    for cp in cp_list:
        res = run(ring_job, cp, args=(seq, heads, dim, repeats), echo=False)
        predicted = cp_ring_layer_bytes(1, seq, heads * dim, cp, bytes_per_element=4)["total"]
        per_rank = [_rank_row(cp, r, predicted) for r in res]
        ranks += per_rank
        rows.append(_cp_row(cp, res, per_rank, base, repeats))
    config = {"cp": list(cp_list), "seq": seq, "heads": heads, "dim": dim, "batch": 1,
              "dtype": "float32", "repeats": repeats, "layout": LAYOUT,
              "cores": os.cpu_count(), "threads_per_rank": 1}
    return {"rows": rows, "ranks": ranks, "one_process_seconds": base, "config": config}


def _cp_row(cp: int, res: list, per_rank: list, base: dict, repeats: int) -> dict:
    """One cp's summary: the slowest rank's median time and its ratios, error, hidden, bytes."""
    t = statistics.median(max(r["seconds"][i] for r in res) for i in range(repeats))
    ratios = [p["bytes_ratio"] for p in per_rank if p["bytes_ratio"] is not None]
    return {"cp": cp, "seconds": t, "vs_tiled": t / base["tiled"], "vs_sdpa": t / base["sdpa"],
            "max_err": max(r["max_err"] for r in res),
            "hidden_min": min(p["hidden"] for p in per_rank),
            "hidden_max": max(p["hidden"] for p in per_rank),
            "sent": [p["sent"] for p in per_rank], "predicted": per_rank[0]["predicted"],
            "bytes_ratio": max(ratios) if ratios else None, "why_not": res[0]["why_not"]}


def _rank_row(cp: int, r: dict, predicted: float) -> dict:
    """One rank's medians over repeats: exposed and standalone seconds per pass, hidden."""
    row = {"cp": cp, "rank": r["rank"]}
    for i, phase in enumerate(("forward", "backward")):
        row[f"exposed_{phase}"] = statistics.median(e[i] for e in r["exposed"])
        row[f"standalone_{phase}"] = statistics.median(a[i] for a in r["standalone"])
        row[f"hidden_{phase}"] = 1.0 - row[f"exposed_{phase}"] / row[f"standalone_{phase}"]
    row["exposed"] = row["exposed_forward"] + row["exposed_backward"]
    row["standalone"] = row["standalone_forward"] + row["standalone_backward"]
    row["hidden"] = 1.0 - row["exposed"] / row["standalone"]
    row.update(posting=statistics.median(r["posting"]), sent=r["sent"], predicted=predicted,
               bytes_ratio=Measured("bytes sent", r["sent"], predicted, counter="kernel TCP").ratio)
    return row


def _print(res: dict) -> None:

    c, base = res["config"], res["one_process_seconds"]
    x = lambda v: f"{v:.2f}x"                                # noqa: E731
    print(table(res["rows"], [
        "cp", ("ms / fwd+bwd", lambda r: 1e3 * r["seconds"], ".1f"),
        ("vs 1-process tiled", "vs_tiled", x), ("vs 1-process SDPA", "vs_sdpa", x),
        ("max |err|", "max_err", ".1e"),
        ("hidden (min..max rank)", lambda r: f"{r['hidden_min']:.2f}..{r['hidden_max']:.2f}"),
        ("sent/predicted (max rank)", "bytes_ratio",
         lambda v: "-" if v is None else f"{v:.3f}")],
        title=f"ring attention fwd+bwd, zig-zag, T={c['seq']} H={c['heads']} d={c['dim']} fp32, "
              f"median of {c['repeats']} (slowest rank); 1 process: tiled "
              f"{1e3 * base['tiled']:.1f} ms, SDPA {1e3 * base['sdpa']:.1f} ms. "
              + _sharing_note(max(c["cp"]), c["cores"])))
    _print_ranks(res["ranks"])


def _sharing_note(ranks: int, cores: int | None) -> str:
    if cores is not None and ranks > cores:
        return (f"One thread per rank, {ranks} ranks sharing {cores} CPU cores: ratios show "
                "overheads (communication, merges, sharing), not speed-up")
    return f"One thread per rank, a core each ({cores} cores): ratios show overheads and speed-up"


def _print_ranks(ranks: list) -> None:

    ms = lambda name, key: (name, lambda r: 1e3 * r[key], ".2f")  # noqa: E731
    count = lambda v: "-" if v is None else f"{v:,}"             # noqa: E731
    print(table(ranks, [
        "cp", "rank", ms("exposed fwd ms", "exposed_forward"),
        ms("standalone fwd ms", "standalone_forward"), ("hidden fwd", "hidden_forward", ".2f"),
        ms("exposed bwd ms", "exposed_backward"), ms("standalone bwd ms", "standalone_backward"),
        ("hidden bwd", "hidden_backward", ".2f"), ("hidden", "hidden", ".2f"),
        ms("posting ms", "posting"), ("sent bytes", "sent", count),
        ("predicted", "predicted", ",.0f"),
        ("ratio", "bytes_ratio", lambda v: "-" if v is None else f"{v:.3f}")],
        title="per rank, medians: hidden = 1 - exposed / standalone, where exposed = seconds "
              "blocked in wait() on ring attention's K/V (and, backward, dK/dV) messages in one "
              "fwd+bwd, standalone = the same for the same hops posted and waited with no "
              "compute between; posting (never hidden) = standalone wall time minus its waits. "
              "Bytes sent in one fwd+bwd: kernel count (labkit.observe.netcount) vs "
              "labkit.costs.context.cp_ring_layer_bytes"))


def options(argv=()):
    """(options, the arguments not taken), checked before any benchmark runs (labkit.bench)."""
    p = bench_parser("context", repeats=10)
    p.add_argument("--cp", type=count, nargs="+", default=[2, 4],
                   help="context-parallel degrees to measure")
    p.add_argument("--seq", type=count, default=1024, help="whole sequence length T")
    p.add_argument("--heads", type=count, default=4, help="attention heads")
    p.add_argument("--dim", type=count, default=32, help="head dimension d")
    a, rest = p.parse_known_args(list(argv or ()))
    try:
        check_config(a.cp, a.seq, a.heads, a.dim, a.repeats)
    except ValueError as err:
        raise BadOption(str(err)) from None
    return a, rest


def main(argv=()) -> dict:
    a, _ = options(argv)
    res = measure(a.cp, a.seq, a.heads, a.dim, a.repeats)
    _print(res)
    return res
