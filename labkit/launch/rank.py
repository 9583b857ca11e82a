"""Inside a rank: the entry point of every rank process, and `device()`.

A rank is started either as `python -m labkit.launch RUNDIR RANK` or forked by the warm zygote
(labkit.launch.zygote). Either way it reads the run's spec, joins the group (rendezvous), calls
the function, sends back its value or its traceback (transport), and stays up until the parent
ends it.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

from labkit.launch import hang, rendezvous, source, transport


def device():
    """The torch.device this rank should compute on: its own GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def die_with_parent(parent_pid: int) -> None:
    """A child must not outlive the notebook kernel that started it, even if the kernel is
    killed."""
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


def main(rundir: str, rank: int, parent_pid: int | None = None) -> None:
    """Entry point of one rank: `python -m labkit.launch RUNDIR RANK`, or forked by the zygote."""
    rundir = Path(rundir)
    import pickle

    spec = pickle.loads((rundir / "spec.pkl").read_bytes())
    world, backend, timeout = spec["world"], spec["backend"], spec["timeout"]
    # Functions of importable modules travel by reference: see the modules the parent sees.
    sys.path += [p for p in spec["sys_path"] if p not in sys.path]
    die_with_parent(parent_pid or spec["parent"])
    if parent_pid:  # forked from the warm zygote: take the caller's current environment and folder
        os.environ.clear()
        os.environ.update(spec["env"])
        os.chdir(spec["cwd"])
    hang.attach(rundir, rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), LABKIT_CHILD="1")
    try:
        import cloudpickle

        source.install(spec.get("sources", {}))
        fn, args, kwargs = cloudpickle.loads(spec["payload"])
        rendezvous.join(rundir, rank, world, backend, timeout)
        result = fn(*args, **kwargs)
        transport.send_result(rundir, rank, result)
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        transport.send_error(rundir, rank, source.format_exception(sys.exc_info()[1]))
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
