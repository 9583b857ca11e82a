"""Runs of many ranks take turns on a shared machine.

Where LABKIT_RUN_LOCK names a file (./test.sh sets it for its two workers), a run of
HEAVY_RANKS ranks or more holds an exclusive lock on that file while its ranks live: two such
runs never share two cores, where each would make the other's ranks wait on a peer that is not
scheduled (a bad-input test took 36 s in a loaded suite and 3.7 s alone). Unset (a reader's
notebook, a lab from the terminal), nothing waits. A run started from inside a run that holds
the lock (its ranks' environment says so) does not wait for it again.
"""
from __future__ import annotations

import contextlib
import fcntl
import os

HEAVY_RANKS = 4
HELD = "LABKIT_RUN_LOCK_HELD"


@contextlib.contextmanager
def turn(nprocs: int):
    path = os.environ.get("LABKIT_RUN_LOCK")
    if not path or nprocs < HEAVY_RANKS or os.environ.get(HELD):
        yield
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes, or the process dies
        os.environ[HELD] = str(os.getpid())
        try:
            yield
        finally:
            os.environ.pop(HELD, None)
