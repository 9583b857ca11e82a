"""Is a measured pipeline timeline possible? Causality and the bubble floor, checked.

    from labkit.pipeline import causality
    causality.check_causality(schedule, timeline)     # [] when no action started too early
    causality.bubble_report(schedule, timeline)       # measured bubble, its two floors
    causality.check_bubble_floor(schedule, timeline)  # [] when the bubble is on or above its floors

`timeline`: dicts with stage, kind, mb, chunk, start, end (seconds on one clock; the executor's
clock is perf_counter, CLOCK_MONOTONIC on Linux: one clock for every process of a machine).

What must have ENDED before an action STARTS (`depends_on`):
- F of micro-batch m on global chunk g: F of m on chunk g-1 (its input activation);
- B of m on chunk g: B of m on chunk g+1 (its output's gradient) and F of m on chunk g (the
  activations it differentiates);
- on every stage, the action before it (one action at a time).

The measured bubble (the definition chapter 05 uses): the step runs from the first start to the
last end over all stages, T; stage p is busy for the sum of its actions' (end - start), W_p; the
bubble is the idle share of the P x T stage-seconds, 1 - sum_p W_p / (P T). Waiting for a message
and the executor's own per-action overhead count as idle.

Two floors under it:
- `critical_path`: with each action taking its measured time, no execution that respects the
  dependencies above can end before the longest chain of them, T_cp (labkit.pipeline.validate's
  replay, no transfer time). T >= T_cp, so bubble >= 1 - W / (P T_cp), for any durations. With
  equal durations it IS the formula; with measured ones it is the formula's generalisation. A
  timeline below it has broken a dependency (or its clocks disagree).
- `formula`: (P-1)/(vK+P-1) for GPipe, 1F1B and interleaved 1F1B. It assumes every action of a
  kind takes the same time on every stage. Measured times are never quite equal (a stage with
  the output head and the loss, jitter of a few percent), and a run whose ramp actions happen to
  be short can sit slightly under it while breaking nothing, so the formula is checked as a
  floor only where it is a theorem for any durations: K = 1, where all 2vP actions form one chain
  (T >= W, bubble >= (P-1)/P). Elsewhere compare it, do not assert it.
"""
from __future__ import annotations

from labkit import costs
from labkit.pipeline.base import Action, Schedule
from labkit.pipeline.validate import replay

FORMULA_SCHEDULES = ("gpipe", "1f1b", "interleaved")


def depends_on(s: Schedule, stage: int, a: Action) -> list:
    """[(stage, Action)] that must end before `a` on `stage` starts (data dependencies only; the
    previous action on the same stage is added by check_causality)."""
    g = s.global_chunk(stage, a.chunk)
    if a.kind == "W":  # the weight gradient resumes from what this stage's B computed
        return [(stage, Action("B", a.mb, a.chunk))]
    if a.kind == "F":
        return [] if g == 0 else [(s.stage_of(g - 1), Action("F", a.mb, s.local_chunk(g - 1)))]
    deps = [(stage, Action("F", a.mb, a.chunk))]
    if g < s.n_chunks - 1:
        deps.append((s.stage_of(g + 1), Action("B", a.mb, s.local_chunk(g + 1))))
    return deps


def _index(timeline) -> dict:
    out = {}
    for e in timeline:
        key = (e["stage"], Action(e["kind"], e["mb"], e.get("chunk", 0)))
        if key in out:
            raise ValueError(f"the timeline has {key[1]!r} twice on stage {key[0]}")
        out[key] = e
    return out


def check_causality(s: Schedule, timeline, tol: float = 0.0) -> list:
    """Every action that starts before an action it depends on has ended (more than `tol` s
    early), as strings naming both; [] when the timeline is causal. Also names actions missing
    from the timeline and a stage running two actions at once."""
    ev = _index(timeline)
    bad = []
    for p, actions in enumerate(s.stages):
        prev = None
        for a in actions:
            e = ev.get((p, a))
            if e is None:
                bad.append(f"stage {p} {a!r}: missing from the timeline")
                continue
            deps = depends_on(s, p, a) + ([(p, prev)] if prev is not None else [])
            for q, d in deps:
                f = ev.get((q, d))
                if f is not None and e["start"] < f["end"] - tol:
                    bad.append(f"stage {p} {a!r} started at {e['start']:.6f} s, "
                               f"{(f['end'] - e['start']) * 1e3:.3f} ms before stage {q} {d!r} "
                               f"ended ({f['end']:.6f} s), which it depends on")
            prev = a
    return bad


def count_dependencies(s: Schedule) -> int:
    """How many (action, data dependency) pairs the schedule has: the denominator of a report."""
    return sum(len(depends_on(s, p, a)) for p, actions in enumerate(s.stages) for a in actions)


def measured_bubble(timeline, P: int) -> tuple:
    """(bubble, T, W): the idle share 1 - W / (P T) of the step [first start, last end]."""
    t0 = min(e["start"] for e in timeline)
    T = max(e["end"] for e in timeline) - t0
    W = sum(e["end"] - e["start"] for e in timeline)
    return (1.0 - W / (P * T) if T > 0 else 0.0), T, W


def critical_path(s: Schedule, timeline) -> float:
    """T_cp: the shortest step any causal run of `s` could have with these measured durations."""
    ev = _index(timeline)
    missing = [f"stage {p} {a!r}" for p, acts in enumerate(s.stages) for a in acts
               if (p, a) not in ev]
    if missing:
        raise ValueError(f"the timeline lacks {len(missing)} actions of the schedule, first "
                         f"{missing[0]}: no critical path to compare with")
    records, stuck = replay(s, lambda p, a: ev[(p, a)]["end"] - ev[(p, a)]["start"], 0.0)
    if stuck:
        raise ValueError(f"schedule {s.name!r} deadlocks; it has no critical path")
    return max(end for recs in records for _, _, end in recs)


def formula_floor(s: Schedule):
    """(P-1)/(vK+P-1) for the schedules it was derived for; None for others."""
    if s.name not in FORMULA_SCHEDULES:
        return None
    return costs.pipeline.bubble_fraction(s.P, s.K, s.v)


def bubble_report(s: Schedule, timeline) -> dict:
    """measured bubble, step T, busy W, and the floors 'critical_path' and 'formula'."""
    b, T, W = measured_bubble(timeline, s.P)
    t_cp = critical_path(s, timeline)
    return {"bubble": b, "step": T, "busy": W, "critical_path_step": t_cp,
            "critical_path": 1.0 - W / (s.P * t_cp) if t_cp > 0 else 0.0,
            "formula": formula_floor(s)}


def check_bubble_floor(s: Schedule, timeline, tol: float = 1e-9) -> list:
    """Floors the measured bubble is below, as strings; [] when it is on or above them: the
    critical-path floor always, the formula's where it holds for any durations (K = 1)."""
    r = bubble_report(s, timeline)
    bad = []
    if r["bubble"] < r["critical_path"] - tol:
        bad.append(f"{s.name} P={s.P} K={s.K} v={s.v}: measured bubble {r['bubble']:.4f} is below "
                   f"the critical-path floor {r['critical_path']:.4f} of its own durations")
    if s.K == 1 and r["formula"] is not None and r["bubble"] < r["formula"] - tol:
        bad.append(f"{s.name} P={s.P} K={s.K} v={s.v}: measured bubble {r['bubble']:.4f} is below "
                   f"(P-1)/P = {r['formula']:.4f}, the floor of any one-micro-batch step")
    return bad
