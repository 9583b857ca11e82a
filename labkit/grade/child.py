"""The sandbox's side of grading: the student's notebook source, run again in a fresh interpreter
that the judge (labkit.grade.sandbox) started, and the student's functions, called on request.

    python labkit/grade/child.py FD      (in the submission's read-only copy of labkit)

FD is the one socket of a socket pair with the judge (nothing else is inherited: stdin is
/dev/null, stdout and stderr a log file). The judge sends (cloudpickle, judge to sandbox only):
first {"cells": [source, ...], "cwd": folder}, then requests. This process runs each code cell
with IPython (cell k runs as In[k], so a traceback's "Cell In[k]" is code cell k) and says
{"cell": k, "state": "start"} and {"cell": k, "state": "done", "error": ..., "printed": bytes}.
Checker calls record answers here (labkit.check is a stub in the sandbox: labkit.grade.stub), and
the answers stay in this process's memory. Then, per exercise, {"op": "begin"} forks a child that
serves the judge's requests for that exercise (call a student function, launch a job on ranks,
read a function's source or what it reaches) until {"op": "end"}; a fork starts from the
notebook's state, and what one exercise does is gone before the next.

Everything sent back is plain data, written with torch.save and read by the judge with
torch.load(weights_only=True): numbers and strings of their exact types, lists, dicts, tensors.
An object that is none of these arrives as {"__opaque__": type name, "repr": text}.
"""
from __future__ import annotations

import contextlib
import copyreg
import importlib
import inspect
import io
import os
import pickle
import signal
import socket
import sys
import traceback
import types

from labkit.grade import isolate
from labkit.grade.plain import HEADER, MAGIC, exactly, objects_in, plain, send

ANSWERS: dict = {}      # exercise id -> {"given": {name: object}, "cell": k, "ignored": [...]}
_cell = [0]             # the code cell running now


# -- the channel -----------------------------------------------------------------------------
def receive(sock):
    head = exactly(sock, HEADER.size)
    magic, size = HEADER.unpack(head)
    if magic != MAGIC:
        raise EOFError("the judge's channel is out of step")
    outer = pickle.loads(exactly(sock, size))   # {"id", "body"}: the judge's plain envelope
    try:
        return _Unpickler(io.BytesIO(outer["body"])).load()
    except Exception as err:  # noqa: BLE001 - a request this copy cannot read: said, not fatal
        return {"op": "unreadable", "id": outer.get("id"), "why": f"{type(err).__name__}: {err}"}


class _Unpickler(pickle.Unpickler):
    """The judge's requests: its own objects, and references to the answers handed in."""

    def persistent_load(self, pid):
        if pid == ("none",):   # the judge's own link to this sandbox: nothing here
            return None
        _, exercise, name = pid
        return ANSWERS[exercise]["given"][name]


# -- plain data ------------------------------------------------------------------------------
def describe(obj):
    """An answer as the judge sees it: a handle for what it calls, the data itself otherwise."""
    if callable(obj):
        kind = "class" if isinstance(obj, type) else "function"
        return {"__remote__": kind, "name": str(getattr(obj, "__name__", type(obj).__name__))}
    return plain(obj)


# -- the notebook ----------------------------------------------------------------------------
def record(exercise: str, names: tuple, params: tuple, args: tuple, kwargs: dict) -> None:
    """A checker call in the notebook: its answers, kept here until the judge asks."""
    bound = dict(zip(params, args))
    bound.update(kwargs)
    ANSWERS[exercise] = {"given": {k: v for k, v in bound.items() if k in names},
                         "cell": _cell[0], "ignored": sorted(set(bound) - set(names))}
    note = (f" (the grader uses its own {', '.join(ANSWERS[exercise]['ignored'])})"
            if ANSWERS[exercise]["ignored"] else "")
    print(f"Exercise {exercise}: answer handed in{note}; `labkit grade` checks it.")


class _Counter(io.TextIOBase):
    """sys.stdout and sys.stderr while a cell runs: counted and dropped (the judge keeps none)."""

    def __init__(self):
        self.total = 0

    def writable(self) -> bool:
        return True

    def write(self, text) -> int:
        self.total += len(str(text))
        return len(text)


def run_cells(sock, cells) -> None:
    from IPython.core.interactiveshell import InteractiveShell  # noqa: PLC0415 - child only
    shell = InteractiveShell.instance()
    counter = _Counter()
    sys.stdout = sys.stderr = counter
    for k, source in enumerate(cells, 1):
        _cell[0] = k
        send(sock, {"cell": k, "state": "start"})
        before = counter.total
        shell.execution_count = k
        result = shell.run_cell(source, store_history=True)
        err = result.error_in_exec or result.error_before_exec
        error = None
        if err is not None:
            error = {"ename": type(err).__name__, "evalue": _text(err)[:500]}
        send(sock, {"cell": k, "state": "done", "error": error, "printed": counter.total - before})


def _text(err: BaseException) -> str:
    try:
        return str(err.code if isinstance(err, SystemExit) else err)
    except BaseException:  # noqa: BLE001 - a str() that raises
        return type(err).__name__


