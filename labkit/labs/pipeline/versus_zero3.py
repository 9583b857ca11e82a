"""PP against ZeRO-3 on the wire: bytes a real pipeline step and a real ZeRO-3 step send, counted
by the kernel, at several tokens per micro-batch, against costs.hiding.pp_vs_zero3.

    from labkit.labs.pipeline.versus_zero3 import measure
    res = measure(rows=(8, 16, 32, 64, 128))      # 2 ranks, labkit.labs.zero.measure.LAB_MODEL
    res["measured_tokens"], res["predicted_tokens"]

A pipeline moves activations: each micro-batch of t tokens crosses each stage boundary as its
activation (t h e bytes, forward) and comes back as that activation's gradient (t h e,
backward): 2 t h e per boundary, growing with t. ZeRO-3 moves weights: per rank and micro-batch,
whatever its size, two all-gathers and a reduce-scatter of Psi e bytes, (N-1)/N of each sent:
3 (N-1)/N Psi e. So PP sends fewer bytes below t* = 1.5 (N-1)/N Psi/h tokens per micro-batch
(costs.hiding.pp_vs_zero3, for a stage with a boundary on each side). On 2 ranks each stage has
one boundary, so the measured PP side is the boundary's bytes: both ranks' sends summed (what an
inner stage of a deeper pipeline sends), against one ZeRO-3 rank's sends (their mean).

Both counts come from labkit.observe.netcount (the kernel's TCP counters of each process: a
counter neither the pipeline executor nor ZeRO3 writes). Under NCCL they are None.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from labkit.costs import hiding
from labkit.labs.zero.measure import LAB_MODEL, moved_numel
from labkit.launch import device, run
from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus
from labkit.observe import netcount
from labkit.pipeline import schedules
from labkit.pipeline.executor import run_schedule
from labkit.table import table as tab
from labkit.zero.zero3 import ZeRO3

ROWS = (8, 16, 32, 64, 128)     # rows per micro-batch (of block_size tokens)


def _job(cfg: GPTConfig, rows) -> dict:
    """Rank side: per rows, the bytes this rank sent in one pipeline step (GPipe, one micro-batch
    of `rows` rows over P = world stages) and in one ZeRO-3 step (`rows` rows on this rank)."""
    torch.set_num_threads(1)
    dev, rank = device(), dist.get_rank()
    pp_model = GPT(cfg, seed=0).to(dev)
    z3_model = GPT(cfg, seed=0).to(dev)
    zero = ZeRO3(z3_model, torch.optim.SGD, lr=1e-4)
    s = schedules.make("gpipe", dist.get_world_size(), 1)
    tokens = tiny_corpus()
    out = {"params": sum(p.numel() for p in GPT(cfg, seed=0).parameters()), "rows": {}}

    def zero_step(x, y):
        z3_model(x, y)[1].backward()
        zero.step()
        zero.zero_grad()

    for b in rows:
        x, y = [t.to(dev) for t in get_batch(tokens, b, cfg.block_size, step=0)]   # (b, T)
        run_schedule(s, pp_model, x, y)           # warm-up: connections opened outside the count
        with netcount.socket_bytes() as pp:
            run_schedule(s, pp_model, x, y)
        xr, yr = [t.to(dev) for t in get_batch(tokens, b, cfg.block_size, step=rank)]
        zero_step(xr, yr)
        with netcount.socket_bytes() as z3:
            zero_step(xr, yr)
        out["rows"][b] = {"pp": pp.sent, "zero3": z3.sent, "reason": pp.reason or z3.reason}
    return out


def measure(nproc: int = 2, rows=ROWS, cfg: GPTConfig | None = None) -> dict:
    """Both steps at each micro-batch on `nproc` ranks; the measured byte crossover (a line
    through PP's boundary bytes against ZeRO-3's per-rank bytes) and the formula's."""

    cfg = LAB_MODEL if cfg is None else cfg
    rows = sorted(set(rows))
    per_rank = run(_job, nproc, args=(cfg, rows), timeout=300, echo=False)
    n_params = per_rank[0]["params"]
    gathered = moved_numel(cfg, 3, nproc)         # Psi as ZeRO-3 gathers it (padded per unit)
    formula = hiding.pp_vs_zero3(cfg.n_embd, gathered, nproc, weight_bytes=4, act_bytes=4)
    reason = per_rank[0]["rows"][rows[0]]["reason"]
    out = []
    for b in rows:
        got = [r["rows"][b] for r in per_rank]
        if any(g["pp"] is None or g["zero3"] is None for g in got):
            break
        t = b * cfg.block_size
        out.append({"rows": b, "tokens": t, "pp_boundary": sum(g["pp"] for g in got),
                    "pp_formula": 2 * t * cfg.n_embd * 4,
                    "zero3_rank": statistics.mean(g["zero3"] for g in got),
                    "zero3_formula": formula.terms["zero3_bytes"]})
    measured = None
    if len(out) == len(rows) and len(out) > 1:
        k, a = statistics.linear_regression([r["tokens"] for r in out],
                                            [r["pp_boundary"] for r in out])
        z = statistics.mean(r["zero3_rank"] for r in out)
        measured = (z - a) / k if k > 0 else None
    return {"nproc": nproc, "cfg": vars(cfg), "params": n_params, "gathered_params": gathered,
            "steps": out, "reason": reason, "predicted_tokens": formula.value,
            "measured_tokens": measured}


def table(res: dict) -> str:

    if not res["steps"]:
        return f"no kernel byte counts here: {res['reason']}"
    rows = tab(res["steps"], [
        ("rows", "rows"), ("tokens/micro-batch", "tokens"),
        ("PP boundary sent B", "pp_boundary", ",.0f"), ("2the B", "pp_formula", ",.0f"),
        ("ZeRO-3 per rank sent B", "zero3_rank", ",.0f"),
        ("3(N-1)/N Psi e B", "zero3_formula", ",.0f"),
        ("PP / ZeRO-3", lambda r: r["pp_boundary"] / r["zero3_rank"], ".2f")],
        title=f"bytes on the wire per micro-batch, {res['nproc']} ranks, counted by the kernel")
    m = res["measured_tokens"]
    return "\n".join([rows, "", f"PP moves fewer bytes below: predicted "
                      f"(costs.hiding.pp_vs_zero3) {res['predicted_tokens']:,.0f} tokens, "
                      f"measured {m:,.0f} tokens" if m else "measured: no crossover"])
