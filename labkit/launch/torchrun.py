"""torchrun mode: under `torchrun --nproc-per-node N ...` the same `run(fn, N)` call runs `fn` in
the current process as its rank (initialised from torchrun's environment) and returns every
rank's value, gathered, so a lab's code is the same on a laptop, a workstation and a cluster.
"""
from __future__ import annotations

import os

from labkit.launch import source
from labkit.launch.errors import LaunchError, RankError
from labkit.launch.rendezvous import resolve_backend
from labkit.launch.transport import to_cpu


def under_torchrun() -> bool:
    """Is this process one of torchrun's ranks (and not a rank labkit.launch started)?"""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LABKIT_CHILD" not in os.environ


def run_under_torchrun(fn, nprocs, args, kwargs, backend):
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
        result = to_cpu(fn(*args, **kwargs))
    except Exception as err:  # noqa: BLE001 - reported like a local rank's failure
        text = source.format_exception(err)
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
