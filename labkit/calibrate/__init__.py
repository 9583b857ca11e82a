"""`labkit calibrate`: this machine measured, beside the book's formulas, as a chip profile.

    labkit calibrate                         # the GPU if there is one, else the CPU
    labkit calibrate --json my-gpu.json      # also write the profile (costs.chips reads it)
    labkit calibrate --device cpu --quick    # seconds: smaller sizes, one short pass each
    LABKIT_CHIP_PROFILE=my-gpu.json python -c \
        "from labkit.costs import chips; print(chips.chip('measured'))"   # planners read it too

Four sections, each figure with the formula's and their ratio:
1. roofs (calibrate.roofs): matmul FLOP/s per dtype at sizes that reach the roof, memory
   bandwidth (read, copy, add), FP8 GEMM rate and its fast/split accumulation error where the
   GPU has FP8; against the datasheet (costs.chips) on a known GPU.
2. memory (calibrate.memory): the reference GPT's model states and activations, fp32 and
   torch.autocast(bf16), measured by saved-tensor hooks (and the CUDA allocator on a GPU),
   against costs.memory and costs.activations, one row per component.
3. compute (calibrate.compute): the reference GPT's step time, tokens/s and MFU against the
   measured and the datasheet roofs; the recomputation factor against (f + b + f)/(f + b).
4. communication (calibrate.comm), with 2+ ranks: an all-reduce busbw sweep and its alpha-beta
   fit (costs.comm).
The JSON (calibrate.report.profile) is a costs.chips profile: `chips.load_profile(path)`, or
`chip("measured")` with LABKIT_CHIP_PROFILE set, gives a Chip with the measured roofs that
costs.memory, costs.flops, costs.roofline and the planner accept wherever they take a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

from labkit.calibrate import comm, compute, memory, report, roofs
from labkit.cliargs import ArgParser, at_least_zero
from labkit.model import GPTConfig

# The reference GPT (labkit.model.GPT): on a GPU the shape measured on one H200 (shared/gpu);
# on a CPU one that runs in a minute; --quick: seconds. (config, memory batch, step batch)
REFERENCE = {
    ("cuda", False): (GPTConfig(n_layer=8, n_embd=2048, n_head=16, block_size=2048), 4, 8),
    ("cuda", True): (GPTConfig(n_layer=2, n_embd=1024, n_head=8, block_size=1024), 4, 4),
    ("cpu", False): (GPTConfig(n_layer=4, n_embd=256, n_head=4, block_size=256), 4, 4),
    ("cpu", True): (GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=64), 2, 2),
}


def provenance(device: str) -> dict:
    """When and on what: date, torch, CUDA, the device, Python."""
    dev = torch.device(device)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "cuda": torch.version.cuda, "python":
            platform.python_version(), "device": device_name(device), "machine":
            platform.machine(), "threads": torch.get_num_threads() if dev.type == "cpu" else None,
            "tool": "labkit calibrate"}


def device_name(device: str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def capacity(device: str) -> float:
    dev = torch.device(device)
    if dev.type == "cuda":
        return float(torch.cuda.get_device_properties(dev).total_memory)
    import psutil  # here: only this function needs it

    return float(psutil.virtual_memory().total)


def default_ranks(device: str, quick: bool) -> tuple:
    """(ranks for the all-reduce sweep, why none): every GPU on a GPU machine with 2 or more;
    2 Gloo ranks on a CPU (none with --quick)."""
    if torch.device(device).type == "cuda":
        n = torch.cuda.device_count()
        if n < 2:
            return 0, ("one GPU: NCCL needs one GPU per rank (it refuses two ranks on one GPU); "
                       "run on a machine with 2 or more GPUs, or --ranks N on the CPU")
        return n, None
    return (0, "skipped by --quick (--ranks 2 measures it)") if quick else (2, None)


def calibrate(device: str = "cpu", quick: bool = False, ranks: int | None = None) -> dict:
    """Every section's measurements as one dict (report.text prints it, report.profile saves it)."""
    t0 = time.perf_counter()
    cuda = torch.device(device).type == "cuda"
    cfg, batch, step_batch = REFERENCE[("cuda" if cuda else "cpu", quick)]
    why = None
    if ranks is None:
        ranks, why = default_ranks(device, quick)
    elif ranks == 1:
        ranks, why = 0, "--ranks 1: an all-reduce needs 2 or more ranks"
    elif ranks == 0:
        why = "--ranks 0"
    sheet = roofs.datasheet_of(device)
    r = roofs.measure(device, quick)
    dtype = "bf16" if cuda else "fp32"
    st = memory.states(cfg, device)
    acts = [memory.activations(cfg, batch, device, autocast=a) for a in (False, True)]
    step = compute.step(cfg, step_batch, device, steps=2 if quick else 10,
                        warmup=1 if quick else 3)
    rc = compute.recompute(cfg, batch, device, repeats=1 if quick else 3)
    res = {"device": str(device), "device_name": device_name(device), "cuda": cuda,
           "quick": quick, "datasheet": sheet, "capacity": capacity(device),
           "provenance": provenance(device), "config": dataclasses.asdict(cfg),
           "roofs": r,
           "memory": {"batch": batch, "states_how": st["how"], "n_params": st["n_params"],
                      "states": memory.state_rows(st), "activations": acts},
           "compute": {"step": step, "dtype": dtype,
                       "mfu_measured": compute.mfu(step, r["peak_flops"].get(dtype)),
                       "mfu_datasheet": compute.mfu(step, sheet and sheet.peak.get(dtype))},
           "recompute": rc,
           "comm": {"skipped": why} if not ranks else comm.sweep(
               ranks, comm.QUICK_SIZES if quick else comm.GPU_SIZES if cuda else comm.CPU_SIZES,
               repeats=3 if quick else 5)}
    res["seconds"] = time.perf_counter() - t0
    return res


def main(argv=()) -> int:
    p = ArgParser(prog="labkit calibrate", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.HelpFormatter)    # the helps say their defaults
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="what to measure (default: cuda if there is a GPU, else cpu)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes, short timings: seconds, not minutes")
    p.add_argument("--json", default=None, metavar="FILE", help="write the profile here")
    p.add_argument("--ranks", type=at_least_zero, default=None,
                   help="ranks of the all-reduce sweep (default: every GPU where there are 2+, "
                        "2 on a CPU, none with --quick; 0: skip it)")
    try:
        a = p.parse_args(list(argv))
    except ValueError as err:
        print(f"labkit calibrate: {err}", file=sys.stderr)
        return 2
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("labkit calibrate: --device cuda, but this torch sees no GPU "
              f"(torch {torch.__version__}, CUDA {torch.version.cuda}); use --device cpu",
              file=sys.stderr)
        return 2
    if a.json and not Path(a.json).resolve().parent.is_dir():
        print(f"labkit calibrate: --json {a.json}: no folder {Path(a.json).parent}; use an "
              f"existing folder, e.g. --json calibrate.json", file=sys.stderr)
        return 2
    res = calibrate(device, a.quick, a.ranks)
    print(report.text(res))
    print(f"\n{res['seconds']:.1f} s on {res['device_name']}")
    if a.json:
        Path(a.json).write_text(json.dumps(report.profile(res), indent=1) + "\n")
        print(f"wrote {a.json}: a chip profile (labkit.costs.chips.load_profile, or "
              f"LABKIT_CHIP_PROFILE={a.json} and chip('measured'))")
    return 0
