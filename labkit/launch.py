"""Run one function on N real processes and get every rank's return value back.

    from labkit.launch import run
    def hello():
        import torch.distributed as dist
        return dist.get_rank()
    run(hello, 4)            # -> [0, 1, 2, 3]

Everything in the book builds on this. Each rank is a fresh process (the spawn start method)
with `torch.distributed` initialised: Gloo on CPU, or NCCL with one GPU per rank when the
machine has enough GPUs. The function is sent by value (cloudpickle), so it may be defined in a
notebook cell.

What goes wrong is reported, never hung on:
- a rank that raises stops the others within seconds; you see that rank's traceback (RankError);
- a hang (a send nobody receives) ends after `timeout` seconds with the Python stack of every
  rank at the moment it was stuck (HangError);
- interrupting the kernel, or any failure, ends every child process.

Rendezvous goes through a file in a private temporary folder (no port to collide on); Gloo's
and NCCL's own sockets are bound to the loopback interface, so nothing listens beyond 127.0.0.1.

Under `torchrun --nproc-per-node N ...` the same call runs the function in the current process as
its rank (initialised from torchrun's environment) and returns every rank's value, gathered, so a
lab's code is the same on a laptop, a workstation and a cluster.
"""
from __future__ import annotations

import ctypes
import faulthandler
import linecache
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

DEFAULT_TIMEOUT = 60.0  # seconds a run may take, once every rank is up, before it is a hang
STARTUP_TIMEOUT = 120.0  # seconds for every rank to start and join the process group
_NOTE_BYTES = 512
_GRACE = 1.5  # seconds to let the other ranks report their own errors after the first one


class LaunchError(RuntimeError):
    """A run could not be started as asked (bad world size, backend, ...)."""


