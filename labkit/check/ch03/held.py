"""Exercise 3.3: predict what a ZeRO rank holds and sends, then measure it.

    labkit.check.ch03.held_and_sent(my_fn)   # (n_params, zero, world) -> {"params", "grads",
                                             #  "optimizer", "sent"}

Graded against labkit.costs and against labkit.zero's stages run on real processes (tensor sizes
of what each rank keeps after a step, fp32 AdamW; bytes sent counted by the kernel, so always on
Gloo), within 5%.
"""
from __future__ import annotations

from labkit.check import Checker, fail, graded
from labkit.check.ch03.common import predicted_held
from labkit.check.mistakes import diagnose
from labkit.costs import zero as costs_zero
from labkit.labs.zero.measure import LAB_MODEL
from labkit.labs.zero.train import sharded_train
from labkit.launch import run
from labkit.model import GPT

EXERCISE, TITLE, POINTS = "3.3", "predict what a ZeRO rank holds and sends, then measure it", 3
# (zero, world): the first shown, the rest hidden
HELD_CASES = [(2, 3), (3, 2), (1, 4)]
HELD_TOLERANCE = 0.05
_MEASURED: dict = {}   # (zero, world) -> per-rank results: labkit's run does not depend on fn
PARTS = ("params", "grads", "optimizer", "sent")


def _held_job(zero):
    res = sharded_train(zero, LAB_MODEL, "adamw", steps=1, batch_size=12)
    return {**res["held"], "sent": res["sent"], "numel": res["numel"],
            "reason": res["wire_reason"]}


def costs_held(n_params, zero, world) -> dict:
    """labkit.costs' answer for fp32 AdamW (4 + 4 + 8 bytes per parameter), fp32 on the wire."""

    out = predicted_held(n_params, zero, world)
    out["sent"] = costs_zero.comm_per_rank(n_params, zero, world, bytes_per_value=4)["total"]
    return out


def held_mistakes(key: str, zero: int, world: int) -> list:
    """(predicted / measured, hint) of the known wrong answers for one part."""
    if key == "sent":
        return ([(2 / 3, "ZeRO-3 frees the full parameters after forward: what must happen "
                         "before backward can use them again?")] if zero == 3 else []) + [
            (2.0, "Only what this rank SENDS, not sent + received."),
            (0.5, "A reduce-scatter of the gradients AND an all-gather of the parameters.")] + (
            [(1 / 3, "A reduce-scatter of the gradients AND an all-gather of the parameters.")]
            if zero == 3 else [])
    return [(world, f"Stage {zero} shards the {key}: each rank keeps 1/{world} of them."),
            (1 / world, f"Does stage {zero} shard the {key}, or does every rank keep all of "
                        f"them?")]


def _held_hint(key, ratio, zero, world) -> str:
    default = ("On a ring of N ranks, what share of a buffer does each rank send per collective?"
               if key == "sent" else f"How many bytes per parameter are {key} in fp32 AdamW, "
               f"and which stage splits them?")
    return diagnose(ratio, held_mistakes(key, zero, world), default, HELD_TOLERANCE)


@graded("3.3")
def held_and_sent(fn):
    """Exercise 3.3: fn(n_params, zero, world) -> {"params", "grads", "optimizer", "sent"}:
    bytes one rank holds after a step (fp32 AdamW) and sends per step."""

    c = Checker(EXERCISE, TITLE, POINTS)
    n = sum(p.numel() for p in GPT(LAB_MODEL).parameters())
    for i, (zero, world) in enumerate(HELD_CASES):
        with c.case(f"ZeRO-{zero}, {world} ranks" if i == 0 else f"hidden case {i}"):
            got = fn(n, zero, world)
            if not (isinstance(got, dict) and all(isinstance(got.get(k), (int, float))
                                                  for k in PARTS)):
                fail('return {"params": B, "grads": B, "optimizer": B, "sent": B}, numbers')
            res = _MEASURED.get((zero, world)) or run(_held_job, world, (zero,), timeout=90,
                                                        echo=False, backend="gloo")
            _MEASURED[(zero, world)] = res
            if any(r["sent"] is None for r in res):
                fail(f"the kernel cannot count this backend's bytes ({res[0]['reason']})")
            measured = {k: max(r[k] for r in res) for k in PARTS}
            want = costs_held(n, zero, world)
            if i == 0:                      # predicted beside measured, in the table
                c.cases[-1]["name"] += "".join(
                    f"\n      {k}: predicted {got[k] / 1e3:.1f} KB, measured "
                    f"{measured[k] / 1e3:.1f} KB, labkit.costs {want[k] / 1e3:.1f} KB"
                    for k in PARTS)
            for k in PARTS:
                if abs(want[k] / measured[k] - 1) > HELD_TOLERANCE:
                    fail(f"labkit.costs says {want[k]:,.0f} B of {k}, measured {measured[k]:,} "
                         "B: the checker disagrees with itself (please report it)")
                ratio = got[k] / measured[k]
                if abs(ratio - 1) > HELD_TOLERANCE:
                    fail(f"{k}: predicted {got[k]:,.0f} B, measured {measured[k]:,.0f} B "
                         f"({ratio:.2f}x). " + _held_hint(k, ratio, zero, world))
    return c.finish()
