"""Checkers for chapter 05: pipeline schedules as data, a pipeline stage on real processes, and
a prediction of the bubble and the memory measured against a real run.

5.1 `one_f_one_b(p, P, K)`: the 1F1B order of stage p. Validated (every action once, backward
    after forward, no deadlock), simulated (peak held <= P - p, bubble = GPipe's), and run on
    real processes against the one-process GPT.
5.2 `zb_h1(p, P, K)`: ZB-H1 (split backward, deferred W's). Both validators (labkit's and
    PyTorch's), peak <= P, bubble (P-1)/(3K+P-1) at t_F = t_B = t_W; run with B and W apart.
5.3 `run_stage(actions, stage_module, micro_batches, targets, group)`: the executor of one
    stage. Hidden cases at P = 2 and 3 with GPipe, 1F1B, ZB-H1 and ZB-H2 orders and micro-batch
    counts that do not divide the batch. Graded: loss and every gradient against the
    one-process reference; the order in which the stage's forwards, input gradients (B) and
    weight gradients (W) actually happened, observed by hooks the checker puts on the stage's
    input and weights; the bytes saved for backward that are alive at once (saved-tensor hooks
    whose packed objects are freed with autograd's graph) within 5% of what the schedule holds;
    point-to-point messages only (a TorchDispatchMode refuses collectives); no pipeline
    implementation (labkit.pipeline, PyTorch's pipelining stages and schedules).
5.4 `predict(schedule, P, K, t_f, t_b, t_w, act_bytes)`: the bubble and the peak bytes held per
    stage. The bubble is graded against labkit's simulator (= labkit.costs.pipeline's closed
    form where it has one) within half a percentage point; the peak bytes against the bytes the
    executor's saved-tensor hooks measure on real processes, within 5%.
"""
from __future__ import annotations

from labkit import costs
from labkit.check import Checker, fail, graded

EXERCISES = {
    "5.1": ("the 1F1B order of actions", 4),
    "5.2": ("from 1F1B to ZB-H1: defer the weight gradients", 4),
    "5.3": ("a pipeline stage on real processes: forward, B, W, sends and receives", 10),
    "5.4": ("predict the bubble and the bytes held, then measure them", 6),
}
ZB_PAPER_CASES = [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8)]  # K >= P (the formula's range)

PAPER_CASES = [(2, 1), (2, 4), (3, 2), (3, 7), (4, 8), (5, 3)]  # (P, K): K < P and K ∤ P too
RUN_CASES = [(2, 3), (3, 5)]                                     # on real processes, batch 7 rows
RUN_TIMEOUT = 90.0  # seconds a launched case may run once its ranks joined (a loaded CI machine
                    # ran a correct P=3 case past the default 30 s); a real hang reports after it


def schedule_from(fn, P: int, K: int):
    """The reader's per-stage function as a Schedule (with a hint when it returns the wrong thing)."""
    from labkit.pipeline.schedules import Action, from_stage_fn

    s = from_stage_fn(fn, P, K, name="yours")
    for p, actions in enumerate(s.stages):
        if not all(isinstance(a, Action) for a in actions):
            bad = next(a for a in actions if not isinstance(a, Action))
            fail(f"stage {p}: found {bad!r} in the list; return actions made with F(k), B(k) "
                 f"(and W(k)) from labkit.pipeline.schedules")
    return s


def assert_1f1b_schedule(s) -> None:
    """Valid, peak in-flight <= P - p on every stage, bubble equal to GPipe's. Shared with tests."""
    from labkit.pipeline.simulate import simulate
    from labkit.pipeline.validate import ScheduleError, validate

    P, K = s.P, s.K
    try:
        validate(s)
    except ScheduleError as err:
        fail(f"P={P}, K={K}: {err}")
    r = simulate(s, t_f=1.0, t_b=2.0)
    for p, peak in enumerate(r.peak_in_flight):
        limit = min(K, P - p)
        if peak > limit:
            fail(f"P={P}, K={K}: stage {p} holds {peak:g} micro-batches' activations at once; "
                 f"1F1B holds at most min(K, P - p) = {limit}. Run only P - p - 1 = "
                 f"{max(P - p - 1, 0)} forwards before the first backward, then alternate F, B")
    want = costs.pipeline.bubble_fraction(P, K)
    if abs(r.bubble - want) > 1e-9:
        fail(f"P={P}, K={K}: the simulated bubble is {r.bubble:.4f}, but GPipe's is "
             f"(P-1)/(K+P-1) = {want:.4f}; a stage waits longer than it must. Alternate one "
             f"forward and one backward in the steady state, oldest backward first")


