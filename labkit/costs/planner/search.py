"""The search: every configuration the rules allow, ranked by estimated time per step."""
from __future__ import annotations

from dataclasses import replace

from labkit.costs.plan_inputs import Cluster, Config, Job
from labkit.costs.planner.estimate import evaluate

# CP is tried from 16K tokens. Llama 3 405B trained its 8K-token stage without CP and turned on
# CP 16 for the 128K long-context stage (Dubey et al. 2024, "The Llama 3 Herd of Models",
# table 4); below 16K the activations of one sequence are handled by TP, SP and recomputation.
# candidates(..., cps=(1, 2, 4)) tries any degrees at any length.
CP_FROM_SEQ = 16384


def cp_degrees(job: Job, cluster: Cluster) -> tuple:
    """The CP degrees tried by default: 1 below CP_FROM_SEQ tokens or without a fused attention
    kernel; from there every power of two that cuts the sequence into 2*cp equal chunks."""
    if job.seq_len < CP_FROM_SEQ or job.attention != "flash":
        return (1,)
    out, cp = [], 1
    while cp <= cluster.n_gpus and job.seq_len % (2 * cp) == 0:
        out.append(cp)
        cp *= 2
    return tuple(out)


def ep_degrees(job: Job, dp: int) -> tuple:
    """EP degrees for a mixture: those that divide both the experts and dp (1 for a dense model)."""
    e = job.spec.n_experts
    return tuple(d for d in range(1, dp + 1) if dp % d == 0 and e % d == 0) if e else (1,)


def candidates(job: Job, cluster: Cluster, micro_batches=(1, 2, 4, 8), cps=None):
    """Every configuration the rules allow, with why others were left out: (configs, skipped).
    cps: the CP degrees to try (default cp_degrees: from CP_FROM_SEQ tokens on)."""
    spec, n = job.spec, cluster.n_gpus
    out, skipped = [], {}

    def skip(why):
        skipped[why] = skipped.get(why, 0) + 1

    cps = cp_degrees(job, cluster) if cps is None else cps
    for tp in (d for d in range(1, n + 1) if n % d == 0):
        if tp > cluster.domain:
            skip("TP larger than the NVLink domain (TP stays on the fast links)")
            continue
        if spec.n_heads % tp or spec.kv_heads % tp and tp % spec.kv_heads:
            skip("TP does not divide the attention heads")
            continue
        for cp in cps:
            if (n // tp) % cp:
                skip("TP x CP does not divide the GPUs")
                continue
            if cp > 1 and (job.seq_len % (2 * cp) or job.attention != "flash"):
                skip("CP does not cut the sequence into 2 x CP chunks (or attention is not fused)")
                continue
            rest = n // (tp * cp)
            for pp in (d for d in range(1, rest + 1) if rest % d == 0):
                if pp > spec.n_layers:
                    skip("more pipeline stages than layers")
                    continue
                dp = rest // pp
                for ep in ep_degrees(job, dp):
                    config = Config(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
                    _stages(job, config, micro_batches, out, skip)
    return out, skipped


def _stages(job: Job, base: Config, micro_batches, out: list, skip) -> None:
    """Append base under each ZeRO stage (and offload) and micro-batch the rules allow."""
    dp, pp = base.dp, base.pp
    shards = dp * base.cp > 1                            # ZeRO shards over the dp*cp ranks
    stages = [(z, False) for z in ((0, 1, 2, 3) if shards else (0,))]
    if job.offload and shards:
        stages += [(2, True), (3, True)]                 # DeepSpeed offloads from stage 2
    for zero, off in stages:
        if zero == 3 and base.ep > 1:
            skip("ZeRO-3 with EP (ZeRO-3 would shard the experts over DP too)")
            continue
        for b in micro_batches:
            if job.global_batch % (dp * b):
                skip("global batch not divisible by DP x micro-batch")
                continue
            if pp > 1 and job.global_batch // (dp * b) < pp:
                skip("fewer micro-batches than pipeline stages")
                continue
            out.append(replace(base, zero=zero, micro_batch=b, offload=off))


def plan(job: Job, cluster: Cluster, *, include_unfit: bool = False, **kw) -> list:
    """Estimates of every candidate, fastest first (only those that fit, unless asked)."""
    configs, _ = candidates(job, cluster, **kw)
    ests = [evaluate(c, job, cluster) for c in configs]
    if not include_unfit:
        ests = [e for e in ests if e.fits]
    return sorted(ests, key=lambda e: (e.effective_step_s, e.memory.total))


def rank_of(config: Config, ranked: list) -> int | None:
    """1-based position of `config` in a ranked list (None when absent)."""
    for i, e in enumerate(ranked, 1):
        if e.config == config:
            return i
    return None


def table(estimates, columns=None) -> str:
    rows = [e.row() for e in estimates]
    if not rows:
        return "(no configuration fits)"
    cols = columns or list(rows[0])
    widths = [max(len(str(c)), *(len(str(r[c])) for r in rows)) for c in cols]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)
