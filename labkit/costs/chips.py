"""The GPUs the book's calculators know: dense peaks, memory bandwidth and capacity, with sources.

    from labkit.costs import chips
    chips.chip("H100 80GB").peak_flops("bf16")       # 989.5e12 FLOP/s
    chips.chip("A100 80GB").capacity / 2**30         # 80.0 GiB

The one table of hardware numbers: costs.memory reads capacities from it, costs.flops the bf16
peaks, costs.roofline the peaks per dtype and the bandwidths. Pure Python (the website runs it).
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.costs.lookup import lookup

TFLOPS = 1e12
GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class Chip:
    """A chip's roofs: dense peak FLOP/s per dtype, memory bandwidth in bytes/s, and where the
    numbers come from; capacity in bytes where known (a measured chip has none)."""
    name: str
    peak: dict
    bandwidth: float
    source: str
    capacity: float | None = None

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.peak:
            raise KeyError(f"{self.name} has no {dtype!r} peak; "
                           f"choose one of {', '.join(self.peak)}")
        return self.peak[dtype]

    def ridge(self, dtype: str) -> float:
        """FLOPs per byte at which the two roofs meet."""
        return self.peak_flops(dtype) / self.bandwidth


# Dense peaks: NVIDIA's datasheets print the tensor-core figures "with sparsity" (2:4 structured),
# twice the dense rate; the dense rate is what a training matmul can reach.
_HOPPER = {"fp32": 67 * TFLOPS, "tf32": 989 * TFLOPS / 2, "bf16": 1979 * TFLOPS / 2,
           "fp16": 1979 * TFLOPS / 2, "fp8": 3958 * TFLOPS / 2}
_AMPERE = {"fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS, "bf16": 312 * TFLOPS,
           "fp16": 312 * TFLOPS}
_A100_SHEET = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-"
               "web): FP32 19.5 TFLOPS; TF32 156, BF16/FP16 312 TFLOPS dense (312 / 624 with "
               "sparsity); ")

# Capacities: the marketing "GB" of HBM are GiB: exact for the A100 80GB (nvidia-smi: 81,920 MiB);
# the H100 80GB shows 81,559 MiB (85.5 GB), so its 80 GiB here is 0.4 GB generous.
CHIPS = {
    "A100 40GB": Chip("A100 40GB", _AMPERE, 1.555e12,
                      _A100_SHEET + "GPU memory bandwidth 1,555 GB/s (40GB SXM)", 40 * GiB),
    "A100 80GB": Chip("A100 80GB", _AMPERE, 2.039e12,
                      _A100_SHEET + "GPU memory bandwidth 2,039 GB/s (80GB SXM)", 80 * GiB),
    "H100 80GB": Chip(
        "H100 80GB", _HOPPER, 3.35e12,
        "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): FP32 67 TFLOPS; TF32 989, "
        "BF16/FP16 1,979, FP8 3,958 TFLOPS with sparsity (half without); GPU memory bandwidth "
        "3.35 TB/s", 80 * GiB),
    "H200 141GB": Chip(
        "H200 141GB", _HOPPER, 4.8e12,
        "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column): the H100's compute; 141 GB "
        "of HBM3e (NVIDIA quotes GB; nvidia-smi shows about 140 GiB) at 4.8 TB/s", 141 * GB),
}


BUILD = "build a Chip(name, peak, bandwidth, source)"


def chip(name_or_chip, table: dict = CHIPS, or_else: str = BUILD) -> Chip:
    """A Chip by name in `table` (or a Chip, returned as is); `or_else` says what else an
    unknown name's error suggests."""
    return lookup(table, name_or_chip, "GPU", or_else, given=Chip)
