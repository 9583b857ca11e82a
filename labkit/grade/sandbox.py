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
What comes back is read with torch.load(weights_only=True): data, never a pickle that runs code.
The judge process adopts orphans (PR_SET_CHILD_SUBREAPER on Linux), so a process the submission
double-forked is found among the judge's children or in the sandbox's session, and killed.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib
import io
import os
import pickle
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import psutil
import torch

from labkit.check.answers import Opaque, Remote
from labkit.grade import copy as grader_copy
from labkit.grade.child import DEPTH, HEADER, MAGIC, objects_in, tensor_from
from labkit.grade.errors import Stopped, rebuild
from labkit.launch import source as launch_source

MEMORY_LIMIT = 16 << 30     # bytes of address space per sandbox process
CPU_LIMIT = 3600            # CPU seconds per sandbox process
REPLY_LIMIT = 512 << 20     # bytes of one message from the sandbox read at most
STARTUP = 120.0             # seconds for the interpreter to start, and for a fork
TAIL = 4096                 # bytes of the log kept for a death's reason
LAUNCHER = ("labkit/launch/zygote.py", "labkit.launch")   # the sandbox's own ranks: not reported


def adopt_orphans() -> None:
    """Make this process the reaper of its descendants' orphans (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER


def _limits(memory: int | None) -> None:
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_LIMIT, CPU_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class Sandbox:
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
        self.proc = subprocess.Popen(
            [sys.executable, "-P", str(self.root / "labkit" / "grade" / "child.py"),
             str(theirs.fileno())], cwd=str(folder), env=env, stdin=subprocess.DEVNULL,
            stdout=self.log, stderr=self.log, pass_fds=(theirs.fileno(),),
            start_new_session=True, preexec_fn=functools.partial(_limits, memory))
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
        grader_copy.remove(self.root)
        self.log.close()
        return left


class Link:
    """One exercise's requests, to a fork of the sandbox made for it."""

    def __init__(self, box: Sandbox, exercise: str, timeout: float):
        self.box, self.exercise, self.timeout = box, exercise, timeout
        self.deadline = time.monotonic() + timeout
        self.guard: set = set()
        self.pid, self.ended, self.ids = None, None, 0

    def remote(self, param: str, desc: dict):
        if isinstance(desc, dict) and desc.get("__remote__") in ("function", "class"):
            return Remote(self, self.exercise, param, desc["__remote__"], str(desc.get("name")))
        return desc

    def begin(self) -> None:
        self.box.send({"op": "begin"})
        forked = self.box._expect(lambda m: isinstance(m.get("forked"), int), STARTUP)
        if forked is None:
            raise Stopped("the sandbox did not start the checks" + self.box.last_words())
        self.pid = forked["forked"]

    def end(self) -> None:
        if self.ended is not None or self.pid is None:
            return
        with contextlib.suppress(OSError):
            self.box.send({"op": "end"})
        self._wait_end(30.0)

    def _wait_end(self, timeout: float) -> None:
        try:
            done = self.box._expect(lambda m: "ended" in m, timeout)
        except EOFError:
            done = None
        if done is None:
            self._kill()
            with contextlib.suppress(EOFError):
                done = self.box._expect(lambda m: "ended" in m, 10.0)
        self.ended = done["ended"] if done else -9

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
            os.killpg(self.pid, signal.SIGKILL)

    # -- requests
    def request(self, op: str, **fields):
        if self.ended is not None:
            raise Stopped(self._why_ended())
        self.ids += 1
        rid = self.ids
        self.box.send({"id": rid, "op": op, "guard": sorted(self.guard), **fields})
        while True:
            left = self.deadline - time.monotonic()
            try:
                message = self.box.read(max(left, 0.01)) if left > 0 else None
            except EOFError:
                self.ended = -9
                raise Stopped("the sandbox's channel broke" + self.box.last_words()) from None
            if message is None:
                self._kill()
                self._wait_end(10.0)
                raise Stopped(f"the checker was still running after {self.timeout:g} s and was "
                              f"stopped (an infinite loop in the answer?)")
            if "ended" in message:
                self.ended = message["ended"]
                raise Stopped(self._why_ended())
            if message.get("id") != rid:
                continue                     # a stale reply, or one the student's code forged
            if "error" in message:
                raise rebuild(message["error"])
            return message.get("ok")

    def _why_ended(self) -> str:
        code = self.ended
        if isinstance(code, int) and code < 0:
            return f"the answer's process was killed by {_signal(-code)}" + self.box.last_words()
        return (f"the answer's process exited with status {code} before it replied "
                f"(os._exit({code}) in the answer? a crash?){self.box.last_words()}")

    def call(self, remote: Remote, args, kwargs):
        args, kwargs = tuple(args), dict(kwargs)
        got = self.request("call", target=remote, args=args, kwargs=kwargs)
        return _same(got, list(objects_in((args, kwargs))))

    def launch(self, job, nprocs: int, args=(), kwargs=None, timeout: float = 30.0):
        args, kwargs = tuple(args), dict(kwargs or {})
        got = self.request("launch", job=job, nprocs=nprocs, args=args, kwargs=kwargs,
                           timeout=timeout)
        return _same(got, list(objects_in((args, kwargs))))

    def here(self, job, args, kwargs):
        args, kwargs = tuple(args), dict(kwargs)
        got = self.request("here", job=job, args=args, kwargs=kwargs)
        return _same(got, list(objects_in((args, kwargs))))

    def source(self, remote: Remote):
        text = self.request("source", target=remote)
        return text if type(text) is str else None

    def forbidden(self, objs, modules, names) -> list:
        self.guard.update(modules)
        found = self.request("forbidden", targets=list(objs), modules=list(modules),
                             names=sorted(names))
        return sorted(str(x) for x in found) if isinstance(found, list) else []


