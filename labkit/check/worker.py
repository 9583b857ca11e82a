"""The grader's checker process: each exercise's checker, run on the answer a notebook handed in,
in a child forked for that exercise from a clean parent that never loads an answer.

    python -m labkit.check.worker CHAPTER FD   (started by labkit.grade.checkers)

FD is the parent's end of a socket pair with the grader: a socket, unlike a pipe, cannot be
opened by another process through /proc/PID/fd, so the notebook's kernel, which runs while this
process starts, cannot write to it. The parent imports the chapter's checkers, says
{"ready": true}, then serves requests, one at a time (starting labkit.launch's warm zygote, once,
at the first):
"EXERCISE NBYTES\\n" and NBYTES of the recorded call (labkit.check.answers). For each it forks a
child and says {"pid": n}; the child closes the grader's socket, leads a session of its own (the
grader kills that group on a timeout), takes the exercise's checker from REGISTRY before it
loads the answer (loading runs the reader's code), calls it, and writes its case records (name,
passed, message) on a socket only the parent reads. Everything printed goes to stdout and
stderr, which the grader drains.
When the child is gone the parent ends whatever the child left (ranks of the shared zygote, its
session) and says {"status": exit status, "reply": the child's JSON or ""}. The score is made
by the grader, from its own table.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import select
import signal
import socket
import sys

import psutil

from labkit.check.answers import REGISTRY, load
from labkit.launch import warm

_FILE_LINE = re.compile(r'File "(?P<file>[^"]+)", line')


def stopped(err: BaseException) -> str:
    """What a checker's stop says about the answer: sys.exit and interrupts by name."""
    if isinstance(err, SystemExit):
        return f"the answer called sys.exit({'' if err.code is None else repr(err.code)})"
    if isinstance(err, KeyboardInterrupt):
        return "the answer raised KeyboardInterrupt"
    return f"{type(err).__name__}: {err}"


def main(argv) -> None:
    importlib.import_module(f"labkit.check.ch{int(argv[0]):02d}")
    grader = socket.socket(fileno=int(argv[1]))
    requests = grader.makefile("rb")
    zygote = None

    def say(message: dict) -> None:
        grader.sendall((json.dumps(message) + "\n").encode())

    say({"ready": True})
    while line := requests.readline():
        exercise, size = line.decode().split()
        answer = requests.read(int(size))
        # One warm zygote for every exercise's ranks, started at the first answer: the kernel
        # is gone by then, and could otherwise write requests into the zygote's pipe via /proc.
        zygote = zygote or warm.get()
        reply, status = serve(exercise, answer, zygote, say, grader.fileno())
        if zygote is not None:
            end_children(zygote.proc.pid)   # ranks of a child killed mid-run
            if status != 0 or not zygote.alive():
                zygote = restart()    # its pipe may hold half a request of the dead child
        say({"status": status, "reply": reply})


def serve(exercise: str, answer: bytes, zygote, say, grader: int) -> tuple[str, int]:
    """Fork the child that grades one answer; (its reply, its exit status) once it is gone."""
    mine, theirs = socket.socketpair()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:   # the child: never returns
        try:
            os.close(grader)   # the reader's code never holds the grader's socket
            mine.close()
            os.setsid()
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            if zygote is not None:
                share(zygote)
            with theirs, theirs.makefile("w") as channel:
                channel.write(json.dumps(grade(exercise, answer)) + "\n")
        finally:
            os._exit(0)   # no atexit: the warm zygote is the parent's to end
    theirs.close()
    say({"pid": pid})
    r = mine.fileno()
    reply, status = bytearray(), None
    while status is None:
        ready, _, _ = select.select([r], [], [], 0.2)
        if ready:
            reply += os.read(r, 1 << 16) or b""
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
    while select.select([r], [], [], 0)[0] and (chunk := os.read(r, 1 << 16)):
        reply += chunk   # written before the child exited
    mine.close()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)   # whatever the child started in its session
    return reply.decode(errors="replace").strip(), status


def grade(exercise: str, answer: bytes) -> dict:
    """In the child: {"cases": [...]} from the real checker, or {"stop": why}."""
    checker = REGISTRY.get(exercise)      # picked before the reader's code is loaded
    if checker is None:
        return {"stop": f"no checker is registered for exercise {exercise} (please report)"}
    try:
        entry = json.loads(answer)
        answers = load(entry)
    except BaseException as err:  # noqa: BLE001 - the reader's code ran while loading
        return {"stop": f"the answer the notebook handed in could not be loaded: {stopped(err)}"}
    names = {f: n for f, (n, _) in entry.get("sources", {}).items() if n}
    try:
        result = checker(**answers)
        return {"cases": [{"name": str(c["name"]), "passed": bool(c["passed"]),
                           "message": cells(str(c["message"]), names),
                           "stopped": bool(c.get("stopped"))} for c in result.cases]}
    except BaseException as err:  # noqa: BLE001 - sys.exit and interrupts get a reason too
        return {"stop": "the checker stopped: " + cells(stopped(err), names)}


def cells(text: str, names: dict) -> str:
    """A traceback's `File "/tmp/ipykernel_1/2.py", line 6` as the reader's `Cell In[5], line 6`."""
    return _FILE_LINE.sub(lambda m: f"{names[m['file']]}, line" if m["file"] in names
                          else m.group(0), text)


def end_children(pid: int) -> None:
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children():
            with contextlib.suppress(psutil.Error):
                child.kill()


def share(zygote) -> None:
    """In a child: use the parent's warm zygote. It is the parent's child, so Popen.poll here
    cannot wait for it (ECHILD reads as "exited", and launch would start a zygote of its own);
    ask the kernel whether it lives instead."""
    pid = zygote.proc.pid

    def poll():
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return None
        return -signal.SIGKILL

    zygote.proc.poll = poll


def restart():
    warm.shutdown()
    return warm.get()


if __name__ == "__main__":
    main(sys.argv[1:])
