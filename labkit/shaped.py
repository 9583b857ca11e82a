"""Links with a bandwidth limit, emulated by pacing: what one host's loopback does not have.

    from labkit.shaped import Shaper
    from labkit.collectives import ring_all_reduce, parameter_server_all_reduce
    link = Shaper(bandwidth=100e6)                 # bytes/s, each way, for this rank
    ring_all_reduce(x, p2p=link.exchange)          # inside a rank (labkit.launch.run)
    parameter_server_all_reduce(x, p2p=link.exchange)

Why: on one machine every rank talks over the kernel's loopback, which has no per-link limit: a
root receiving from N-1 ranks at once is not slowed by "its link". A cluster's rank has one
network link (a NIC) of B bytes/s each way, and that is what the ring's advantage is about.

The model, enforced with sleeps (a pacer: a token bucket that allows no burst):
- out: this rank's outgoing link carries one message at a time at `bandwidth`. A send of m bytes
  is handed to the transport only when the link has had m/B seconds for it, after every
  earlier send (store and forward: the receiver cannot have the message before that).
- in: this rank's incoming link takes one message at a time at `bandwidth`. A receive of m bytes
  completes no earlier than m/B after it was posted and after the previous receive completed,
  nor before the data really arrived.
So a root that receives N-1 buffers of D bytes needs (N-1)·D/B, and a ring rank that sends
2(N-1)/N·D bytes needs 2(N-1)/N·D/B, whatever the CPU does. The real transfer still happens
(over loopback), so its cost adds on top; latency (α) is not emulated.

For Gloo (CPU) only: sends are posted one by one after their pacing, which NCCL's batched
point-to-point rules do not allow; a GPU machine has real links to measure instead.
"""
from __future__ import annotations

import time

import torch.distributed as dist

from labkit.collectives import exchange


class _PacedReceive:
    """A receive's work whose wait() also waits for the incoming link (see Shaper)."""

    def __init__(self, work, nbytes: int, posted: float, shaper: "Shaper"):
        self.work, self.nbytes, self.posted, self.shaper = work, nbytes, posted, shaper
        self.done = False

    def wait(self):
        self.work.wait()
        if not self.done:  # charge the link once, however often wait() is called
            self.done = True
            link = self.shaper
            start = max(self.posted, link.in_free)
            link.in_free = max(start + self.nbytes / link.bandwidth, time.perf_counter())
            link.sleep_until(link.in_free)
        return True


class Shaper:
    """One rank's network link, `bandwidth` bytes/s out and the same in (full duplex).

    `exchange(ops)` takes the same ops as labkit.collectives.exchange and returns one waitable
    per op; pass it as `p2p=` to labkit.collectives' functions. `slept` is the total time spent
    pacing (seconds), for the reader who wants to see what the emulation added."""

    def __init__(self, bandwidth: float):
        if not bandwidth > 0:
            raise ValueError(f"bandwidth must be a positive number of bytes/s, got {bandwidth!r}")
        self.bandwidth = float(bandwidth)
        self.out_free = self.in_free = 0.0  # perf_counter time when each direction is idle
        self.slept = 0.0

    def sleep_until(self, t: float) -> None:
        wait = t - time.perf_counter()
        if wait > 0:
            self.slept += wait
            time.sleep(wait)

    def exchange(self, ops, where: str = "") -> list:


        if dist.is_initialized() and "nccl" in str(dist.get_backend(ops[0][3] if ops else None)):
            raise RuntimeError("labkit.shaped emulates links for Gloo on one host; under NCCL "
                               "measure the real links instead")
        works = [None] * len(ops)
        for i, op in enumerate(ops):  # receives first: posting one never blocks
            if op[0] is dist.irecv:
                nbytes = op[1].numel() * op[1].element_size()
                works[i] = _PacedReceive(exchange([op], where)[0], nbytes,
                                         time.perf_counter(), self)
        for i, op in enumerate(ops):  # then each send once the outgoing link has carried it
            if op[0] is not dist.irecv:
                nbytes = op[1].numel() * op[1].element_size()
                self.out_free = max(self.out_free, time.perf_counter()) + nbytes / self.bandwidth
                self.sleep_until(self.out_free)
                works[i] = exchange([op], where)[0]
        return works
