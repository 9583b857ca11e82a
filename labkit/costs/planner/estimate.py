"""One configuration's estimate: memory, compute, every axis's traffic and what of it hides.

`evaluate(config, job, cluster)` is the step model the package docstring describes; the helpers
here are its terms (ring attention, MoE all-to-alls, the memory under CP and EP)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from labkit.costs import (
    activations,
    checkpoint,
    comm,
    context,
    flops,
    memory,
    models,
    moe,
    pipeline,
)
from labkit.costs.flops import cpu_adam_s
from labkit.costs.plan_inputs import Cluster, Config, Job


@dataclass
class Estimate:
    """One configuration's numbers. Seconds per step; the failure-free step splits exactly as
    K * compute_s + tp_comm_s + cp_exposed_s + ep_comm_s + bubble_s + pp_comm_s + dp_exposed_s
    + offload_s."""
    config: Config
    K: int                       # micro-batches per step per pipeline
    memory: memory.MemoryPlan    # bytes per GPU, by component
    fits: bool                   # leaves the cluster's memory margin free
    headroom: float              # bytes left on the GPU
    bubble: float                # idle share of the pipelined step
    compute_s: float             # one micro-batch's forward + backward on one stage
    tp_comm_s: float             # per step, on the critical path
    pp_comm_s: float
    dp_comm_s: float             # per step, all of it
    dp_exposed_s: float          # the part not hidden under backward compute
    step_s: float                # failure-free
    bubble_s: float = 0.0        # idle time of the pipeline ramp, (P-1)(t_f + t_b)
    offload_s: float = 0.0       # PCIe transfers + the CPU's Adam step (ZeRO-Offload)
    mfu: float = 0.0             # model FLOPs / (step_s * GPUs * peak)
    hfu: float = 0.0             # hardware FLOPs (recomputation included) / the same
    failure_waste: float = 0.0   # share of wall time lost to checkpoints and failures
    effective_step_s: float = 0.0  # step_s / (1 - failure_waste): what ranks plans
    notes: list = field(default_factory=list)
    cp_comm_s: float = 0.0       # ring attention's K/V (and dK/dV) hops per step, all of them
    cp_exposed_s: float = 0.0    # the part not hidden under attention compute (critical path)
    ep_comm_s: float = 0.0       # the all-to-alls of the MoE layers per step (critical path)

    @property
    def comm_s(self) -> float:
        return self.tp_comm_s + self.pp_comm_s + self.dp_comm_s + self.cp_comm_s + self.ep_comm_s

    def row(self) -> dict:
        c = self.config
        return {"TP": c.tp, "PP": c.pp, "DP": c.dp, "CP": c.cp, "EP": c.ep, "ZeRO": c.zero,
                "offload": "yes" if c.offload else "no", "micro-batch": c.micro_batch,
                "K": self.K, "memory GB": round(self.memory.total / 1e9, 1),
                "headroom GB": round(self.headroom / 1e9, 1),
                "states GB": round((self.memory.params + self.memory.grads
                                    + self.memory.optimizer) / 1e9, 2),
                "bubble %": round(100 * self.bubble, 1), "TP comm s": round(self.tp_comm_s, 2),
                "PP comm s": round(self.pp_comm_s, 2), "DP comm s": round(self.dp_comm_s, 2),
                "DP exposed s": round(self.dp_exposed_s, 2),
                "CP comm s": round(self.cp_comm_s, 2),
                "CP exposed s": round(self.cp_exposed_s, 2), "EP comm s": round(self.ep_comm_s, 2),
                "offload s": round(self.offload_s, 2),
                "step s": round(self.step_s, 2), "MFU %": round(100 * self.mfu, 1),
                "HFU %": round(100 * self.hfu, 1),
                "failures %": round(100 * self.failure_waste, 1),
                "eff. step s": round(self.effective_step_s, 2), "fits": self.fits}


# ----------------------------------------------------------------------------- one configuration
def link(cluster: Cluster, spans_domains: bool) -> tuple:
    """(alpha, bandwidth) of the links a group uses: the NVLink domain's, or between domains."""
    return ((cluster.inter_alpha, cluster.inter_bw) if spans_domains
            else (cluster.intra_alpha, cluster.intra_bw))


def spans(c: Config, cluster: Cluster) -> dict:
    """Which axes' groups leave one NVLink domain (cluster.domain GPUs: a node of 8 on HGX, a
    rack of 72 on NVL72): {"tp", "cp", "dp", "pp", "ep"} -> bool.
    rank = ((pp * dp + dp_i) * cp + cp_i) * tp + tp_i (labkit.topology): TP innermost, then CP,
    then DP; neighbouring pipeline stages are tp*cp*dp ranks apart."""
    g = cluster.domain
    return {"tp": c.tp > g, "cp": c.tp * c.cp > g, "dp": c.tp * c.cp * c.dp > g,
            "pp": c.tp * c.cp * c.dp >= g and cluster.n_gpus > g,
            "ep": c.tp * c.cp * c.ep > g}