class RankError(RuntimeError):
    """A rank raised (or died). `.rank` is the first rank that failed; `.remote_traceback` its text."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "", others=()):
        self.rank, self.remote_traceback, self.others = rank, remote_traceback, list(others)
        super().__init__(message)


class HangError(TimeoutError):
    """The run did not finish within its timeout. `.stacks[rank]` is where each rank was stuck."""

    def __init__(self, message: str, stacks: dict, notes: dict):
        self.stacks, self.notes = stacks, notes
        super().__init__(message)


# ----------------------------------------------------------------------------- inside a rank
_note_slot = None  # this rank's slice of the shared notes file (set in the child)


def note(text: str) -> None:
    """Record what this rank is doing now; a HangError shows each rank's latest note.

    Cheap enough to call every step (it writes into shared memory). A no-op outside `run`."""
    if _note_slot is not None:
        data = text.encode("utf-8", "replace")[: _NOTE_BYTES - 1] + b"\0"
        _note_slot[: len(data)] = data


def device():
    """The torch.device this rank should compute on: its own GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _die_with_parent(parent_pid: int) -> None:
    """A child must not outlive the notebook kernel that started it, even if the kernel is killed."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="labkit-parent-watch").start()


def _to_cpu(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if type(obj) in (list, tuple):
        return type(obj)(_to_cpu(o) for o in obj)
    if type(obj) is dict:
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _child(rundir: str, rank: int, parent_pid: int | None = None) -> None:
    """Entry point of one rank: `python -m labkit.launch RUNDIR RANK`, or forked by the zygote."""
    global _note_slot
    rundir = Path(rundir)
    import pickle

    spec = pickle.loads((rundir / "spec.pkl").read_bytes())
    world, backend, timeout = spec["world"], spec["backend"], spec["timeout"]
    # Functions of importable modules travel by reference: see the modules the parent sees.
    sys.path += [p for p in spec["sys_path"] if p not in sys.path]
    _die_with_parent(parent_pid or spec["parent"])
    if parent_pid:  # forked from the warm zygote: take the caller's current environment and folder
        os.environ.clear()
        os.environ.update(spec["env"])
        os.chdir(spec["cwd"])
    stack_file = open(rundir / f"stack{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    with open(rundir / "notes.bin", "r+b") as f:
        _note_slot = memoryview(mmap.mmap(f.fileno(), 0))[rank * _NOTE_BYTES:(rank + 1) * _NOTE_BYTES]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), LABKIT_CHILD="1")
    try:
        import cloudpickle
        import torch
        import torch.distributed as dist

        fn, args, kwargs = cloudpickle.loads(spec["payload"])
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(str(rundir / "store"), world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=max(timeout, 1.0) + 30))
        (rundir / f"ready{rank}").touch()  # the timeout counts from here: start-up is not a hang
        result = fn(*args, **kwargs)
        _write_atomic(rundir / f"result{rank}.pkl", cloudpickle.dumps(_to_cpu(result)))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        text = traceback.format_exc()
        _write_atomic(rundir / f"error{rank}.txt", f"{time.time()!r}\n{text}".encode())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Stay up until every rank is done (the parent then ends us): a rank that finished must not
    # close its connections under a peer still waiting on it, or that peer's hang would show up
    # as a confusing "connection reset" instead of a hang with its stack.
    while True:
        time.sleep(60)


# ----------------------------------------------------------------------------- the parent
def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "LABKIT_CHILD" not in os.environ


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, nprocs: int) -> str:
    """'auto' -> NCCL with one GPU per rank when there are enough GPUs, otherwise Gloo."""
    backend = backend.lower()
    if backend == "auto":
        return "nccl" if gpu_count() >= nprocs else "gloo"
    if backend == "nccl":
        gpus = gpu_count()
        if gpus < nprocs:
            raise LaunchError(f"backend='nccl' needs one GPU per rank: {nprocs} ranks asked for, "
                              f"{gpus} GPU(s) on this machine. Use backend='gloo' (CPU) or "
                              f"nprocs <= {gpus}.")
        return "nccl"
    if backend == "gloo":
        return "gloo"
    raise LaunchError(f"unknown backend {backend!r}: use 'auto', 'gloo' or 'nccl'")


MAX_PROCS = 64


def run(fn, nprocs: int, args: tuple = (), kwargs: dict | None = None, *,
        backend: str = "auto", timeout: float = DEFAULT_TIMEOUT, echo: bool = True):
    """Run `fn(*args, **kwargs)` on `nprocs` ranks; return the list of return values by rank.
    The timeout counts from the moment every rank has joined the process group.

    backend: 'auto' | 'gloo' | 'nccl'.  timeout: seconds before the run is called a hang.
    echo: show what the ranks print, each line marked with its rank.
    Raises RankError when a rank raises, HangError on a hang, LaunchError on bad input.
    """
    kwargs = dict(kwargs or {})
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise LaunchError(f"nprocs must be a positive integer, got {nprocs!r}")
    if _under_torchrun():
        return _run_under_torchrun(fn, nprocs, args, kwargs, backend)
    if nprocs > MAX_PROCS:
        raise LaunchError(f"nprocs={nprocs}: more processes than this launcher runs on one machine "
                          f"(at most {MAX_PROCS}; this one has {os.cpu_count()} cores). Use fewer "
                          f"ranks, or torchrun across machines.")
    if timeout is None or timeout <= 0:
        raise LaunchError(f"timeout must be a positive number of seconds, got {timeout!r}")
    backend = resolve_backend(backend, nprocs)
    import pickle

    import cloudpickle

    try:
        payload = cloudpickle.dumps((fn, tuple(args), kwargs))
    except Exception as err:  # noqa: BLE001
        raise LaunchError(f"could not send the function to the ranks ({err}): it and its "
                          f"arguments must be picklable") from err
    rundir = Path(tempfile.mkdtemp(prefix="labkit-run-"))
    procs, outs = [], []
    try:
        (rundir / "spec.pkl").write_bytes(pickle.dumps(dict(
            world=nprocs, backend=backend, timeout=timeout, parent=os.getpid(), payload=payload,
            sys_path=list(sys.path), env=_child_env(), cwd=os.getcwd())))
        (rundir / "notes.bin").write_bytes(bytes(nprocs * _NOTE_BYTES))
        env = _child_env()
        zygote = _zygote()
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
        return _wait(procs, rundir, timeout, nprocs, _Echo(rundir, nprocs) if echo else None)
    finally:
        _kill_all(procs)
        for out in outs:
            out.close()
        shutil.rmtree(rundir, ignore_errors=True)


# Loopback only: Gloo and NCCL bind their sockets to this interface. One thread per rank,
# so N ranks on N cores do not fight over cores.
_CHILD_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
              "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


def _child_env() -> dict:
    env = dict(os.environ, **_CHILD_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [_PACKAGE_ROOT, env.get("PYTHONPATH")] if p)
    return env


class _ForkedRank:
    """A rank forked by the zygote: the Popen-like handle _wait and _kill_all need."""

    def __init__(self, pid: int, rundir: Path, rank: int):
        self.pid, self._exit = pid, rundir / f"exit{rank}"

    def poll(self):
        try:
            return int(self._exit.read_text())
        except (OSError, ValueError):
            pass
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:  # gone with no status written: the zygote itself died
            return -signal.SIGKILL
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


class _Zygote:
    """The warm parent of ranks (labkit._zygote): torch imported once, a fork per rank."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "labkit._zygote"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=_child_env(), cwd=os.getcwd())
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

    def fork(self, rundir: Path, rank: int) -> _ForkedRank:
        with self.lock:
            self.proc.stdin.write(f"{rundir} {rank}\n".encode())
            self.proc.stdin.flush()
            return _ForkedRank(int(self._readline(timeout=30)), rundir, rank)

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


