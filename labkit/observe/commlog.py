"""One communication log: every collective and point-to-point call labkit makes passes here.

    from labkit.observe import commlog
    commlog.name_group(tp_group, "tp")            # once, where the mesh is built
    with commlog.record() as log:                 # on this rank
        commlog.all_reduce(x, group=tp_group, where="g forward")
        loss.backward()
    log.events            # [Event(op='all_reduce', dim='tp', bytes=..., start=..., end=...)]
    log.bytes(dim="tp")   # payload bytes handed to collectives along the tp dimension
    log.by_dim()          # {"tp": {"all_reduce": (count, bytes)}, "dp": ...}

Why one place: timelines, labs and checkers all read the same events, and nothing patches
torch.distributed to find out what ran. What is logged is what labkit *asked* for: the operation,
the mesh dimension of its group, the payload size of the tensor handed over (the whole tensor
for an all-reduce, the whole output of an all-gather, the whole input of a reduce-scatter, the
message of a send) and wall-clock start/end. That is a record for timelines and for counting
calls; it is NOT a proof of bytes on the wire: `observe.netcount` reads the kernel's own socket
counters for that, and labkit.costs predicts wire bytes from (op, bytes, group size).

Logging costs nothing when no log is open. While one is open each call reads the clock with
`labkit.timing.now`, which synchronizes a GPU, so timings are honest and a run is slower.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import record_function

from labkit.observe.storage import nbytes
from labkit.timing import now

_OPEN: list = []                  # open logs (instrumentation only: groups are always passed)
_NAMES: dict = {}                 # id(process group) -> mesh dimension name
_LOCK = threading.Lock()
_INSIDE = threading.local()       # depth of `composite` calls on this thread: inner calls unlogged


@dataclass
class Event:
    op: str                       # all_reduce, all_gather, reduce_scatter, broadcast, all_to_all,
                                  # send, recv
    dim: str                      # mesh dimension of the group ("tp", "dp", ...; "world", "?")
    bytes: int                    # payload, see the module docstring
    group_size: int
    start: float
    end: float | None = None      # None until an asynchronous op has been waited for
    where: str = ""               # who asked ("g forward", "ZeRO-3 gather", "pipeline F")
    peer: int | None = None       # point-to-point: the other rank (group rank)
    shape: tuple = ()             # of the tensor handed over
    blocked: float = 0.0          # seconds the caller waited: the whole call for a blocking
                                  # collective, only the time inside wait() for a posted send/recv


@dataclass
class Log:
    events: list = field(default_factory=list)

    def select(self, op=None, dim=None, where=None) -> list:
        return [e for e in self.events if (op is None or e.op == op)
                and (dim is None or e.dim == dim) and (where is None or e.where == where)]

    def count(self, op=None, dim=None, where=None) -> int:
        return len(self.select(op, dim, where))

    def bytes(self, op=None, dim=None, where=None) -> int:
        return sum(e.bytes for e in self.select(op, dim, where))

    def seconds(self, op=None, dim=None, where=None) -> float:
        """Seconds callers were blocked (overlapping asynchronous transfers are not counted)."""
        return sum(e.blocked for e in self.select(op, dim, where))

    def by_dim(self) -> dict:
        """{dim: {op: (count, bytes)}}"""
        out: dict = {}
        for e in self.events:
            c, b = out.setdefault(e.dim, {}).get(e.op, (0, 0))
            out[e.dim][e.op] = (c + 1, b + e.bytes)
        return out

    def as_dicts(self) -> list:
        return [vars(e).copy() for e in self.events]


@contextmanager
def record():
    """Open a log on this rank; every labkit call made inside is appended to it."""
    log = Log()
    with _LOCK:
        _OPEN.append(log)
    try:
        yield log
    finally:
        with _LOCK:   # by identity: two open logs with the same events compare equal
            _OPEN[:] = [o for o in _OPEN if o is not log]


def recording() -> bool:
    return bool(_OPEN)


def name_group(group, dim: str) -> None:
    """Say which mesh dimension `group` runs along (None: the default group)."""
    _NAMES[id(group)] = dim


def dim_of(group) -> str:
    if id(group) in _NAMES:
        return _NAMES[id(group)]
    if group is None or group is dist.group.WORLD:
        return "world"
    return "?"


def _muted() -> bool:
    return getattr(_INSIDE, "depth", 0) > 0


def _begin(op, t: torch.Tensor | None, nbytes, group, where, peer=None):
    if not _OPEN or _muted():
        return None
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    e = Event(op=op, dim=dim_of(group), bytes=int(nbytes), group_size=size,
              start=now(None if t is None else t.device), where=where, peer=peer,
              shape=() if t is None else tuple(t.shape))
    for log in _OPEN:
        log.events.append(e)
    return e


def _finish(e, t) -> None:
    if e is not None:
        e.end = now(t.device)
        e.blocked = e.end - e.start


# ----------------------------------------------------------------------------- logged calls
def all_reduce(t, op=dist.ReduceOp.SUM, group=None, where: str = ""):
    e = _begin("all_reduce", t, nbytes(t), group, where)
    with record_function(f"all_reduce {where}"):  # a span in profiler traces
        dist.all_reduce(t, op=op, group=group)
    _finish(e, t)
    return t


def all_gather_into(out, inp, group=None, where: str = ""):
    """out: (N * c,) flat; inp: (c,) this rank's piece. Payload: the whole output."""
    e = _begin("all_gather", out, nbytes(out), group, where)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    with record_function(f"all_gather {where}"):  # a span in profiler traces
        fn(out, inp, group=group)
    _finish(e, out)
    return out


