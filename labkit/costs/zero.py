"""What ZeRO costs besides memory: bytes sent per step, offload's PCIe traffic, and DeepSpeed's
published memory estimates (pure math).

    from labkit.costs import zero
    zero.comm_per_rank(7e9, zero=3, dp=64)["total"]             # 3(N-1)/N * Ψ * 2 bytes
    zero.deepspeed_zero2_estimate(2_851_598_336, gpus_per_node=8)["gpu"] / 2**30   # 15.93 GiB

Units: bytes. Ψ is the number of parameters; `bytes_per_value` the width of what is sent
(2 for bf16). Ring collectives (labkit.costs.comm): a reduce-scatter or an all-gather of a
D-byte buffer sends (N-1)/N * D bytes per rank; an all-reduce is both.
"""
from __future__ import annotations

from labkit.costs._check import positive_ints
from labkit.costs.flops import cpu_adam_s
from labkit.costs.memory import get_recipe
from labkit.degrees import check_zero


def comm_per_rank(n_params: float, zero: int, dp: int, bytes_per_value: float = 2) -> dict:
    """Bytes each rank sends per step (ring collectives) for a ZeRO stage: the ZeRO paper's 2Ψ/3Ψ.

    Stages 0-2 move the gradients once through a reduce-scatter and the (updated) parameters once
    through an all-gather: 2(N-1)/N Ψ values, the same as DDP's all-reduce (which is those two
    phases). Stage 3 all-gathers the parameters twice (forward, and again in backward because
    they were freed) and reduce-scatters the gradients: 3(N-1)/N Ψ, 1.5x DDP."""
    positive_ints(dp=dp)
    check_zero(zero)
    one = (dp - 1) / dp * n_params * bytes_per_value   # one reduce-scatter or all-gather
    parts = ({"reduce_scatter": one, "all_gather": one} if zero < 3 else
             {"reduce_scatter": one, "all_gather": 2 * one})
    parts["total"] = sum(parts.values())
    return parts


def hsdp_comm_per_rank(n_params: float, replicate: int, shard: int, param_bytes: float = 2,
                       grad_bytes: float = 4) -> dict:
    """Bytes each rank sends per step under HSDP (labkit.zero.hsdp), per mesh dimension, ring
    collectives: ZeRO-3 over the shard group, 3(S-1)/S Ψ (two all-gathers of param_bytes, one
    reduce-scatter of grad_bytes), and the all-reduce of the Ψ/S gradient shard over the
    replicate group, 2(R-1)/R Ψ/S grad_bytes. replicate=1 is ZeRO-3 (FSDP), shard=1 is DDP."""
    positive_ints(replicate=replicate, shard=shard)
    one = (shard - 1) / shard * n_params
    out = {"shard": 2 * one * param_bytes + one * grad_bytes,
           "replicate": 2 * (replicate - 1) / replicate * n_params / shard * grad_bytes}
    out["total"] = out["shard"] + out["replicate"]
    return out


