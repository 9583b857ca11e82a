"""What the student's code raised in the sandbox, raised again in the judge as the checkers expect
it, from data (type name, message, traceback text): never the student's own exception object.

    raise rebuild({"type": "RankError", "rank": 1, "message": ..., "remote_traceback": ...})

Stopped ends a checker where the sandbox stopped answering (a timeout, a death): a BaseException,
so no checker's `except Exception` takes it for a failed case.
"""
from __future__ import annotations

from labkit.check.refusal import Refused
from labkit.launch.errors import HangError, RankError


class Stopped(BaseException):
    """The sandbox stopped answering for this exercise; the message says why."""


class RemoteExit(SystemExit):
    """sys.exit in the student's code, in the sandbox."""

    def __init__(self, code, where: str = ""):
        super().__init__(code)
        self.where = where


class RemoteInterrupt(KeyboardInterrupt):
    """KeyboardInterrupt raised by the student's code, in the sandbox (not the grader's Ctrl-C)."""

    def __init__(self, message: str = "", where: str = ""):
        super().__init__(message)
        self.where = where


class RemoteError(Exception):
    """Any other exception of the student's code, under its own type name."""


_KINDS: dict = {}


def rebuild(error) -> BaseException:
    if not isinstance(error, dict):
        return RemoteError("the sandbox replied with something that is not an error report")
    kind, message = str(error.get("type", "Error")), str(error.get("message", ""))
    where = str(error.get("where", ""))
    if kind == "SystemExit":
        code = error.get("code")
        return RemoteExit(code if type(code) in (int, str, type(None)) else message, where)
    if kind == "KeyboardInterrupt":
        return RemoteInterrupt(message, where)
    if kind == "RankError":
        return RankError(int(error.get("rank") or 0), message,
                         str(error.get("remote_traceback", "")))
    if kind == "HangError":
        stacks = error.get("stacks") if isinstance(error.get("stacks"), dict) else {}
        notes = error.get("notes") if isinstance(error.get("notes"), dict) else {}
        return HangError(message, {int(k): str(v) for k, v in stacks.items()},
                         {int(k): str(v) for k, v in notes.items()})
    if kind == "Refused" or "[refused]" in message:
        reason = error.get("reason")
        return Refused(str(reason) if reason else message.replace("[refused]", "").strip())
    if kind == "NotImplementedError":
        return NotImplementedError(message)
    if kind == "AssertionError":
        return AssertionError(message)
    name = kind if kind.isidentifier() else "Error"
    if name not in _KINDS:
        _KINDS[name] = type(name, (RemoteError,), {"__module__": "sandbox"})
    err = _KINDS[name](message + (f" ({where})" if where else ""))
    return err
