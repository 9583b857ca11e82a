"""Exercise 5.4: predict the bubble and the bytes held, then measure them.

    labkit.check.ch05.predict_then_measure(predict)   # predict(schedule, P, K, t_f, t_b, t_w,
                                                      #   act_bytes) -> {"bubble", "peak_bytes"}

The bubble is graded against labkit's simulator (= labkit.costs.pipeline's closed form where it
has one) within half a percentage point; the peak bytes per stage against the bytes the
executor's saved-tensor hooks measure on real processes, within 5%.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.check import Checker, Forbidden, fail, graded
from labkit.labs.pipeline import measure
from labkit.observe.saved import SavedTensors
from labkit.pipeline import schedules
from labkit.pipeline.executor import DEFAULT_CFG, GPT, build_chunks, make_batch
from labkit.pipeline.simulate import simulate

EXERCISE, TITLE, POINTS = "5.4", "predict the bubble and the bytes held, then measure them", 6
PREDICT_PAPER_CASES = [  # (schedule, P, K, t_f, t_b, t_w, act_bytes per stage): no run
    ("gpipe", 4, 8, 1.0, 2.0, 1.0, [1000, 1000, 1000, 1500]),
    ("1f1b", 3, 5, 1.0, 2.0, 1.0, [2000, 2000, 3000]),
    ("zb-h1", 4, 8, 1.0, 2.0, 1.0, [1000, 1000, 1000, 1500]),
    ("zb-h1", 3, 7, 1.0, 3.0, 1.0, [1000, 1000, 1000]),
    ("zb-h2", 4, 8, 1.0, 2.0, 1.0, [1000, 1000, 1000, 1500]),
    ("zb-h2", 2, 5, 2.0, 2.0, 1.0, [1000, 1000]),
]
PREDICT_RUN_P, PREDICT_RUN_K = 3, 8           # the measured cases: one launch, three schedules
PREDICT_RUN_SCHEDULES = ("1f1b", "zb-h1", "zb-h2")
PREDICT_PAD = (0.006, 0.012)                  # seconds per forward, per whole backward (W = half)
BUBBLE_TOLERANCE = 0.005                      # absolute, against the simulator
BYTES_TOLERANCE = 0.05                        # relative, against the measured bytes
FORBIDDEN = Forbidden(("labkit.costs", "labkit.pipeline"),
                      why="derive the numbers yourself (the chapter's sections 2 and 5)")

def _measured_act_bytes(P: int, K: int, batch_size: int) -> list:
    """Bytes one micro-batch's forward saves on each stage, as the executor's own meter counts
    them (labkit.pipeline.executor: saved-tensor hooks, parameters excluded): from a GPipe run
    of K micro-batches there, peak / K (every micro-batch the same size: K divides the batch)."""

    s = schedules.gpipe(P, K)
    model = GPT(DEFAULT_CFG, seed=0)
    x, y = make_batch(batch_size, DEFAULT_CFG)
    rows = batch_size // K
    h = torch.zeros(rows, DEFAULT_CFG.block_size, DEFAULT_CFG.n_embd)
    out = []
    for p in range(P):
        chunk = build_chunks(model, s, p)[0]
        meter = SavedTensors(chunk.parameters())
        inp = x[:rows] if chunk.first else h.clone().requires_grad_(True)
        meter.current = 0
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            o = chunk(inp)
            if chunk.last:
                o = F.cross_entropy(o.flatten(0, 1), y[:rows].flatten(), reduction="sum")
        out.append(meter.bytes_of(0))
    return out


def _check_prediction(fn, case, measured=None) -> str:
    """Grade one prediction; returns the line showing predicted beside simulated / measured."""

    name, P, K, t_f, t_b, t_w, act = case
    got = fn(name, P, K, t_f, t_b, t_w, list(act))
    if not isinstance(got, dict) or not {"bubble", "peak_bytes"} <= set(got):
        fail(f"return a dict {{'bubble': fraction, 'peak_bytes': [P numbers]}}, got {got!r}")
    peaks = list(got["peak_bytes"])
    if len(peaks) != P:
        fail(f"peak_bytes has {len(peaks)} numbers; give one per stage (P={P})")
    s = schedules.make(name, P, K)
    sim = simulate(s, t_f, t_b, t_w=t_w if s.split else None)
    bubble = float(got["bubble"])
    if abs(bubble - sim.bubble) > BUBBLE_TOLERANCE:
        hint = ""
        if name == "zb-h2" and bubble < sim.bubble:
            hint = (" The step ends with a flush here (every stage finishes before the optimizer "
                    "steps): how long does the last stage wait for its first input, and can any "
                    "order of its own work make up for that?")
        elif bubble > 1 or bubble < 0:
            hint = " The bubble is a fraction of P x the step time, between 0 and 1."
        fail(f"{name}, P={P}, K={K}, t_f={t_f:g}, t_b={t_b:g}, t_w={t_w:g}: you predict a bubble "
             f"of {bubble:.2%}, labkit's simulator gives {sim.bubble:.2%} (tolerance "
             f"{BUBBLE_TOLERANCE:.1%}). Which stage waits, for what, and for how long?" + hint)
    want = measured if measured is not None else [h * a for h, a in zip(sim.peak_in_flight, act)]
    what = "measured by the executor's saved-tensor hooks" if measured is not None else "simulated"
    for p, (mine, ref) in enumerate(zip(peaks, want)):
        if abs(float(mine) - ref) > BYTES_TOLERANCE * ref:
            fail(f"{name}, P={P}, K={K}: stage {p} holds {ref:,.0f} bytes at its peak ({what}), "
                 f"you predict {float(mine):,.0f} (tolerance {BYTES_TOLERANCE:.0%}). How many "
                 f"micro-batches does stage {p} hold at once, from which action to which?")
    return (f"{name}: bubble predicted {bubble:.1%}, simulated {sim.bubble:.1%}; peak bytes "
            f"predicted {[round(float(x)) for x in peaks]}, {what} {[round(x) for x in want]}")


@graded("5.4")
def predict_then_measure(fn, run: bool = True):
    """Exercise 5.4: the reader's predict() against labkit's simulator and a real run."""

    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(fn, who="predict"))   # labkit's own model earns nothing

    for case in PREDICT_PAPER_CASES:
        name, P, K, t_f, t_b, t_w, _ = case
        with c.case(f"{name}, P={P}, K={K}, t_f={t_f:g}, t_b={t_b:g}, t_w={t_w:g}: bubble "
                    f"within {BUBBLE_TOLERANCE:.1%} of the simulator, peak bytes within "
                    f"{BYTES_TOLERANCE:.0%}"):
            _check_prediction(fn, case)
    if not run:
        return c.finish()
    P, K = PREDICT_RUN_P, PREDICT_RUN_K
    rows = {}
    for name in PREDICT_RUN_SCHEDULES:
        t_f, t_b = PREDICT_PAD
        with c.case(f"real processes: {name}, P={P}, K={K}, pads {t_f * 1e3:g}/{t_b * 1e3:g} ms: "
                    f"peak bytes within {BYTES_TOLERANCE:.0%} of the measured, bubble shown "
                    f"beside the measured"):
            c.go_on()                         # a refused answer starts no run
            if not rows:
                got = measure.measure(P, [(n, K, 1) for n in PREDICT_RUN_SCHEDULES],
                                      pad=PREDICT_PAD, repeats=2, timeout=120)
                rows.update({r["schedule"]: r for r in got})
                rows["act"] = _measured_act_bytes(P, K, 16)
            r = rows[name]
            line = _check_prediction(fn, (name, P, K, t_f, t_b, t_b / 2, rows["act"]),
                                     measured=r["peak_bytes"])
            print(f"   {line}; measured bubble {r['bubble']:.1%} (median of "
                  f"{len(r['bubbles'])} steps, the executor's overhead on top)")
    return c.finish()
