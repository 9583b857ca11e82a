"""The planner: every feasible (TP, PP, DP, CP, EP, ZeRO stage, offload, micro-batch) for a model
on a cluster, ranked by estimated time per step including failures. Pure math over costs.memory,
costs.activations, costs.pipeline, costs.comm, costs.flops, costs.context, costs.moe and
costs.checkpoint.

    from labkit.costs import planner
    cluster = planner.Cluster(n_gpus=256, gpus_per_node=8, gpu="A100 80GB")
    job = planner.Job("gpt3-175b", global_batch=1536, seq_len=2048)
    best = planner.plan(job, cluster)[:5]        # Estimates, fastest first
    print(planner.table(best)); print(planner.reasons(best[0], job, cluster))
    planner.evaluate(planner.Config(tp=8, pp=4, dp=8, zero=1), job, cluster)
    planner.stability(job, cluster, inter_bw=[12.5e9, 25e9, 50e9])   # does the ranking hold?
    planner.plan(planner.Job("llama3-8b", global_batch=32, seq_len=131072), cluster)  # tries CP
    planner.plan(planner.Job("mixtral-8x7b", global_batch=1024, seq_len=4096), cluster)  # EP

The inputs (Cluster, Job, Config, with sourced defaults) live in costs.plan_inputs.

The model of one training step (each term is a function below; all are estimates, meant for
ranking and for seeing which term dominates, not for promising seconds):
  compute   hardware FLOPs (model FLOPs 6N + 12Lhs per token, plus what recomputation and a fused
            attention kernel redo) split over tp * pp * cp GPUs at `flop_efficiency` of peak; for
            a mixture of experts N is the ACTIVE parameters (the k experts a token visits)
  TP        4 all-reduces of b*(s/cp)*h 16-bit values per layer and micro-batch (2 forward, 2
            backward; Megatron f/g), on the node's links when the TP group fits in a node
  PP        the 1F1B step (K + P - 1)(t_f + t_b): the bubble (P-1)/(K+P-1)       (costs.pipeline)
            plus one b*(s/cp)*h activation send per stage boundary on the ramp
  CP        zig-zag ring attention over cp ranks (costs.context.cp_ring_layer_bytes): per layer
            and micro-batch cp-1 hops of this rank's K/V chunk 2*b*(s/cp)*kv forward, 2cp-1
            (K/V and dK/dV) backward; a share `overlap` of each hides under the layer's attention
            matmuls (4hs FLOPs per token forward, twice that backward), the rest is on the
            critical path. Activations, logits and compute per GPU are / cp. Links inside a node
            while tp*cp fits in one. CP is tried from CP_FROM_SEQ tokens (see there)
  EP        a mixture's experts sharded over ep of the dp ranks: 2 all-to-alls forward (dispatch,
            combine) and 2 backward per MoE layer and micro-batch, each sending (ep-1)/ep of this
            rank's k * b*s/cp rows of h values (costs.moe.alltoall_bytes_per_layer); not hidden
            (DeepSeek-V3's DualPipe overlaps them; this planner does not). On the node's links
            while tp*cp*ep fits in one
  DP        gradients of the N/(tp*pp) local parameters, reduced over the dp*cp ranks that hold
            the same weights (CP ranks hold the same weights; a mixture's experts over the
            dp*cp/ep ranks that hold the same experts), and ZeRO shards over those ranks.
            ZeRO 0/1 accumulate gradients locally and reduce once per step. ZeRO-2 keeps only a
            gradient shard, so it must reduce-scatter after EVERY micro-batch (K times), then
            all-gather the updated weights; ZeRO-3 also all-gathers the weights twice per
            micro-batch. A share `overlap` of the traffic that could hide under backward compute
            does hide; the rest is exposed (overlap=1 is the ideal no run reaches: communication
            kernels compete with compute for the GPU's cores and memory bandwidth)
  offload   ZeRO-Offload: gradient shard to the CPU and weight shard back over PCIe, and the
            CPU's Adam step over the shard (memory-bound: bytes touched / CPU bandwidth)
  failures  a sharded checkpoint every Young interval sqrt(2 * save * MTBF); the share of time
            lost to saving, to redoing half an interval and to restarting inflates the step
  memory    costs.memory.plan: states under the ZeRO stage, activations of the micro-batches
            1F1B keeps alive (min(K, P) at the first stage), logits (both for s/cp tokens); a
            mixture's expert states / ep, and its MLP activations kept for each of the k experts a
            token visits; it must leave `memory_margin` (10%) of the GPU free
MFU counts the model FLOPs per second, HFU the FLOPs the hardware ran (recomputation included);
both are reported. Sequence parallelism and selective recomputation are options, off by default:
the chapter on sequence and context parallelism teaches them.
Rules of thumb (the reasons the planner prints): TP inside a node, PP across nodes, DP for the
rest; ZeRO only as far as memory needs it; enough micro-batches to shrink the bubble; CP when one
sequence's activations do not fit even with TP (and SP); EP when replicated experts do not fit,
inside a node while the all-to-alls can stay there.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from labkit.costs import (activations, checkpoint, comm, context, flops, memory, models, moe,
                          pipeline)
from labkit.costs.flops import ADAM_BYTES_PER_PARAM, cpu_adam_s  # noqa: F401 (planner API)
from labkit.costs.plan_inputs import (LLAMA3_CKPT_BW, LLAMA3_GPU_MTBF_H, Cluster,  # noqa: F401
                                      Config, Job)

# CP is tried from 16K tokens. Llama 3 405B trained its 8K-token stage without CP and turned on
# CP 16 for the 128K long-context stage (Dubey et al. 2024, "The Llama 3 Herd of Models",
# table 4); below 16K the activations of one sequence are handled by TP, SP and recomputation.
# candidates(..., cps=(1, 2, 4)) tries any degrees at any length.
CP_FROM_SEQ = 16384


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
def _link(cluster: Cluster, spans_nodes: bool):
    return ((cluster.inter_alpha, cluster.inter_bw) if spans_nodes
            else (cluster.intra_alpha, cluster.intra_bw))


def _hidden(traffic: float, window: float, overlap: float) -> float:
    """Seconds of `traffic` left exposed when a share `overlap` of it hides under `window`."""
    return traffic - overlap * min(traffic, window)


def _check(c: Config, job: Job, cluster: Cluster) -> None:
    """Refuse a configuration that cannot describe a run, naming the factors and what to change."""
    spec = job.spec
    for name in ("tp", "pp", "dp", "cp", "ep"):
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{c}: {name}={v!r} must be a positive integer")
    if c.gpus != cluster.n_gpus:
        names, vals = ("TP x PP x DP", f"{c.tp} x {c.pp} x {c.dp}") if c.cp == 1 else \
            ("TP x PP x DP x CP", f"{c.tp} x {c.pp} x {c.dp} x {c.cp}")
        raise ValueError(f"{names} = {vals} = {c.gpus}, but the cluster has {cluster.n_gpus} "
                         f"GPUs: the product must match")
    if job.global_batch % (c.dp * c.micro_batch):
        raise ValueError(f"global batch {job.global_batch} is not a whole number of micro-batches "
                         f"of {c.micro_batch} on each of DP={c.dp} replicas")
    if c.offload and c.zero < 1:
        raise ValueError(f"{c}: offload needs ZeRO stage 1 or more (the optimizer is sharded first)")
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
    if c.dp % c.ep:
        raise ValueError(f"ep={c.ep} must divide dp={c.dp}: expert parallelism shards the experts "
                         f"over groups of ep data-parallel ranks; use an ep that divides {c.dp}")
    if c.ep > 1 and c.zero == 3:
        raise ValueError(f"ZeRO-3 with ep={c.ep}: ZeRO-3 would shard the experts over dp as well "
                         f"(as labkit.parallel.Plan refuses); use zero <= 2, or ep=1")


def _weight_groups(c: Config, spec) -> list:
    """[(parameters on one GPU, ranks holding the same ones)]: the dense part over dp*cp, and a
    mixture's experts (E/ep of them per GPU) over the dp*cp/ep ranks with the same experts."""
    n, n_exp = models.num_params(spec), models.expert_params(spec)
    groups = [((n - n_exp) / (c.tp * c.pp), c.dp * c.cp)]
    if n_exp:
        groups.append((n_exp / (c.tp * c.pp * c.ep), c.dp * c.cp // c.ep))
    return groups


def _memory(c: Config, job: Job, K: int) -> memory.MemoryPlan:
    """costs.memory.plan for s/cp tokens per GPU, states sharded over dp*cp; a mixture's expert
    states / ep, and its MLP activations kept once per expert a token visits (k times)."""
    spec, seq = job.spec, job.seq_len // c.cp
    kw = dict(recipe=job.recipe, zero_stage=c.zero, offload_optimizer=c.offload)
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
    a, bw = _link(cluster, c.tp * c.cp > cluster.gpus_per_node)
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
    a, bw = _link(cluster, c.tp * c.cp * c.ep > cluster.gpus_per_node)
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
    mem = _memory(c, job, K)
    fits = mem.total <= cluster.usable
    g = cluster.gpus_per_node
    # rank = ((pp * dp + dp_i) * cp + cp_i) * tp + tp_i (labkit.topology): TP innermost, then CP,
    # then DP; neighbouring pipeline stages are tp*cp*dp ranks apart
    tp_spans, dp_spans = c.tp > g, c.tp * c.cp * c.dp > g
    pp_spans = c.tp * c.cp * c.dp >= g and cluster.n_gpus > g

    # compute: one micro-batch, forward + backward, on one stage of tp*cp GPUs: hardware FLOPs
    tokens = c.micro_batch * job.seq_len
    n_mm = models.active_matmul_params(spec)     # = matmul_params for a dense model
    shape = (n_mm, spec.n_layers, spec.hidden, job.seq_len)
    f_model = flops.model_flops_per_token(*shape)
    f_hw = flops.hardware_flops_per_token(*shape, job.recompute, job.attention)
    peak = flops.peak_flops(cluster.gpu)
    speed = peak * cluster.flop_efficiency                                   # FLOP/s per GPU
    compute = f_hw * tokens / (c.tp * c.pp * c.cp) / speed
    fwd_share = (f_model / 3) / f_hw      # the forward is 2N + 4Lhs; every recomputation is in backward
    t_f, t_b = compute * fwd_share, compute * (1 - fwd_share)

    # TP: Megatron f/g all-reduces of b*s*h 16-bit values, 4 per layer (6 if the forward is redone)
    layers = -(-spec.n_layers // c.pp)
    act_bytes = 2 * tokens // c.cp * spec.hidden
    n_ar = 6 if job.recompute == "full" else 4
    t_ar = comm.ring_allreduce_time(act_bytes, c.tp, *_link(cluster, tp_spans)) if c.tp > 1 else 0.0
    tp_mb = layers * n_ar * t_ar                                       # per micro-batch, per stage
    t_f, t_b = t_f + tp_mb * 2 / n_ar, t_b + tp_mb * (n_ar - 2) / n_ar

    # CP: ring attention, partly under the attention matmuls (4hs FLOPs a token, per layer)
    window_f = 4 * spec.hidden * job.seq_len * tokens / (c.tp * c.cp) / speed
    cp_mb, cp_f, cp_b = _ring_attention(c, job, cluster, layers, window_f)
    # EP: the MoE layers' all-to-alls, on the critical path
    ep_f, ep_b = _all_to_alls(c, job, cluster, layers)
    t_f, t_b = t_f + cp_f + ep_f, t_b + cp_b + ep_b

    # PP: 1F1B, one activation (forward) or its gradient (backward) per boundary crossing
    a, bw = _link(cluster, pp_spans)
    t_p2p = (a + act_bytes / bw) if c.pp > 1 else 0.0
    step = pipeline.step_time(c.pp, K, t_f, t_b, t_p2p=t_p2p)
    bubble = pipeline.bubble_fraction(c.pp, K)

    # DP: gradients of the local parameters, over the ranks that hold the same ones
    r = memory.get_recipe(job.recipe)
    groups = [(p, ranks) for p, ranks in _weight_groups(c, spec) if ranks > 1]
    a, bw = _link(cluster, dp_spans)
    rs = sum(comm.ring_time("reduce_scatter", p * r.grads, ranks, a, bw) for p, ranks in groups)
    ag = sum(comm.ring_time("all_gather", p * r.weights, ranks, a, bw) for p, ranks in groups)
    ov = cluster.overlap
    if c.zero <= 1:
        # gradients accumulate locally; one all-reduce (= RS + AG) per step, under the last backward
        dp_total = rs + ag
        exposed = _hidden(dp_total, t_b, ov)
    elif c.zero == 2:
        # a gradient shard cannot accumulate a full gradient: reduce-scatter every micro-batch
        dp_total = K * rs + ag
        exposed = K * _hidden(rs, t_b, ov) + ag
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


# ----------------------------------------------------------------------------- search
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
        if tp > cluster.gpus_per_node:
            skip("TP larger than a node (TP stays on the fast links)")
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
                    _stages(job, Config(tp, pp, dp, cp=cp, ep=ep), micro_batches, out, skip)
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


# ----------------------------------------------------------------------------- why
def reasons(est: Estimate, job: Job, cluster: Cluster) -> list:
    """The rules of thumb behind a configuration, with its own numbers."""
    c, g, gb = est.config, cluster.gpus_per_node, 1e9
    out = []
    if c.tp > 1:
        out.append(f"TP={c.tp} inside a node of {g}: its {4 if job.recompute != 'full' else 6} "
                   f"all-reduces per layer (activations b*s*h, not weights) use the fast links; "
                   f"{est.tp_comm_s:.2f} s per step.")
    else:
        out.append("TP=1: the model fits without splitting layers, so no per-layer all-reduces.")
    if c.pp > 1:
        out.append(f"PP={c.pp} across nodes: only one b*s*h activation crosses each boundary per "
                   f"micro-batch; the price is the bubble, {100 * est.bubble:.1f}% with K={est.K} "
                   f"micro-batches.")
    out += _cp_reason(est, job, cluster) + _ep_reason(est, job, cluster)
    over = f" (gradients reduced over DP x CP = {c.dp * c.cp} ranks)" if c.cp > 1 else ""
    out.append(f"DP={c.dp} for the rest{over}, ZeRO-{c.zero}: model states "
               f"{(est.memory.params + est.memory.grads + est.memory.optimizer) / gb:.1f} GB of "
               f"{est.memory.total / gb:.1f} GB per GPU ({cluster.usable / gb:.0f} GB usable, keeping "
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
    out.append(f"MFU {100 * est.mfu:.1f}% (model FLOPs), HFU {100 * est.hfu:.1f}% (FLOPs the GPUs "
               f"ran, recomputation included), at {100 * cluster.flop_efficiency:.0f}% kernel "
               f"efficiency; failures and checkpoints cost {100 * est.failure_waste:.1f}% "
               f"(per-GPU MTBF {cluster.gpu_mtbf_h:,.0f} h over {cluster.n_gpus} GPUs).")
    return out + [n + "." for n in est.notes]


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
    whole = _memory(replace(c, cp=1), job, est.K).activations
    sp = " + SP" if job.sequence_parallel and c.tp > 1 else ""
    redo = "no" if job.recompute == "none" else job.recompute
    verdict = ("does not fit" if whole + _states(est.memory) > cluster.usable
               else "would fit, but CP is faster here")
    where = "inside a node" if c.tp * c.cp <= cluster.gpus_per_node else "across nodes"
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
    kw = dict(recipe=job.recipe, zero_stage=c.zero, offload_optimizer=c.offload)
    experts = models.expert_params(spec) / (c.tp * c.pp)                # on one GPU without EP
    every = memory.model_states(experts, dp=c.dp * c.cp, **kw).total
    if c.ep == 1:
        return [f"EP=1: every GPU holds all {spec.n_experts} experts ({every / gb:.1f} GB of "
                f"expert states) and sends no all-to-all."]
    mine = memory.model_states(experts / c.ep, dp=c.dp * c.cp // c.ep, **kw).total
    inside = c.tp * c.cp * c.ep <= cluster.gpus_per_node
    return [f"EP={c.ep} {'inside a node' if inside else 'across nodes'}: each GPU holds "
            f"{spec.n_experts // c.ep} of the {spec.n_experts} experts, {mine / gb:.1f} GB of "
            f"expert states instead of {every / gb:.1f} GB; the 4 all-to-alls per MoE layer and "
            f"micro-batch (dispatch and combine, forward and backward) cost {est.ep_comm_s:.2f} s "
            f"per step on the {'node' if inside else 'inter-node'} links."]


# ----------------------------------------------------------------------------- does the ranking hold?
def stability(job: Job, cluster: Cluster, top: int = 5, extra=(), **sweeps) -> dict:
    """How the top plans fare when one input changes: {"plans", "sweeps"}.

    plans: the `top` configurations ranked with the cluster as given, then `extra` ones (Configs
    to follow as well, e.g. a plan that wins under other assumptions). sweeps: for each keyword
    (a Cluster field such as inter_bw=[12.5e9, 25e9, 50e9] or overlap=[0, 0.5, 1]):
    {"values", "step_s": {config: [effective step per value]}, "rank": {config: [rank per value,
    None when it no longer fits]}, "winner": [the best configuration per value]}."""
    base = plan(job, cluster)[:top]
    base += [evaluate(c, job, cluster) for c in extra if c not in {e.config for e in base}]
    out = {"plans": [e.config for e in base], "sweeps": {}}
    for name, values in sweeps.items():
        res = {"values": list(values), "step_s": {e.config: [] for e in base},
               "rank": {e.config: [] for e in base}, "winner": []}
        for v in values:
            cl = replace(cluster, **{name: v})
            ranked = plan(job, cl)
            res["winner"].append(ranked[0].config if ranked else None)
            for e in base:
                res["step_s"][e.config].append(evaluate(e.config, job, cl).effective_step_s)
                res["rank"][e.config].append(rank_of(e.config, ranked))
        out["sweeps"][name] = res
    return out
