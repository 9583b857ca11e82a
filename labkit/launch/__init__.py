"""Run one function on N real processes and get every rank's return value back.

    from labkit.launch import run
    def hello():
        import torch.distributed as dist
        return dist.get_rank()
    run(hello, 4)            # -> [0, 1, 2, 3]

Everything in the book builds on this. Each rank is a fresh process with `torch.distributed`
initialised: Gloo on CPU, or NCCL with one GPU per rank when the machine has enough GPUs. The
function is sent by value (cloudpickle), so it may be defined in a notebook cell.

What goes wrong is reported, never hung on:
- a rank that raises stops the others within seconds; you see that rank's traceback (RankError);
- a hang (a send nobody receives) ends after `timeout` seconds with the Python stack of every
  rank at the moment it was stuck (HangError);
- interrupting the kernel, or any failure, ends every child process.

One idea per module:
    process     run(): start the ranks, watch them, end them all
    warm        the warm helper seen from the parent (a zygote that imported torch once)
    zygote      the warm helper's own process: forks a fresh rank per request
    rank        inside a rank: the entry point (`python -m labkit.launch`), device()
    rendezvous  backend choice, loopback-only environment, the file store ranks meet at
    transport   return values, tracebacks and prints, back from the ranks through files
    hang        note() and the per-rank stacks of a HangError
    torchrun    the same run() as one of torchrun's ranks
    errors      LaunchError, RankError, HangError
"""
from labkit.launch.errors import HangError, LaunchError, RankError
from labkit.launch.hang import note
from labkit.launch.process import DEFAULT_TIMEOUT, MAX_PROCS, STARTUP_TIMEOUT, run
from labkit.launch.rank import device
from labkit.launch.rendezvous import gpu_count, resolve_backend
from labkit.launch.torchrun import init_torchrun_rank, torchrun_backend, under_torchrun
from labkit.launch.warm import shutdown

__all__ = ["run", "device", "note", "gpu_count", "resolve_backend", "shutdown",
           "init_torchrun_rank", "torchrun_backend", "under_torchrun", "LaunchError",
           "RankError", "HangError", "DEFAULT_TIMEOUT", "STARTUP_TIMEOUT", "MAX_PROCS"]
