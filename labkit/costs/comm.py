"""The alpha-beta model of collectives, and algorithm vs bus bandwidth (nccl-tests' convention).

A message of n bytes over one link costs  alpha + n / bandwidth  seconds: alpha is the fixed
latency of a message, bandwidth is bytes per second (beta = 1 / bandwidth is seconds per byte).

Units: D is the size in BYTES of the whole buffer being reduced (every rank holds D bytes before
an all-reduce and after it). GB = 1e9 bytes, GiB = 2**30 bytes: bandwidths here are in bytes/s.

Ring all-reduce (Patarasuk & Yuan 2009; Baidu's ring; NCCL's ring) is a reduce-scatter followed
by an all-gather: 2(N-1) steps, each moving D/N bytes per rank, so each rank sends and receives
2(N-1)/N * D bytes. The 2 is the two phases. Its latency term 2(N-1)*alpha grows linearly in N
(a tree or recursive halving/doubling is what gets log2 N); its bandwidth term 2(N-1)/N * D / bw
approaches 2D/bw and does not grow with N.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9
GiB = 2**30
MB = 1e6
MiB = 2**20
KiB = 2**10
US = 1e-6  # one microsecond, in seconds


@dataclass(frozen=True)
class Link:
    """One interconnect: per-message latency `alpha` (s) and per-direction `bandwidth` (bytes/s)."""
    name: str
    alpha: float
    bandwidth: float

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth


# Typical figures (per GPU, one direction); order of magnitude, for the calculators. NVIDIA
# prints NVLink per GPU as both directions added: 900 GB/s for NVLink 4, 1.8 TB/s for NVLink 5
# (B200, GB200/GB300; costs.chips gives each sheet), so one direction is half. The alphas are
# this table's assumption, not a measurement. How many GPUs one NVLink joins is a property of
# the system, not of the link: costs.chips.SYSTEMS (8 on an HGX board, 72 in an NVL72 rack).
LINKS = {
    "NVLink 5 (B200, GB200 NVL72)": Link("NVLink 5 (B200, GB200 NVL72)", 3 * US, 900 * GB),
    "NVLink 4 (H100 SXM)": Link("NVLink 4 (H100 SXM)", 3 * US, 450 * GB),
    "NVLink 3 (A100 SXM)": Link("NVLink 3 (A100 SXM)", 3 * US, 300 * GB),
    "PCIe 4.0 x16": Link("PCIe 4.0 x16", 5 * US, 25 * GB),
    "InfiniBand XDR 800 Gb/s": Link("InfiniBand XDR 800 Gb/s", 5 * US, 100 * GB),
    "InfiniBand NDR 400 Gb/s": Link("InfiniBand NDR 400 Gb/s", 5 * US, 50 * GB),
    "InfiniBand HDR 200 Gb/s": Link("InfiniBand HDR 200 Gb/s", 5 * US, 25 * GB),
    "Ethernet 100 Gb/s": Link("Ethernet 100 Gb/s", 10 * US, 12.5 * GB),
}

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")


# ----------------------------------------------------------------------------- steps and bytes
def ring_steps(op: str, n: int) -> int:
    """Communication steps of the ring algorithm for `op` over n ranks."""
    _check(op, n)
    if n == 1:
        return 0
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def ring_bytes_sent_per_rank(op: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in the ring version of `op` on a D-byte buffer."""
    _check(op, n)
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n * nbytes
    return (n - 1) / n * nbytes  # pipelined ring broadcast/reduce, chunked in N pieces


def parameter_server_bytes(nbytes: float, n: int) -> dict:
    """Reduce to a root, then broadcast from it (the 'master GPU' pattern), on a D-byte buffer.

    The root receives (N-1)*D and sends (N-1)*D; every other rank sends D and receives D."""
    return {"root_received": (n - 1) * nbytes, "root_sent": (n - 1) * nbytes,
            "other_sent": nbytes if n > 1 else 0.0, "other_received": nbytes if n > 1 else 0.0}


# ----------------------------------------------------------------------------- time
def ring_time(op: str, nbytes: float, n: int, alpha: float, bandwidth: float) -> float:
    """alpha-beta time of the ring algorithm: steps * alpha + bytes per rank / bandwidth."""
    return ring_steps(op, n) * alpha + ring_bytes_sent_per_rank(op, nbytes, n) / bandwidth


