"""A line per finished phase of a lab, so a long run is never silent.

    from labkit.progress import Progress
    prog = Progress("ring", total=6)
    prog.done("16 MiB ring: 8.5 ms")       # [ring] 16 MiB ring: 8.5 ms (1/6, 2.1 s)

Only rank 0 prints (RANK from torchrun or labkit.launch; a plain process counts as rank 0), so
under `torchrun --nproc-per-node 4` a reader sees each line once. Every line is flushed at once
(a terminal piped into `tee` or a CI log shows it as it happens) and ends with the count and the
seconds since the lab started. No dependency: a progress bar library would redraw one line,
which a log file turns into noise.
"""
from __future__ import annotations

import os
import sys
import time


def is_rank_zero() -> bool:
    """Rank 0 of the initialised group, else RANK from the environment (a plain process: 0)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except ImportError:
        pass
    return os.environ.get("RANK", "0") == "0"


class Progress:
    """Prints `[tag] what (i/total, elapsed s)` on rank 0 each time a phase is done."""

    def __init__(self, tag: str, total: int | None = None, *, stream=None, quiet: bool = False):
        if total is not None and (isinstance(total, bool) or not isinstance(total, int)
                                  or total < 0):
            raise ValueError(f"total must be a non-negative integer or None, got {total!r}")
        self.tag, self.total, self.count = tag, total, 0
        self.stream = stream
        self.quiet = quiet or not is_rank_zero()
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def done(self, what: str) -> None:
        """One phase finished: count it and print the line."""
        self.count += 1
        of = f"{self.count}/{self.total}, " if self.total is not None else ""
        self.say(f"{what} ({of}{self.elapsed():.1f} s)")

    def say(self, text: str) -> None:
        """A line that is not a counted phase (a heading, what is about to start)."""
        if not self.quiet:
            print(f"[{self.tag}] {text}", file=self.stream or sys.stdout, flush=True)
