"""Process start: `run(fn, nprocs)` starts the ranks (forked by the warm zygote, or fresh Python
processes), watches them, and ends every one of them whatever happens.

The watch loop returns the values when every rank has sent one, raises RankError soon after a
rank fails (the others get a moment to report their own errors, then are killed), and raises
HangError when the run outlives its timeout, counted from the moment every rank joined the group.
"""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from labkit.launch import hang, rendezvous, serial, source, transport, warm
from labkit.launch.errors import HangError, LaunchError, RankError
from labkit.launch.torchrun import run_under_torchrun, under_torchrun

DEFAULT_TIMEOUT = 60.0  # seconds a run may take, once every rank is up, before it is a hang
STARTUP_TIMEOUT = warm.STARTUP_TIMEOUT  # seconds for every rank to start and join the group
MAX_PROCS = 64
_GRACE = 1.5  # seconds to let the other ranks report their own errors after the first one


def run(fn, nprocs: int, args: tuple = (), kwargs: dict | None = None, *,
        backend: str = "auto", timeout: float = DEFAULT_TIMEOUT, echo: bool = True):
    """Run `fn(*args, **kwargs)` on `nprocs` ranks; return the list of return values by rank.
    The timeout counts from the moment every rank has joined the process group.

    backend: 'auto' | 'gloo' | 'nccl'.  timeout: seconds before the run is called a hang.
    echo: show what the ranks print, each line marked with its rank.
    Raises RankError when a rank raises, HangError on a hang, LaunchError on bad input.
    """
    __tracebackhide__ = True   # IPython shows the rank's traceback, not the launcher's frames
    kwargs = dict(kwargs or {})
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise LaunchError(f"nprocs must be a positive integer, got {nprocs!r}")
    if under_torchrun():
        return run_under_torchrun(fn, nprocs, args, kwargs, backend)
    if nprocs > MAX_PROCS:
        raise LaunchError(f"nprocs={nprocs}: more processes than this launcher runs on one machine "
                          f"(at most {MAX_PROCS}; this one has {os.cpu_count()} cores). Use fewer "
                          f"ranks, or torchrun across machines.")
    if timeout is None or timeout <= 0:
        raise LaunchError(f"timeout must be a positive number of seconds, got {timeout!r}")
    backend = rendezvous.resolve_backend(backend, nprocs)
    with serial.turn(nprocs):   # many ranks take turns where LABKIT_RUN_LOCK says so (tests)
        return _start(fn, nprocs, args, kwargs, backend, timeout, echo)


def _start(fn, nprocs: int, args: tuple, kwargs: dict, backend: str, timeout: float, echo: bool):
    __tracebackhide__ = True
    try:
        payload, sources = source.dumps((fn, tuple(args), kwargs))
    except Exception as err:  # noqa: BLE001
        raise LaunchError(f"could not send the function to the ranks ({err}): it and its "
                          f"arguments must be picklable") from err
    sweep_orphans()
    rundir = Path(tempfile.mkdtemp(prefix="labkit-run-"))
    procs, outs = [], []
    try:
        (rundir / "owner").write_text(str(os.getpid()))   # for sweep_orphans
        env = rendezvous.child_env()
        (rundir / "spec.pkl").write_bytes(pickle.dumps(dict(
            world=nprocs, backend=backend, timeout=timeout, parent=os.getpid(), payload=payload,
            sources=sources,
            sys_path=list(sys.path), env=env, cwd=os.getcwd())))
        hang.create_notes(rundir, nprocs)
        zygote = warm.get()
        for rank in range(nprocs):
            if zygote is not None:
                procs.append(zygote.fork(rundir, rank))
                continue
            out = open(rundir / f"out{rank}.txt", "wb")
            outs.append(out)
            procs.append(subprocess.Popen(
                [sys.executable, "-u", "-m", "labkit.launch", str(rundir), str(rank)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=os.getcwd()))
        echoer = transport.Echo(rundir, nprocs) if echo else None
        names = {file: name for file, (name, _) in sources.items() if name}
        try:
            return _wait(procs, rundir, timeout, nprocs, echoer, names)
        except (RankError, HangError) as err:
            raise err.with_traceback(None) from None   # the report is the ranks', not ours

    finally:
        _kill_all(procs)
        for out in outs:
            out.close()
        shutil.rmtree(rundir, ignore_errors=True)


def sweep_orphans() -> int:
    """Remove run folders whose launching process is gone: it was killed while cleaning up (a
    notebook kernel shut down by a grader's cell timeout, say), so its `finally` never ran.
    Returns how many were removed. Folders of live processes are left alone."""
    removed = 0
    for d in Path(tempfile.gettempdir()).glob("labkit-run-*"):
        try:
            pid = int((d / "owner").read_text())
            os.kill(pid, 0)
        except ProcessLookupError:      # the owner is gone: nobody will read this folder again
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
        except (OSError, ValueError):   # no owner file yet, or another user's live process
            pass
    return removed


def _wait(procs, rundir: Path, timeout: float, n: int, echo, names: dict):
    __tracebackhide__ = True
    started = time.monotonic()
    deadline = None  # set once every rank is up: a slow start on a busy machine is not a hang
    first_failure = None
    try:
        while True:
            if echo:
                echo.pump()
            codes = [p.poll() for p in procs]
            failed = [r for r in range(n) if transport.has_error(rundir, r)
                      or codes[r] not in (None, 0)]
            if failed and first_failure is None:
                first_failure = time.monotonic()
            if first_failure is not None and (time.monotonic() - first_failure > _GRACE
                                              or all(c is not None for c in codes)):
                raise transport.rank_error(procs, rundir)
            done = [transport.has_result(rundir, r) for r in range(n)]
            if all(done):
                return transport.receive_results(rundir, n)
            now = time.monotonic()
            if deadline is None:
                if rendezvous.all_ready(rundir, n):
                    deadline = now + timeout
                elif now - started > STARTUP_TIMEOUT:
                    raise hang.hang_error(procs, rundir, STARTUP_TIMEOUT, done, names,
                                          starting=True)
            elif now > deadline:
                raise hang.hang_error(procs, rundir, timeout, done, names)
            time.sleep(0.005 if now - started < 1 else 0.02)
    finally:
        if echo:
            _kill_all(procs)
            echo.pump(final=True)


def _kill_all(procs) -> None:
    """End every child (SIGKILL: ranks hold nothing worth a graceful shutdown) and reap it."""
    for p in procs:
        if p.poll() is None:
            try:
                p.kill()
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