def _hidden(traffic: float, window: float, overlap: float) -> float:
    """Seconds of `traffic` left exposed when a share `overlap` of it hides under `window`."""
    return traffic - overlap * min(traffic, window)


def _check(c: Config, job: Job, cluster: Cluster) -> None:
    """Refuse a configuration that cannot describe a run, naming the factors and what to change."""
    spec = job.spec
    # labkit.degrees: the rules every layer shares (a ZeRO stage over one rank is a no-op here)
    c.degrees.check(world=cluster.n_gpus, launch=False)
    if job.global_batch % (c.dp * c.micro_batch):
        raise ValueError(f"global batch {job.global_batch} is not a whole number of micro-batches "
                         f"of {c.micro_batch} on each of DP={c.dp} replicas")
    if c.offload and c.zero < 1:
        raise ValueError(f"{c}: offload needs ZeRO stage 1 or more "
                         f"(the optimizer is sharded first)")
    if c.cp > 1 and job.seq_len % (2 * c.cp):
        raise ValueError(f"cp={c.cp} with seq_len={job.seq_len}: zig-zag ring attention cuts each "
                         f"sequence into 2 x cp = {2 * c.cp} equal chunks, so cp must divide "
                         f"seq_len/2 = {job.seq_len / 2:g}; use a cp that divides it (or a "
                         f"sequence length divisible by {2 * c.cp})")
    if c.cp > 1 and job.attention != "flash":
        raise ValueError(f"cp={c.cp} with attention={job.attention!r}: ring attention runs a fused "
                         f"(flash) kernel on each block, so it never keeps the s x s scores; use "
                         f"attention='flash' or cp=1")
    if c.ep > 1 and not spec.n_experts:
        raise ValueError(f"ep={c.ep} but {spec.name} has no experts (n_experts=0): use ep=1, or a "
                         f"mixture-of-experts model")
    if spec.n_experts:
        moe.check(spec.n_experts, spec.top_k, c.ep)     # ep must divide the number of experts