def ring_allreduce_time(nbytes: float, n: int, alpha: float, bandwidth: float) -> float:
    """2(N-1)*alpha + 2(N-1)/N * D / bandwidth."""
    return ring_time("all_reduce", nbytes, n, alpha, bandwidth)


def tree_allreduce_time(nbytes: float, n: int, alpha: float, bandwidth: float) -> float:
    """Recursive halving then doubling (Rabenseifner): 2*log2(N)*alpha + 2(N-1)/N * D / bw.

    Same bandwidth term as the ring, log N latency: this, not the ring, is the O(log N) one.
    N not a power of two: the N - P extra ranks (P the largest power of two below N) first send
    their whole D to a partner and get the result back at the end (the fold, exercise 1.3), so
    2(alpha + D/bw) more on the critical path, around the halving and doubling over P ranks:
    2*log2(P)*alpha + 2(P-1)/P * D/bw. (2 log2 P + 2 = 2 ceil(log2 N) messages either way.)"""
    if n <= 1:
        return 0.0
    p = 1 << (n.bit_length() - 1)                            # largest power of two <= n
    fold = 0.0 if p == n else 2 * (alpha + nbytes / bandwidth)
    return 2 * math.log2(p) * alpha + 2 * (p - 1) / p * nbytes / bandwidth + fold


def parameter_server_time(nbytes: float, n: int, alpha: float, bandwidth: float) -> float:
    """Reduce-to-root + broadcast with the root's link as the bottleneck.

    The root receives N-1 full buffers one after the other, then sends N-1:
    2(N-1) * (alpha + D / bandwidth). Grows linearly in N, unlike the ring's bandwidth term."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * (alpha + nbytes / bandwidth)


def time_of(algorithm: str, nbytes: float, n: int, alpha: float, bandwidth: float) -> float:
    """Dispatch by name: 'ring', 'tree', 'parameter_server' (all-reduce of D bytes)."""
    fns = {"ring": ring_allreduce_time, "tree": tree_allreduce_time,
           "parameter_server": parameter_server_time}
    if algorithm not in fns:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {sorted(fns)}")
    return fns[algorithm](nbytes, n, alpha, bandwidth)


# ----------------------------------------------------------------------------- bandwidths
def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth.

    all_reduce 2(N-1)/N; reduce_scatter and all_gather (N-1)/N; broadcast and reduce 1.
    Bus bandwidth is comparable to the link's speed whatever N, which algbw is not."""
    _check(op, n)
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth: bytes of the buffer / time (bytes/s)."""
    return nbytes / seconds


def busbw(op: str, nbytes: float, n: int, seconds: float) -> float:
    """Bus bandwidth (bytes/s) of a measured collective on a D-byte buffer over n ranks."""
    return algbw(nbytes, seconds) * busbw_factor(op, n)


def predicted_busbw(op: str, nbytes: float, n: int, alpha: float, bandwidth: float) -> float:
    """Bus bandwidth the alpha-beta ring model predicts: tends to `bandwidth` for large D."""
    return busbw(op, nbytes, n, ring_time(op, nbytes, n, alpha, bandwidth))


def fit_alpha_beta(nbytes_per_step, seconds_per_step):
    """Least-squares fit of t = alpha + n / bandwidth to measured (bytes, seconds) points.

    Returns (alpha, bandwidth). Feed it per-step bytes and times (e.g. one ring step moves D/N)."""
    xs, ys = list(map(float, nbytes_per_step)), list(map(float, seconds_per_step))
    if len(xs) < 2 or len(xs) != len(ys):
        raise ValueError("need at least two (bytes, seconds) points of equal count")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all message sizes are equal: vary the size to fit a bandwidth")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    alpha = my - slope * mx
    if slope <= 0:
        raise ValueError("time does not grow with size in these measurements: "
                         "cannot fit a bandwidth")
    return max(alpha, 0.0), 1.0 / slope


def _check(op: str, n: int) -> None:
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; choose one of {OPS}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of ranks must be a positive integer, got {n!r}")
