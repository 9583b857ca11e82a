"""Fault tolerance on a running job: find the straggler, notice the rank that stopped answering.

Stragglers. In synchronous data parallelism every step waits for the slowest rank, so one slow
GPU (thermal throttling, a bad link, a noisy neighbour) slows all of them. Measure each rank's own
compute time per step (before the collective that hides it), gather them, and flag ranks whose
median is well above the median of all ranks:

    times = gather_step_times(my_times)            # [rank][step] seconds, on every rank
    find_stragglers(times, threshold=1.5)          # -> [(rank, slowdown), ...]

Health checks. A rank that hangs (a deadlock, a dead NIC, a stopped process) makes its peers
block inside a collective until its timeout (often 10-30 minutes). A heartbeat bounds that: every
rank's background thread stamps a time every `interval` seconds; a watchdog that sees a stamp
older than `timeout` reports the rank. A rank stopped at time t is reported by
t + timeout + check_every at the latest (the last stamp is at most `interval` old at t, and
interval < timeout): a bounded detection time instead of a hang.
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path


# ----------------------------------------------------------------------------- stragglers
def gather_step_times(my_times: list, group=None) -> list:
    """All ranks' per-step times, [rank][step] seconds, on every rank (one all_gather_object)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, list(my_times), group=group)
    return out


def find_stragglers(times: list, threshold: float = 1.5) -> list:
    """[(rank, slowdown)] for ranks whose median step time exceeds threshold x the median rank.

    The median (not the mean) of each rank's steps ignores one-off hiccups such as a GC pause."""
    if threshold <= 1:
        raise ValueError(f"threshold={threshold}: a straggler is slower than typical, use > 1")
    medians = [statistics.median(t) for t in times]
    typical = statistics.median_low(medians)  # low median: with 2 ranks, the faster one
    return [(r, m / typical) for r, m in enumerate(medians) if m > threshold * typical]


# ----------------------------------------------------------------------------- heartbeats
class Heartbeat:
    """A daemon thread that stamps `time.time()` into DIR/hb{rank} every `interval` seconds.

    Files keep it independent of the process group (whose collectives are what hang); on a
    cluster a key-value store (torch.distributed.TCPStore) plays the same role."""

    def __init__(self, folder, rank: int, interval: float = 0.2):
        self.path = Path(folder) / f"hb{rank}"
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="labkit-heartbeat")

    def start(self) -> "Heartbeat":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._stamp()
        self._thread.start()
        return self

    def _stamp(self):
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        tmp.write_text(repr(time.time()))
        os.replace(tmp, self.path)  # a reader never sees half a number

    def _beat(self):
        while not self._stop.wait(self.interval):
            self._stamp()

    def stop(self):
        self._stop.set()


def last_seen(folder, world: int) -> dict:
    """{rank: seconds since its last heartbeat} (inf when it never beat)."""
    now, out = time.time(), {}
    for r in range(world):
        try:
            out[r] = now - float((Path(folder) / f"hb{r}").read_text())
        except (FileNotFoundError, ValueError):
            out[r] = float("inf")
    return out


def watch(folder, world: int, timeout: float = 1.0, check_every: float = 0.05,
          give_up_after: float = 30.0) -> tuple:
    """Block until some rank's heartbeat is older than `timeout`; return (ranks, when).

    Raises TimeoutError when every rank stays healthy for `give_up_after` seconds."""
    deadline = time.time() + give_up_after
    while time.time() < deadline:
        silent = [r for r, age in last_seen(folder, world).items() if age > timeout]
        if silent:
            return silent, time.time()
        time.sleep(check_every)
    raise TimeoutError(f"no rank went silent for {timeout}s within {give_up_after}s")


def detection_bound(interval: float, timeout: float, check_every: float) -> float:
    """Worst-case seconds from a rank stopping to the watchdog reporting it."""
    if interval >= timeout:
        raise ValueError(f"interval={interval}s must be shorter than timeout={timeout}s, or a "
                         f"healthy rank between two beats looks dead")
    return timeout + check_every


# ----------------------------------------------------------------------------- rank functions
def straggler_job(slow_rank: int, slowdown: float = 3.0, steps: int = 8, work_s: float = 0.01,
                  threshold: float = 1.5, group=None):
    """Each rank computes for `work_s` per step (the slow one `slowdown` x longer), then joins an
    all-reduce (where the fast ranks wait). Returns (per-rank median times, stragglers found)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank(group)
    mine = []
    for _ in range(steps):
        t0 = time.perf_counter()
        time.sleep(work_s * (slowdown if rank == slow_rank else 1.0))  # the "compute"
        mine.append(time.perf_counter() - t0)  # own time, measured before the collective
        dist.all_reduce(torch.ones(1), group=group)  # a synchronous step: everyone waits here
    times = gather_step_times(mine, group)
    return [statistics.median(t) for t in times], find_stragglers(times, threshold)


def health_job(folder: str, victim: int, interval: float = 0.1, timeout: float = 0.5,
               check_every: float = 0.05):
    """Every rank beats; `victim` freezes itself (SIGSTOP: the whole process, heartbeat thread
    included, as a hung machine would); rank 0's watchdog reports it, then wakes it (SIGCONT).

    Returns, on rank 0, (silent ranks, seconds from freeze to detection, the bound)."""
    import signal

    import torch.distributed as dist

    rank = dist.get_rank()
    if victim == 0:
        raise ValueError("victim must not be rank 0: rank 0 runs the watchdog here")
    hb = Heartbeat(folder, rank, interval).start()
    dist.barrier()  # every rank is beating before anyone freezes
    result = None
    if rank == victim:
        Path(folder, "victim").write_text(f"{os.getpid()} {time.time()!r}")
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen here until rank 0 sends SIGCONT
    elif rank == 0:
        silent, when = watch(folder, dist.get_world_size(), timeout, check_every)
        while not Path(folder, "victim").exists():
            time.sleep(0.01)
        pid, t_stop = Path(folder, "victim").read_text().split()
        os.kill(int(pid), signal.SIGCONT)
        result = (silent, when - float(t_stop), detection_bound(interval, timeout, check_every))
    dist.barrier()  # healthy ranks keep beating until everyone is here
    hb.stop()
    return result
