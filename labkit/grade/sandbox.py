"""The sandbox, seen from the judge: where the student's code runs, and the one channel to it.

    box = Sandbox(chapter, folder)        # a fresh interpreter on a read-only copy of labkit
    for event in box.run(cells, timeout): ...       # each code cell's start and end
    answers = box.answers(timeout)        # {exercise: {"given": {...}, "cell": k}}
    with box.exercise("1.1", timeout) as link:       # one fork of the sandbox per exercise
        link.call(remote, args, kwargs)   # plain data back, or the student's exception
    left = box.close()                    # every process the submission left, killed

The child (labkit.grade.child) is `python -P labkit/grade/child.py FD` in the copy made for this
submission (labkit.grade.copy): its own session, no file descriptor but stdin (/dev/null),
stdout and stderr (a log file the judge reads only as a dying process's last words) and FD, one
end of a socket pair (a socket, unlike a pipe, cannot be opened again through /proc/PID/fd), with
an address-space limit (MEMORY_LIMIT, not where CUDA runs: its driver reserves more), a CPU-time
limit (CPU_LIMIT, per process) and the judge's wall-clock timeouts per cell and per exercise.
It has no network (labkit.grade.isolate: a user and network namespace of its own where Linux
allows one, else Python's audit hooks refusing sockets; self.network says which).
What comes back is read with torch.load(weights_only=True): data, never a pickle that runs code.
The judge process adopts orphans (PR_SET_CHILD_SUBREAPER on Linux), so a process the submission
double-forked is found among the judge's children or in the sandbox's session, and killed.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from labkit.grade import copy as grader_copy
from labkit.grade.isolate import CPU_LIMIT, ENV, prepare
from labkit.grade.link import STARTUP, Link, _load, _Pickler, _signal
from labkit.grade.plain import HEADER, MAGIC

MEMORY_LIMIT = 16 << 30     # bytes of address space per sandbox process
REPLY_LIMIT = 512 << 20     # bytes of one message from the sandbox read at most
TAIL = 4096                 # bytes of the log kept for a death's reason
LAUNCHER = ("labkit/launch/zygote.py", "labkit.launch")   # the sandbox's own ranks: not reported


def adopt_orphans(on: bool = True) -> None:
    """Make this process the reaper of its descendants' orphans while a sandbox lives (Linux;
    elsewhere nothing); off again once it is closed, so the judge adopts nothing else."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0)   # PR_SET_CHILD_SUBREAPER


_NETWORK: list = []         # how sandboxes are cut off from the network here, once known


