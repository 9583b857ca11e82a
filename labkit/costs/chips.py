"""The GPUs the book's calculators know: dense peaks, memory bandwidth and capacity, with sources.

    from labkit.costs import chips
    chips.chip("H100 80GB").peak_flops("bf16")       # 989.5e12 FLOP/s
    chips.chip("A100 80GB").capacity / 2**30         # 80.0 GiB
    chips.chip("H200 141GB (measured)").peak_flops("bf16")   # 796e12: measured, not the sheet
    chips.chip("measured")                            # the profile $LABKIT_CHIP_PROFILE names
    chips.chip("GB200 (NVL72)").nvlink_domain         # 72: GPUs one NVLink domain joins
    chips.system("GB200 NVL72")                       # the rack: domain, NVLink, NIC, sources
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
    nvlink: float | None = None         # NVLink bytes/s per GPU per direction (half the sheet's
                                        # "bidirectional" figure)
    nvlink_domain: int | None = None    # GPUs one NVLink domain joins in the system it ships in

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
# Blackwell dense peaks: half the rates NVIDIA prints "with sparsity" (sources in each entry)
PFLOPS = 1e15
_BLACKWELL_HGX = {"bf16": 2.25 * PFLOPS, "fp16": 2.25 * PFLOPS, "fp8": 4.5 * PFLOPS,
                  "fp4": 9 * PFLOPS}
_BLACKWELL_GB200 = {"bf16": 2.5 * PFLOPS, "fp16": 2.5 * PFLOPS, "fp8": 5 * PFLOPS,
                    "fp4": 10 * PFLOPS}
_BLACKWELL_GB300 = {"bf16": 2.5 * PFLOPS, "fp16": 2.5 * PFLOPS, "fp8": 5 * PFLOPS,
                    "fp4": 15 * PFLOPS}
_A100_SHEET = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-"
               "web): FP32 19.5 TFLOPS; TF32 156, BF16/FP16 312 TFLOPS dense (312 / 624 with "
               "sparsity); ")

# Capacities: the marketing "GB" of HBM are GiB: exact for the A100 80GB (nvidia-smi: 81,920 MiB);
# the H100 80GB shows 81,559 MiB (85.5 GB), so its 80 GiB here is 0.4 GB generous. Blackwell's
# capacities are taken as the sheets' GB (1e9 bytes): no nvidia-smi figure was checked for them.
CHIPS = {
    "A100 40GB": Chip("A100 40GB", _AMPERE, 1.555e12,
                      _A100_SHEET + "GPU memory bandwidth 1,555 GB/s (40GB SXM)", 40 * GiB,
                      nvlink=300 * GB, nvlink_domain=8),
    "A100 80GB": Chip("A100 80GB", _AMPERE, 2.039e12,
                      _A100_SHEET + "GPU memory bandwidth 2,039 GB/s (80GB SXM)", 80 * GiB,
                      nvlink=300 * GB, nvlink_domain=8),
    "H100 80GB": Chip(
        "H100 80GB", _HOPPER, 3.35e12,
        "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): FP32 67 TFLOPS; TF32 989, "
        "BF16/FP16 1,979, FP8 3,958 TFLOPS with sparsity (half without); GPU memory bandwidth "
        "3.35 TB/s; NVLink 900 GB/s (HGX H100: 8 GPUs on NVSwitch)", 80 * GiB,
        nvlink=450 * GB, nvlink_domain=8),
    "H200 141GB": Chip(
        "H200 141GB", _HOPPER, 4.8e12,
        "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column): the H100's compute; 141 GB "
        "of HBM3e (NVIDIA quotes GB; nvidia-smi shows about 140 GiB) at 4.8 TB/s; NVLink "
        "900 GB/s (HGX H200: 8 GPUs)", 141 * GB, nvlink=450 * GB, nvlink_domain=8),
    # H800: DeepSeek-V3's GPU. NVIDIA's H800 datasheet was not found by this book's search; the
    # H800 is described (secondary sources, not NVIDIA) as the H100 SXM's silicon and tensor-core
    # rates with NVLink cut to 400 GB/s bidirectional. Its peaks here are the H100 SXM's: an
    # assumption, which costs.reported says wherever it divides by them.
    "H800 80GB": Chip(
        "H800 80GB", _HOPPER, 3.35e12,
        "ASSUMED equal to the H100 SXM datasheet's compute and bandwidth (no NVIDIA H800 sheet "
        "found); NVLink 400 GB/s bidirectional as secondary sources describe it; DeepSeek-V3 "
        "(arXiv:2412.19437 §3.1) runs 8 per node on NVLink/NVSwitch", 80 * GiB,
        nvlink=200 * GB, nvlink_domain=8),
    # Blackwell. NVIDIA prints the tensor-core rates "with sparsity"; the dense rates below are
    # half of them (the per-GPU dense tables of Tom's Hardware from Hot Chips 2025, G. Lockwood's
    # B200 page and Verda's GB300 post give the same halves). Where a figure is a rack's, it is
    # divided by the rack's 72 GPUs. The nvidia.com product pages themselves were not readable
    # from this book's search: figures marked "as quoted" come from pages that quote them.
    "B200 180GB": Chip(
        "B200 180GB", _BLACKWELL_HGX, 8e12,
        "HGX/DGX B200 (1,000 W per GPU): DGX B200 page as quoted: 72 PFLOPS FP8 / 144 PFLOPS "
        "FP4 with sparsity per 8 GPUs -> 9 / 18 PFLOPS per GPU sparse, 4.5 / 9 dense; BF16 "
        "2.25 PFLOPS dense (4.5 with sparsity; Lockwood's B200 table, HGX at 1,000 W); "
        "1,440 GB HBM3e and 64 TB/s per 8 GPUs -> 180 GB, 8 TB/s per GPU (MLPerf system "
        "files name it B200-SXM-180GB); NVLink 5: 14.4 TB/s per 8 GPUs = 1.8 TB/s per GPU "
        "bidirectional, 900 GB/s each way; 8 GPUs per NVLink domain (two NVSwitch chips)",
        180 * GB, nvlink=900 * GB, nvlink_domain=8),
    "GB200 (NVL72)": Chip(
        "GB200 (NVL72)", _BLACKWELL_GB200, 8e12,
        "one Blackwell GPU of a GB200 NVL72 rack (1,200 W per GPU): the GB200 NVL72 page as "
        "quoted, with sparsity per 72 GPUs: FP16/BF16 360, FP8/FP6 720, FP4 1,440 PFLOPS -> "
        "5 / 10 / 20 PFLOPS per GPU sparse, 2.5 / 5 / 10 dense; up to 13.4 TB HBM3e at 576 TB/s "
        "-> 186 GB (MLPerf: GB200-186GB) and 8 TB/s per GPU; NVLink 130 TB/s per 72 GPUs = "
        "1.8 TB/s per GPU bidirectional, 900 GB/s each way; one NVLink domain of 72 GPUs",
        186 * GB, nvlink=900 * GB, nvlink_domain=72),
    "GB300 (NVL72)": Chip(
        "GB300 (NVL72)", _BLACKWELL_GB300, 8e12,
        "one Blackwell Ultra GPU of a GB300 NVL72 rack (1,400 W per GPU): NVIDIA's developer "
        "blog 'Inside NVIDIA Blackwell Ultra' (2025): 15 PFLOPS dense NVFP4 per GPU, 288 GB "
        "HBM3e; the GB300 NVL72 page as quoted: FP4 1,440 PFLOPS with sparsity / 1,080 dense per "
        "72 GPUs (the FP4 sparse rate is NOT twice the dense one here), 576 TB/s HBM -> 8 TB/s "
        "per GPU, NVLink 130 TB/s -> 1.8 TB/s per GPU. FP8 5 and BF16 2.5 PFLOPS dense are NOT "
        "verified against NVIDIA: Verda's GB300 post lists them dense; Tom's Hardware's Hot Chips "
        "table prints 10 and 5 without saying dense or sparse",
        288 * GB, nvlink=900 * GB, nvlink_domain=72),
}


@dataclass(frozen=True)
class System:
    """A system of GPUs as the planner places work on it: its chip (a CHIPS name), the GPUs of one
    node (the box or tray a launcher fills first), the GPUs one NVLink domain joins (8 on an HGX
    board, 72 in an NVL72 rack: the fast domain TP, EP and CP belong inside), and the scale-out
    NIC per GPU in bytes/s per direction (the links between domains)."""
    name: str
    gpu: str
    gpus_per_node: int
    nvlink_domain: int
    nic: float
    source: str


_NDR = "one ConnectX-7 400 Gb/s (50 GB/s) NIC per GPU"
SYSTEMS = {
    "HGX H100": System("HGX H100", "H100 80GB", 8, 8, 50 * GB,
                       "8 H100 SXM on NVSwitch (NVLink 4, 900 GB/s per GPU); " + _NDR),
    "HGX H200": System("HGX H200", "H200 141GB", 8, 8, 50 * GB,
                       "8 H200 SXM on NVSwitch (NVLink 4, 900 GB/s per GPU); " + _NDR),
    "HGX B200": System("HGX B200", "B200 180GB", 8, 8, 50 * GB,
                       "8 B200 on two NVSwitch chips (NVLink 5, 14.4 TB/s per 8 GPUs); " + _NDR
                       + " (MLPerf system file nebius_b200_n1: 8x ConnectX-7 NDR 400Gb/s)"),
    "GB200 NVL72": System("GB200 NVL72", "GB200 (NVL72)", 4, 72, 50 * GB,
                          "18 compute trays of 4 GPUs (2 GB200 superchips) on one NVLink "
                          "Switch System, 130 TB/s per 72 GPUs; " + _NDR + " (MLPerf system "
                          "file GB200-NVL72_GB200-186GB: 4 GPUs per node, ConnectX-7)"),
    "GB300 NVL72": System("GB300 NVL72", "GB300 (NVL72)", 4, 72, 100 * GB,
                          "18 compute trays of 4 GPUs on one NVLink Switch System (130 TB/s); "
                          "one ConnectX-8 800 Gb/s (100 GB/s) SuperNIC per GPU, as NVIDIA's "
                          "GB300 NVL72 page is quoted"),
}


def system(name_or_system) -> System:
    """A System by name in SYSTEMS, or a System, returned as is."""
    return lookup(SYSTEMS, name_or_system, "system",
                  "build a chips.System(name, gpu, gpus_per_node, nvlink_domain, nic, source)",
                  given=System)


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