def _zygote():
    """The process's zygote, started on first use; None where forking is not available
    (then every rank is a fresh `python -m labkit.launch`). LABKIT_LAUNCH=spawn forces that."""
    global _ZYGOTE
    if os.environ.get("LABKIT_LAUNCH", "") == "spawn" or not sys.platform.startswith("linux"):
        return None
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or not _ZYGOTE.alive():
            try:
                _ZYGOTE = _Zygote()
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


class _Echo:
    """Relay what each rank prints to this process's stdout (the notebook), marked by rank."""

    def __init__(self, rundir: Path, n: int):
        self.files = [rundir / f"out{r}.txt" for r in range(n)]
        self.offsets = [0] * n
        self.partial = [b""] * n

    def pump(self, final: bool = False) -> None:
        for r, path in enumerate(self.files):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[r])
                    data = f.read()
            except OSError:
                continue
            self.offsets[r] += len(data)
            lines = (self.partial[r] + data).split(b"\n")
            self.partial[r] = b"" if final else lines.pop()
            for line in lines:
                text = line.decode("utf-8", "replace")
                if not _NOISE.search(text):
                    print(f"[rank {r}] {text}", flush=True)


_NOISE = re.compile(r"^\s*$|^\[Gloo\] Rank \d+ is connected to|ProcessGroupGloo")


def _wait(procs, rundir: Path, timeout: float, n: int, echo):
    import cloudpickle

    started = time.monotonic()
    deadline = None  # set once every rank is up: a slow start on a busy machine is not a hang
    first_failure = None
    try:
        while True:
            if echo:
                echo.pump()
            codes = [p.poll() for p in procs]
            failed = [r for r in range(n) if (rundir / f"error{r}.txt").exists()
                      or codes[r] not in (None, 0)]
            if failed and first_failure is None:
                first_failure = time.monotonic()
            if first_failure is not None and (time.monotonic() - first_failure > _GRACE
                                              or all(c is not None for c in codes)):
                raise _rank_error(procs, rundir)
            done = [(rundir / f"result{r}.pkl").exists() for r in range(n)]
            if all(done):
                return [cloudpickle.loads((rundir / f"result{r}.pkl").read_bytes())
                        for r in range(n)]
            now = time.monotonic()
            if deadline is None:
                if all((rundir / f"ready{r}").exists() for r in range(n)):
                    deadline = now + timeout
                elif now - started > STARTUP_TIMEOUT:
                    raise _hang_error(procs, rundir, STARTUP_TIMEOUT, done, starting=True)
            elif now > deadline:
                raise _hang_error(procs, rundir, timeout, done)
            time.sleep(0.005 if now - started < 1 else 0.02)
    finally:
        if echo:
            _kill_all(procs)
            echo.pump(final=True)


def _rank_error(procs, rundir: Path) -> RankError:
    failures = []  # (time, rank, text)
    for r, p in enumerate(procs):
        f = rundir / f"error{r}.txt"
        if f.exists():
            stamp, _, text = f.read_text().partition("\n")
            failures.append((float(stamp), r, text))
        elif p.poll() not in (None, 0):
            code = p.poll()
            why = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            # A rank killed by a signal is almost always the cause: its peers' errors
            # ("connection reset") are the effect, so it sorts first.
            failures.append((float("-inf") if code < 0 else float("inf"), r,
                             f"rank {r} died ({why}) without a Python traceback"))
    failures.sort()
    _, rank, text = failures[0]
    last = text.strip().splitlines()[-1] if text.strip() else "died"
    others = [r for _, r, _ in failures[1:]]
    tail = (f"\n(ranks {others} failed after it, most likely because rank {rank} stopped)"
            if others else "")
    msg = f"rank {rank} failed: {last}\n\n--- traceback from rank {rank} ---\n{text.rstrip()}{tail}"
    return RankError(rank, msg, text, others)


