"""The planner: every feasible (TP, PP, DP, CP, EP, ZeRO stage, offload, micro-batch) for a model
on a cluster, ranked by estimated time per step including failures. Pure math over costs.memory,
costs.activations, costs.pipeline, costs.comm, costs.flops, costs.context, costs.moe and
costs.checkpoint.

    from labkit.costs import planner
    cluster = planner.Cluster(n_gpus=256, gpus_per_node=8, gpu="A100 80GB")
    job = planner.Job("gpt3-175b", global_batch=1536, seq_len=2048)
    best = planner.plan(job, cluster)[:5]        # Estimates, fastest first
    print(planner.table(best)); print(planner.reasons(best[0], job, cluster))
    planner.evaluate(planner.Config(dp=8, tp=8, pp=4, zero=1), job, cluster)
    planner.stability(job, cluster, inter_bw=[12.5e9, 25e9, 50e9])   # does the ranking hold?
    planner.plan(planner.Job("llama3-8b", global_batch=32, seq_len=131072), cluster)  # tries CP
    planner.plan(planner.Job("mixtral-8x7b", global_batch=1024, seq_len=4096), cluster)  # EP
    nvl72 = planner.system_cluster("GB200 NVL72", n_gpus=144)   # TP/EP/CP inside 72, not 8

The inputs (Cluster, Job, Config, with sourced defaults) live in costs.plan_inputs. Modules:

    planner.estimate    Estimate and evaluate(): one configuration's step, term by term
    planner.search      candidates(), plan(), rank_of(), table(): the rules and the ranking
    planner.conditions  conditions(), binding(): each axis's hiding condition (costs.hiding)
                        at this plan's numbers, and which one binds
    planner.why         reasons(): the rules of thumb behind a plan, with its numbers
    planner.stability   stability(): does the ranking hold when one input changes?
    planner.systems     system_cluster(): a Cluster from a named system (HGX H100, GB200 NVL72)

The model of one training step (each term is a function below; all are estimates, meant for
ranking and for seeing which term dominates, not for promising seconds):
  compute   hardware FLOPs (model FLOPs 6N + 12Lhs per token, plus what recomputation and a fused
            attention kernel redo) split over tp * pp * cp GPUs at `flop_efficiency` of peak; for
            a mixture of experts N is the ACTIVE parameters (the k experts a token visits)
  TP        4 all-reduces of b*(s/cp)*h 16-bit values per layer and micro-batch (2 forward, 2
            backward; Megatron f/g), on the NVLink links when the TP group fits in one NVLink
            domain (Cluster.domain: a node of 8 on HGX, 72 GPUs on an NVL72 rack)
  PP        the 1F1B step (K + P - 1)(t_f + t_b): the bubble (P-1)/(K+P-1)       (costs.pipeline)
            plus one b*(s/cp)*h activation send per stage boundary on the ramp
  CP        zig-zag ring attention over cp ranks (costs.context.cp_ring_layer_bytes): per layer
            and micro-batch cp-1 hops of this rank's K/V chunk 2*b*(s/cp)*kv forward, 2cp-1
            (K/V and dK/dV) backward; a share `overlap` of each hides under the layer's attention
            matmuls (4hs FLOPs per token forward, twice that backward), the rest is on the
            critical path. Activations, logits and compute per GPU are / cp. NVLink inside the
            domain while tp*cp fits in one. CP is tried from CP_FROM_SEQ tokens (see there)
  EP        a mixture's experts sharded over ep of the dp ranks: 2 all-to-alls forward (dispatch,
            combine) and 2 backward per MoE layer and micro-batch, each sending (ep-1)/ep of this
            rank's k * b*s/cp rows of h values (costs.moe.alltoall_bytes_per_layer); not hidden
            (DeepSeek-V3's DualPipe overlaps them; this planner does not). On the NVLink links
            while tp*cp*ep fits in one
  DP        gradients of the N/(tp*pp) local parameters, reduced over the dp*cp ranks that hold
            the same weights (CP ranks hold the same weights; a mixture's experts over the
            dp*cp/ep ranks that hold the same experts), and ZeRO shards over those ranks.
            Gradients travel in Job.grad_reduce's dtype (fp32 by default, as Megatron --bf16,
            torchtitan and Llama 3 reduce; "bf16" halves them), weights in the recipe's.
            ZeRO-0 all-reduces once per step under the last backward. ZeRO-1 reduce-scatters
            once under the last backward; ZeRO-2 keeps only a gradient shard, so it must
            reduce-scatter after EVERY micro-batch (K times). Both all-gather the updated weights
            after the optimizer step: exposed, or under the next step's forward with
            Job.overlap_param_gather (Megatron's --overlap-param-gather). ZeRO-3 all-gathers the
            weights twice per micro-batch. A share `overlap` of the traffic that could hide under
            compute does hide; the rest is exposed (overlap=1 is the ideal no run reaches:
            communication kernels compete with compute for the GPU's cores and memory bandwidth)
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
Rules of thumb (the reasons the planner prints), stated per NVLink domain (8 GPUs on an HGX node,
72 in an NVL72 rack): TP inside the domain, PP across domains, DP for the
rest; ZeRO only as far as memory needs it; enough micro-batches to shrink the bubble; CP when one
sequence's activations do not fit even with TP (and SP); EP when replicated experts do not fit,
inside the domain while the all-to-alls can stay there.
"""
from labkit.costs.flops import ADAM_BYTES_PER_PARAM, cpu_adam_s  # noqa: F401 (planner API)
from labkit.costs.plan_inputs import LLAMA3_CKPT_BW, LLAMA3_GPU_MTBF_H, Cluster, Config, Job  # noqa: F401
from labkit.costs.planner.conditions import binding, conditions, conditions_table  # noqa: F401
from labkit.costs.planner.estimate import Estimate, evaluate, memory_of  # noqa: F401
from labkit.costs.planner.search import (  # noqa: F401
                                      CP_FROM_SEQ,
                                      candidates,
                                      cp_degrees,
                                      ep_degrees,
                                      plan,
                                      rank_of,
                                      table,
)
from labkit.costs.planner.stability import stability  # noqa: F401
from labkit.costs.planner.systems import system_cluster  # noqa: F401
from labkit.costs.planner.why import reasons  # noqa: F401
