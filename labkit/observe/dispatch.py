"""Every torch.distributed call this thread makes, seen by a dispatch mode: the one collective log.

    with CollectiveLog() as log:                         # inside a rank
        fn(x)
    log.calls                # ["all_reduce", "send", ...] in torch.distributed's spelling
    log.collectives()        # the same without point-to-point (send, recv, barrier)
    log.times("all_reduce")  # perf_counter of each dispatch
    log.sized()              # [("all_reduce", elements), ...]; log.records has bytes as well

    with CollectiveLog(allow=(), why="build the ring from isend/irecv only"):
        ring(x)              # any collective raises at once, naming it, before it runs
    with CollectiveLog(refuse=("all_gather",), why="..."):  # or refuse some by name
    with CollectiveLog(allow=(), why="...", error=Refused):  # a checker's refusal (labkit.check)

Why a dispatch mode: every torch.distributed call reaches the dispatcher as a c10d operator,
whoever makes it (labkit's wrappers, the reader's function, torch DDP's C++ reducer), so the
log is a counter the code under test does not write, and nothing in torch.distributed is
replaced. labkit.observe.commlog is the other log: what labkit's own wrappers asked for, with
the mesh dimension and the time blocked; this one sees calls that bypass them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

POINT_TO_POINT = ("send", "recv", "recv_any_source", "barrier", "monitored_barrier")
# c10d operator name -> the torch.distributed name the caller wrote
_PUBLIC = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
           "allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
           "allgather_into_tensor_coalesced": "all_gather_into_tensor",
           "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter_tensor",
           "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
           "alltoall": "all_to_all", "alltoall_base": "all_to_all_single",
           "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter"}


def public_name(op_name: str) -> str:
    """torch.distributed's name of a c10d operator ("allreduce_.default" -> "all_reduce")."""
    base = op_name.split(".")[0].rstrip("_")
    return _PUBLIC.get(base, base)


@dataclass(frozen=True)
class Call:
    op: str          # torch.distributed's name
    numel: int       # elements in the tensors of its first argument
    bytes: int       # their bytes (Tensor.nbytes)
    time: float      # time.perf_counter() when it was dispatched


def _tensors(args) -> list:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [t for t in a if isinstance(t, torch.Tensor)]
    return out


class CollectiveLog(TorchDispatchMode):
    """Record each c10d operator dispatched on this thread while active: `calls` their
    torch.distributed names, `records` each as a Call (elements, bytes, time). allow: None (any
    call may run) or the names (prefixes) that may run besides point-to-point (send, recv,
    barrier), so allow=() refuses every collective; refuse: names that may not run. A refused
    call raises error("collective dist.<name> called: <why>") instead of running (a checker
    passes error=labkit.check.Refused)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False    # else the first dispatch imports torch._dynamo: seconds on a cold rank

    def __init__(self, allow: tuple | None = None, refuse: tuple = (), why: str = "",
                 error: type = RuntimeError):
        super().__init__()
        self.calls: list = []        # torch.distributed's name of each call, in order
        self.records: list = []      # the same calls as Call(op, numel, bytes, time)
        self.allow = None if allow is None else POINT_TO_POINT + tuple(allow)
        self.refuse, self.why, self.error = tuple(refuse), why, error

    def refused(self, op: str) -> bool:
        return (self.allow is not None and not op.startswith(self.allow)) \
            or op.startswith(self.refuse)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func.__name__.split(".")[0].rstrip("_") \
                not in ("wait", "work_wait"):
            op = public_name(func.__name__)
            ts = _tensors(args[:1])
            self.calls.append(op)
            self.records.append(Call(op, sum(t.numel() for t in ts), sum(t.nbytes for t in ts),
                                     time.perf_counter()))
            if self.refused(op):
                raise self.error(f"collective dist.{op} called: {self.why}")
        return func(*args, **(kwargs or {}))

    def names(self) -> list:
        return list(self.calls)

    def collectives(self) -> list:
        return [op for op in self.calls if not op.startswith(POINT_TO_POINT)]

    def times(self, op: str | None = None) -> list:
        """perf_counter of each call whose name starts with `op` (all_reduce: also coalesced)."""
        return [c.time for c in self.records if op is None or c.op.startswith(op)]

    def sized(self) -> list:
        """[(name, elements)] of every call, in order."""
        return [(c.op, c.numel) for c in self.records]
