"""Which hiding condition binds a plan: costs.hiding's crossovers at this plan's own numbers.

For every axis a configuration uses, the closed-form condition under which its traffic fits
under the compute it can overlap (costs.hiding), evaluated on the links the planner gives that
axis and at the cluster's FLOP/s (peak * flop_efficiency). Each row compares what the plan has
with what the condition needs; margin = have / need (above 1: fits). The row with the smallest
margin binds: that is the axis that turns the plan communication-bound first when the batch,
the width or the sequence per rank shrinks.

  DP (ZeRO-0)    tokens in the backward the gradients' all-reduce overlaps: one micro-batch's
                 (b * s / cp: under accumulation only the last backward is left to hide it)
  ZeRO-1/2       the reduce-scatter under the (last) backward, and the parameter all-gather
                 after the optimizer step: under the next forward with overlap_param_gather
                 (Megatron's --overlap-param-gather), else exposed (it never hides: need inf)
  Gradients are reduced in job.grad_reduce's dtype (fp32 by default), parameters gathered in
  the recipe's weight dtype.
  ZeRO-3         tokens per micro-batch, against gathers and a reduce-scatter every micro-batch
  TP             the hidden width, against Megatron's f/g (blocking: hides only as async TP)
  PP             hidden width * layers per stage, against one activation per boundary
  CP             tokens per rank s / cp, against one K/V hop per block of ring attention
EP's all-to-alls are not hidden by this planner (it has no such condition)."""
from __future__ import annotations

import math

from labkit.costs import comm, flops, hiding, memory, models
from labkit.costs.plan_inputs import Cluster, Config, Job
from labkit.costs.planner.estimate import Estimate, link, spans
from labkit.table import table


def conditions(plan: Config | Estimate, job: Job, cluster: Cluster) -> list:
    """[{axis, need, have, unit, margin, hides, binds}] for each axis this plan uses."""
    c = plan.config if isinstance(plan, Estimate) else plan
    spec = job.spec
    C = flops.peak_flops(cluster.gpu) * cluster.flop_efficiency
    span = spans(c, cluster)
    r = memory.get_recipe(job.recipe)
    tokens = c.micro_batch * job.seq_len / c.cp                   # this rank's, one micro-batch
    local = models.active_matmul_params(spec) / (c.tp * c.pp)      # parameters one GPU multiplies
    ranks = c.dp * c.cp
    # matmul parameters of one layer in units of h^2 (12 for a GPT block; a mixture: the active)
    k = (models.layer_params(spec) if not spec.n_experts
         else models.active_matmul_params(spec) / spec.n_layers) / spec.hidden ** 2
    out = []
    g = job.grad_reduce_bytes
    if ranks > 1 and c.zero == 0:
        a, bw = link(cluster, span["dp"])
        x = hiding.dp(local, ranks, C, bw, a, grad_bytes=g)
        out.append(_row(x, tokens, "tokens per rank in the backward"))
    if ranks > 1 and c.zero in (1, 2):
        a, bw = link(cluster, span["dp"])
        out.append(_row(_zero12_reduce(local, ranks, C, bw, a, g, c.zero), tokens,
                        "tokens per rank in the backward"))
        out.append(_row(_zero12_gather(local, ranks, C, bw, a, r.weights, c.zero,
                                       job.overlap_param_gather), tokens,
                        "tokens per rank in the next forward"))
    if ranks > 1 and c.zero == 3:
        a, bw = link(cluster, span["dp"])
        x = hiding.zero3(local, ranks, C, bw, a, weight_bytes=r.weights, grad_bytes=g)
        out.append(_row(x, tokens, "tokens per rank per micro-batch"))
    if c.tp > 1:
        a, bw = link(cluster, span["tp"])
        x = hiding.tp(c.tp, C, bw, a, tokens=tokens, layer_h2=k)
        out.append(_row(x, spec.hidden, "hidden width (if overlapped: f/g block)"))
    if c.pp > 1:
        layers = -(-spec.n_layers // c.pp)
        x = hiding.pp(1, C, link(cluster, span["pp"])[1], layer_h2=k)
        out.append(_row(x, spec.hidden * layers, "hidden width x layers per stage"))
    if c.cp > 1:
        a, bw = link(cluster, span["cp"])
        heads = min(c.tp, spec.kv_heads)
        x = hiding.cp(c.cp, spec.hidden // c.tp, spec.kv_dim // heads, C, bw, a,
                      batch=c.micro_batch)
        out.append(_row(x, job.seq_len / c.cp, "tokens per rank (s / cp)"))
    if out:
        low = min(out, key=lambda row: row["margin"])
        low["binds"] = True
    return out


def binding(plan: Config | Estimate, job: Job, cluster: Cluster) -> dict | None:
    """The condition with the smallest margin (None for a one-GPU plan)."""
    return next((row for row in conditions(plan, job, cluster) if row["binds"]), None)


def conditions_table(estimates, job: Job, cluster: Cluster) -> str:
    """One line per plan and axis: need, have, margin; '<-' marks the one that binds."""
    rows = [dict(row, plan=str(e.config if isinstance(e, Estimate) else e))
            for e in estimates for row in conditions(e, job, cluster)]
    return table(rows, [("plan", "plan"), ("axis", "axis"), ("needs", "need", ",.0f"),
                        ("has", "have", ",.0f"), ("of", "unit"), ("margin", "margin", ".2f"),
                        ("hides", lambda r: "yes" if r["hides"] else "NO"),
                        ("binds", lambda r: "<-" if r["binds"] else "")])


def _zero12_reduce(p: float, n: int, C: float, bw: float, a: float, g: float,
                   zero: int) -> hiding.Crossover:
    """ZeRO-1/2's gradient reduce-scatter under a backward (4P FLOPs a token):
    t >= (N-1)/N * (g/4) * C/bw, half of DDP's all-reduce."""
    rs = comm.ring_time("reduce_scatter", p * g, n, a, bw)
    per_token = hiding.BACKWARD_FLOPS * p / C
    return hiding.Crossover(f"ZeRO-{zero} reduce-scatter", "tokens per rank in the backward",
                            rs / per_token, "the gradients' bytes", {"comm_s": rs})


def _zero12_gather(p: float, n: int, C: float, bw: float, a: float, w: float, zero: int,
                   overlapped: bool) -> hiding.Crossover:
    """ZeRO-1/2's all-gather of the updated parameters, after the optimizer step. Overlapped with
    the next step's forward (Megatron's --overlap-param-gather, 2P FLOPs a token) it hides when
    t >= (N-1)/N * (w/2) * C/bw; without that nothing runs beside it: it never hides (need inf)."""
    ag = comm.ring_time("all_gather", p * w, n, a, bw)
    name = f"ZeRO-{zero} param all-gather"
    if not overlapped:
        return hiding.Crossover(name, "tokens per rank in the next forward", math.inf,
                                "after the optimizer step, not overlapped (exposed)",
                                {"comm_s": ag})
    per_token = hiding.FORWARD_FLOPS * p / C
    return hiding.Crossover(name, "tokens per rank in the next forward", ag / per_token,
                            "the parameters' bytes, under the next forward", {"comm_s": ag})


def _row(x: hiding.Crossover, have: float, unit: str) -> dict:
    return {"axis": x.axis, "need": x.value, "have": have, "unit": unit,
            "margin": x.margin(have), "hides": x.hides(have), "binds": False, "why": x.binds}
