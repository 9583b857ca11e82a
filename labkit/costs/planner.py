"""The 3D planner: every feasible (TP, PP, DP, ZeRO stage, micro-batch, micro-batches) for a model
on a cluster, ranked by estimated step time. Pure math over costs.memory, costs.pipeline,
costs.comm and costs.flops.

    from labkit.costs import planner
    cluster = planner.Cluster(n_gpus=256, gpus_per_node=8, gpu="A100 80GB")
    job = planner.Job("gpt3-175b", global_batch=1536, seq_len=2048)
    best = planner.plan(job, cluster)[:5]        # Estimates, fastest first
    print(planner.table(best)); print(planner.reasons(best[0], job, cluster))
    planner.evaluate(planner.Config(tp=8, pp=4, dp=8, zero=2, micro_batch=1), job, cluster)

The model of one training step (each term is a function below; all are estimates, meant for
ranking and for seeing which term dominates, not for promising seconds):
  compute   6N FLOPs per token (+ attention, + the repeated forward under recomputation) split
            over tp * pp GPUs, at a fraction `mfu` of the GPU's peak            (costs.flops)
  TP        4 all-reduces of b*s*h 16-bit values per layer and micro-batch (2 forward, 2
            backward; Megatron f/g), on the node's links when the TP group fits in a node
  PP        the 1F1B step (K + P - 1)(t_f + t_b): the bubble (P-1)/(K+P-1)       (costs.pipeline)
            plus one b*s*h activation send per stage boundary on the ramp
  DP        gradients of the N/(tp*pp) local parameters. ZeRO 0/1 accumulate gradients locally
            and reduce once per step. ZeRO-2 keeps only a gradient shard, so it must
            reduce-scatter after EVERY micro-batch (K times), then all-gather the updated
            weights; ZeRO-3 also all-gathers the weights twice per micro-batch. The part of a
            micro-batch's DP traffic that fits under its backward compute is hidden (overlap).
  memory    costs.memory.plan: states under the ZeRO stage, activations of the micro-batches
            1F1B keeps alive (min(K, P) at the first stage), logits; it must fit in `usable`
            (default 90%) of the GPU, the rest being workspace and fragmentation.
Rules of thumb (the reasons the planner prints): TP inside a node, PP across nodes, DP for the
rest; ZeRO only as far as memory needs it; enough micro-batches to shrink the bubble.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from labkit.costs import comm, flops, memory, models, pipeline


@dataclass(frozen=True)
class Cluster:
    n_gpus: int
    gpus_per_node: int = 8
    gpu: str = "A100 80GB"             # name in costs.memory.GPUS / costs.flops.PEAK_FLOPS
    gpu_memory: float | None = None    # bytes; None: the GPU's capacity
    intra_bw: float = 300e9            # bytes/s per GPU per direction inside a node (NVLink 3)
    inter_bw: float = 25e9             # bytes/s per GPU between nodes (InfiniBand HDR 200 Gb/s)
    intra_alpha: float = 3e-6          # seconds per message
    inter_alpha: float = 5e-6
    mfu: float = 0.5                   # share of peak FLOP/s the matrix multiplies reach
    usable: float = 0.9                # share of GPU memory a plan may fill

    def __post_init__(self):
        if self.n_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"n_gpus={self.n_gpus}, gpus_per_node={self.gpus_per_node}: both "
                             f"must be positive")
        if self.n_gpus > self.gpus_per_node and self.n_gpus % self.gpus_per_node:
            raise ValueError(f"n_gpus={self.n_gpus} is not a whole number of nodes of "
                             f"{self.gpus_per_node} GPUs: use a multiple of {self.gpus_per_node}")

    @property
    def capacity(self) -> float:
        return memory.gpu_capacity(self.gpu if self.gpu_memory is None else self.gpu_memory)


@dataclass(frozen=True)
class Job:
    model: object                      # a ModelSpec or a preset name (costs.models.PRESETS)
    global_batch: int                  # sequences per optimizer step
    seq_len: int = 2048
    recipe: str = "mixed"              # costs.memory.RECIPES: always an explicit choice
    recompute: str = "selective"       # "none", "selective" or "full"
    sequence_parallel: bool = True     # Megatron's sequence parallelism with TP (same traffic)

    @property
    def spec(self) -> models.ModelSpec:
        return self.model if isinstance(self.model, models.ModelSpec) else models.preset(self.model)


@dataclass(frozen=True)
class Config:
    tp: int
    pp: int
    dp: int
    zero: int = 0
    micro_batch: int = 1

    def micro_batches(self, job: Job) -> int:
        return job.global_batch // (self.dp * self.micro_batch)

    def __str__(self):
        return f"TP{self.tp} x PP{self.pp} x DP{self.dp}, ZeRO-{self.zero}, b={self.micro_batch}"


@dataclass
class Estimate:
    """One configuration's numbers. Seconds per step; the step splits exactly as
    K * compute_s + tp_comm_s + bubble_s + pp_comm_s + dp_exposed_s."""
    config: Config
    K: int                       # micro-batches per step per pipeline
    memory: memory.MemoryPlan    # bytes per GPU, by component
    fits: bool
    bubble: float                # idle share of the pipelined step
    compute_s: float             # one micro-batch's forward + backward on one stage
    tp_comm_s: float             # per step, on the critical path
    pp_comm_s: float
    dp_comm_s: float             # per step, all of it
    dp_exposed_s: float          # the part not hidden under backward compute
    step_s: float
    bubble_s: float = 0.0        # idle time of the pipeline ramp, (P-1)(t_f + t_b)
    notes: list = field(default_factory=list)

    @property
    def comm_s(self) -> float:
        return self.tp_comm_s + self.pp_comm_s + self.dp_comm_s

    def row(self) -> dict:
        c = self.config
        return {"TP": c.tp, "PP": c.pp, "DP": c.dp, "ZeRO": c.zero, "micro-batch": c.micro_batch,
                "K": self.K, "memory GB": round(self.memory.total / 1e9, 1),
                "states GB": round((self.memory.params + self.memory.grads
                                    + self.memory.optimizer) / 1e9, 2),
                "bubble %": round(100 * self.bubble, 1), "TP comm s": round(self.tp_comm_s, 2),
                "PP comm s": round(self.pp_comm_s, 2), "DP comm s": round(self.dp_comm_s, 2),
                "DP exposed s": round(self.dp_exposed_s, 2), "step s": round(self.step_s, 2),
                "fits": self.fits}


# ----------------------------------------------------------------------------- one configuration
def _link(cluster: Cluster, spans_nodes: bool):
    return ((cluster.inter_alpha, cluster.inter_bw) if spans_nodes
            else (cluster.intra_alpha, cluster.intra_bw))


def evaluate(config: Config, job: Job, cluster: Cluster) -> Estimate:
    """Memory, bubble, communication and step time of one configuration (no feasibility filter
    beyond `fits`; raises ValueError when the numbers cannot describe a run at all)."""
    spec, c = job.spec, config
    if c.tp * c.pp * c.dp != cluster.n_gpus:
        raise ValueError(f"TP x PP x DP = {c.tp} x {c.pp} x {c.dp} = {c.tp * c.pp * c.dp}, but "
                         f"the cluster has {cluster.n_gpus} GPUs: the product must match")
    if job.global_batch % (c.dp * c.micro_batch):
        raise ValueError(f"global batch {job.global_batch} is not a whole number of micro-batches "
                         f"of {c.micro_batch} on each of DP={c.dp} replicas")
    K = c.micro_batches(job)
    n = models.num_params(spec)
    mem = memory.plan(spec, recipe=job.recipe, zero_stage=c.zero, dp=c.dp, tp=c.tp, pp=c.pp,
                      seq_len=job.seq_len, micro_batch=c.micro_batch, recompute=job.recompute,
                      sequence_parallel=job.sequence_parallel and c.tp > 1,
                      microbatches_alive=min(K, c.pp))
    fits = mem.total <= cluster.usable * cluster.capacity
    g = cluster.gpus_per_node
    # TP is the innermost dimension (labkit.topology): ranks tp*dp apart are neighbouring stages
    tp_spans, dp_spans = c.tp > g, c.tp * c.dp > g
    pp_spans = c.tp * c.dp >= g and cluster.n_gpus > g

    # compute: one micro-batch, forward + backward, on one stage of tp GPUs
    tokens = c.micro_batch * job.seq_len
    f_tok = flops.flops_per_token(n, spec.n_layers, spec.hidden, job.seq_len, job.recompute)
    compute = f_tok * tokens / (c.tp * c.pp) / (flops.peak_flops(cluster.gpu) * cluster.mfu)
    fwd_share = 2 / (f_tok / n)                                        # 2N of the f_tok FLOPs
    t_f, t_b = compute * fwd_share, compute * (1 - fwd_share)

    # TP: Megatron f/g all-reduces of b*s*h 16-bit values, 4 per layer (6 if the forward is redone)
    layers = -(-spec.n_layers // c.pp)
    act_bytes = 2 * tokens * spec.hidden
    n_ar = 6 if job.recompute == "full" else 4
    t_ar = comm.ring_allreduce_time(act_bytes, c.tp, *_link(cluster, tp_spans)) if c.tp > 1 else 0.0
    tp_mb = layers * n_ar * t_ar                                       # per micro-batch, per stage
    t_f, t_b = t_f + tp_mb * 2 / n_ar, t_b + tp_mb * (n_ar - 2) / n_ar

    # PP: 1F1B, one activation (forward) or its gradient (backward) per boundary crossing
    a, bw = _link(cluster, pp_spans)
    t_p2p = (a + act_bytes / bw) if c.pp > 1 else 0.0
    step = pipeline.step_time(c.pp, K, t_f, t_b, t_p2p=t_p2p)
    bubble = pipeline.bubble_fraction(c.pp, K)

    # DP: gradients of the local N/(tp*pp) parameters
    r = memory.get_recipe(job.recipe)
    local = n / (c.tp * c.pp)
    a, bw = _link(cluster, dp_spans)
    rs = comm.ring_time("reduce_scatter", local * r.grads, c.dp, a, bw) if c.dp > 1 else 0.0
    ag = comm.ring_time("all_gather", local * r.weights, c.dp, a, bw) if c.dp > 1 else 0.0
    if c.zero <= 1:
        # gradients accumulate locally; one all-reduce (= RS + AG) per step, under the last backward
        dp_total = rs + ag
        exposed = max(0.0, dp_total - t_b)
    elif c.zero == 2:
        # a gradient shard cannot accumulate a full gradient: reduce-scatter every micro-batch
        dp_total = K * rs + ag
        exposed = K * max(0.0, rs - t_b) + ag
    else:
        # ZeRO-3: gather the weights for the forward (under t_f), again for the backward and
        # reduce-scatter the gradients (under t_b), for every micro-batch
        dp_total = K * (rs + 2 * ag)
        exposed = K * (max(0.0, ag - t_f) + max(0.0, ag + rs - t_b))
    step += exposed

    notes = []
    if c.zero == 2 and K > 1:
        notes.append(f"ZeRO-2 reduce-scatters gradients after each of the K={K} micro-batches")
    if c.zero == 3 and K > 1:
        notes.append(f"ZeRO-3 all-gathers the weights twice per micro-batch (K={K})")
    return Estimate(c, K, mem, fits, bubble, compute, K * tp_mb, 2 * (c.pp - 1) * t_p2p,
                    dp_total, exposed, step, (c.pp - 1) * (t_f + t_b), notes)


# ----------------------------------------------------------------------------- search
def candidates(job: Job, cluster: Cluster, micro_batches=(1, 2, 4, 8)):
    """Every configuration the rules allow, with why others were left out: (configs, skipped)."""
    spec, n = job.spec, cluster.n_gpus
    out, skipped = [], {}

    def skip(why):
        skipped[why] = skipped.get(why, 0) + 1

    for tp in (d for d in range(1, n + 1) if n % d == 0):
        if tp > cluster.gpus_per_node:
            skip("TP larger than a node (TP stays on the fast links)")
            continue
        if spec.n_heads % tp or spec.kv_heads % tp and tp % spec.kv_heads:
            skip("TP does not divide the attention heads")
            continue
        for pp in (d for d in range(1, n // tp + 1) if (n // tp) % d == 0):
            if pp > spec.n_layers:
                skip("more pipeline stages than layers")
                continue
            dp = n // (tp * pp)
            for zero in ((0, 1, 2, 3) if dp > 1 else (0,)):
                for b in micro_batches:
                    if job.global_batch % (dp * b):
                        skip("global batch not divisible by DP x micro-batch")
                        continue
                    if pp > 1 and job.global_batch // (dp * b) < pp:
                        skip("fewer micro-batches than pipeline stages")
                        continue
                    out.append(Config(tp, pp, dp, zero, b))
    return out, skipped


def plan(job: Job, cluster: Cluster, *, include_unfit: bool = False, **kw) -> list:
    """Estimates of every candidate, fastest first (only those that fit, unless asked)."""
    configs, _ = candidates(job, cluster, **kw)
    ests = [evaluate(c, job, cluster) for c in configs]
    if not include_unfit:
        ests = [e for e in ests if e.fits]
    return sorted(ests, key=lambda e: (e.step_s, e.memory.total))


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
    out.append(f"DP={c.dp} for the rest, ZeRO-{c.zero}: model states "
               f"{(est.memory.params + est.memory.grads + est.memory.optimizer) / gb:.1f} GB of "
               f"{est.memory.total / gb:.1f} GB per GPU (usable {cluster.usable * cluster.capacity / gb:.0f} GB); "
               f"DP traffic {est.dp_comm_s:.2f} s per step, {est.dp_exposed_s:.2f} s not hidden.")
    if c.zero >= 1:
        lower = evaluate(replace(c, zero=c.zero - 1), job, cluster)
        if not lower.fits:
            out.append(f"ZeRO-{c.zero - 1} would need {lower.memory.total / gb:.1f} GB per GPU: "
                       f"does not fit, so stage {c.zero} is needed.")
        elif lower.step_s > est.step_s:
            out.append(f"ZeRO-{c.zero - 1} also fits but is not faster here "
                       f"({lower.step_s:.2f} s vs {est.step_s:.2f} s).")
    return out + [n + "." for n in est.notes]
