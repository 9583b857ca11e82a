"""One exercise's link from the judge to the sandbox: requests out, plain data back.

    with box.exercise("2.1", timeout) as link:      # a fork of the sandbox made for it
        link.call(remote, args, kwargs)   # the student's function, called there
        link.launch(job, n, args)         # a checker's rank job, on the sandbox's ranks
        link.here(job, args)              # a checker's job, beside the answer (Checker.here)
        link.source(remote), link.forbidden(remotes, modules, names)

Requests go out as cloudpickle (judge to sandbox only: the judge's own objects by value with
their file names, tensors as torch.save bytes, the student's objects by reference); replies come
back as frames read with torch.load(weights_only=True) (labkit.grade.plain). A reply that is not
plain data is no message; one whose id is not the request's is skipped (stale, or forged by the
student's code: it can only claim what the answer returned). Past the exercise's deadline the
fork's process group is killed and the checker stops (Stopped).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import signal
import sys
import time
import types

import torch

from labkit.check.answers import Opaque, Remote
from labkit.grade.errors import Stopped, rebuild
from labkit.grade.plain import DEPTH, objects_in, tensor_from
from labkit.launch import source as launch_source

STARTUP = 120.0             # seconds for the interpreter to start, and for a fork


class Link:
    """One exercise's requests, to a fork of the sandbox made for it."""

    judge_only = True   # never sent to the sandbox (reached by value through answers.active())

    def __init__(self, box, exercise: str, timeout: float):   # box: labkit.grade.sandbox's
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
        if getattr(type(obj), "judge_only", False):   # via labkit.check.answers.active()
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




def _signal(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
