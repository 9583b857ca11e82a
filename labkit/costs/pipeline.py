"""The pipeline bubble and the activation memory of pipeline schedules: pure math.

P stages, K micro-batches per step, v model chunks per stage (v = 1: GPipe or 1F1B; v > 1:
interleaved 1F1B). Times are per micro-batch for a whole stage: t_f forward, t_b backward
(with v chunks, each chunk takes t_f / v and t_b / v).

    from labkit import costs
    costs.pipeline.bubble_fraction(P=8, K=32)            # 7/39 = 0.179
    costs.pipeline.micro_batches_for_bubble(P=8, target=0.05)   # 134 (strictly under 5%)

Where the formula comes from. Every stage does K forwards and K backwards: K (t_f + t_b) of
work. The last stage cannot start before P - 1 forwards have passed through the stages before
it, and the first stage's last backward waits for P - 1 backwards after it: (P - 1)(t_f + t_b)
of idle time per stage, whatever the order of work in between. So a step takes
(K + P - 1)(t_f + t_b) and the idle share is

    bubble = (P - 1) / (K + P - 1)                  GPipe (Huang et al., 2019) and 1F1B alike

1F1B (PipeDream-Flush, Narayanan et al., 2021) reorders the same work so that a stage holds the
activations of at most P - p micro-batches instead of K: it changes the memory, not the bubble.
Interleaving v chunks per stage (Megatron-LM, Narayanan et al., SC'21) makes each ramp step a
chunk, t/v, so the idle time is divided by v:

    bubble time  = (P - 1)(t_f + t_b) / v
    bubble       = (P - 1) / (v K + P - 1)          of the step, interleaved, K >= P

paid for with (vP - 1)/(P - 1) times as many point-to-point sends (about v). With fewer
micro-batches than stages (K < P) interleaving cannot shrink the ramp that much: micro-batch 0
alone must cross all v P chunk-stages forward and back, P (t_f + t_b), and the other K - 1 queue
behind it one chunk each, so the step takes (P + (K - 1)/v)(t_f + t_b) and

    bubble       = (v (P - K) + K - 1) / (v P + K - 1)          interleaved, K < P

(both are (max(K, P) + (min(K, P) - 1)/v)(t_f + t_b); at v = 1 they are the same formula). Fractions
are of the whole step (idle / (work + idle)); `bubble_overhead` gives idle / work = (P - 1) / (v K),
the ratio the Megatron paper quotes.
"""
from __future__ import annotations

import math

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _check(P: int, K: int, v: int = 1) -> None:
    if int(P) != P or P < 1:
        raise ValueError(f"P={P} stages: need a whole number >= 1")
    if int(K) != K or K < 1:
        raise ValueError(f"K={K} micro-batches: need a whole number >= 1")
    if int(v) != v or v < 1:
        raise ValueError(f"v={v} chunks per stage: need a whole number >= 1")


def _schedule_v(schedule: str, v: int) -> int:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: choose one of {SCHEDULES}")
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"v={v} chunks only makes sense for schedule='interleaved'; "
                         f"use v=1 with {schedule!r}")
    return v


def _span(P: int, K: int, v: int) -> float:
    """A step's length in units of (t_f + t_b): K + (P-1)/v for K >= P, P + (K-1)/v for K < P."""
    return max(K, P) + (min(K, P) - 1) / v


def bubble_fraction(P: int, K: int, v: int = 1) -> float:
    """Idle share of a pipeline step: (P-1)/(vK + P-1). v=1: GPipe and 1F1B (the same).
    Interleaved with K < P: (v(P-K) + K-1)/(vP + K-1) (the module's docstring says why)."""
    _check(P, K, v)
    return 1 - K / _span(P, K, v)


def bubble_overhead(P: int, K: int, v: int = 1) -> float:
    """Idle time over useful time, (P-1)/(vK): the 'bubble time fraction' of the Megatron paper
    (for K >= P; interleaved with K < P the ramp is longer, see bubble_fraction)."""
    _check(P, K, v)
    return _span(P, K, v) / K - 1


def step_time(P: int, K: int, t_f: float, t_b: float, v: int = 1, t_p2p: float = 0.0) -> float:
    """Ideal step time in the units of t_f, t_b: (K + (P-1)/v)(t_f + t_b)
    ((P + (K-1)/v)(t_f + t_b) when K < P).

    t_p2p (optional) is one activation transfer between neighbouring stages; each of the
    2(vP - 1) boundary crossings on the critical path of the ramp costs one (a rough model:
    transfers in the steady state overlap with compute on real hardware)."""
    _check(P, K, v)
    return _span(P, K, v) * (t_f + t_b) + 2 * (v * P - 1) * t_p2p


def micro_batches_for_bubble(P: int, target: float, v: int = 1) -> int:
    """Fewest micro-batches K with a bubble strictly under `target` (a fraction, e.g. 0.05).

    (P-1)/(vK + P-1) < target  <=>  K > (P-1)(1 - target) / (v target)."""
    _check(P, 1, v)
    if not 0 < target < 1:
        raise ValueError(f"target={target}: give the bubble as a fraction between 0 and 1 "
                         f"(5% is 0.05)")
    if P == 1:
        return 1
    bound = (P - 1) * (1 - target) / (v * target)
    K = max(1, math.floor(bound) + 1)
    while K > 1 and bubble_fraction(P, K - 1, v) < target:  # guard against float rounding
        K -= 1
    while bubble_fraction(P, K, v) >= target:
        K += 1
    return K