class Sandbox:
    judge_only = True   # never sent to the sandbox

    def __init__(self, chapter: int, folder: Path, memory: int | None = MEMORY_LIMIT):
        adopt_orphans()
        self.root = grader_copy.make(chapter)
        self.log = tempfile.TemporaryFile()
        self.sock, theirs = socket.socketpair()
        env = {k: v for k, v in os.environ.items() if not k.startswith("LABKIT_GRADE")}
        env.update(PYTHONPATH=str(self.root), MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1",
                   LABKIT_JUDGE_LABKIT=str(grader_copy.LABKIT) + os.sep)
        if torch.cuda.is_available():
            memory = None
        self.started = time.time() - 1
        command = [sys.executable, "-P", str(self.root / "labkit" / "grade" / "child.py"),
                   str(theirs.fileno())]
        for network in ([] if _NETWORK == ["audit"] else ["namespace"]) + ["audit"]:
            env[ENV] = network
            try:
                self.proc = subprocess.Popen(
                    command, cwd=str(folder), env=env, stdin=subprocess.DEVNULL,
                    stdout=self.log, stderr=self.log, pass_fds=(theirs.fileno(),),
                    start_new_session=True,
                    preexec_fn=functools.partial(prepare, memory, network == "namespace"))
            except subprocess.SubprocessError:   # unshare refused: Python's audit hooks instead
                continue
            _NETWORK[:] = [network]
            break
        self.network = _NETWORK[0]
        theirs.close()
        self.buffer = bytearray()
        self.folder = folder

    # -- the channel
    def send(self, message: dict) -> None:
        buf = io.BytesIO()
        with grader_copy.by_value():
            _Pickler(buf).dump(message)
        data = pickle.dumps({"id": message.get("id"), "body": buf.getvalue()})
        self.sock.sendall(HEADER.pack(MAGIC, len(data)) + data)

    def read(self, timeout: float):
        """The next message (a dict); None after `timeout` s; EOFError when the sandbox is gone
        or wrote something that is not a message."""
        end = time.monotonic() + timeout
        while True:
            if len(self.buffer) >= HEADER.size:
                magic, size = HEADER.unpack(bytes(self.buffer[:HEADER.size]))
                if magic != MAGIC or size > REPLY_LIMIT:
                    raise EOFError("the sandbox wrote something that is not a message")
                if len(self.buffer) >= HEADER.size + size:
                    data = bytes(self.buffer[HEADER.size:HEADER.size + size])
                    del self.buffer[:HEADER.size + size]
                    return _load(data)
            left = end - time.monotonic()
            if left <= 0:
                return None
            if not select.select([self.sock], [], [], min(left, 1.0))[0]:
                continue
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("the sandbox closed its channel")
            self.buffer += chunk

    # -- the notebook
    def run(self, cells: list, cell_timeout: float):
        """Yield ("done", k, message) per code cell; then ("stop", k, why) if the run ended
        early (a timeout, a death)."""
        self.send({"cells": cells, "cwd": str(self.folder)})
        k = 0
        while k < len(cells):
            try:
                start = self._expect(lambda m: m.get("state") == "start", STARTUP)
                if start is None:
                    yield "stop", k + 1, ("the sandbox did not start the next cell"
                                          + self.last_words())
                    return
                k = start["cell"] if isinstance(start.get("cell"), int) else k + 1
                done = self._expect(lambda m: m.get("state") == "done", cell_timeout)
            except EOFError:
                yield "stop", k, self._died()
                return
            if done is None:
                yield "stop", k, (f"a cell ran longer than {cell_timeout:g} s (a hang? raise "
                                  f"--cell-timeout if not)")
                return
            yield "done", k, done

    def answers(self, timeout: float) -> dict:
        try:
            found = self._expect(lambda m: isinstance(m.get("answers"), dict), timeout)
        except EOFError:
            found = None
        return found["answers"] if found else {}

    def _expect(self, match, timeout: float):
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            message = self.read(left)
            if message is None:
                return None
            if match(message):
                return message
        return None

    def _died(self) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        status = self.proc.poll()
        if status is None:
            return "the sandbox stopped answering" + self.last_words()
        if status < 0:
            return (f"the notebook's process was killed by {_signal(-status)} (out of memory? "
                    f"a crash? its limits: {CPU_LIMIT} CPU s){self.last_words()}")
        return f"the notebook's process exited with status {status} (os._exit?)"

    def last_words(self) -> str:
        self.log.seek(0, io.SEEK_END)
        self.log.seek(max(0, self.log.tell() - TAIL))
        lines = [ln.strip() for ln in self.log.read().decode(errors="replace").splitlines()
                 if ln.strip()]
        return f" (its last words: {lines[-1][:200]!r})" if lines else ""

    # -- checking
    @contextlib.contextmanager
    def exercise(self, exercise: str, timeout: float):
        link = Link(self, exercise, timeout)
        try:
            link.begin()
            yield link
        finally:
            link.end()

    def close(self) -> list:
        """End the sandbox and everything it left; [description] of what it left besides its
        own launcher's processes."""
        mine = {self.proc.pid}
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        left, procs = [], []
        for p in _left_behind(self.proc.pid, self.started):
            if p.pid in mine:
                continue
            with contextlib.suppress(psutil.Error):
                if p.status() == psutil.STATUS_ZOMBIE:   # exited already: only reaped
                    procs.append(p)
                    continue
                cmd = " ".join(p.cmdline())[:120]
                if cmd and not any(marker in cmd for marker in LAUNCHER):   # '': exiting
                    left.append(f"pid {p.pid} ({cmd})")
                p.kill()
                procs.append(p)
        psutil.wait_procs(procs, timeout=5)
        for p in procs:   # adopted orphans are this process's children now: reap them
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(p.pid, os.WNOHANG)
        adopt_orphans(False)
        grader_copy.remove(self.root)
        self.log.close()
        return left


def _left_behind(sid: int, since: float):
    """The processes of the sandbox's session, and the judge's adopted children started since."""
    mine = os.getpid()
    adopted = {p.pid for p in psutil.Process(mine).children(recursive=True)}
    for p in psutil.process_iter(["create_time"]):
        with contextlib.suppress(psutil.Error, OSError):
            if p.pid == mine:
                continue
            if os.getsid(p.pid) == sid or (p.pid in adopted and p.info["create_time"] >= since):
                yield p


__all__ = ["Sandbox", "Path"]
