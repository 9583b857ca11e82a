"""Measure pipeline schedules on real processes, next to the formula and the simulator.

    from labkit.labs.pipeline import measure
    rows = measure.measure(P=4, specs=[("1f1b", 8, 1), ("gpipe", 8, 1)], pad=(0.004, 0.008))

One launch runs every spec (schedule, K, v) `repeats` times (after one warm-up run) and reports
medians over the repeats. For each, the row holds the measured step time and bubble (from the
executor's timeline, as labkit.pipeline.causality defines it: idle share of P x step time, waits
for messages counted as idle), its floors (the critical path of the measured durations, the
formula), every causality or floor violation of every repeat (`violations`: [] when none), and
the simulator's step time predicted from the measured forward and backward time (median) of
each stage and the measured latency of one message (`transfer_latency`): what remains between
measured and predicted is the executor's own overhead (Python, scheduling, a loaded machine).

`pad=(t_f, t_b)` seconds are slept after each forward and backward (before its send). On a laptop
the P ranks share a few cores, so real compute of one stage slows the others; the pad stands in for
each stage owning its own accelerator and makes the measured bubble comparable to the formula.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from labkit import costs
from labkit.launch import device, run
from labkit.model import GPTConfig
from labkit.observe import commlog, netcount
from labkit.observe.measured import Measured
from labkit.pipeline import causality, schedules
from labkit.pipeline.base import Action
from labkit.pipeline.executor import DEFAULT_CFG, GPT, make_batch, run_schedule
from labkit.pipeline.simulate import simulate
from labkit.pipeline.validate import is_local, needs, produces


def _job(specs, cfg, batch_size, pad, repeats):
    torch.set_num_threads(1)
    P = dist.get_world_size()
    model = GPT(cfg, seed=0).to(device())       # this rank's GPU under NCCL, else the CPU
    x, y = make_batch(batch_size, cfg)
    out = []
    for i, (name, K, v) in enumerate(specs):
        s = schedules.make(name, P, K, v)
        runs = []
        for r in range(repeats + (i == 0)):  # one extra first run warms up connections
            dist.barrier()
            res = run_schedule(s, model, x, y, pad=pad)
            if i > 0 or r > 0:
                runs.append(res["timeline"])
        out.append({"timelines": runs, "peak_in_flight": res["peak_in_flight"],
                    "peak_bytes": res["peak_activation_bytes"],
                    "peak_live_bytes": res["peak_live_bytes"],
                    "backend": dist.get_backend(), "device": str(device())})
    return out


def formula_bubble(name: str, P: int, K: int, v: int, pad, flush: bool = True):
    """labkit.costs' closed form for the schedule (with the executor's flush, or back to back),
    or None where it has none (zb-h2 for K < 2P-1, zb-v for K < 2P-1 or unequal times)."""
    return costs.pipeline.schedule_bubble(
        name, P, K, v, *((pad[0], pad[1], pad[1] / 2) if pad and sum(pad) > 0 else (1, 2, 1)),
        flush=flush)


def transfer_latency(s, timeline) -> float:
    """Median time from a message's send (producer's end) to its use, over receivers that were
    already waiting for it: the per-message latency of this executor on this machine."""
    by_stage = {}
    for e in sorted(timeline, key=lambda e: e["start"]):
        by_stage.setdefault(e["stage"], []).append(e)
    sent = {}
    for p, events in by_stage.items():
        for e in events:
            key = produces(s, p, Action(e["kind"], e["mb"], e["chunk"]))
            if key is not None and not is_local(s, key):  # a hand-over in a stage: no message
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
            repeats: int = 3, timeout: float = 300) -> list:
    """Rows per spec (schedule, K, v): measured (median over `repeats` steps) and predicted step
    time and bubble, the floors and the causality check of every repeat, peaks."""
    specs = [tuple(s) for s in specs]
    per_rank = run(_job, P, args=(specs, cfg, batch_size, pad, repeats), timeout=timeout,
                   echo=False)
    rows = []
    for i, (name, K, v) in enumerate(specs):
        sched = schedules.make(name, P, K, v)
        repeats_ = []
        for j in range(len(per_rank[0][i]["timelines"])):
            events = [e for r in per_rank for e in r[i]["timelines"][j]]
            t0 = min(e["start"] for e in events)
            timeline = [dict(e, start=e["start"] - t0, end=e["end"] - t0) for e in events]
            rep = causality.bubble_report(sched, timeline)
            rep["timeline"] = timeline
            rep["violations"] = (causality.check_causality(sched, timeline)
                                 + causality.check_bubble_floor(sched, timeline))
            repeats_.append(rep)
        mid = sorted(repeats_, key=lambda r: r["step"])[len(repeats_) // 2]   # the median step
        timeline = mid["timeline"]
        typical = {}  # median: one action slowed by a neighbour's process should not count K times
        for p in range(P):
            for kind in ("FBW" if sched.split else "FB"):
                for c in range(v):
                    d = sorted(e["end"] - e["start"] for e in timeline
                               if (e["stage"], e["kind"], e["chunk"]) == (p, kind, c))
                    typical[p, kind, c] = d[len(d) // 2]
        t_p2p = transfer_latency(sched, timeline)
        sim = simulate(sched, t_p2p=t_p2p, durations=typical)
        step = Measured("step time", statistics.median([r["step"] for r in repeats_]),
                        sim.makespan, "the executor's clocks", "s")
        rows.append({"P": P, "schedule": name, "K": K, "v": v,
                     "step_s": step.measured, "predicted_step_s": step.predicted,
                     "overhead": step.ratio, "t_p2p_s": t_p2p,
                     "bubble": statistics.median([r["bubble"] for r in repeats_]),
                     "bubbles": [r["bubble"] for r in repeats_],
                     "critical_path_floor": statistics.median([r["critical_path"]
                                                               for r in repeats_]),
                     "predicted_bubble": sim.bubble,
                     "formula_bubble": formula_bubble(name, P, K, v, pad),
                     "violations": [m for r in repeats_ for m in r["violations"]],
                     "dependencies": causality.count_dependencies(sched) * len(repeats_),
                     "peak_in_flight": [r[i]["peak_in_flight"] for r in per_rank],
                     "peak_bytes": [r[i]["peak_bytes"] for r in per_rank],
                     "peak_live_bytes": [r[i]["peak_live_bytes"] for r in per_rank],
                     "backend": per_rank[0][i]["backend"], "device": per_rank[0][i]["device"],
                     "timeline": timeline, "timelines": [r["timeline"] for r in repeats_]})
    return rows


def _messages_job(specs, cfg, batch_size):
    torch.set_num_threads(1)
    model = GPT(cfg, seed=0).to(device())
    x, y = make_batch(batch_size, cfg)
    out = []
    for name, K, v in specs:
        s = schedules.make(name, dist.get_world_size(), K, v)
        run_schedule(s, model, x, y)                      # warm-up: connections opened outside
        with netcount.socket_bytes() as kernel, commlog.record() as log:
            run_schedule(s, model, x, y)
        sends = log.select(op="send", where="pipeline")
        out.append({"sends": len(sends), "shapes": sorted({tuple(e.shape) for e in sends}),
                    "pipeline_bytes": sum(e.bytes for e in sends),
                    "logged_bytes": log.bytes(op="send"), "kernel_sent": kernel.sent,
                    "kernel_reason": kernel.reason})
    return out


def messages(P: int, specs, cfg: GPTConfig = DEFAULT_CFG, batch_size: int = 16) -> list:
    """Per spec (schedule, K, v), summed over stages: the pipeline's sends as the comm log saw
    them (count, message shapes, payload bytes), all sends logged (the tied-embedding exchange
    after the step too) and the bytes the kernel's TCP counters saw leave the processes
    (labkit.observe.netcount, a counter the executor does not write; None under NCCL)."""
    per_rank = run(_messages_job, P, args=([tuple(x) for x in specs], cfg, batch_size),
                   timeout=120, echo=False)
    rows = []
    for i, (name, K, v) in enumerate(specs):
        got = [r[i] for r in per_rank]
        sent = [g["kernel_sent"] for g in got]
        rows.append({"schedule": name, "K": K, "v": v, "sends": sum(g["sends"] for g in got),
                     "shapes": sorted({sh for g in got for sh in g["shapes"]}),
                     "pipeline_bytes": sum(g["pipeline_bytes"] for g in got),
                     "logged_bytes": sum(g["logged_bytes"] for g in got),
                     "kernel_sent": None if None in sent else sum(sent),
                     "kernel_reason": got[0]["kernel_reason"]})
    return rows


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def table(rows) -> str:
    """One line per row: step times (measured, simulated, their ratio), message latency, the
    bubble measured (median), simulated, its critical-path floor and the formula, peaks on stage 0
    and the largest peak of activation bytes over the stages (saved-tensor hooks)."""
    head = (f"{'P':>2} {'schedule':>11} {'K':>3} {'v':>2} {'step ms':>8} {'sim ms':>8} "
            f"{'overhead':>8} {'p2p ms':>6} {'bubble':>7} {'sim':>6} {'floor':>6} {'formula':>7} "
            f"{'peak mb':>8} {'peak KiB':>9} {'max KiB':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['P']:>2} {r['schedule']:>11} {r['K']:>3} {r['v']:>2} "
                     f"{r['step_s'] * 1e3:>8.1f} {r['predicted_step_s'] * 1e3:>8.1f} "
                     f"{r['overhead']:>7.2f}x {r['t_p2p_s'] * 1e3:>6.2f} "
                     f"{r['bubble']:>7.1%} {r['predicted_bubble']:>6.1%} "
                     f"{r['critical_path_floor']:>6.1%} {_pct(r['formula_bubble']):>7} "
                     f"{r['peak_in_flight'][0]:>8g} {r['peak_bytes'][0] / 1024:>9.0f} "
                     f"{max(r['peak_bytes']) / 1024:>8.0f}")
    return "\n".join(lines)