def peak_in_flight(schedule: str, P: int, K: int, stage: int = 0, v: int = 1) -> float:
    """Most micro-batches whose activations stage `stage` holds at once, in whole-stage units.

    GPipe: all K (every forward runs before any backward). 1F1B: min(K, P - stage): stage p
    runs P - p - 1 warm-up forwards, then one more before its first backward. Interleaved
    1F1B (Megatron's order): stage p holds min(vK, 2(P - p - 1) + (v - 1)P + 1) chunk
    activations, each 1/v of a stage's, so a bit more than 1F1B at stage 0. With the backward
    split (a micro-batch is held from its F until its W): ZB-H1 min(K, P) on every stage
    (1F1B's stage 0), ZB-H2 min(K, 2P - 1) on every stage (labkit's simulator agrees for
    P <= 6, K < 20: tests/test_zbv.py)."""
    _check(P, K, v)
    if not 0 <= stage < P:
        raise ValueError(f"stage={stage}: stages are numbered 0 .. {P - 1} for P={P}")
    if schedule in ("zb-h1", "zb-h2") and v == 1:
        return float(min(K, P if schedule == "zb-h1" else 2 * P - 1))
    v = _schedule_v(schedule, v)
    if schedule == "gpipe":
        return float(K)
    if schedule == "1f1b":
        return float(min(K, P - stage))
    chunks = min(v * K, 2 * (P - stage - 1) + (v - 1) * P + 1)
    return chunks / v


def peak_activation_bytes(schedule: str, P: int, K: int, bytes_per_micro_batch: float,
                          stage: int = 0, v: int = 1) -> float:
    """Peak activation bytes on a stage: peak_in_flight * one micro-batch's activations there.

    bytes_per_micro_batch: what one micro-batch's forward through the whole stage keeps for
    its backward (for a transformer roughly layers_per_stage * b * s * h * 34 bytes in 16-bit,
    Korthikanti et al. 2022, without attention-score storage)."""
    return peak_in_flight(schedule, P, K, stage, v) * bytes_per_micro_batch


def p2p_bytes_per_step(P: int, K: int, micro_batch: int, seq: int, hidden: int,
                       bytes_per_element: int = 2, v: int = 1) -> int:
    """Bytes sent between stages in one step, all boundaries together.

    Each of the vP - 1 chunk boundaries carries one activation (b*s*h elements) forward and
    one gradient of the same size backward, per micro-batch. Compare tensor parallelism, which
    all-reduces b*s*h elements twice per layer in each direction inside every stage."""
    _check(P, K, v)
    return 2 * (v * P - 1) * K * micro_batch * seq * hidden * bytes_per_element


def schedule_bubble(schedule: str, P: int, K: int, v: int = 1, t_f: float = 1.0,
                    t_b: float = 2.0, t_w: float = 1.0, flush: bool = True):
    """Idle share of the step by schedule name, or None where no closed form is known.

    flush=True (the default): every step ends with all stages done (an optimizer step after a
    global gradient-norm all-reduce; labkit's executor). flush=False: steps run back to back,
    each stage starting the next step as soon as it is done with this one (optimizer
    post-validation, Qi et al. 2023 sec. 4); the share is then of the period between steps
    (labkit.pipeline.simulate.steady_state).

    'gpipe', '1f1b', 'interleaved': bubble_fraction, (P-1)/(vK + P-1) for K >= P, whatever the
    times, flush or not.
    'zb-h1' (Qi et al., 2023): the backward t_b is split into B = t_b - t_w and W = t_w;
    deferred W's fill the cool-down, so a stage idles (P-1)(t_f + t_B - t_W) instead of
    (P-1)(t_f + t_b), for K >= P: with t_f = t_B = t_W that is a third.
    'zb-h2' (up to 2P-1 micro-batches held; K >= 2P-1): a parallelogram, every stage busy from
    its first forward to its last W. With a flush a stage idles
    (P-1) max(t_F, t_F + t_B - 2 t_W, t_B - t_F): no v = 1 schedule beats (P-1) t_F under a
    flush (the last stage waits that long for its first input and still has all its work to
    do), which ZB-H1 already reaches at equal times, so there ZB-H2 = ZB-H1. Without the flush
    the parallelograms tile: (P-1) max(0, t_F + t_B - 2 t_W, t_B - t_F), the paper's
    (P-1)(t_F + t_B - 2 t_W) = 0 at equal times; the t_B - t_F term is the ramp 2P-1 warm-up
    forwards cannot cover when a B is slower than an F. Both equal labkit's simulator
    (tests/test_zbv.py).
    'zb-v': half of ZB-H1's idle time at equal times and K >= 2P-1 (with a flush), else None."""
    _check(P, K, v)
    if schedule in SCHEDULES:
        return bubble_fraction(P, K, _schedule_v(schedule, v))
    t_B, t_W = t_b - t_w, t_w

    def share(idle):
        return idle / (K * (t_f + t_b) + idle)

    if schedule == "zb-h1":
        if K < P or not flush:
            return None
        return share((P - 1) * max(0.0, t_f + t_B - t_W))
    if schedule == "zb-h2":
        if K < 2 * P - 1:
            return None
        return share((P - 1) * max(t_f if flush else 0.0, t_f + t_B - 2 * t_W, t_B - t_f))
    if schedule == "zb-v":
        # 2P half-size chunks in a V; with t_f = t_B = t_W and K >= 2P-1 a stage idles
        # (P-1) * t_f/2: (P-1)/(6K+P-1) at t_f = 1, t_b = 2, t_w = 1 (labkit's simulator agrees
        # exactly, tests/test_zbv.py). Other times or fewer micro-batches: no closed form here.
        if K < 2 * P - 1 or not (math.isclose(t_f, t_B) and math.isclose(t_B, t_W)):
            return None
        return share((P - 1) * t_f / 2 if flush else 0.0)
    raise ValueError(f"schedule={schedule!r}: choose one of "
                     f"{SCHEDULES + ('zb-h1', 'zb-h2', 'zb-v')}")
