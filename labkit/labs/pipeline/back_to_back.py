"""Measure pipeline steps back to back (no flush) against steps with a flush, on real processes.

    from labkit.labs.pipeline import back_to_back
    rows = back_to_back.measure(P=4, specs=[("zb-h2", 8, 1)], pad=(0.008, 0.016), steps=4)
    print(back_to_back.table(rows))

With a flush every step ends with all stages done before the next begins: here `steps` calls of
the executor's run_schedule with a dist.barrier() between them (the stand-in for the all-reduce
of the gradient norm that clipping needs). Back to back, each stage starts step i+1 as soon as
it is done with step i (optimizer post-validation, Qi et al. 2023, sec. 4): ONE call of
run_schedule on labkit.pipeline.simulate.repeat(s, steps), a batch of K*steps micro-batches of
the same size. That run is a real one: its loss and every gradient are compared with the
one-process reference on the same K*steps micro-batches (the executor accumulates gradients and
steps no optimizer either way, so the timing leaves the optimizer out both ways).

The period is read off the timeline, the same way for both (`period`): per stage, the time from
the end of step `first`'s last action to the end of step `last`'s, divided by the steps between;
the bubble is 1 - (that stage's busy time in those steps) / (period), over all stages together.
The default steps 1 .. steps-2 keep away from the first step's ramp and the last one's drain. With
a flush the period is a step's makespan: the flush itself (the barrier and the executor's setup
of the next step) is left out, as the simulator leaves it out, and reported apart (`between`);
counted, it would only raise the flush's bubble.

Beside the measured bubble, each row has the simulator's (`sim_*`) from a replay of each repeat
with every action taking its OWN measured time and every message the run's measured latency
(labkit.labs.pipeline.measure.transfer_latency), read with the same `period`; `mean_sim_*`: the
simulator fed one mean time per stage and kind (`simulate` with the flush,
`simulate.steady_state` back to back); and labkit.costs' closed form at the pads' times (None
where costs has none). Measured minus simulated is what the executor costs between actions
(posting and waiting for messages, waking up on a loaded machine), which the simulator leaves out.
`stretch`: the measured work per stage and step over the pads' (1 + the real compute's share;
well above 1 when the P ranks and other work share few cores).
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from labkit.labs.pipeline.measure import formula_bubble, transfer_latency
from labkit.launch import device, run
from labkit.model import GPTConfig
from labkit.pipeline import causality, schedules
from labkit.pipeline.executor import (
    GPT,
    compare_to_reference,
    make_batch,
    reference_step,
    run_schedule,
)
from labkit.pipeline.simulate import repeat, simulate, steady_state


def small_config(n_chunks: int) -> GPTConfig:
    """One block per chunk, narrow: the P ranks share a few cores and every millisecond of real
    compute is one a neighbour may wait for (and one more that varies from action to action,
    which a schedule with no slack, ZB-H2 back to back, pays as idle time); the pads stand in
    for the compute."""
    return GPTConfig(n_layer=n_chunks, n_embd=16, n_head=2, block_size=16)


def _job(specs, cfg, batch_size, pad, repeats, steps):
    torch.set_num_threads(1)
    P = dist.get_world_size()
    model = GPT(cfg, seed=0).to(device())
    x, y = make_batch(batch_size, cfg)                  # one step's batch: (B, T)
    xs, ys = make_batch(batch_size * steps, cfg)        # steps x B rows: (steps*B, T)
    out = []
    for i, (name, K, v) in enumerate(specs):
        s = schedules.make(name, P, K, v)
        r = repeat(s, steps)
        flush, b2b = [], []
        for rep in range(repeats + (i == 0)):   # one extra first run warms up connections
            timeline = []
            for step in range(steps):
                dist.barrier()                           # the flush
                res = run_schedule(s, model, x, y, pad=pad)
                timeline += [dict(e, mb=e["mb"] + step * K) for e in res["timeline"]]
            peak_flush = res["peak_in_flight"]
            dist.barrier()
            got = run_schedule(r, model, xs, ys, pad=pad)
            if i > 0 or rep > 0:
                flush.append(timeline)
                b2b.append(got["timeline"])
        out.append({"flush": flush, "b2b": b2b, "peak_flush": peak_flush,
                    "peak_b2b": got["peak_in_flight"], "loss": got["loss"], "grads": got["grads"]})
    return out


def period(timeline, K: int, steps: int, flush: bool = False, first: int = 1,
           last: int = None) -> dict:
    """Period and bubble of `steps` steps of K micro-batches (step of an action = mb // K), read
    off a timeline (dicts: stage, mb, start, end), over the steps first+1 .. last (n of them).
    Back to back (flush=False), per stage p: period_p = (end of its last action of step `last` -
    end of its last action of step `first`) / n. With a flush every stage's period is the mean
    makespan of those steps (first start to last end over all stages): the flush itself (a
    barrier, the executor's setup) is left out, as the simulator leaves it out; it is returned
    as `between`, the mean time from one step's last end to the next step's first start.
    busy_p = the summed durations of stage p's actions in those steps / n; the bubble is
    1 - sum(busy_p) / sum(period_p), the idle share of P x period."""
    last = steps - 2 if last is None else last
    if not 0 <= first < last < steps:
        raise ValueError(f"need 0 <= first < last < steps: got first={first}, last={last}, "
                         f"steps={steps}; use steps >= 4 for the default middle steps 1..steps-2")
    stages = sorted({e["stage"] for e in timeline})
    end, busy, lo, hi = {}, {p: 0.0 for p in stages}, {}, {}
    for e in timeline:
        p, i = e["stage"], e["mb"] // K
        end[p, i] = max(end.get((p, i), e["end"]), e["end"])
        lo[i], hi[i] = min(lo.get(i, e["start"]), e["start"]), max(hi.get(i, e["end"]), e["end"])
        if first < i <= last:
            busy[p] += e["end"] - e["start"]
    missing = [(p, i) for p in stages for i in range(first, last + 1) if (p, i) not in end]
    if missing:
        raise ValueError(f"stage {missing[0][0]} has no action in step {missing[0][1]}: is K={K} "
                         f"the micro-batches of ONE step, and steps={steps}?")
    n = last - first
    if flush:
        span = sum(hi[i] - lo[i] for i in range(first + 1, last + 1)) / n
        periods = [span] * len(stages)
    else:
        periods = [(end[p, last] - end[p, first]) / n for p in stages]
    busies = [busy[p] / n for p in stages]
    total = sum(periods)
    return {"period": total / len(stages), "busy": sum(busies) / len(stages),
            "bubble": 1.0 - sum(busies) / total if total > 0 else 0.0,
            "between": sum(lo[i] - hi[i - 1] for i in range(first + 1, last + 1)) / n,
            "periods": periods, "busies": busies}


def _mean_durations(s, timeline) -> dict:
    """{(stage, kind, chunk): mean duration}: the mean, not the median, so that the simulated
    stage does the same work (sum of durations) as the measured one; a slow stage (the output
    head's, a loaded core's) sets the period back to back."""
    out = {}
    for p in range(s.P):
        for kind in ("FBW" if s.split else "FB"):
            for c in range(s.v):
                d = [e["end"] - e["start"] for e in timeline
                     if (e["stage"], e["kind"], e["chunk"]) == (p, kind, c)]
                out[p, kind, c] = sum(d) / len(d)
    return out


def replay(s, timeline, K: int, steps: int, flush: bool, t_p2p: float = 0.0) -> list:
    """The simulator's timeline of the same steps with each action taking its own measured time
    (and each message t_p2p): `steps` separate steps of `s` laid end to end with the flush, one
    run of repeat(s, steps) without. What the run would have been without the executor's time
    between actions."""
    own = {(e["stage"], e["kind"], e["mb"], e["chunk"]): e["end"] - e["start"] for e in timeline}
    if not flush:
        return simulate(repeat(s, steps), t_p2p=t_p2p, durations=own).timeline
    out, t0 = [], 0.0
    for i in range(steps):
        step = {(p, kind, mb - i * K, c): d for (p, kind, mb, c), d in own.items()
                if mb // K == i}
        sim = simulate(s, t_p2p=t_p2p, durations=step)
        out += [dict(e, mb=e["mb"] + i * K, start=e["start"] + t0, end=e["end"] + t0)
                for e in sim.timeline]
        t0 += sim.makespan
    return out


def _zeroed(per_rank_timelines):
    events = [e for t in per_rank_timelines for e in t]
    t0 = min(e["start"] for e in events)
    return [dict(e, start=e["start"] - t0, end=e["end"] - t0) for e in events]


def _way(s, r, timelines, K, steps, flush):
    """Medians over repeats: measured period, bubble, busy, time between steps, and the same of
    each repeat's replay (`replay`); the median-period repeat's timeline."""
    reps = []
    for t in timelines:
        got = period(t, K, steps, flush)
        got["timeline"] = t
        got["violations"] = causality.check_causality(r, t)
        got["t_p2p"] = transfer_latency(r, t)
        got["sim"] = period(replay(s, t, K, steps, flush, got["t_p2p"]), K, steps, flush)
        reps.append(got)
    mid = sorted(reps, key=lambda g: g["period"])[len(reps) // 2]
    out = {key: statistics.median([g[key] for g in reps])
           for key in ("period", "busy", "bubble", "between", "t_p2p")}
    out.update(bubbles=[g["bubble"] for g in reps],
               sim_period=statistics.median([g["sim"]["period"] for g in reps]),
               sim_bubble=statistics.median([g["sim"]["bubble"] for g in reps]),
               violations=[m for g in reps for m in g["violations"]], timeline=mid["timeline"],
               busies=mid["busies"])
    return out


def measure(P: int, specs, steps: int = 4, pad=None, repeats: int = 3,
            cfg: GPTConfig = None, batch_size: int = None, timeout: float = 300) -> list:
    """One launch: each spec (schedule, K, v) run `repeats` times both ways, `steps` steps each,
    on batches of `batch_size` rows per step (default: the largest K, one row per micro-batch)
    of `cfg` (default: small_config, one block per chunk).
    Rows: measured period and bubble both ways (medians over repeats), simulated from the run's
    own durations both ways, the formula both ways, peaks held, causality violations ([] if none).
    Raises AssertionError when a back-to-back run's loss or a gradient differs from the
    one-process reference on the same K*steps micro-batches."""
    if steps < 4:
        raise ValueError(f"steps={steps}: use steps >= 4, so that steps 1..steps-2 (away from the "
                         f"ramp and the drain) hold at least one period")

    batch_size = batch_size or max(K for _, K, _ in specs)
    if batch_size < max(K for _, K, _ in specs):
        raise ValueError(f"batch_size={batch_size} cannot make K={max(K for _, K, _ in specs)} "
                         f"micro-batches per step; use batch_size >= K")
    specs = [tuple(x) for x in specs]
    cfg = cfg or small_config(P * max(v for _, _, v in specs))
    per_rank = run(_job, P, args=(specs, cfg, batch_size, pad, repeats, steps),
                   timeout=timeout, echo=False)
    ref = reference_step(cfg, batch_size * steps)
    rows = []
    for i, (name, K, v) in enumerate(specs):
        s = schedules.make(name, P, K, v)
        r = repeat(s, steps)
        got = [rk[i] for rk in per_rank]
        merged = {"loss": next(g["loss"] for g in got if g["loss"] is not None),
                  "grads": {n: t for g in got for n, t in g["grads"].items()}}
        compare_to_reference(merged, ref)        # raises, naming the first gradient that differs
        grad_error = max(float((merged["grads"][n] - t).abs().max())
                         for n, t in ref["grads"].items())
        ways = {}
        for way in ("flush", "b2b"):
            timelines = [_zeroed([g[way][j] for g in got]) for j in range(len(got[0][way]))]
            ways[way] = _way(s, r, timelines, K, steps, way == "flush")
            ways[way]["durations"] = _mean_durations(s, ways[way]["timeline"])
        fl, bb = ways["flush"], ways["b2b"]
        pad_work = K * sum(pad) if pad and sum(pad) > 0 else None   # slept per stage per step
        # the same with one mean time per (stage, kind, chunk): the simulator's own bookkeeping
        mean_flush = simulate(s, t_p2p=fl["t_p2p"], durations=fl["durations"])
        mean_b2b = steady_state(s, t_p2p=bb["t_p2p"], steps=steps, durations=bb["durations"])
        rows.append({
            "P": P, "schedule": name, "K": K, "v": v, "steps": steps, "pad": pad,
            "period_flush_s": fl["period"], "period_b2b_s": bb["period"],
            "bubble_flush": fl["bubble"], "bubble_b2b": bb["bubble"],
            "bubbles_flush": fl["bubbles"], "bubbles_b2b": bb["bubbles"],
            # the measured work per step over the pads' (P ranks on few cores: > 1)
            "stretch_flush": fl["busy"] / pad_work if pad_work else None,
            "stretch_b2b": bb["busy"] / pad_work if pad_work else None,
            "between_flush_s": fl["between"],
            "busy_per_stage_flush_s": fl["busies"], "busy_per_stage_b2b_s": bb["busies"],
            "sim_period_flush_s": fl["sim_period"], "sim_period_b2b_s": bb["sim_period"],
            "sim_bubble_flush": fl["sim_bubble"], "sim_bubble_b2b": bb["sim_bubble"],
            "mean_sim_bubble_flush": mean_flush.bubble, "mean_sim_bubble_b2b": mean_b2b["bubble"],
            "formula_flush": formula_bubble(name, P, K, v, pad),
            "formula_b2b": formula_bubble(name, P, K, v, pad, flush=False),
            "t_p2p_flush_s": fl["t_p2p"], "t_p2p_b2b_s": bb["t_p2p"],
            "peak_flush": [g["peak_flush"] for g in got], "peak_b2b": [g["peak_b2b"] for g in got],
            "violations": fl["violations"] + bb["violations"],
            "dependencies": causality.count_dependencies(r) * 2 * len(got[0]["b2b"]),
            "max_grad_error": grad_error,
            "timeline_flush": fl["timeline"], "timeline_b2b": bb["timeline"]})
    return rows


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def table(rows) -> str:
    """One line per row: period (ms) and bubble both ways, measured / simulated from the run's
    durations / formula, the flush's own time, the most micro-batches a stage held, causality."""
    head = (f"{'':>19}|{'with the flush':^38}|{'back to back':^31}|\n"
            f"{'schedule':>11} {'K':>3} {'v':>2} | {'period':>6} {'gap':>5} {'bubble':>6} "
            f"{'sim':>6} {'formula':>7} | {'period':>6} {'bubble':>6} {'sim':>6} {'formula':>7} | "
            f"{'held':>4} {'causal':>6}")
    lines = head.split("\n") + ["-" * len(head.split("\n")[1])]
    for r in rows:
        lines.append(
            f"{r['schedule']:>11} {r['K']:>3} {r['v']:>2} | {r['period_flush_s'] * 1e3:>6.1f} "
            f"{r['between_flush_s'] * 1e3:>5.1f} {r['bubble_flush']:>6.1%} "
            f"{r['sim_bubble_flush']:>6.1%} "
            f"{_pct(r['formula_flush']):>7} | {r['period_b2b_s'] * 1e3:>6.1f} "
            f"{r['bubble_b2b']:>6.1%} {r['sim_bubble_b2b']:>6.1%} {_pct(r['formula_b2b']):>7} | "
            f"{max(max(r['peak_flush']), max(r['peak_b2b'])):>4g} "
            f"{'yes' if not r['violations'] else len(r['violations']):>6}")
    lines.append("period: ms per step (middle steps); gap: ms between flushed steps (barrier, "
                 "setup), not counted; bubble: idle share of P x period; sim: the simulator "
                 "replaying the run, each action at its own measured time")
    return "\n".join(lines)
