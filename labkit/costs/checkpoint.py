"""Checkpoint costs: how big, how long to write, how often, and how much work a failure loses.

Units: bytes (GB = 1e9), seconds, hours where named. No torch, no processes.

Size. A checkpoint that can resume training holds the weights and the optimizer state, not the
gradients (they are recomputed by the next step). Mixed-precision Adam keeps fp32 master
weights, momentum and variance (12 bytes/param) plus the bf16 working weights (2): 14 bytes/param
when the bf16 copy is saved too, 12 when it is rebuilt from the master weights on load. (The 16
bytes/param of training memory include 2 bytes of gradients, which are not saved.)

Time. Each of N writers streams its 1/N share: T = bytes / min(N * per_writer_bw, storage_bw).

How often (Young 1974; Daly 2006). Saving every tau seconds at a cost of delta seconds, with
failures at mean time between failures M, the expected fraction of time wasted is about
    waste(tau) = delta / tau  +  (tau / 2 + R) / M
(delta/tau: time spent saving; tau/2: work since the last checkpoint lost on average per failure;
R: restart time). It is smallest at Young's tau* = sqrt(2 delta M); Daly's higher-order
correction is tau* = sqrt(2 delta M) (1 + sqrt(delta/(2M))/3 + delta/(18 M)) - delta (delta < 2M).
"""
from __future__ import annotations

import math

from labkit.costs import memory

GB = 1e9

# Bytes per parameter saved, keyed by the precision recipes of labkit.costs.memory (the one
# vocabulary of costs): a checkpoint that resumes training saves the weights and the optimizer
# state, never the gradients ("mixed": bf16 weights 2 + fp32 master, m and v 12 = 14; "fp32" and
# "autocast": 4 + 8 = 12). Two ways of saving that are not recipes of their own:
RECIPES = {name: r.weights + r.optimizer for name, r in memory.RECIPES.items()}
RECIPES["mixed, master only"] = memory.RECIPES["mixed"].optimizer  # bf16 copy rebuilt on load: 12
RECIPES["bf16 weights only"] = 2.0   # an export for inference: no optimizer, cannot resume


def bytes_per_param(recipe: str = "mixed") -> float:
    """Bytes per parameter a checkpoint saves under `recipe` (a name in RECIPES)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)} "
                         f"(labkit.costs.memory's recipes, e.g. 'mixed')")
    return RECIPES[recipe]


def checkpoint_bytes(n_params: float, recipe: str = "mixed") -> float:
    """Bytes of one full checkpoint of n_params parameters (all ranks together)."""
    return n_params * bytes_per_param(recipe)


def shard_bytes(n_params: float, world: int, recipe: str = "mixed") -> float:
    """Bytes each of `world` ranks writes in a sharded (ZeRO/FSDP) checkpoint."""
    return checkpoint_bytes(n_params, recipe) / world


def save_time(total_bytes: float, writers: int = 1, per_writer_GBps: float = 2.0,
              storage_GBps: float = float("inf")) -> float:
    """Seconds to write total_bytes with `writers` parallel writers, capped by the storage."""
    if writers < 1:
        raise ValueError(f"writers={writers}: need at least one writer")
    bw = min(writers * per_writer_GBps, storage_GBps) * GB
    return total_bytes / bw


def cluster_mtbf_hours(node_mtbf_hours: float, nodes: int) -> float:
    """Failures are independent: N nodes fail N times as often as one."""
    return node_mtbf_hours / nodes


def waste_fraction(interval_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0):
    """Expected fraction of wall time lost to saving and to redoing work after failures."""
    if interval_s <= 0:
        raise ValueError(f"interval_s={interval_s}: the checkpoint interval must be positive")
    return save_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


def expected_lost_work_s(interval_s: float) -> float:
    """Work redone per failure, on average: half an interval (failures land uniformly)."""
    return interval_s / 2


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's optimum checkpoint interval sqrt(2 delta M) (seconds)."""
    return math.sqrt(2 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum; equals M when saving takes at least 2M."""
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    r = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - save_s


def recompute_time_factor(backward_over_forward: float = 2.0) -> float:
    """Step time with full activation recomputation over without: (f + b + f) / (f + b).

    With backward = 2 forwards, 4/3: about one extra forward pass, ~33% more compute."""
    return (2 + backward_over_forward) / (1 + backward_over_forward)
