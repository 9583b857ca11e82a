"""Data-parallel scaling efficiency: how much of N GPUs' compute a DDP step keeps.

Weak scaling (the usual DDP setting): every GPU processes its own fixed micro-batch, taking
`compute` seconds of forward + backward; the gradients' all-reduce takes `comm` seconds, of which
a fraction `overlap` (0..1) is hidden under backward. Then

    step time   T = k * compute + s * overlap * comm + (1 - overlap) * comm
                                                              (k micro-batches accumulated)
    efficiency  E = k * compute / T                           (1.0: no time lost to comm)
    speedup     S = N * E   samples/s relative to one GPU doing the same micro-batch alone

Overlap is not free: on a GPU the collective's kernels take SMs and memory bandwidth from the
compute they overlap, so that compute runs a fraction `slowdown` (s) slower while it overlaps. Lee
et al., "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
Learning" (arXiv:2507.03114, 2025) measure s = 18.9% on average and up to 40% on A100, H100 and
MI250: OVERLAP_SLOWDOWN. The functions take s = 0 (the ideal) unless told, so a chapter can show
the hidden share both ways; pass slowdown=OVERLAP_SLOWDOWN for a GPU estimate.

With one GPU there is nothing to all-reduce (E = 1). Times in seconds (any unit works, as long as
compute and comm share it). The bandwidth part of `comm` for a ring is 2(N-1)/N * D / bw: it
approaches 2D/bw and does not grow with N (labkit.costs.comm).

A common claim computes the efficiency as `(compute / N) / (compute + comm)` (11.4% for 100 ms,
10 ms, 8 GPUs) beside a speedup of 7.27x: the first divides a strong-scaling ideal by a
weak-scaling step and contradicts the second. `common_claim_efficiency` keeps that formula only
to show the mismatch.
"""
from __future__ import annotations

from labkit.costs import comm as _comm

# Fraction by which compute slows while it overlaps a collective, measured on A100/H100/MI250
# (Lee et al., arXiv:2507.03114: 18.9% on average, 40% at most).
OVERLAP_SLOWDOWN = 0.189


def _check(compute: float, comm: float, n: int, overlap: float, accum: int,
           slowdown: float = 0.0) -> None:
    if compute <= 0 or comm < 0:
        raise ValueError(f"compute={compute} must be > 0 and comm={comm} >= 0 (seconds)")
    if int(n) != n or n < 1:
        raise ValueError(f"n={n}: the number of GPUs is a whole number >= 1")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap={overlap}: the hidden fraction of comm is between 0 and 1")
    if int(accum) != accum or accum < 1:
        raise ValueError(f"accum={accum}: micro-batches per step is a whole number >= 1")
    if slowdown < 0:
        raise ValueError(f"slowdown={slowdown}: compute overlapped with comm is slower, s >= 0 "
                         f"(e.g. OVERLAP_SLOWDOWN = {OVERLAP_SLOWDOWN})")


def step_time(compute: float, comm: float, n: int = 2, overlap: float = 0.0,
              accum: int = 1, slowdown: float = 0.0) -> float:
    """Seconds per optimizer step: k*compute + the exposed part of comm + what the hidden part
    costs the compute it overlaps (s * overlap * comm); no comm when n == 1."""
    _check(compute, comm, n, overlap, accum, slowdown)
    if n == 1:
        return accum * compute
    hidden = overlap * comm
    # the slowed compute cannot stretch by more than s times the compute there is to overlap
    contention = slowdown * min(hidden, accum * compute)
    return accum * compute + contention + (1.0 - overlap) * comm


def efficiency(compute: float, comm: float, n: int, overlap: float = 0.0, accum: int = 1,
               slowdown: float = 0.0) -> float:
    """Fraction of the step spent computing: 1.0 means perfect scaling."""
    return accum * compute / step_time(compute, comm, n, overlap, accum, slowdown)


def speedup(compute: float, comm: float, n: int, overlap: float = 0.0, accum: int = 1,
            slowdown: float = 0.0) -> float:
    """Throughput of N GPUs over one GPU's (same micro-batch per GPU): N * efficiency."""
    return n * efficiency(compute, comm, n, overlap, accum, slowdown)


def common_claim_efficiency(compute: float, comm: float, n: int) -> float:
    """A common claim's formula, (compute/N) / (compute + comm): NOT an efficiency (see above)."""
    return compute / n / (compute + comm)


def comm_time(grad_bytes: float, n: int, alpha: float, bandwidth: float,
              n_buckets: int = 1) -> float:
    """Ring all-reduce time of D gradient bytes sent as `n_buckets` equal buckets, one after
    another: each bucket pays the latency 2(N-1)*alpha; the bandwidth term is unchanged."""
    if n_buckets < 1:
        raise ValueError(f"n_buckets={n_buckets} must be >= 1")
    return n_buckets * _comm.ring_allreduce_time(grad_bytes / n_buckets, n, alpha, bandwidth)


def bytes_per_rank(grad_bytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) per step in DDP's ring all-reduce: 2(N-1)/N * D."""
    return _comm.ring_bytes_sent_per_rank("all_reduce", grad_bytes, n)


def table(compute: float, comm: float, ns=(1, 2, 4, 8, 16, 32, 64), overlap: float = 0.0,
          accum: int = 1, slowdown: float = 0.0) -> list:
    """Rows {n, step, efficiency, speedup} for a calculator or a worked answer."""
    return [{"n": n, "step": step_time(compute, comm, n, overlap, accum, slowdown),
             "efficiency": efficiency(compute, comm, n, overlap, accum, slowdown),
             "speedup": speedup(compute, comm, n, overlap, accum, slowdown)} for n in ns]
