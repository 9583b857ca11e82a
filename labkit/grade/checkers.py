"""The grader's checker process, seen from the grader: send an answer, get case records back.

    checkers = Checkers(chapter)       # starts `python -m labkit.check.worker CHAPTER`
    outcome = checkers.check("8.1", answer, timeout)   # Outcome(cases, stop, printed, seconds)
    checkers.close()

The grader starts it beside the notebook's kernel, so that it imports torch and the chapter's
checkers while the notebook runs (launch's warm zygote, whose pipes a process could open, only
once the kernel is gone); then it forks a fresh child per answer (labkit.check.worker says how).
Requests and replies travel on a socket pair, which no other process can open through /proc/PID/fd
(a pipe can be): the only channel back. The process leads a session of its own, and so does each
child: on a timeout the child's group is killed, and close() kills everything left (the process, its
zygote, the ranks). Whatever the reader's code prints arrives on the process's stdout and stderr,
drained here, counted, and kept only as a tail.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from labkit.check.answers import ANSWERS_ENV
from labkit.launch import STARTUP_TIMEOUT

REPLY_LIMIT = 16 << 20      # bytes of one reply read at most
TAIL = 4096                 # bytes of printed output kept, for a death's reason
GRACE = 10.0                # seconds for the process to report a child it was told to kill


@dataclass
class Outcome:
    cases: list = field(default_factory=list)   # [{"name", "passed", "message"}]
    stop: str = ""          # why no case records came back ("" when they did)
    printed: int = 0        # bytes printed while the answer was checked
    seconds: float = 0.0


class Checkers:
    def __init__(self, chapter: int):
        self.chapter = chapter
        self._start()

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != ANSWERS_ENV}   # grade, never record
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "labkit.check.worker",
                                      str(self.chapter), str(theirs.fileno())],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     pass_fds=(theirs.fileno(),))
        theirs.close()
        self.ready, self.buffer, self.printed = False, b"", _Tail()
        threading.Thread(target=self._drain, args=(self.proc, self.printed), daemon=True).start()

    def check(self, exercise: str, answer: bytes, timeout: float) -> Outcome:
        """Check one answer (a recorded call) with exercise `exercise`'s own checker."""
        if self.proc.poll() is not None:   # a child's code may have killed it: start afresh
            self.close()
            self._start()
        if not self.ready:
            if (self._read(STARTUP_TIMEOUT) or {}).get("ready") is not True:
                why = self.printed.last_line()
                self.close()
                return Outcome(stop="the grader's checker process did not start" + why)
            self.ready = True
        start, printed = time.perf_counter(), self.printed.total
        out, done, pid = Outcome(), None, None
        try:
            self.sock.sendall(f"{exercise} {len(answer)}\n".encode() + answer)
            # the child's pid comes first; before the first answer's the worker starts the warm
            # zygote, which takes seconds under load: wait for it as for any start, or the pid
            # would be read as this answer's reply and every later reply shifted by one
            first = self._read(STARTUP_TIMEOUT + GRACE) or {}
            pid = first.get("pid")
            done = first if "status" in first else self._read(timeout)
        except OSError:
            pass
        elapsed = time.perf_counter() - start
        out.seconds = round(elapsed, 1)
        if done is None and elapsed >= timeout and isinstance(pid, int):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)   # the child's group (close() ends its ranks)
            out.stop = (f"the checker was still running after {timeout:g} s and was stopped "
                        f"(an infinite loop in the answer?)")
        elif done is None:
            out.stop = "the grader's checker process died" + self.printed.last_line()
        out.printed = self.printed.total - printed
        if out.stop:
            self.close()   # the next answer gets a fresh process
            return out
        reply, status = _parse(done.get("reply", "")), done.get("status")
        if reply is not None and status == 0:
            out.cases, out.stop = reply.get("cases", []), reply.get("stop", "")
        elif isinstance(status, int) and status != 0:
            out.stop = f"the checker's process {_status(status)}" + self.printed.last_line()
        else:
            out.stop = "the checker's process ended without a report" + self.printed.last_line()
        return out

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)   # a ready process ends; a starting one is killed
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5 if self.ready else 0)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)   # the process, its zygote and ranks
        self.proc.wait()
        self.sock.close()
        self.ready = False

    def _read(self, timeout: float) -> dict | None:
        """The next JSON line on the process's stdout; None after `timeout` seconds or at EOF."""
        end = time.monotonic() + timeout
        fd = self.sock.fileno()
        while b"\n" not in self.buffer:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk or len(self.buffer) > REPLY_LIMIT:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            return {}
        return message if isinstance(message, dict) else {}

    @staticmethod
    def _drain(proc, printed) -> None:
        with contextlib.suppress(OSError, ValueError):
            while chunk := proc.stdout.read1(1 << 16):
                printed.add(chunk)


class _Tail:
    """The last TAIL bytes of a stream, and how many bytes it carried."""

    def __init__(self):
        self.total, self.tail = 0, b""

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.tail = (self.tail + chunk)[-TAIL:]

    def last_line(self) -> str:
        lines = [ln.strip() for ln in self.tail.decode(errors="replace").splitlines() if ln.strip()]
        return f" (its last words: {lines[-1][:200]!r})" if lines else ""


def _parse(text: str) -> dict | None:
    """A child's reply, if it wrote one whole: {"cases": [...]} or {"stop": "..."}."""
    try:
        reply = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError, AttributeError):
        return None
    if not isinstance(reply, dict):
        return None
    if isinstance(reply.get("stop"), str) and reply["stop"]:
        return {"stop": reply["stop"]}
    cases = reply.get("cases")
    if not isinstance(cases, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str)
            and isinstance(c.get("passed"), bool) and isinstance(c.get("message"), str)
            for c in cases):
        return None
    return {"cases": cases}


def _status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return (f"exited with status {code} before it reported (os._exit({code}) in the answer? a "
            f"crash?)")
