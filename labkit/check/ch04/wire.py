"""Exercise 4.4: predict the bytes a TP rank sends per step, then measure them.

    labkit.check.ch04.tp_bytes(predict_tp_bytes)   # (b, s, h, n_layer, tp, bytes_per_element)

Graded against labkit.costs.tensor_parallel and against the kernel's count (observe.netcount) of a
forward + backward of labkit's TP GPT on real processes, always on Gloo: the kernel counts TCP,
never NCCL's NVLink or InfiniBand.
"""
from __future__ import annotations

from labkit.check import Checker, fail, graded
from labkit.check.mistakes import diagnose
from labkit.costs import tensor_parallel as tpc
from labkit.labs.tp.measure import wire_job
from labkit.launch import run

EXERCISE, TITLE, POINTS = "4.4", "predict the bytes a TP rank sends per step, then measure them", 3
# (tp, b, s, h, n_layer, n_head): activations large enough that Gloo's headers stay under 2%
WIRE_CASES = [(2, 4, 32, 64, 2, 4), (4, 8, 32, 64, 1, 4), (3, 4, 32, 96, 2, 6)]  # 2-3 hidden
WIRE_TOLERANCE = 0.05
_MEASURED: dict = {}   # case -> per-rank results: labkit's run does not depend on fn


def costs_tp_bytes(b, s, h, n_layer, tp, bytes_per_element=4) -> float:
    """labkit.costs' answer: n_layer x 4 ring all-reduces of (b, s, h) per forward + backward."""

    return n_layer * tpc.layer_bytes_sent_per_rank(b, s, h, tp, bytes_per_element)


def wire_mistakes(tp: int) -> list:
    """(predicted / measured, hint) of the known wrong answers at tensor-parallel degree tp."""
    buffer = ("That is the all-reduced buffer's size; on a ring of tp ranks, how much of a "
              "buffer does each rank SEND in one all-reduce (two phases)?")
    return [(0.5, "About half: how many all-reduces does one layer run in forward, and how many "
                  "in backward (attention and MLP each have a g and an f)?"),
            (tp / (2 * (tp - 1)), buffer), (tp / (4 * (tp - 1)), buffer),
            (2.0, "Twice the count: only what this rank sends, not sent + received.")]


WIRE_DEFAULT = ("How many all-reduces per layer, of how many bytes each (activations or "
                "weights?), and what share of each does a ring rank send?")


@graded("4.4")
def tp_bytes(fn):
    """Exercise 4.4: fn(b, s, h, n_layer, tp, bytes_per_element) -> bytes one rank sends in one
    forward + backward of labkit's TP GPT (fp32 on the CPU, so bytes_per_element = 4)."""

    c = Checker(EXERCISE, TITLE, POINTS)
    for i, (tp, b, s, h, n_layer, n_head) in enumerate(WIRE_CASES):
        name = (f"tp={tp}, b={b}, s={s}, h={h}, {n_layer} layers" if i == 0 else
                f"hidden case {i}")
        with c.case(name):
            got = fn(b, s, h, n_layer, tp, 4)
            if not isinstance(got, (int, float)):
                fail(f"return a number of bytes, got {type(got).__name__}")
            cfg = dict(n_layer=n_layer, n_embd=h, n_head=n_head, block_size=s, vocab_size=96)
            key = (tp, b, s, h, n_layer, n_head)
            res = _MEASURED.get(key) or run(wire_job, tp, (cfg, b, 1), timeout=120, echo=False,
                                            backend="gloo")
            _MEASURED[key] = res
            if any(r["sent"] is None for r in res):
                fail(f"the kernel cannot count this backend's bytes ({res[0]['reason']})")
            measured = max(r["sent"] for r in res)
            want = costs_tp_bytes(b, s, h, n_layer, tp)
            c.cases[-1]["name"] += (f"\n      predicted {got / 1e3:.1f} KB, measured "
                                    f"{measured / 1e3:.1f} KB (kernel), labkit.costs "
                                    f"{want / 1e3:.1f} KB") if i == 0 else ""
            if abs(want / measured - 1) > WIRE_TOLERANCE:
                fail(f"labkit.costs says {want:,.0f} B, the kernel counted {measured:,} B: the "
                     "checker disagrees with itself (please report it)")
            if abs(got / measured - 1) > WIRE_TOLERANCE:
                fail(f"predicted {got:,.0f} B, measured {measured:,} B by the kernel "
                     f"({got / measured:.2f}x). "
                     + diagnose(got / measured, wire_mistakes(tp), WIRE_DEFAULT, WIRE_TOLERANCE))
    return c.finish()