def zeropp_comm_per_rank(n_params: float, world: int, *, qwz: bool = False, hpz: int = 0,
                         qgz: bool = False, block: int = 256, param_bytes: float = 2,
                         grad_bytes: float = 4) -> dict:
    """Bytes each rank sends per step under ZeRO++ (labkit.zero.zeropp; Wang et al. 2023), per
    collective. Ψ = n_params is split in N shards of c = Ψ/N values (give one unit's padded Ψ to
    be exact: blocks are rounded up per shard). int8 blocks of `block` values carry one fp32
    scale each: ceil(c/block)(block + 4) bytes a shard instead of c·param_bytes.

    forward_gather   (N-1) shards, int8 with qwZ, else param_bytes a value
    backward_gather  hpZ=G: (G-1) secondary shards of ceil(Ψ/G) values (inside the node, in the
                     compute dtype); else as forward
    reduce_scatter   (N-1) chunks, int8 all-to-all with qgZ, else grad_bytes a value
    With hpZ, nodes of G ranks, only the forward gather and the gradients cross nodes."""
    positive_ints(world=world)
    c = n_params / world
    blocks = -(-c // block)

    def shard_bytes(quantized: bool, width: float) -> float:
        return blocks * (block + 4) if quantized else c * width

    fwd = (world - 1) * shard_bytes(qwz, param_bytes)
    if hpz and hpz < world:
        positive_ints(hpz=hpz)
        bwd = (hpz - 1) * -(-n_params // hpz) * param_bytes
    else:
        bwd = fwd
    rs = (world - 1) * shard_bytes(qgz, grad_bytes)
    out = {"forward_gather": fwd, "backward_gather": bwd, "reduce_scatter": rs}
    out["total"] = fwd + bwd + rs
    return out


def hsdp_or_fsdp(n_params: float, nodes: int, gpus_per_node: int, intra_bw: float,
                 inter_bw: float, param_bytes: float = 2, grad_bytes: float = 4,
                 state_bytes: float = 16, memory_bytes: float | None = None) -> dict:
    """FSDP over all nodes x gpus_per_node ranks, or HSDP sharded inside each node and replicated
    across nodes: communication seconds per step and model-state bytes per GPU of each, and the
    choice (the faster one whose model states fit in memory_bytes, when given).

    intra_bw, inter_bw: bytes/s per GPU inside a node (NVLink) and across nodes (its NIC). FSDP's
    ring spans the nodes, so all of its 3(N-1)/N Ψ runs at inter_bw (the slowest link of the
    ring); HSDP's gathers and reduce-scatter stay at intra_bw and only the gradient shard's
    all-reduce crosses nodes. state_bytes: model-state bytes per parameter (16 for mixed
    precision with fp32 Adam). Default dtypes: bf16 gathers, fp32 gradient reduction."""
    positive_ints(nodes=nodes, gpus_per_node=gpus_per_node)
    world = nodes * gpus_per_node
    fsdp = hsdp_comm_per_rank(n_params, 1, world, param_bytes, grad_bytes)
    hsdp = hsdp_comm_per_rank(n_params, nodes, gpus_per_node, param_bytes, grad_bytes)
    out = {"fsdp": {"seconds": fsdp["total"] / (inter_bw if nodes > 1 else intra_bw),
                    "state_bytes": state_bytes * n_params / world, "sent": fsdp["total"]},
           "hsdp": {"seconds": hsdp["shard"] / intra_bw + hsdp["replicate"] / inter_bw,
                    "state_bytes": state_bytes * n_params / gpus_per_node,
                    "sent": hsdp["total"]}}
    fits = [k for k in ("hsdp", "fsdp")
            if memory_bytes is None or out[k]["state_bytes"] <= memory_bytes]
    out["choice"] = min(fits, key=lambda k: out[k]["seconds"]) if fits else None
    return out


def offload_transfer_bytes(n_params: float, *, recipe, dp: int = 1) -> dict:
    """PCIe bytes per step per GPU under ZeRO-Offload: gradient shard out, weight shard back."""
    r = get_recipe(recipe)
    positive_ints(dp=dp)
    out = {"gpu_to_cpu_grads": r.grads * n_params / dp,
           "cpu_to_gpu_weights": r.weights * n_params / dp}
    out["total"] = out["gpu_to_cpu_grads"] + out["cpu_to_gpu_weights"]
    return out


def offload_seconds(n_params: float, *, recipe, dp: int = 1, pcie_bw: float = 25e9,
                    cpu_bw: float = 25e9) -> dict:
    """Seconds per step ZeRO-Offload adds per GPU: {"pcie_s", "cpu_adam_s", "total"}.

    The PCIe copies (offload_transfer_bytes over pcie_bw) and the CPU's Adam over Ψ/N elements
    (costs.flops.cpu_adam_s: memory-bound, ADAM_BYTES_PER_PARAM bytes per element over cpu_bw).
    cpu_bw is what labkit.labs.zero.measure.offload_step measures on this machine's CPU; the
    planner takes the same number (labkit.costs.plan_inputs.Cluster(cpu_bw=...))."""

    pcie = offload_transfer_bytes(n_params, recipe=recipe, dp=dp)["total"] / pcie_bw
    adam = cpu_adam_s(n_params / dp, cpu_bw)
    return {"pcie_s": pcie, "cpu_adam_s": adam, "total": pcie + adam}


def replication_cost(n_replicated: float, *, recipe, dp: int) -> float:
    """Extra bytes per rank when n_replicated parameters stay whole under ZeRO-3 instead of
    being sharded: (p + g + o) * n_replicated * (1 - 1/N)."""
    positive_ints(dp=dp)
    return get_recipe(recipe).total * n_replicated * (1 - 1 / dp)


# ------------------------------------------------------------------------- DeepSpeed's estimates
def deepspeed_zero2_estimate(total_params: float, *, gpus_per_node: int = 1, nodes: int = 1,
                             cpu_offload: bool = False, buffer_factor: float = 1.5) -> dict:
    """DeepSpeed's estimate_zero2_model_states_mem_needs: {"gpu": bytes, "cpu": bytes}.

    Without offload each GPU holds 4Ψ + 16Ψ/N: DeepSpeed counts fp16 weights and gradients (4Ψ,
    the full gradient buffer during backward) and 16 bytes/param of sharded fp32 state."""
    n = gpus_per_node * nodes
    if cpu_offload:
        return {"gpu": 2 * total_params,
                "cpu": total_params * max(4 * n, 16) * buffer_factor}
    return {"gpu": 4 * total_params + int(16 * total_params / n),
            "cpu": total_params * 4 * gpus_per_node * buffer_factor}


def deepspeed_zero3_estimate(total_params: float, largest_layer_params: float, *,
                             gpus_per_node: int = 1, nodes: int = 1, cpu_offload: bool = False,
                             cpu_offload_params: bool = False, zero_init: bool = True,
                             buffer_factor: float = 1.5) -> dict:
    """DeepSpeed's estimate_zero3_model_states_mem_needs: {"gpu": bytes, "cpu": bytes}.

    Without offload: 18Ψ/N per GPU plus 4 bytes x the largest layer (gathered whole)."""
    n = gpus_per_node * nodes
    per_node = 1 / nodes
    largest = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        gpu = largest
        k = 18 * per_node if zero_init else max(4 * gpus_per_node, 18 * per_node)
        return {"gpu": gpu, "cpu": total_params * k * buffer_factor}
    if cpu_offload:
        gpu = largest + int(2 * total_params / n)
        k = 16 * per_node if zero_init else max(4 * gpus_per_node, 16 * per_node)
        return {"gpu": gpu, "cpu": total_params * k * buffer_factor}
    gpu = largest + int(18 * total_params / n)
    cpu = (largest_layer_params if zero_init else total_params) * 4 * gpus_per_node * buffer_factor
    return {"gpu": gpu, "cpu": cpu}
