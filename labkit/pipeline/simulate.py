"""Time a pipeline schedule on paper: timeline, bubble fraction, peak in-flight micro-batches.

    from labkit.pipeline import schedules, simulate
    r = simulate.simulate(schedules.one_f_one_b(P=4, K=8), t_f=1.0, t_b=2.0)
    r.bubble              # 3/11 = (P-1)/(K+P-1)
    r.peak_in_flight      # [4.0, 3.0, 2.0, 1.0]  micro-batches held per stage

Each stage runs its actions in order; an action starts when the stage is free and its input has
arrived. t_f and t_b are one micro-batch's forward and backward through a whole stage (a chunk
takes 1/v of that); either may be a list with one value per stage. t_p2p is one transfer.

The bubble is the idle share of the stage-time: 1 - sum(busy) / (P * makespan). Peak in-flight
counts micro-batches whose activations a stage holds (forward done, backward not yet), in units
of one whole stage (a chunk's activations count 1/v).
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.pipeline.base import Action, Schedule
from labkit.pipeline.validate import replay, validate


@dataclass
class SimResult:
    schedule: Schedule
    timeline: list        # dicts: stage, kind, mb, chunk, start, end
    makespan: float
    busy: list            # per stage
    peak_in_flight: list  # per stage, micro-batches (whole-stage units)

    @property
    def bubble(self) -> float:
        P = self.schedule.P
        return 1.0 - sum(self.busy) / (P * self.makespan) if self.makespan > 0 else 0.0


def in_flight(actions, v: int = 1) -> float:
    """Peak number of micro-batches (whole-stage units) held by a stage running `actions`: from
    the forward to the backward, or to the W where the backward is split (W needs them)."""
    split = any(a.kind == "W" for a in actions)
    held = peak = 0
    for a in actions:
        if a.kind == "B" and split:
            continue
        held += 1 if a.kind == "F" else -1
        peak = max(peak, held)
    return peak / v


def timeline_stats(timeline, P: int):
    """(makespan, busy per stage) of a timeline: a list of dicts with stage, start, end."""
    t0 = min(e["start"] for e in timeline)
    makespan = max(e["end"] for e in timeline) - t0
    busy = [0.0] * P
    for e in timeline:
        busy[e["stage"]] += e["end"] - e["start"]
    return makespan, busy


def simulate(s: Schedule, t_f=1.0, t_b=2.0, t_p2p: float = 0.0, durations=None,
             t_w: float = None) -> SimResult:
    """Time schedule `s`. `durations` (optional) {(stage, kind, chunk): seconds} overrides t_f and
    t_b action by action, e.g. with times measured on real processes; a key (stage, kind, mb,
    chunk) times one action alone (a replay of a measured run with each action's own time). t_b is
    the whole backward; where `s` splits it, W takes t_w (default t_b / 2) and B the rest, so the
    work is the same."""
    validate(s)
    tf = list(t_f) if isinstance(t_f, (list, tuple)) else [t_f] * s.P
    tb = list(t_b) if isinstance(t_b, (list, tuple)) else [t_b] * s.P
    if len(tf) != s.P or len(tb) != s.P:
        raise ValueError(f"give one t_f and t_b per stage: got {len(tf)} and {len(tb)} for P={s.P}")

    def duration(p, a):
        if durations is not None:
            if (p, a.kind, a.mb, a.chunk) in durations:
                return durations[p, a.kind, a.mb, a.chunk]
            if (p, a.kind, a.chunk) in durations:
                return durations[p, a.kind, a.chunk]
        if a.kind == "F":
            return tf[p] / s.v
        if not s.split:
            return tb[p] / s.v
        w = tb[p] / 2 if t_w is None else t_w
        return (w if a.kind == "W" else tb[p] - w) / s.v

    records, _ = replay(s, duration, t_p2p)
    timeline = [dict(stage=p, kind=a.kind, mb=a.mb, chunk=a.chunk, start=start, end=end)
                for p, recs in enumerate(records) for a, start, end in recs]
    makespan, busy = timeline_stats(timeline, s.P)
    peaks = [in_flight(actions, s.v) for actions in s.stages]
    return SimResult(s, timeline, makespan, busy, peaks)


def repeat(s: Schedule, steps: int) -> Schedule:
    """`steps` training steps back to back with no flush between them: each stage runs its
    order for step 0, then at once its order for step 1 (micro-batches K..2K-1), and so on.
    This is a step boundary under optimizer post-validation (Qi et al., 2023, sec. 4): a stage
    steps its optimizer as soon as its own W's are done and the global checks (gradient norm,
    inf/nan) are validated afterwards, so no stage waits for the others between steps."""
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps={steps}: need a whole number >= 1")
    stages = [[Action(a.kind, a.mb + i * s.K, a.chunk) for i in range(steps) for a in actions]
              for actions in s.stages]
    return Schedule(s.name, s.P, s.K * steps, s.v, stages, placement=s.placement)


def steady_state(s: Schedule, t_f=1.0, t_b=2.0, t_w: float = None, t_p2p: float = 0.0,
                 steps: int = 4, durations=None) -> dict:
    """Time per step and bubble when steps run back to back without a flush (`repeat`): the
    period is makespan(steps) - makespan(steps - 1), the bubble 1 - work / (P x period). With a
    flush (the executor's barrier, an all-reduce of the gradient norm) use `simulate`: no v = 1
    schedule then idles less than (P-1) t_F per stage, the time the last stage waits for its
    first input. ZB-H2's parallelogram tiles across steps: its bubble falls to
    (P-1) max(0, t_F + t_B - 2 t_W, t_B - t_F) per step, 0 at equal times. `durations` as in
    `simulate` (keyed by stage, kind, chunk: the same in every step)."""
    if steps < 2:
        raise ValueError(f"steps={steps}: need at least 2 steps to see the period")
    a = simulate(repeat(s, steps), t_f, t_b, t_p2p, durations, t_w=t_w)
    b = simulate(repeat(s, steps - 1), t_f, t_b, t_p2p, durations, t_w=t_w)
    period = a.makespan - b.makespan
    work = (sum(a.busy) - sum(b.busy)) / s.P         # one step's work on the average stage
    return {"period": period, "work": work, "bubble": 1.0 - work / period if period > 0 else 0.0}