def _run_job(s, cfg, batch_size):
    from labkit.pipeline.executor import schedules_job

    return schedules_job([s], cfg, batch_size)[0]


@graded("5.1")
def one_f_one_b(fn):
    """Exercise 5.1: check the reader's 1F1B order, on paper and on real processes."""
    from labkit.model import GPTConfig
    from labkit.pipeline import causality, executor

    c = Checker("5.1", EXERCISES["5.1"][0], EXERCISES["5.1"][1])
    for P, K in PAPER_CASES:
        with c.case(f"P={P}, K={K}: valid, peak <= P - p, bubble = GPipe's"):
            assert_1f1b_schedule(schedule_from(fn, P, K))
    for P, K in RUN_CASES:
        with c.case(f"real processes, P={P}, K={K}: loss and gradients = one-process reference, "
                    f"timeline causal"):
            s = schedule_from(fn, P, K)
            cfg = GPTConfig(n_layer=P, n_embd=16, n_head=2, block_size=16)
            merged = executor.merge(c.launch(_run_job, P, args=(s, cfg, 7), timeout=RUN_TIMEOUT))
            executor.compare_to_reference(merged, executor.reference_step(cfg, 7))
            bad = (causality.check_causality(s, merged["timeline"])
                   + causality.check_bubble_floor(s, merged["timeline"]))
            if bad:
                fail(f"the measured timeline is impossible ({len(bad)} problems), first: {bad[0]}")
    return c.finish()


def assert_zb_h1_schedule(s) -> None:
    """Split backward, both validators, peak <= 1F1B's (P micro-batches, W holding them), and
    with t_F = t_B = t_W the simulated bubble (P-1)/(3K+P-1). Shared with tests."""
    from labkit.pipeline.simulate import simulate
    from labkit.pipeline.validate import ScheduleError, check_message_order, validate

    P, K = s.P, s.K
    if not s.split:
        fail(f"P={P}, K={K}: no W actions: split every backward into B(k) (input gradient) "
             f"and W(k) (weight gradient)")
    try:
        validate(s)
        check_message_order(s)
    except ScheduleError as err:
        fail(f"P={P}, K={K}: {err}")
    try:
        from labkit.pipeline.torch_orders import torch_validate
        torch_validate(s)
    except AssertionError as err:
        fail(f"P={P}, K={K}: PyTorch's schedule validator refuses it: {str(err).splitlines()[0]}")
    r = simulate(s, t_f=1.0, t_b=2.0, t_w=1.0)
    for p, peak in enumerate(r.peak_in_flight):
        if peak > P:
            fail(f"P={P}, K={K}: stage {p} holds {peak:g} micro-batches (a micro-batch is held "
                 f"from its F to its W); 1F1B's peak is P = {P}. Run each W at most p B's late")
    want = costs.pipeline.schedule_bubble("zb-h1", P, K, 1, 1.0, 2.0, 1.0)
    if r.bubble > want + 1e-9:
        fail(f"P={P}, K={K}: the simulated bubble is {r.bubble:.4f} (t_F = t_B = t_W), ZB-H1's is "
             f"(P-1)/(3K+P-1) = {want:.4f}: some stage idles in the cool-down where a deferred "
             f"W could run")


