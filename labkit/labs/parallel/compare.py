"""A parallel run against the one-process reference, and its bytes against labkit.costs.

    diffs = differences(rank_results, ref)      # one row per rank: worst |diff| of each kind
    ok = all(d["ok"] for d in diffs)
    rows = bytes_rows(rank_results, plan, cfg, batch)

Tolerances (fp32 on the CPU): the loss and the first step's gradients are sums in another order
(tensor-parallel partial sums, micro-batches, replicas), so they differ from the reference in the
last bits: 1e-5 and 1e-6 absolute. Parameters after SGD steps stay that close (1e-6). After AdamW
steps they get 1e-3: Adam's update is lr * m / sqrt(v), about lr = 1e-2 whatever the gradient's
size, so for an element whose gradient is tiny a last-bit difference in m or v moves the update
by a visible fraction of lr (measured: up to 2e-4 after 3 steps of the 3D run). 1e-3 is a tenth
of one update; a dimension left out (a missing all-reduce) is off by whole updates and more
(tests/test_parallel.py breaks each dimension on purpose and checks that this catches it).
"""
from __future__ import annotations

from labkit.context.layout import sizes
from labkit.costs import parallel as pc
from labkit.testing import worst_difference

TOL = {"loss": 1e-5, "grads": 1e-6, "params": 1e-6}
PARAMS_TOL = {"sgd": 1e-6, "adamw": 1e-3}


def tolerances(optimizer: str) -> dict:
    return {**TOL, "params": PARAMS_TOL[optimizer]}


def differences(results: list, ref: dict, optimizer: str = "adamw") -> list:
    """Per rank: {"rank", "coords", "loss", "grads", "params", "ok"}; also checks that the
    stages together returned every parameter of the reference (none silently left out)."""
    tol, rows, covered = tolerances(optimizer), [], set()
    for rank, r in enumerate(results):
        d = {"rank": rank, "coords": r["coords"],
             "loss": max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])),
             "grads": (worst_difference(r["grads"], ref["grads"], "grads") if r["grads"]
                       else float("nan")),
             "params": worst_difference(r["params"], ref["params"], "params")}
        d["ok"] = all(not d[k] > tol[k] for k in tol)   # nan (not compared) is not a failure
        covered |= set(r["params"])
        rows.append(d)
    missing = sorted(set(ref["params"]) - covered)
    if missing:
        for d in rows:
            d["ok"] = False
        rows[0]["missing"] = missing
    return rows


def bytes_rows(results: list, plan, cfg, batch: int) -> list:
    """Per rank and mesh dimension: payload logged (observe.commlog) vs labkit.costs.parallel,
    and the kernel's count of all bytes the rank sent vs the ring prediction."""
    rows = []
    if cfg.n_expert or (plan.cp > 1 and plan.cp_method != "ring"):
        return rows      # routing decides MoE bytes; all-gather CP: no prediction written here
    cp_sizes = None
    if plan.cp > 1:
        cp_sizes = sizes(cfg.block_size, plan.cp, plan.cp_layout)
    for rank, r in enumerate(results):
        c = r["coords"]
        kw = dict(dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp, zero=plan.zero, sp=plan.sp,
                  batch=batch, stage=c["pp"], replica=c["dp"], cp_rank=c.get("cp", 0),
                  cp_sizes=cp_sizes)
        pay, wire = pc.step_payload(cfg, **kw), pc.wire_bytes(cfg, **kw)
        for dim in ("tp", "pp", "dp", "cp"):
            size = plan.dp * plan.cp if dim == "dp" else getattr(plan, dim)
            if size == 1:
                continue
            logged = r["comm"].get("dp_cp" if dim == "dp" and plan.cp > 1 else dim, {})
            rows.append({"rank": rank, "dim": dim, "calls": logged.get("calls", 0),
                         "logged": logged.get("bytes", 0), "predicted": pay[dim],
                         "seconds": logged.get("seconds", 0.0), "wire": wire[dim]})
    return rows