class _Pickler(launch_source._Pickler):
    """The judge's requests: its own objects by value, keeping their code's file names (so that
    the guard knows a checker's job from the student's code), the student's by reference."""

    def persistent_id(self, obj):
        if isinstance(obj, Remote):
            return obj.ref
        if isinstance(obj, (Link, Sandbox)):   # reached through labkit.check.answers.active()
            return ("none",)
        return None

    def reducer_override(self, obj):
        if type(obj) in (torch.Tensor, torch.nn.Parameter):   # torch.save's own format: fp8 too
            buf = io.BytesIO()
            torch.save(obj.detach(), buf)
            return tensor_from, (buf.getvalue(), type(obj) is torch.nn.Parameter,
                                 obj.requires_grad)
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType:
            return importlib.import_module, (obj.__name__,)   # torch's config modules, by name
        return super().reducer_override(obj)


def _load(data: bytes):
    try:
        message = torch.load(io.BytesIO(data), weights_only=True)
    except Exception:  # noqa: BLE001 - anything but plain data: not a message at all
        return {}
    message = _unwrap(message)
    return message if isinstance(message, dict) else {}


def _unwrap(obj):
    if type(obj) is dict:
        if "__opaque__" in obj:
            return _opaque(str(obj.get("__opaque__")), str(obj.get("repr", "")))
        if "__labkit__" in obj:
            return _record(obj)
        return {k: _unwrap(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_unwrap(v) for v in obj)
    return obj


def _same(obj, sent: list, depth: int = 0):
    """The judge's own objects where the sandbox said {"__same__": i} (returned as they came)."""
    if depth > DEPTH:
        return obj
    if type(obj) is dict:
        i = obj.get("__same__")
        if len(obj) == 1 and type(i) is int and 0 <= i < len(sent):
            return sent[i]
        return {k: _same(v, sent, depth + 1) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_same(v, sent, depth + 1) for v in obj)
    return obj


def _record(obj: dict):
    """One of labkit's dataclasses (an Action), rebuilt here from its fields: the class is
    looked up in the judge's own labkit, never named by the sandbox beyond labkit's modules."""
    module, _, name = str(obj.get("__labkit__")).partition(":")
    fields = obj.get("fields")
    if module.startswith("labkit.") and not module.startswith("labkit.check") and \
            module in sys.modules and type(fields) is dict:
        cls = getattr(sys.modules[module], name, None)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            with contextlib.suppress(Exception):
                return cls(**{k: _unwrap(v) for k, v in fields.items()})
    return _opaque(name or "object", f"a {name} with {fields!r:.120}")


_OPAQUE: dict = {}


def _opaque(type_name: str, text: str) -> Opaque:
    """An Opaque whose type bears the student's type name (a checker's "got LyingFloat")."""
    name = type_name.rsplit(".", 1)[-1]
    name = name if name.isidentifier() else "object"
    if name not in _OPAQUE:
        _OPAQUE[name] = type(name, (Opaque,), {"__module__": "sandbox"})
    return _OPAQUE[name](type_name, text)


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


def _signal(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


__all__ = ["Sandbox", "Link", "Path"]