# -- requests --------------------------------------------------------------------------------
def serve(sock) -> None:
    """In the sandbox, after the cells: the answers, then one fork per exercise."""
    send(sock, {"answers": {ex: {"given": {k: describe(v) for k, v in a["given"].items()},
                                 "cell": a["cell"], "ignored": a["ignored"]}
                            for ex, a in ANSWERS.items()}})
    while True:
        message = receive(sock)
        if message.get("op") != "begin":
            return
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                os.setpgid(0, 0)   # the judge ends this group on a timeout
                share_zygote()
                while (request := receive(sock)).get("op") != "end":
                    send(sock, answer(request))
            except BaseException:  # noqa: BLE001 - said in the log, the judge's last words
                traceback.print_exc(file=sys.__stderr__)
                sys.__stderr__.flush()
                os._exit(3)
            finally:
                os._exit(0)
        send(sock, {"forked": pid})
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        send(sock, {"ended": os.waitstatus_to_exitcode(status)})


def answer(request: dict) -> dict:
    rid = request.get("id")
    try:
        given = (request.get("args"), request.get("kwargs"))
        same = {id(o): i for i, o in enumerate(objects_in(given))}
        return {"id": rid, "ok": plain(_do(request), same=same)}
    except BaseException as err:  # noqa: BLE001 - the student's exit and interrupt come back too
        return {"id": rid, "error": _error(err)}


def _do(request: dict):
    from labkit.grade import guard  # noqa: PLC0415 - the copy's, in the sandbox only
    op = request["op"]
    specs = tuple(request.get("guard") or ())
    answers = {id(v) for a in ANSWERS.values() for v in a["given"].values()}
    if op in ("call", "launch"):
        guard.refuse_answers([o for o in objects_in((request.get("target"), request.get("args"),
                                                     request.get("kwargs"))) if id(o) in answers],
                             specs)
    with guard.refusing(specs):
        if op == "call":
            return request["target"](*request["args"], **request["kwargs"])
        if op == "here":
            return request["job"](*request["args"], **request["kwargs"])
        if op == "launch":
            from labkit.launch import run  # noqa: PLC0415 - torch on demand
            _modules_by_name()
            return run(guard.guarded, request["nprocs"],
                       args=(specs, request["job"],
                             request["args"], request["kwargs"]),
                       timeout=request["timeout"], echo=False)
    if op == "source":
        try:
            return inspect.getsource(request["target"])
        except (OSError, TypeError):
            return None
    if op == "forbidden":
        forbidden = importlib.import_module("labkit.check.forbidden")
        return forbidden.forbidden_used(request["targets"], tuple(request["modules"]),
                                        set(request["names"]))
    if op == "attr":
        return getattr(request["target"], request["name"])
    if op == "unreadable":
        raise RuntimeError(f"the sandbox could not read the checker's request ({request['why']}):"
                           f" please report")
    raise ValueError(f"unknown request {op!r}")


def _by_name(module):
    return importlib.import_module, (module.__name__,)


def _modules_by_name() -> None:
    """torch's config modules (a ModuleType subclass) travel to the ranks by name: cloudpickle
    sends the submodules a function sent by value names (the judge's rank jobs are such)."""
    for module in list(sys.modules.values()):
        if isinstance(module, types.ModuleType) and type(module) is not types.ModuleType:
            copyreg.pickle(type(module), _by_name)


def _error(err: BaseException) -> dict:
    out = {"type": type(err).__name__, "message": _text(err)[:4000],
           "traceback": "".join(traceback.format_exception(err))[-6000:],
           "stop": isinstance(err, (SystemExit, KeyboardInterrupt)), "where": _where(err)}
    if isinstance(err, SystemExit):
        out["code"] = plain(err.code)
    for key in ("rank", "remote_traceback", "stacks", "notes", "reason"):
        if hasattr(err, key):
            out[key] = plain(getattr(err, key))
    return out


def _where(err: BaseException) -> str:
    """'Cell In[5], line 6, in predict': the last line of a cell the traceback went through."""
    from labkit.launch.source import cell_name  # noqa: PLC0415 - the copy's, on demand
    found = ""
    for frame in traceback.extract_tb(err.__traceback__):
        name = cell_name(frame.filename)
        if name:
            found = f"{name}, line {frame.lineno}, in {frame.name}"
    return found


def share_zygote() -> None:
    """In a fork: use the notebook's warm zygote, whose Popen cannot be polled from here (it is
    the parent's child): ask the kernel whether it lives instead."""
    warm = sys.modules.get("labkit.launch.warm")
    zygote = getattr(warm, "_ZYGOTE", None) if warm is not None else None
    proc = getattr(zygote, "proc", None)
    if proc is None:
        return
    import psutil  # noqa: PLC0415 - only where a zygote runs

    def poll(pid=proc.pid):
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return None
        return -signal.SIGKILL

    proc.poll = poll


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    if os.environ.get(isolate.ENV) != "namespace":   # the judge's network: refused from Python
        isolate.install_fallback()
    first = receive(sock)
    os.chdir(first["cwd"])
    sys.path.insert(0, first["cwd"])   # helper modules beside the notebook, as a kernel has
    run_cells(sock, first["cells"])
    serve(sock)


if __name__ == "__main__":
    sys.modules["labkit.grade.child"] = sys.modules["__main__"]   # the stub's record() is ours
    main(int(sys.argv[1]))
