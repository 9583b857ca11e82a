"""Benchmark: forward + backward time of a TP MLP and a TP GPT block at TP = 1, 2, 4, and the
bytes of every all-reduce measured on real processes against the formula b*s*h elements.

    labkit bench tp [--tps 1 2 4] [--hidden 256] [--batch 8] [--seq 64] [--repeats 10]

Times are medians on rank 0 (with a barrier around each step) and reported as a ratio to TP=1
measured in the same run. On a CPU with a core or two per rank this measures the communication
overhead of TP, not its speed-up: ranks share cores, Gloo goes through the kernel's loopback.
"""
from __future__ import annotations

from labkit.cliargs import BadOption, bench_parser, count
from labkit.costs import tensor_parallel as tpc
from labkit.labs.tp.measure import count_layer_comm, time_layers
from labkit.table import table


def options(argv=()):
    """(options, the arguments not taken), checked before any benchmark runs (labkit.bench)."""
    p = bench_parser("tp", repeats=10)
    p.add_argument("--tps", type=count, nargs="+", default=[1, 2, 4],
                   help="tensor-parallel degrees to measure")
    p.add_argument("--hidden", type=count, default=256, help="hidden size")
    p.add_argument("--heads", type=count, default=8, help="attention heads")
    p.add_argument("--batch", type=count, default=8, help="sequences per step")
    p.add_argument("--seq", type=count, default=64, help="tokens per sequence")
    a, rest = p.parse_known_args(list(argv or ()))
    if a.hidden % a.heads:
        raise BadOption(f"--hidden {a.hidden} is not divisible by --heads {a.heads}; e.g. "
                        f"--hidden {a.heads * 32}")
    for tp in a.tps:
        if a.heads % tp:
            raise BadOption(f"--tps {tp}: the {a.heads} heads do not split over {tp} ranks; "
                            f"use a divisor of --heads, e.g. 2")
    return a, rest


def main(argv=()) -> dict:

    a, _ = options(argv)
    b, s, h = a.batch, a.seq, a.hidden
    rows = time_layers(tuple(a.tps), b=b, s=s, h=h, n_head=a.heads, repeats=a.repeats)
    comm_rows = []
    for tp in a.tps:
        if tp == 1:
            continue
        events = count_layer_comm(tp, b=b, s=s, h=h, n_head=a.heads)
        measured = sum(e["measured_bytes"] for e in events)
        predicted = tpc.layer_allreduce_bytes(b, s, h, 4)
        per_layer = tpc.allreduces_per_layer()
        comm_rows.append({"tp": tp, "allreduces": len(events),
                          "predicted_allreduces": per_layer,
                          "measured_bytes": measured, "predicted_bytes": predicted,
                          "exact": measured == predicted and len(events) == per_layer,
                          "sent_per_rank_ring": tpc.layer_bytes_sent_per_rank(b, s, h, tp, 4)})
    print(table(rows, [("tp", "tp"), ("kind", "kind"), ("ms", lambda r: r["seconds"] * 1e3, ".3f"),
                       ("vs TP=1", "vs_tp1", ".2f")],
                title=f"one layer fwd+bwd, b={b} s={s} h={h} fp32, median of {a.repeats} (rank 0)"))
    print()
    print(table(comm_rows, [("tp", "tp"), ("count", "allreduces"), ("measured B", "measured_bytes"),
                            ("predicted B", "predicted_bytes"), ("exact", "exact"),
                            ("ring sent/rank B", "sent_per_rank_ring", ".0f")],
                title="all-reduce bytes per layer (fwd+bwd): measured vs 4 * b*s*h*4 bytes"))
    return {"rows": rows, "comm": comm_rows, "config": {"b": b, "s": s, "h": h}}
