"""The GPUs the book's calculators know: dense peaks, memory bandwidth and capacity, with sources.

    from labkit.costs import chips
    chips.chip("H100 80GB").peak_flops("bf16")       # 989.5e12 FLOP/s
    chips.chip("A100 80GB").capacity / 2**30         # 80.0 GiB
    chips.chip("H200 141GB (measured)").peak_flops("bf16")   # 796e12: measured, not the sheet
    chips.chip("measured")                            # the profile $LABKIT_CHIP_PROFILE names
    chips.load_profile("calibrate.json")              # what `labkit calibrate --json` wrote

The one table of hardware numbers: costs.memory reads capacities from it, costs.flops the bf16
peaks, costs.roofline the peaks per dtype and the bandwidths. Pure Python (the website runs it).

Two kinds of roofs. CHIPS holds the datasheets' dense peaks. MEASURED names chip profiles:
JSON files in labkit/costs/profiles/ holding roofs measured on a real chip (a large matmul per
dtype, a large copy), with their provenance (date, torch and CUDA versions, the files they come
from). A profile is what `labkit calibrate --json FILE` writes for the reader's own machine;
`chip("measured")` loads the file named by the environment variable LABKIT_CHIP_PROFILE, and
`chip("path/to/profile.json")` a file directly, so every calculator that takes a GPU by name
(costs.memory, costs.flops, costs.roofline, the planner) plans with measured roofs. Measured
roofs sit below the sheet: on one H200, 0.80 of its bf16 peak and 0.90 of its bandwidth.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

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
    datasheet: str | None = None    # a measured chip: the CHIPS entry of the same GPU, if known
    provenance: dict = field(default_factory=dict)   # a measured chip: when, how, with what

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


BUILD = ("build a Chip(name, peak, bandwidth, source), or pass 'measured' (the profile "
         "$LABKIT_CHIP_PROFILE names) or a profile's path ending in .json")

# Measured profiles shipped with the book: name -> file in PROFILES (loaded when first asked for)
PROFILES = Path(__file__).resolve().parent / "profiles"
MEASURED = {"H200 141GB (measured)": "h200-measured-2026-11-27.json"}
PROFILE_ENV = "LABKIT_CHIP_PROFILE"
PROFILE_FORMAT = "labkit chip profile 1"


def load_profile(path) -> Chip:
    """The Chip a profile file describes (`labkit calibrate --json FILE` writes one): its name,
    peak FLOP/s per dtype, bandwidth, capacity, the datasheet chip it was measured on and its
    provenance. Everything else in the file (the calibration's rows) is left for the reader."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no chip profile at {path}: write one with `labkit calibrate "
                                f"--json {path}`")
    return profile_chip(json.loads(path.read_text()), str(path))


def profile_chip(d: dict, where: str = "a profile") -> Chip:
    """A Chip from a profile's dictionary (load_profile's parsed file)."""
    peak, bw = d.get("peak_flops"), d.get("bandwidth")
    if d.get("format") != PROFILE_FORMAT or not isinstance(peak, dict) or not peak:
        raise ValueError(f"{where} is not a chip profile (format {PROFILE_FORMAT!r} with "
                         f"peak_flops per dtype and bandwidth): write one with `labkit calibrate "
                         f"--json FILE`")
    bad = [k for k, v in [*peak.items(), ("bandwidth", bw)]
           if not isinstance(v, (int, float)) or v <= 0]
    if bad:
        raise ValueError(f"{where}: {', '.join(bad)} must be positive numbers (FLOP/s, bytes/s)")
    return Chip(d.get("name", "measured"), {k: float(v) for k, v in peak.items()}, float(bw),
                d.get("source", f"measured ({where})"), d.get("capacity"), d.get("datasheet"),
                dict(d.get("provenance") or {}))


def profile_dict(c: Chip, **sections) -> dict:
    """The JSON a profile file holds for chip `c` (load_profile reads it back), with any further
    `sections` (a calibration's rows) beside it."""
    return {"format": PROFILE_FORMAT, "name": c.name, "peak_flops": dict(c.peak),
            "bandwidth": c.bandwidth, "capacity": c.capacity, "datasheet": c.datasheet,
            "source": c.source, "provenance": dict(c.provenance), **sections}


def measurements(name: str) -> dict:
    """The `measurements` section of a shipped measured profile (the figures its roofs and the
    chapters cite beside them: MFU of the book's GPT, the recomputation factor, FP8 errors)."""
    file = lookup(MEASURED, name, "measured profile", "run `labkit calibrate` for your own")
    return json.loads((PROFILES / file).read_text()).get("measurements", {})


def measured(name: str) -> Chip:
    """A shipped measured profile by its name in MEASURED."""
    file = lookup(MEASURED, name, "measured profile", "run `labkit calibrate` for your own")
    return load_profile(PROFILES / file)


def _resolve(name) -> Chip | None:
    """'measured', a shipped profile's name or a .json path as a Chip; None for other names."""
    if not isinstance(name, (str, os.PathLike)):
        return None
    if name == "measured":
        path = os.environ.get(PROFILE_ENV)
        if not path:
            raise KeyError(f"chip 'measured' reads the profile ${PROFILE_ENV} names, and it is "
                           f"not set: `labkit calibrate --json my-gpu.json`, then "
                           f"{PROFILE_ENV}=my-gpu.json")
        return load_profile(path)
    if name in MEASURED:
        return load_profile(PROFILES / MEASURED[name])
    if str(name).endswith(".json"):
        return load_profile(name)
    return None


def chip(name_or_chip, table: dict | None = None, or_else: str = BUILD) -> Chip:
    """A Chip by name in `table` (default: the datasheets, CHIPS, plus the measured profiles:
    MEASURED's names, 'measured' and a profile's .json path), or a Chip, returned as is;
    `or_else` says what else an unknown name's error suggests."""
    if table is None:
        found = _resolve(name_or_chip)
        if found is not None:
            return found
        table = dict(CHIPS, **{n: None for n in MEASURED})
    return lookup(table, name_or_chip, "GPU", or_else, given=Chip)