_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _format_stack(raw: str) -> str:
    """faulthandler's dump (innermost first) -> a Python-style traceback with source lines."""
    frames = []
    for line in raw.splitlines():
        m = _FRAME.match(line)
        if not m:
            continue
        file, lineno, func = m["file"], int(m["line"]), m["func"]
        if file.endswith(("labkit/launch.py", "labkit/_zygote.py", "c10d_logger.py")) \
                or file.startswith("<frozen"):
            continue
        frames.append((file, lineno, func))
    out = []
    for file, lineno, func in reversed(frames):
        out.append(f'  File "{file}", line {lineno}, in {func}')
        src = linecache.getline(file, lineno).strip()
        if src:
            out.append(f"    {src}")
    return "\n".join(out) if out else "  (no Python frame: the rank was starting or exiting)"


def _hang_error(procs, rundir: Path, timeout: float, done, starting=False) -> HangError:
    notes_raw = (rundir / "notes.bin").read_bytes()
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(0.3)
    stacks, notes, parts = {}, {}, []
    for r, p in enumerate(procs):
        notes[r] = notes_raw[r * _NOTE_BYTES:(r + 1) * _NOTE_BYTES].split(b"\0", 1)[0].decode("utf-8", "replace")
        if done[r]:
            stacks[r] = "(finished)"
        else:
            raw = (rundir / f"stack{r}.txt").read_text() if (rundir / f"stack{r}.txt").exists() else ""
            stacks[r] = _format_stack(raw)
        head = f"rank {r}: " + ("finished" if done[r] else "stuck")
        if notes[r]:
            head += f" (last note: {notes[r]})"
        parts.append(head + ("" if done[r] else "\n" + stacks[r]))
    if starting:
        msg = (f"the ranks did not all start within {timeout:g}s (a very busy machine, or an "
               f"import that blocks). Where each rank was:\n\n" + "\n\n".join(parts))
    else:
        msg = (f"the run did not finish within timeout={timeout:g}s: a hang. Most often a send "
               f"without its matching recv, or a collective some rank never called. Where each "
               f"rank was:\n\n" + "\n\n".join(parts))
    return HangError(msg, stacks, notes)


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


def _run_under_torchrun(fn, nprocs, args, kwargs, backend):
    """This process is one of torchrun's ranks: join torchrun's group (once), run fn here, and
    gather every rank's value. A failure in fn is a RankError, as with local processes."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if nprocs != world:
        raise LaunchError(f"run(fn, {nprocs}) under torchrun with WORLD_SIZE={world}: "
                          f"start torchrun with {nprocs} processes in all, or ask for {world}")
    if not dist.is_initialized():
        init_torchrun_rank(backend)
    rank = dist.get_rank()
    try:
        result = _to_cpu(fn(*args, **kwargs))
    except Exception as err:  # noqa: BLE001 - reported like a local rank's failure
        text = traceback.format_exc()
        raise RankError(rank, f"rank {rank} failed: {text.strip().splitlines()[-1]}\n\n"
                              f"--- traceback from rank {rank} ---\n{text.rstrip()}", text) from err
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    return gathered


def torchrun_backend(backend: str = "auto") -> str:
    """The backend for a torchrun rank: 'auto' -> NCCL when this node has a GPU for each of its
    local ranks (LOCAL_WORLD_SIZE), else Gloo; 'nccl' without enough GPUs is a LaunchError."""
    return resolve_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def init_torchrun_rank(backend: str = "auto") -> str:
    """Join the process group torchrun set up for this process; return the backend used.

    torchrun's agent keeps one key-value store (at MASTER_ADDR:MASTER_PORT) for the whole job,
    across restarts (`--max-restarts`). Joining under torch's default keys, a restarted attempt
    can read the addresses the dead attempt's ranks published and fail to connect. So every
    attempt joins under its own key prefix (TORCHELASTIC_RESTART_COUNT). We only connect to the
    agent's store as a client: nothing new listens. Where the agent does not share its store
    (TORCHELASTIC_USE_AGENT_STORE is not True), torch's env:// rendezvous is used as is: rank 0
    then starts a fresh store for each attempt, where torchrun told it to."""
    import torch
    import torch.distributed as dist

    backend = torchrun_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return backend
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"labkit/attempt{attempt}", store),
                            rank=rank, world_size=world)
    return backend


if __name__ == "__main__":
    # Run the child from the imported module (not this __main__ copy), so that `note()` called by
    # user code as labkit.launch.note sees the same module state.
    from labkit.launch import _child as _entry

    _entry(sys.argv[1], int(sys.argv[2]))
