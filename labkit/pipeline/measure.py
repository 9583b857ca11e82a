"""Measure pipeline schedules on real processes, next to the formula and the simulator.

    from labkit.pipeline import measure
    rows = measure.measure(P=4, specs=[("1f1b", 8, 1), ("gpipe", 8, 1)], pad=(0.004, 0.008))

One launch runs every spec (schedule, K, v) `repeats` times (plus one warm-up run) and keeps the
fastest step. For each, the row holds the measured step time and bubble (from the executor's
timeline: idle share of P x step time, waits for messages counted as idle), the formula's
bubble, and the simulator's
step time predicted from the measured forward and backward time (median) of each stage and the
measured latency of one message (`transfer_latency`): what remains between measured and
predicted is the executor's own overhead (Python, scheduling, a loaded machine).

`pad=(t_f, t_b)` seconds are slept after each forward and backward (before its send). On a laptop the P ranks
share a few cores, so real compute of one stage slows the others; the pad stands in for each
stage owning its own accelerator and makes the measured bubble comparable to the formula.
"""
from __future__ import annotations

from labkit import costs
from labkit.launch import run
from labkit.model import GPTConfig
from labkit.pipeline import schedules
from labkit.pipeline.simulate import simulate, timeline_stats

DEFAULT_CFG = GPTConfig(n_layer=8, n_embd=32, n_head=4, block_size=32)


def _job(specs, cfg, batch_size, pad, repeats):
    import torch.distributed as dist

    import torch

    from labkit.launch import device
    from labkit.pipeline.executor import GPT, make_batch, run_schedule

    torch.set_num_threads(1)
    P = dist.get_world_size()
    model = GPT(cfg, seed=0).to(device())       # this rank's GPU under NCCL, else the CPU
    x, y = make_batch(batch_size, cfg)
    out = []
    for i, (name, K, v) in enumerate(specs):
        s = schedules.make(name, P, K, v)
        best = None
        for _ in range(repeats + (i == 0)):  # one extra first run warms up connections
            dist.barrier()
            r = run_schedule(s, model, x, y, pad=pad)
            ends = [e["end"] for e in r["timeline"]]
            starts = [e["start"] for e in r["timeline"]]
            span = [min(starts), max(ends)]
            gathered = [None] * P
            dist.all_gather_object(gathered, span)
            step = max(g[1] for g in gathered) - min(g[0] for g in gathered)
            if best is None or step < best[0]:
                best = (step, r["timeline"], r["peak_in_flight"], r["peak_activation_bytes"])
        out.append({"timeline": best[1], "peak_in_flight": best[2], "peak_bytes": best[3],
                    "backend": dist.get_backend(), "device": str(device())})
    return out


def transfer_latency(s, timeline) -> float:
    """Median time from a message's send (producer's end) to its use, over receivers that were
    already waiting for it: the per-message latency of this executor on this machine."""
    from labkit.pipeline.schedules import Action
    from labkit.pipeline.validate import needs, produces

    by_stage = {}
    for e in sorted(timeline, key=lambda e: e["start"]):
        by_stage.setdefault(e["stage"], []).append(e)
    sent = {}
    for p, events in by_stage.items():
        for e in events:
            key = produces(s, p, Action(e["kind"], e["mb"], e["chunk"]))
            if key is not None:
                sent[key] = e["end"]
    gaps = []
    for p, events in by_stage.items():
        for prev, e in zip([None] + events[:-1], events):
            key = needs(s, p, Action(e["kind"], e["mb"], e["chunk"]))
            if key in sent and (prev is None or prev["end"] <= sent[key]):
                gaps.append(e["start"] - sent[key])
    gaps.sort()
    return max(0.0, gaps[len(gaps) // 2]) if gaps else 0.0


def measure(P: int, specs, cfg: GPTConfig = DEFAULT_CFG, batch_size: int = 16, pad=None,
            repeats: int = 2, timeout: float = 300) -> list:
    """Rows per spec (schedule, K, v): measured and predicted step time and bubble, peaks."""
    specs = [tuple(s) for s in specs]
    per_rank = run(_job, P, args=(specs, cfg, batch_size, pad, repeats), timeout=timeout, echo=False)
    rows = []
    for i, (name, K, v) in enumerate(specs):
        events = [e for r in per_rank for e in r[i]["timeline"]]
        t0 = min(e["start"] for e in events)
        timeline = [dict(e, start=e["start"] - t0, end=e["end"] - t0) for e in events]
        step, busy = timeline_stats(timeline, P)
        typical = {}  # median: one action slowed by a neighbour's process should not count K times
        for p in range(P):
            for kind in "FB":
                for c in range(v):
                    d = sorted(e["end"] - e["start"] for e in timeline
                               if (e["stage"], e["kind"], e["chunk"]) == (p, kind, c))
                    typical[p, kind, c] = d[len(d) // 2]
        sched = schedules.make(name, P, K, v)
        t_p2p = transfer_latency(sched, timeline)
        sim = simulate(sched, t_p2p=t_p2p, durations=typical)
        rows.append({"P": P, "schedule": name, "K": K, "v": v, "step_s": step,
                     "predicted_step_s": sim.makespan, "t_p2p_s": t_p2p,
                     "bubble": 1 - sum(busy) / (P * step),
                     "predicted_bubble": sim.bubble,
                     "formula_bubble": costs.pipeline.bubble_fraction(P, K, v),
                     "peak_in_flight": [r[i]["peak_in_flight"] for r in per_rank],
                     "peak_bytes": [r[i]["peak_bytes"] for r in per_rank],
                     "backend": per_rank[0][i]["backend"], "device": per_rank[0][i]["device"],
                     "timeline": timeline})
    return rows


def table(rows) -> str:
    head = (f"{'P':>2} {'schedule':>11} {'K':>3} {'v':>2} {'step ms':>8} {'sim ms':>8} "
            f"{'overhead':>8} {'p2p ms':>6} {'bubble':>7} {'formula':>7} {'peak mb':>8} {'peak KiB':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['P']:>2} {r['schedule']:>11} {r['K']:>3} {r['v']:>2} "
                     f"{r['step_s'] * 1e3:>8.1f} {r['predicted_step_s'] * 1e3:>8.1f} "
                     f"{r['step_s'] / r['predicted_step_s']:>7.2f}x {r['t_p2p_s'] * 1e3:>6.2f} {r['bubble']:>7.1%} "
                     f"{r['formula_bubble']:>7.1%} {r['peak_in_flight'][0]:>8g} "
                     f"{r['peak_bytes'][0] / 1024:>9.0f}")
    return "\n".join(lines)