@graded("5.2")
def zb_h1(fn):
    """Exercise 5.2: the reader's ZB-H1 order, on paper and on real processes."""
    from labkit.model import GPTConfig
    from labkit.pipeline import causality, executor

    c = Checker("5.2", EXERCISES["5.2"][0], EXERCISES["5.2"][1])
    for P, K in ZB_PAPER_CASES:
        with c.case(f"P={P}, K={K}: valid (labkit's and PyTorch's validators), peak <= P, "
                    f"bubble (P-1)/(3K+P-1)"):
            assert_zb_h1_schedule(schedule_from(fn, P, K))
    for P, K in RUN_CASES:
        with c.case(f"real processes, P={P}, K={K}: B and W run apart, loss and gradients = "
                    f"one-process reference, timeline causal"):
            s = schedule_from(fn, P, K)
            cfg = GPTConfig(n_layer=P, n_embd=16, n_head=2, block_size=16)
            merged = executor.merge(c.launch(_run_job, P, args=(s, cfg, 7), timeout=RUN_TIMEOUT))
            executor.compare_to_reference(merged, executor.reference_step(cfg, 7))
            bad = causality.check_causality(s, merged["timeline"])
            if bad:
                fail(f"the measured timeline is impossible ({len(bad)} problems), first: {bad[0]}")
    return c.finish()


# ----------------------------------------------------------------------------- 5.3 a pipeline stage
from labkit.check.ch05_stage import forbidden_used, pipeline_stage  # noqa: E402,F401 - 5.3's checker
from labkit.check.ch05_trace import TRACE_EXERCISES, exposed_communication  # noqa: E402,F401 - 5.5
EXERCISES.update(TRACE_EXERCISES)


# ----------------------------------------------------------------------------- 5.4 predict, measure
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
PREDICT_FORBIDDEN = ("labkit.costs", "labkit.pipeline")


def _measured_act_bytes(P: int, K: int, batch_size: int) -> list:
    """Bytes one micro-batch's forward saves on each stage, as the executor's own meter counts
    them (labkit.pipeline.executor: saved-tensor hooks, parameters excluded): from a GPipe run
    of K micro-batches there, peak / K (every micro-batch the same size: K divides the batch)."""
    from labkit.pipeline.measure import DEFAULT_CFG
    from labkit.pipeline.executor import GPT, build_chunks, make_batch, ActivationMeter
    from labkit.pipeline import schedules
    import torch
    import torch.nn.functional as F

    s = schedules.gpipe(P, K)
    model = GPT(DEFAULT_CFG, seed=0)
    x, y = make_batch(batch_size, DEFAULT_CFG)
    rows = batch_size // K
    h = torch.zeros(rows, DEFAULT_CFG.block_size, DEFAULT_CFG.n_embd)
    out = []
    for p in range(P):
        chunk = build_chunks(model, s, p)[0]
        meter = ActivationMeter(chunk.parameters())
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
    from labkit.pipeline import schedules
    from labkit.pipeline.simulate import simulate

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
    from labkit.pipeline import measure

    c = Checker("5.4", EXERCISES["5.4"][0], EXERCISES["5.4"][1])
    banned = forbidden_used(fn, modules=PREDICT_FORBIDDEN, names=())

    def refuse_code():  # every case: labkit's own model earns nothing
        if banned:
            fail(f"predict uses {', '.join(banned)}: derive the numbers yourself (the "
                 f"chapter's sections 2 and 5)")

    for case in PREDICT_PAPER_CASES:
        name, P, K, t_f, t_b, t_w, _ = case
        with c.case(f"{name}, P={P}, K={K}, t_f={t_f:g}, t_b={t_b:g}, t_w={t_w:g}: bubble "
                    f"within {BUBBLE_TOLERANCE:.1%} of the simulator, peak bytes within "
                    f"{BYTES_TOLERANCE:.0%}"):
            refuse_code()
            _check_prediction(fn, case)
    if not run:
        return c.finish()
    P, K = PREDICT_RUN_P, PREDICT_RUN_K
    rows = {}
    for i, name in enumerate(PREDICT_RUN_SCHEDULES):
        t_f, t_b = PREDICT_PAD
        with c.case(f"real processes: {name}, P={P}, K={K}, pads {t_f * 1e3:g}/{t_b * 1e3:g} ms: "
                    f"peak bytes within {BYTES_TOLERANCE:.0%} of the measured, bubble shown "
                    f"beside the measured"):
            refuse_code()
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

