"""Why a configuration: the rules of thumb behind it, with its own numbers."""
from __future__ import annotations

import math
from dataclasses import replace

from labkit.costs import memory, models
from labkit.costs.plan_inputs import Cluster, Job
from labkit.costs.planner.conditions import binding
from labkit.costs.planner.estimate import Estimate, evaluate, memory_of, spans
from labkit.costs.planner.search import CP_FROM_SEQ


def reasons(est: Estimate, job: Job, cluster: Cluster) -> list:
    """The rules of thumb behind a configuration, with its own numbers."""
    c, gb = est.config, 1e9
    out = []
    if c.tp > 1:
        n_ar = 4 if job.recompute != "full" else 6
        out.append(f"TP={c.tp} inside {_domain(cluster)}: its {n_ar} all-reduces per layer "
                   f"(activations b*s*h, not weights) use the fast links; "
                   f"{est.tp_comm_s:.2f} s per step.")
    else:
        out.append("TP=1: the model fits without splitting layers, so no per-layer all-reduces.")
    if c.pp > 1:
        where = ("across NVLink domains" if spans(c, cluster)["pp"]
                 else "on NVLink (neighbouring stages share a domain)")
        out.append(f"PP={c.pp} {where}: only one b*s*h activation crosses each boundary per "
                   f"micro-batch; the price is the bubble, {100 * est.bubble:.1f}% with K={est.K} "
                   f"micro-batches.")
    out += _cp_reason(est, job, cluster) + _ep_reason(est, job, cluster)
    over = f" (gradients reduced over DP x CP = {c.dp * c.cp} ranks)" if c.cp > 1 else ""
    out.append(f"DP={c.dp} for the rest{over}, ZeRO-{c.zero}: model states "
               f"{(est.memory.params + est.memory.grads + est.memory.optimizer) / gb:.1f} GB of "
               f"{est.memory.total / gb:.1f} GB per GPU "
               f"({cluster.usable / gb:.0f} GB usable, keeping "
               f"{100 * cluster.memory_margin:.0f}% free); "
               f"DP traffic {est.dp_comm_s:.2f} s per step, {est.dp_exposed_s:.2f} s not hidden.")
    if c.zero >= 1:
        lower = evaluate(replace(c, zero=c.zero - 1, offload=c.offload and c.zero > 2), job,
                         cluster)
        if not lower.fits:
            out.append(f"ZeRO-{c.zero - 1} would need {lower.memory.total / gb:.1f} GB per GPU: "
                       f"does not fit, so stage {c.zero} is needed.")
        elif lower.effective_step_s > est.effective_step_s:
            out.append(f"ZeRO-{c.zero - 1} also fits but is not faster here "
                       f"({lower.effective_step_s:.2f} s vs {est.effective_step_s:.2f} s).")
    bind = binding(est, job, cluster)
    if bind and math.isinf(bind["need"]):
        out.append(f"Which hiding condition binds: {bind['axis']} ({bind['why']}): nothing runs "
                   f"beside it, so all of it is exposed (Job(overlap_param_gather=True) runs it "
                   f"under the next forward, as Megatron's --overlap-param-gather).")
    elif bind:
        verdict = "fits under the compute" if bind["hides"] else "does NOT fit: exposed"
        out.append(f"Which hiding condition binds: {bind['axis']} ({bind['why']}), needs "
                   f"{bind['need']:,.0f} {bind['unit']}, has {bind['have']:,.0f} (margin "
                   f"{bind['margin']:.2f}x): its traffic {verdict} (costs.hiding).")
    out.append(f"MFU {100 * est.mfu:.1f}% (model FLOPs), HFU {100 * est.hfu:.1f}% (FLOPs the GPUs "
               f"ran, recomputation included), at {100 * cluster.flop_efficiency:.0f}% kernel "
               f"efficiency; failures and checkpoints cost {100 * est.failure_waste:.1f}% "
               f"(per-GPU MTBF {cluster.gpu_mtbf_h:,.0f} h over {cluster.n_gpus} GPUs).")
    return out + [n + "." for n in est.notes]


def _domain(cluster: Cluster) -> str:
    """'the NVLink domain of 72 GPUs' (an NVL72 rack) or 'a node of 8' (the domain is the node)."""
    if cluster.domain == cluster.gpus_per_node:
        return f"a node of {cluster.gpus_per_node} (its NVLink domain)"
    return f"the NVLink domain of {cluster.domain} GPUs"


def _states(m: memory.MemoryPlan) -> float:
    return m.params + m.grads + m.optimizer + m.gathered


def _cp_reason(est: Estimate, job: Job, cluster: Cluster) -> list:
    """CP when one sequence's activations do not fit even with TP (+ SP, recomputation)."""
    c, gb, s = est.config, 1e9, job.seq_len
    if c.cp == 1:
        if s < CP_FROM_SEQ:
            return []
        return [f"CP=1: the activations of {s:,}-token sequences fit without splitting them "
                f"({est.memory.activations / gb:.1f} GB per GPU), so no ring traffic."]
    whole = memory_of(replace(c, cp=1), job, est.K).activations
    sp = " + SP" if job.sequence_parallel and c.tp > 1 else ""
    redo = "no" if job.recompute == "none" else job.recompute
    verdict = ("does not fit" if whole + _states(est.memory) > cluster.usable
               else "would fit, but CP is faster here")
    where = (f"inside {_domain(cluster)}" if c.tp * c.cp <= cluster.domain
             else "across NVLink domains")
    return [f"CP={c.cp}: unsplit, the {s:,}-token sequences keep {whole / gb:.1f} GB of "
            f"activations per GPU with TP={c.tp}{sp} and {redo} recomputation, which "
            f"with the model states {verdict} ({cluster.usable / gb:.0f} GB usable); split over "
            f"{c.cp} ranks, {est.memory.activations / gb:.1f} GB. Ring attention passes K/V "
            f"{where}: {est.cp_comm_s:.2f} s per step, {est.cp_exposed_s:.2f} s not hidden "
            f"under the attention compute."]


def _ep_reason(est: Estimate, job: Job, cluster: Cluster) -> list:
    """EP when replicated experts do not fit; inside a node while the all-to-alls can stay there."""
    c, spec, gb = est.config, job.spec, 1e9
    if not spec.n_experts:
        return []
    kw = dict(recipe=job.recipe, zero=c.zero, offload_optimizer=c.offload)
    experts = models.expert_params(spec) / (c.tp * c.pp)                # on one GPU without EP
    every = memory.model_states(experts, dp=c.dp * c.cp, **kw).total
    if c.ep == 1:
        return [f"EP=1: every GPU holds all {spec.n_experts} experts ({every / gb:.1f} GB of "
                f"expert states) and sends no all-to-all."]
    mine = memory.model_states(experts / c.ep, dp=c.dp * c.cp // c.ep, **kw).total
    inside = c.tp * c.cp * c.ep <= cluster.domain
    where = f"inside {_domain(cluster)}" if inside else "across NVLink domains"
    return [f"EP={c.ep} {where}: each GPU holds "
            f"{spec.n_experts // c.ep} of the {spec.n_experts} experts, {mine / gb:.1f} GB of "
            f"expert states instead of {every / gb:.1f} GB; the 4 all-to-alls per MoE layer and "
            f"micro-batch (dispatch and combine, forward and backward) cost {est.ep_comm_s:.2f} s "
            f"per step on the {'NVLink' if inside else 'inter-domain'} links."]