def all_gather_list(outs, inp, group=None, where: str = ""):
    """dist.all_gather into a list of tensors (sizes may differ on some backends)."""
    e = _begin("all_gather", inp, sum(nbytes(o) for o in outs), group, where)
    with record_function(f"all_gather {where}"):  # a span in profiler traces
        dist.all_gather(outs, inp, group=group)
    _finish(e, inp)
    return outs


def reduce_scatter_into(out, inp, op=dist.ReduceOp.SUM, group=None, where: str = ""):
    """out: (c,); inp: (N * c,) flat. Payload: the whole input. The backend's own algorithm:
    Gloo's moves all-reduce bytes (observe.netcount shows it); labkit.collectives has a ring."""
    e = _begin("reduce_scatter", inp, nbytes(inp), group, where)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    with record_function(f"reduce_scatter {where}"):  # a span in profiler traces
        fn(out, inp, op=op, group=group)
    _finish(e, out)
    return out


def broadcast(t, src: int, group=None, where: str = ""):
    """src: the global rank, as dist.broadcast takes it."""
    e = _begin("broadcast", t, nbytes(t), group, where)
    with record_function(f"broadcast {where}"):  # a span in profiler traces
        dist.broadcast(t, src=src, group=group)
    _finish(e, t)
    return t


def all_to_all_single(out, inp, out_splits=None, in_splits=None, group=None, where: str = ""):
    """Payload: what this rank sends (its whole input)."""
    e = _begin("all_to_all", inp, nbytes(inp), group, where)
    with record_function(f"all_to_all {where}"):  # a span in profiler traces
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    _finish(e, out)
    return out


@contextmanager
def composite(op: str, t: torch.Tensor, group=None, where: str = "", payload: int | None = None):
    """Log ONE event for a collective labkit builds from smaller calls (ZeRO's ring reduce-scatter
    from labkit.collectives' send/recv); the calls inside are not logged again."""
    e = _begin(op, t, nbytes(t) if payload is None else payload, group, where)
    _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
    try:
        with record_function(f"{op} {where}"):  # one span in profiler traces
            yield e
    finally:
        _INSIDE.depth -= 1
        _finish(e, t)


def posted(op: str, t: torch.Tensor, group=None, where: str = "", payload: int | None = None):
    """Open the event of a collective the caller posted itself with async_op=True (ZeRO-3's
    prefetched all-gather): returns the Event, or None when no log is open. The caller owns
    closing it: `end` when the data has arrived, `blocked` += the time spent in wait()."""
    return _begin(op, t, nbytes(t) if payload is None else payload, group, where)


class _Timed:
    """A work whose wait() also closes its log event."""

    def __init__(self, work, event, tensor):
        self.work, self.event, self.tensor = work, event, tensor

    def wait(self):
        t0 = now(self.tensor.device)
        out = self.work.wait()
        t1 = now(self.tensor.device)
        self.event.blocked += t1 - t0
        if self.event.end is None:
            self.event.end = t1
        return out

    def is_completed(self):
        return self.work.is_completed()


def p2p_posted(ops, works, where: str = "") -> list:
    """Log a batch of point-to-point ops [(dist.isend | dist.irecv, tensor, peer, group, ...)]
    just posted (labkit.collectives.exchange); returns the works, wrapped to time their wait."""
    if not _OPEN or _muted():
        return works
    out = []
    for (fn, t, peer, group, *_), w in zip(ops, works):
        kind = "send" if fn is dist.isend else "recv"
        e = _begin(kind, t, nbytes(t), group, where, peer=peer)
        out.append(_Timed(w, e, t))
    return out
