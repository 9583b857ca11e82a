"""Exercise 5.3: a pipeline stage on real processes.

    labkit.check.ch05.pipeline_stage(run_stage)   # run_stage(actions, stage_module,
                                                  #   micro_batches, targets, group)

The executor of one stage. Hidden cases at P = 2 and 3 with GPipe, 1F1B, ZB-H1 and ZB-H2 orders
and micro-batch counts that do not divide the batch. Graded: loss and every gradient against the
one-process reference; the order in which the stage's forwards, input gradients (B) and weight
gradients (W) actually happened, observed by hooks the checker puts on the stage's input and
weights; the bytes saved for backward that are alive at once (saved-tensor hooks whose packed
objects are freed with autograd's graph) within 5% of what the schedule holds; point-to-point
messages only (a TorchDispatchMode refuses collectives, and the source is read); no pipeline
implementation (labkit.pipeline, PyTorch's pipelining stages and schedules).

Parts: observe.py (the observer, the expected order and peak, the rank job, the reference), this
module (the cases and their hints).
"""
from __future__ import annotations

import torch

from labkit.check import Checker, Forbidden, collectives_refusal, fail, graded, tensors_close
from labkit.check.ch05.stage.observe import (
    MEMORY_SLACK,
    STAGE_BATCH,
    STAGE_CASES,
    STAGE_MODULES,
    STAGE_NAMES,
    expected_order,
    expected_peak,
    fused_pairs,
    reference,
    stage_job,
)
from labkit.pipeline import schedules

EXERCISE, TITLE, POINTS = ("5.3", "a pipeline stage on real processes: forward, B, W, sends and "
                           "receives", 10)
RUN_TIMEOUT = 90.0  # seconds a launched case may run once its ranks joined (a loaded CI machine
                    # ran a correct P=3 case past the default 30 s); a real hang reports after it
FORBIDDEN = Forbidden(STAGE_MODULES, frozenset(STAGE_NAMES),
                      why="the exercise is to write the stage yourself (torch.autograd and "
                          "torch.distributed's point-to-point calls)")


def _assert_stage_numerics(runs, s, ref) -> None:
    P = s.P
    last = runs[P - 1]["loss"]
    if not isinstance(last, (int, float)):
        fail(f"the last stage returned {last!r}: return the sum of the K micro-batch losses "
             f"(a float) there")
    if abs(last - ref[0]) > 1e-4 * max(1.0, abs(ref[0])):
        fail(f"the last stage's loss is {last:.6f}, the one-process model's {ref[0]:.6f}: does "
             f"every micro-batch's loss enter once, and does the last stage see the right "
             f"activations for each micro-batch?")
    for p, r in enumerate(runs):
        for n, g in sorted(r["grads"].items()):
            try:
                tensors_close(g, ref[1][n], rtol=1e-4, atol=1e-6,
                              what=f"stage {p}'s gradient of {n}")
            except AssertionError as err:
                where = ("the last stage" if p == P - 1 else
                         f"stage {p} (the stages after it are right)" if all(
                             _grads_ok(q, ref) for q in runs[p + 1:]) else f"stage {p}")
                fail(f"{err}\nfirst wrong gradient on {where}: is the gradient you receive "
                     f"for each micro-batch the one sent for it (waited for before it is "
                     f"used), and does each W use that micro-batch's output and gradient?")
    missing = sorted(set(ref[1]) - {n for r in runs for n in r["grads"]})
    if missing:
        fail(f"no stage left a gradient in .grad for {missing[0]} ({len(missing)} missing): "
             f"every stage must run its weights' backward for every micro-batch")


def _grads_ok(run, ref) -> bool:
    return all(torch.allclose(g, ref[1][n], rtol=1e-4, atol=1e-6)
               for n, g in run["grads"].items())


def _assert_stage_order_and_memory(runs, s) -> None:
    for p, r in enumerate(runs):
        actions = s.stages[p]
        want = expected_order(actions, first=p == 0)
        got = list(r["events"]) if s.split else fused_pairs(r["events"])
        if got != want:
            i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                     min(len(got), len(want)))
            names = {"F": "a forward", "B": "an input gradient (B)", "W": "a weight gradient (W)"}
            was = names.get(got[i], "nothing") if i < len(got) else "nothing"
            wants = names[want[i]] if i < len(want) else "nothing more"
            fail(f"stage {p} of {s.P}: event #{i} was {was}, the schedule's order wants {wants} "
                 f"there (observed {''.join(got[:i + 1])}..., scheduled {''.join(want[:i + 1])}...)"
                 + (". In a split schedule B computes only the input's gradient and W only the "
                    "weights': which tensors does each of your backward calls differentiate?"
                    if s.split else ""))
        limit = expected_peak(actions, r["per_mb"])
        slack = MEMORY_SLACK * max(r["per_mb"] or [0])
        if r["peak"] > limit + slack:
            fail(f"stage {p} of {s.P}: {r['peak'] / 1024:.1f} KiB saved for backward were alive "
                 f"at once; running this order holds at most {limit / 1024:.1f} KiB (a "
                 f"micro-batch's activations from its F to its "
                 f"{'W' if s.split else 'B'}). What still refers to a micro-batch's output or "
                 f"graph after its last backward action: a list, a dict, or a local name that "
                 f"keeps it until a later action rebinds it?")


@graded("5.3")
def pipeline_stage(fn, Ps=None):
    """Exercise 5.3: the reader's run_stage on real processes. Ps: the world sizes to run
    (default all of STAGE_CASES; the tests pick one to stay quick)."""
    c = Checker(EXERCISE, TITLE, POINTS)
    # an untouched stub or a borrowed executor earns nothing
    c.refuse(FORBIDDEN.refusal(fn, who="run_stage")
             or collectives_refusal(fn, "a pipeline's stages talk to their neighbours only, "
                                        "with send/recv (or isend/irecv)", who="run_stage"))
    ref = reference(STAGE_BATCH)
    for P, specs in sorted(STAGE_CASES.items()):
        if Ps is not None and P not in Ps:
            continue
        got = {}
        for i, (name, K) in enumerate(specs):
            s = schedules.make(name, P, K)
            label = (f"P={P}, {name}, K={K} ({STAGE_BATCH} rows: micro-batches of "
                     f"{STAGE_BATCH // K}-{-(-STAGE_BATCH // K)})")
            with c.case(label + ": loss and every gradient = one-process reference (P2P only, "
                        "no pipeline implementation)"):
                if "runs" not in got:
                    try:
                        got["runs"] = c.launch(stage_job, P, args=(fn, specs, STAGE_BATCH),
                                               timeout=RUN_TIMEOUT)
                    except Exception as err:
                        got["error"] = err
                        raise
                if "error" in got:
                    fail(f"see the first case of P={P}")
                used = sorted({u for r in got["runs"] for u in r.get("collectives", [])})
                if used:
                    fail(f"dist.{', dist.'.join(used)} called while run_stage ran: send "
                         f"activations and gradients point to point")
                runs = [r["runs"][i] for r in got["runs"]]
                _assert_stage_numerics(runs, s, ref)
            with c.case(label + ": forwards, B's and W's in the schedule's order; bytes held "
                        f"<= the schedule's (+{MEMORY_SLACK:.0%} of a micro-batch)"):
                if "runs" not in got or any("collectives" in r for r in got["runs"]):
                    fail(f"the run of P={P} failed (see above)")
                _assert_stage_order_and_memory([r["runs"][i] for r in got["runs"]], s)
    return c.finish()
