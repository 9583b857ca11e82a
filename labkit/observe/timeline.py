"""Timeline: spans (name, lane, start, end) of one rank's step, on labkit.timing's clock.

    tl = Timeline(device)
    with tl.span("forward"):
        ...
    tl.events      # [{"name": "forward", "lane": "compute", "start": 0.0, "end": 0.012}, ...]

DDP's wrappers (labkit.ddp), ZeRO-3's units (labkit.zero.zero3), the labs' measurements and the
profiler's jobs (labkit.profiling.jobs) draw on it, so their spans share one clock and one shape.
"""
from __future__ import annotations

import contextlib

from labkit.timing import now


class Timeline:
    """Spans (name, lane, start, end) in seconds since `t0`, on this rank's clock.

    Lanes used in the book: "compute" (forward, backward, optimizer) and "comm" (all-reduces).
    The clock is `labkit.timing.now(device)`: on a GPU it waits for the queued kernels first, so a
    span ends when its work has run, not when it was queued."""

    def __init__(self, device=None):
        self.device = device
        self.t0 = now(device)
        self.events: list[dict] = []

    def now(self) -> float:
        return now(self.device) - self.t0

    @contextlib.contextmanager
    def span(self, name: str, lane: str = "compute", **info):
        start = self.now()
        try:
            yield
        finally:
            self.events.append({"name": name, "lane": lane, "start": start, "end": self.now(),
                                **info})

    def reset(self) -> None:
        self.t0, self.events = now(self.device), []