def _weight_groups(c: Config, spec) -> list:
    """[(parameters on one GPU, ranks holding the same ones)]: the dense part over dp*cp, and a
    mixture's experts (E/ep of them per GPU) over the dp*cp/ep ranks with the same experts."""
    n, n_exp = models.num_params(spec), models.expert_params(spec)
    groups = [((n - n_exp) / (c.tp * c.pp), c.dp * c.cp)]
    if n_exp:
        groups.append((n_exp / (c.tp * c.pp * c.ep), c.dp * c.cp // c.ep))
    return groups


def memory_of(c: Config, job: Job, K: int) -> memory.MemoryPlan:
    """costs.memory.plan for s/cp tokens per GPU, states sharded over dp*cp; a mixture's expert
    states / ep, and its MLP activations kept once per expert a token visits (k times)."""
    spec, seq = job.spec, job.seq_len // c.cp
    kw = dict(recipe=job.recipe, zero=c.zero, offload_optimizer=c.offload)
    act_kw = dict(seq_len=seq, micro_batch=c.micro_batch, recompute=job.recompute, tp=c.tp,
                  sequence_parallel=job.sequence_parallel and c.tp > 1, attention=job.attention)
    alive = min(K, c.pp)
    mem = memory.plan(spec, dp=c.dp * c.cp, pp=c.pp, microbatches_alive=alive, **kw, **act_kw)
    mem.settings.update(cp=c.cp, ep=c.ep)
    if not spec.n_experts:
        return mem
    states = [memory.model_states(p, dp=ranks, **kw) for p, ranks in _weight_groups(c, spec)]
    terms = activations.layer_terms(spec, **act_kw)
    mlp = sum(v for k, v in terms.items() if k.startswith(("MLP input", "SwiGLU", "GELU")))
    extra = (spec.top_k - 1) * mlp * -(-spec.n_layers // c.pp) * alive      # bytes
    return replace(mem, params=sum(s.params for s in states), grads=sum(s.grads for s in states),
                   optimizer=sum(s.optimizer for s in states), cpu=sum(s.cpu_total for s in states),
                   activations=mem.activations + extra)


def _ring_attention(c: Config, job: Job, cluster: Cluster, layers: int, window_f: float) -> tuple:
    """(all, exposed forward, exposed backward) seconds of ring attention per micro-batch on one
    stage. window_f: this rank's attention matmuls of one layer's forward, in seconds."""
    if c.cp == 1:
        return 0.0, 0.0, 0.0
    spec = job.spec
    kv = spec.kv_dim // min(c.tp, spec.kv_heads)     # K/V width on one TP rank (heads split by tp)
    by = context.cp_ring_layer_bytes(c.micro_batch, job.seq_len, kv, c.cp)   # bytes per layer
    a, bw = link(cluster, c.tp * c.cp > cluster.domain)
    fwd = (c.cp - 1) * a + by["forward"] / bw                     # cp-1 hops of K/V
    bwd = (2 * c.cp - 1) * a + by["backward"] / bw                # K/V again, then dK/dV home
    if job.recompute == "full":
        bwd += fwd                                                # the forward's ring, redone
    ov = cluster.overlap
    return (layers * (fwd + bwd), layers * _hidden(fwd, window_f, ov),
            layers * _hidden(bwd, 2 * window_f, ov))


def _all_to_alls(c: Config, job: Job, cluster: Cluster, layers: int) -> tuple:
    """(forward, backward) seconds of the MoE all-to-alls per micro-batch on one stage."""
    spec = job.spec
    if c.ep == 1 or not spec.n_experts:
        return 0.0, 0.0
    tokens = c.micro_batch * job.seq_len // c.cp                 # this rank's tokens
    # one all-to-all: half the forward pair (dispatch + combine); 16-bit rows of h values
    one = moe.alltoall_bytes_per_layer(tokens, spec.top_k, spec.hidden, c.ep, 2, "forward") / 2
    a, bw = link(cluster, c.tp * c.cp * c.ep > cluster.domain)
    t = moe.alltoall_seconds(one, bw, c.ep, a)
    fwd = layers * 2 * t
    return fwd, fwd * (2 if job.recompute == "full" else 1)     # a redone forward redoes its pair


def evaluate(config: Config, job: Job, cluster: Cluster) -> Estimate:
    """Memory, bubble, communication and step time of one configuration (no feasibility filter
    beyond `fits`; raises ValueError when the numbers cannot describe a run at all)."""
    spec, c = job.spec, config
    _check(c, job, cluster)
    K = c.micro_batches(job)
    n = models.num_params(spec)
    mem = memory_of(c, job, K)
    fits = mem.total <= cluster.usable
    tp_spans, dp_spans, pp_spans = (spans(c, cluster)[k] for k in ("tp", "dp", "pp"))

    # compute: one micro-batch, forward + backward, on one stage of tp*cp GPUs: hardware FLOPs
    tokens = c.micro_batch * job.seq_len
    n_mm = models.active_matmul_params(spec)     # = matmul_params for a dense model
    shape = (n_mm, spec.n_layers, spec.hidden, job.seq_len)
    f_model = flops.model_flops_per_token(*shape)
    f_hw = flops.hardware_flops_per_token(*shape, job.recompute, job.attention)
    peak = flops.peak_flops(cluster.gpu)
    speed = peak * cluster.flop_efficiency                                   # FLOP/s per GPU
    compute = f_hw * tokens / (c.tp * c.pp * c.cp) / speed
    # the forward is 2N + 4Lhs; every recomputation is in the backward
    fwd_share = (f_model / 3) / f_hw
    t_f, t_b = compute * fwd_share, compute * (1 - fwd_share)

    # TP: Megatron f/g all-reduces of b*s*h 16-bit values, 4 per layer (6 if the forward is redone)
    layers = -(-spec.n_layers // c.pp)
    act_bytes = 2 * tokens // c.cp * spec.hidden
    n_ar = 6 if job.recompute == "full" else 4
    t_ar = comm.ring_allreduce_time(act_bytes, c.tp, *link(cluster, tp_spans)) if c.tp > 1 else 0.0
    tp_mb = layers * n_ar * t_ar                                       # per micro-batch, per stage
    t_f, t_b = t_f + tp_mb * 2 / n_ar, t_b + tp_mb * (n_ar - 2) / n_ar

    # CP: ring attention, partly under the attention matmuls (4hs FLOPs a token, per layer)
    window_f = 4 * spec.hidden * job.seq_len * tokens / (c.tp * c.cp) / speed
    cp_mb, cp_f, cp_b = _ring_attention(c, job, cluster, layers, window_f)
    # EP: the MoE layers' all-to-alls, on the critical path
    ep_f, ep_b = _all_to_alls(c, job, cluster, layers)
    t_f, t_b = t_f + cp_f + ep_f, t_b + cp_b + ep_b

    # PP: 1F1B, one activation (forward) or its gradient (backward) per boundary crossing
    a, bw = link(cluster, pp_spans)
    t_p2p = (a + act_bytes / bw) if c.pp > 1 else 0.0
    step = pipeline.step_time(c.pp, K, t_f, t_b, t_p2p=t_p2p)
    bubble = pipeline.bubble_fraction(c.pp, K)

    # DP: gradients of the local parameters, over the ranks that hold the same ones, reduced in
    # job.grad_reduce (fp32 by default); ZeRO's parameter all-gather in the weights' dtype
    r = memory.get_recipe(job.recipe)
    g = job.grad_reduce_bytes
    groups = [(p, ranks) for p, ranks in _weight_groups(c, spec) if ranks > 1]
    a, bw = link(cluster, dp_spans)
    rs = sum(comm.ring_time("reduce_scatter", p * g, ranks, a, bw) for p, ranks in groups)
    ag = sum(comm.ring_time("all_gather", p * r.weights, ranks, a, bw) for p, ranks in groups)
    ov = cluster.overlap
    if c.zero == 0:
        # gradients accumulate locally; one all-reduce (RS + AG of gradients) under the last
        # backward
        dp_total = 2 * rs
        exposed = _hidden(dp_total, t_b, ov)
    elif c.zero in (1, 2):
        # ZeRO-1: one reduce-scatter under the last backward; ZeRO-2 (a gradient shard cannot
        # accumulate a full gradient): one under every micro-batch's backward. The updated
        # parameters' all-gather follows the optimizer step (ZeRO paper: reduce-scatter, update,
        # all-gather): exposed, unless it overlaps the next step's first forward
        # (overlap_param_gather, Megatron's --overlap-param-gather)
        n_rs = 1 if c.zero == 1 else K
        dp_total = n_rs * rs + ag
        exposed = n_rs * _hidden(rs, t_b, ov) + (_hidden(ag, t_f, ov) if job.overlap_param_gather
                                                 else ag)
    else:
        # ZeRO-3: gather the weights for the forward (under t_f), again for the backward and
        # reduce-scatter the gradients (under t_b), for every micro-batch
        dp_total = K * (rs + 2 * ag)
        exposed = K * (_hidden(ag, t_f, ov) + _hidden(ag + rs, t_b, ov))
    step += exposed

    # ZeRO-Offload: the shard's gradients go to the CPU, its Adam runs there, weights come back
    offload_s = 0.0
    if c.offload:
        shard = sum(p / ranks for p, ranks in _weight_groups(c, spec))
        offload_s = (shard * (r.grads + r.weights) / cluster.pcie_bw
                     + cpu_adam_s(shard, cluster.cpu_bw))
        step += offload_s

    # failures: a sharded checkpoint (weights + optimizer states) over every GPU, Young's interval
    save_s = n * (r.weights + r.optimizer) / cluster.n_gpus / cluster.ckpt_bw
    mtbf_s = cluster.gpu_mtbf_h * 3600 / cluster.n_gpus
    interval = checkpoint.young_interval(save_s, mtbf_s)
    waste = min(0.99, checkpoint.waste_fraction(interval, save_s, mtbf_s, cluster.restart_s))

    model_step = f_model * job.global_batch * job.seq_len
    hw_step = f_hw * job.global_batch * job.seq_len
    notes = []
    if c.zero in (1, 2) and len(groups) and not job.overlap_param_gather:
        notes.append(f"ZeRO-{c.zero}: the parameter all-gather after the step is exposed "
                     f"({ag:.2f} s; overlap_param_gather=True hides it under the next forward)")
    if c.zero == 2 and K > 1:
        notes.append(f"ZeRO-2 reduce-scatters gradients after each of the K={K} micro-batches")
    if c.zero == 3 and K > 1:
        notes.append(f"ZeRO-3 all-gathers the weights twice per micro-batch (K={K})")
    if c.offload:
        notes.append(f"offload: the CPU's Adam step and PCIe copies add {offload_s:.2f} s per step")
    return Estimate(c, K, mem, fits, cluster.capacity - mem.total, bubble, compute, K * tp_mb,
                    2 * (c.pp - 1) * t_p2p, dp_total, exposed, step, (c.pp - 1) * (t_f + t_b),
                    offload_s, flops.utilization(model_step, step, cluster.n_gpus, peak),
                    flops.utilization(hw_step, step, cluster.n_gpus, peak), waste,
                    step / (1 - waste), notes, cp_comm_s=K * cp_mb,
                    cp_exposed_s=K * (cp_f + cp_b), ep_comm_s=K * (ep_f + ep_b))
