"""How the ranks of one run find each other: the backend, the loopback-only environment, and a
file store in the run's private folder.

Rendezvous goes through a file in a private temporary folder (no port to collide on, so two
notebooks can launch at the same moment); Gloo's and NCCL's own sockets are bound to the
loopback interface, so nothing listens beyond 127.0.0.1.
"""
from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

from labkit.launch.errors import LaunchError

# Loopback only: Gloo and NCCL bind their sockets to this interface. One thread per rank,
# so N ranks on N cores do not fight over cores.
CHILD_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
             "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)  # the folder holding labkit/


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_FELL_BACK: set = set()   # (ranks, GPUs) already announced by this process: say it once


def fallback_note(nprocs: int, gpus: int) -> str:
    """The line a run prints when 'auto' chose Gloo on a machine that has GPUs."""
    return (f"labkit: {nprocs} ranks asked for, {gpus} GPU(s) here: running on Gloo on the CPU, "
            f"not NCCL (NCCL needs one GPU per rank; it refuses two ranks on one GPU: "
            f"\"Duplicate GPU detected\"). Use --nproc {gpus} for NCCL.")


def resolve_backend(backend: str, nprocs: int) -> str:
    """'auto' -> NCCL with one GPU per rank when there are enough GPUs, otherwise Gloo (said once
    per process where there are GPUs, so the reader knows the run is on the CPU)."""
    backend = backend.lower()
    if backend == "auto":
        gpus = gpu_count()
        if gpus >= nprocs:
            return "nccl"
        if gpus and (nprocs, gpus) not in _FELL_BACK and os.environ.get("RANK", "0") == "0":
            _FELL_BACK.add((nprocs, gpus))
            print(fallback_note(nprocs, gpus), flush=True)
        return "gloo"
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


def child_env() -> dict:
    """The environment of every rank: the caller's, loopback-only, labkit importable."""
    env = dict(os.environ, **CHILD_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [PACKAGE_ROOT, env.get("PYTHONPATH")] if p)
    return env


def join(rundir: Path, rank: int, world: int, backend: str, timeout: float) -> None:
    """Inside a rank: join the run's process group through its file store, then mark this rank
    ready (the parent's hang timeout counts from there: start-up is not a hang)."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(str(rundir / "store"), world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=max(timeout, 1.0) + 30))
    (rundir / f"ready{rank}").touch()


def all_ready(rundir: Path, n: int) -> bool:
    """In the parent: has every rank joined the group?"""
    return all((rundir / f"ready{r}").exists() for r in range(n))
