"""The planner's inputs: the cluster, the job and one configuration, with sourced defaults.

Every number the planner cannot derive is a field here, with where its default comes from:
links (NVLink 3, InfiniBand HDR), the kernels' efficiency, the overlap of communication with
compute (an assumption: chapter 07 sweeps it), the memory margin, the failure rate (Llama 3),
checkpoint bandwidth (Llama 3's storage), restart time, PCIe and CPU memory bandwidth (offload),
the gradients' reduction dtype (fp32, as Megatron, torchtitan and Llama 3 reduce) and whether
ZeRO-1/2's parameter all-gather overlaps the next forward (Megatron's --overlap-param-gather).
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.costs import memory, models
from labkit.degrees import Degrees

# Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 H100s (Dubey et al. 2024,
# "The Llama 3 Herd of Models", section 3.3.4): one per 16,384 * 54 * 24 / 419 = 50,677 GPU-hours
# (5.8 GPU-years), about one every 3.1 hours for the whole job. 78% were hardware.
LLAMA3_GPU_MTBF_H = 16_384 * 54 * 24 / 419
# Llama 3's storage (Tectonic) sustains 2 TB/s, peaks at 7 (section 3.3.1): 122 MB/s per GPU
# at 16,384 GPUs, the sustained figure.
LLAMA3_CKPT_BW = 2e12 / 16_384
GRAD_REDUCE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class Cluster:
    n_gpus: int
    gpus_per_node: int = 8
    gpu: str = "A100 80GB"             # name in costs.memory.GPUS / costs.flops.PEAK_FLOPS
    gpu_memory: float | None = None    # bytes; None: the GPU's capacity
    intra_bw: float = 300e9            # bytes/s per GPU per direction inside the NVLink domain
                                       # (default: NVLink 3, one node)
    inter_bw: float = 25e9             # bytes/s per GPU between nodes (InfiniBand HDR 200 Gb/s)
    intra_alpha: float = 3e-6          # seconds per message
    inter_alpha: float = 5e-6
    flop_efficiency: float = 0.5       # share of peak the kernels reach on the FLOPs they run
    overlap: float = 0.5               # share of hideable DP traffic that hides (assumption)
    memory_margin: float = 0.10        # share of GPU memory a plan must leave free
    gpu_mtbf_h: float = LLAMA3_GPU_MTBF_H   # hours between interruptions, per GPU (Llama 3)
    ckpt_bw: float = LLAMA3_CKPT_BW    # bytes/s each GPU writes its checkpoint shard at
    restart_s: float = 600.0           # seconds to restart after a failure (assumption)
    pcie_bw: float = 25e9              # bytes/s GPU <-> CPU per GPU (PCIe 4.0 x16, offload)
    cpu_bw: float = 25e9               # bytes/s of CPU memory bandwidth per GPU (offloaded Adam)
    nvlink_domain: int | None = None   # GPUs one NVLink domain joins, at intra_bw: None is one
                                       # node (gpus_per_node; HGX: 8); a GB200/GB300 NVL72 rack
                                       # joins 72 (costs.chips.SYSTEMS; planner.system_cluster)

    def __post_init__(self):
        if self.n_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"n_gpus={self.n_gpus}, gpus_per_node={self.gpus_per_node}: both "
                             f"must be positive")
        if self.n_gpus > self.gpus_per_node and self.n_gpus % self.gpus_per_node:
            raise ValueError(f"n_gpus={self.n_gpus} is not a whole number of nodes of "
                             f"{self.gpus_per_node} GPUs: use a multiple of {self.gpus_per_node}")
        d = self.domain
        if isinstance(d, bool) or not isinstance(d, int) or d < 1 or d % self.gpus_per_node:
            raise ValueError(f"nvlink_domain={self.nvlink_domain!r}: a whole number of nodes of "
                             f"{self.gpus_per_node} GPUs (e.g. 72 for an NVL72 rack of 4-GPU "
                             f"trays), or None for one node")
        if self.n_gpus > d and self.n_gpus % d:
            raise ValueError(f"n_gpus={self.n_gpus} is not a whole number of NVLink domains of "
                             f"{d} GPUs: use a multiple of {d}")
        for name in ("flop_efficiency", "overlap", "memory_margin"):
            v = getattr(self, name)
            if not 0 <= v <= 1 or (name == "flop_efficiency" and v == 0):
                raise ValueError(f"{name}={v}: a share between 0 and 1 (50% is 0.5)")

    @property
    def domain(self) -> int:
        """GPUs one NVLink domain joins: the fast links of intra_bw. Groups that fit in one
        stay on them; larger ones cross inter_bw."""
        return self.gpus_per_node if self.nvlink_domain is None else self.nvlink_domain

    @property
    def capacity(self) -> float:
        return memory.gpu_capacity(self.gpu if self.gpu_memory is None else self.gpu_memory)

    @property
    def usable(self) -> float:
        """Bytes a plan may fill: the capacity less the margin."""
        return (1 - self.memory_margin) * self.capacity


@dataclass(frozen=True)
class Job:
    model: object                      # a ModelSpec or a preset name (costs.models.PRESETS)
    global_batch: int                  # sequences per optimizer step
    seq_len: int = 2048
    recipe: str = "mixed"              # costs.memory.RECIPES: always an explicit choice
    recompute: str = "none"            # "none", "full" (chapter 06) or "selective" (chapter 07)
    sequence_parallel: bool = False    # Megatron's SP with TP (chapter 07): activations / tp
    attention: str = "flash"           # "flash": scaled_dot_product_attention's fused kernel,
                                       # as labkit.model runs it; "eager": s x s scores kept
    offload: bool = True               # consider ZeRO-Offload plans (chapter 03)
    grad_reduce: str = "fp32"          # dtype of the gradients' all-reduce / reduce-scatter:
                                       # "fp32", the default of Megatron --bf16 (arguments.py:
                                       # "bfloat16 requires gradient accumulation and all-reduce
                                       # to be done in fp32" unless --grad-reduce-in-bf16),
                                       # torchtitan (mixed_precision_reduce="float32") and
                                       # Llama 3 (section 3.3.2, "reduce-scatter gradients in
                                       # FP32"); "bf16" halves the DP/ZeRO gradient bytes
    overlap_param_gather: bool = False  # ZeRO-1/2: the updated parameters' all-gather runs
                                        # under the next step's forward (Megatron-Core
                                        # DistributedDataParallelConfig.overlap_param_gather,
                                        # "overlap param all-gather with forward compute");
                                        # False: it waits after the optimizer step, exposed

    def __post_init__(self):
        if self.attention == "sdpa":     # PyTorch's scaled_dot_product_attention: the fused kernel
            object.__setattr__(self, "attention", "flash")
        if self.grad_reduce not in GRAD_REDUCE_BYTES:
            raise ValueError(f"grad_reduce={self.grad_reduce!r}: the gradients are reduced in "
                             f"'fp32' (Megatron's, torchtitan's and Llama 3's default) or 'bf16' "
                             f"(half the bytes); e.g. grad_reduce='fp32'")

    @property
    def grad_reduce_bytes(self) -> int:
        """Bytes per gradient value on the wire of the DP / ZeRO reduction."""
        return GRAD_REDUCE_BYTES[self.grad_reduce]

    @property
    def spec(self) -> models.ModelSpec:
        return self.model if isinstance(self.model, models.ModelSpec) else models.preset(self.model)


@dataclass(frozen=True, kw_only=True)
class Config(Degrees):
    """One configuration: the degrees (labkit.degrees: dp, tp, pp, cp, ep, zero, by keyword only,
    Config(dp=4, tp=8, pp=4, zero=1); cp splits each sequence, zig-zag ring attention, the
    weights replicated over cp; ep shards the experts over groups of ep data-parallel ranks, as
    parallel.Plan), the micro-batch and ZeRO-Offload."""
    micro_batch: int = 1
    offload: bool = False              # ZeRO-Offload: optimizer states (and their update) on CPU

    @property
    def gpus(self) -> int:
        return self.world

    def micro_batches(self, job: Job) -> int:
        return job.global_batch // (self.dp * self.micro_batch)

    def __str__(self):
        off = " +offload" if self.offload else ""
        cp = f" x CP{self.cp}" if self.cp > 1 else ""
        ep = f" (EP{self.ep})" if self.ep > 1 else ""
        return (f"TP{self.tp} x PP{self.pp} x DP{self.dp}{ep}{cp}, ZeRO-{self.zero}{off}, "
                f"b={self.micro_batch}")
