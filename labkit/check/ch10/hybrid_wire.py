"""Exercise 10.3: predict a DP x TP run's bytes per rank per step, then measure them.

    labkit.check.ch10.hybrid_bytes(predict)   # predict(cfg, dp, tp, zero, rows, local_params)
                                              #   -> bytes one rank sends in one step

One training step of labkit.parallel's DP x TP GPT, measured by the kernel's TCP counters
(labkit.observe.netcount) on real processes, within BYTES_TOLERANCE, shown beside
labkit.costs.parallel.wire_bytes.
"""
from __future__ import annotations

from labkit.check import Checker, fail, graded
from labkit.check.ch10.common import FORBIDDEN
from labkit.costs import parallel as pc
from labkit.labs.parallel.job import train
from labkit.model import GPTConfig
from labkit.parallel import Plan

EXERCISE, TITLE, POINTS = ("10.3", "predict a DP x TP run's bytes per rank per step, then measure "
                           "them", 3)
BYTES_TOLERANCE = 0.05   # within 5% of the kernel's count (Gloo adds its framing)
HYBRID_CFG = dict(n_layer=2, n_embd=64, n_head=4, block_size=16)
HYBRID_CASES = [  # (dp, tp, zero, global batch, hidden)
    (2, 2, 0, 8, False),
    (4, 1, 1, 8, False),
    (2, 2, 1, 7, True),          # 7 rows: replicas of 4 and 3, so their TP traffic differs
]


_MEASURED: dict = {}     # (dp, tp, zero, batch) -> the ranks' results: one run per process


def _measured(c, dp, tp, zero, batch) -> list:
    """labkit.parallel's step on real processes, run once per case and process: the bytes do
    not depend on the reader's code, so a re-run of the check (or a test) reuses the count."""

    key = (dp, tp, zero, batch)
    if key not in _MEASURED:
        _MEASURED[key] = c.measure(_hybrid_job, dp * tp, args=(Plan(dp=dp, tp=tp, zero=zero),
                                                                HYBRID_CFG, batch), timeout=90)
    return _MEASURED[key]


def _hybrid_job(plan, cfg_kwargs, batch):
    return train(plan, cfg_kwargs, steps=1, batch=batch, capture_grads=False)


def _bytes_hint(got, measured, wire: dict, rows, batch, tp, dp, zero) -> str:
    """Name the likely mistake by the prediction it would give (ring wire bytes per term)."""
    said = f"predicted {got:,.0f} B, measured {measured:,} B. "
    close = lambda x: abs(got - x) <= BYTES_TOLERANCE * max(x, 1)  # noqa: E731
    t, d = wire["tp"], wire["dp"]
    t_pay = t * tp / (2 * (tp - 1)) if tp > 1 else 0.0        # what the all-reduces were handed
    d_pay = d * dp / ((1 if zero else 2) * (dp - 1)) if dp > 1 else 0.0
    variants = [
        (tp > 1 and close(t / 2 + d), "Tensor parallelism: how many all-reduces per block in the "
         "forward (Megatron's g), and how many in the backward (f)?"),
        (tp > 1 and rows != batch and close(t * batch / rows + d), "Whose rows does a TP group "
         "all-reduce: the global batch's, or its data-parallel replica's?"),
        (close(t_pay + d_pay), "That is what the collectives were handed (the payload). How many "
         "bytes does each rank of a ring put on the wire for an all-reduce of D bytes, and for "
         "a reduce-scatter or an all-gather?"),
        (dp > 1 and zero and close(t + 1.5 * d), "ZeRO-1 reduce-scatters the gradients and "
         "all-gathers the updated weights: is that more traffic than plain DP's all-reduce? "
         "(1.5x is ZeRO-3's.)"),
        (dp > 1 and close(t + d / 2), "Data parallelism: a ring all-reduce runs two phases; "
         "what does each send?"),
    ]
    for hit, hint in variants:
        if hit:
            return said + hint
    return said + (f"Count per step: the TP all-reduces of this replica's {rows} rows of "
                   f"activations in every block, both passes; the DP reduction of the "
                   f"parameters this rank holds; what a ring sends of each.")


@graded("10.3")
def hybrid_bytes(predict):
    """Exercise 10.3: predict(cfg, dp, tp, zero, rows, local_params) -> bytes one rank sends in
    one training step (ring collectives; the loss's own tiny reduction left out)."""

    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.because("derive the bytes yourself").refusal(predict, who="your prediction"))
    cfg = GPTConfig(**HYBRID_CFG)
    for dp, tp, zero, batch, hidden in HYBRID_CASES:
        name = "hidden case" if hidden else (
            f"DP {dp} x TP {tp}, ZeRO-{zero}, global batch {batch}, GPT {HYBRID_CFG}")
        with c.case(name):
            c.go_on()                          # a refused answer starts no run
            local = sum(pc.stage_param_numels(cfg, tp, 1, 0))
            got = {}                                   # replica -> YOUR bytes, before any run
            for replica in range(dp):
                rows = pc.rows_of(batch, dp, replica)
                got[replica] = predict(cfg, dp, tp, zero, rows, local)
                if not isinstance(got[replica], (int, float)):
                    fail("return one number: the bytes this rank sends in one step")
            res = _measured(c, dp, tp, zero, batch)
            if res[0]["kernel_sent"] is None:
                fail("the kernel's counter cannot count here (not Gloo over TCP)")
            lines = []
            for rank, r in enumerate(res):
                replica = r["coords"]["dp"]
                rows = pc.rows_of(batch, dp, replica)
                wire = pc.wire_bytes(cfg, dp=dp, tp=tp, zero=zero, batch=batch, replica=replica)
                measured = r["kernel_sent"]
                if abs(sum(wire.values()) / measured - 1) > BYTES_TOLERANCE:
                    fail(f"labkit.costs.parallel says {sum(wire.values()):,.0f} B, the kernel "
                         f"{measured:,} B: the checker disagrees with itself (please report it)")
                lines.append(f"\n      rank {rank} (replica {replica}, {rows} rows): predicted "
                             f"{got[replica]:,.0f} B, measured {measured:,} B, "
                             f"labkit.costs.parallel {sum(wire.values()):,.0f} B")
                if abs(got[replica] / measured - 1) > BYTES_TOLERANCE:
                    fail(f"rank {rank}: " + _bytes_hint(got[replica], measured, wire, rows, batch,
                                                        tp, dp, zero))
            if not hidden:
                c.cases[-1]["name"] += "".join(lines[:2])
    return c.finish()
