"""The warm helper, seen from the parent: start the zygote once, ask it to fork each rank.

`get()` returns this process's zygote, started on first use, or None where forking is not
available (then every rank is a fresh `python -m labkit.launch`). LABKIT_LAUNCH=spawn forces
that. `shutdown()` ends it; the next run starts a new one.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from labkit.launch.rendezvous import child_env

STARTUP_TIMEOUT = 120.0  # seconds for the zygote (and, in process.py, every rank) to start
_STATUS_GRACE = 1.0  # seconds between the zygote reaping a rank and writing its exit status
ZYGOTE_FILE = str(Path(__file__).with_name("zygote.py"))


class ForkedRank:
    """A rank forked by the zygote: the Popen-like handle the parent's wait and kill need."""

    def __init__(self, pid: int, rundir: Path, rank: int):
        self.pid, self._exit = pid, rundir / f"exit{rank}"
        self._gone_since = None  # when the pid was first seen reaped with no status written

    def poll(self):
        try:
            return int(self._exit.read_text())
        except (OSError, ValueError):
            pass
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            # The zygote reaps, then writes the status: give it a moment, or the parent would
            # delete the run's folder while the zygote still writes into it. No status after
            # that: the zygote itself died.
            now = time.monotonic()
            self._gone_since = self._gone_since or now
            return -signal.SIGKILL if now - self._gone_since > _STATUS_GRACE else None
        return None

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout=None):
        end = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.poll()


class Zygote:
    """The warm parent of ranks (labkit/launch/zygote.py): torch imported once, a fork per rank."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-u", ZYGOTE_FILE], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=child_env(), cwd=os.getcwd())
        self.lock = threading.Lock()
        if self._readline(timeout=STARTUP_TIMEOUT) != "ready":
            self.close()
            raise OSError("the zygote did not start")

    def _readline(self, timeout: float) -> str:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise OSError("no answer from the zygote")
        return self.proc.stdout.readline().decode().strip()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, rundir: Path, rank: int) -> ForkedRank:
        with self.lock:
            self.proc.stdin.write(f"{rundir} {rank}\n".encode())
            self.proc.stdin.flush()
            return ForkedRank(int(self._readline(timeout=30)), rundir, rank)

    def close(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_ZYGOTE = None
_ZYGOTE_LOCK = threading.Lock()


def get():
    """The process's zygote, started on first use; None where forking is not available."""
    global _ZYGOTE
    if os.environ.get("LABKIT_LAUNCH", "") == "spawn" or not sys.platform.startswith("linux"):
        return None
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or not _ZYGOTE.alive():
            try:
                _ZYGOTE = Zygote()
            except OSError:
                _ZYGOTE = None
                return None
            import atexit

            atexit.register(shutdown)
        return _ZYGOTE


def shutdown() -> None:
    """End the warm zygote (its ranks, if any, end with it). The next run starts a new one."""
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is not None:
            _ZYGOTE.close()
            _ZYGOTE = None
