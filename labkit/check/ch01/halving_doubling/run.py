"""Exercise 1.3's rank side: the observer around the reader's all-reduce (it counts this rank's
sends, logs every send and receive before it is posted, and refuses a collective, a message over
another group, or one to a rank that does not exist), the inputs, the rank job, and the logs it
leaves behind.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from labkit.check import Refused
from labkit.launch import device, note
from labkit.observe import netcount
from labkit.observe.dispatch import CollectiveLog

WHY = "build the all-reduce from send/recv (or isend/irecv) only"


def power_of_two_core(n: int) -> int:
    """P: the largest power of two <= n (the ranks that halve and double)."""
    return 1 << (n.bit_length() - 1)



def observer(path: str, case: int, rank: int, members: list, group):
    """A CollectiveLog (refusing collectives) that also counts this rank's sends, refuses a message
    over another process group than `group` or to a rank that does not exist, and appends
    "case op peer elements" (peer: its global rank) to `path` before each send or receive is
    posted (flushed at once, so the line survives a rank that Gloo aborts)."""


    n = len(members)

    class P2PObserver(CollectiveLog):
        def __init__(self):
            super().__init__(allow=(), why=WHY, error=Refused)
            self.sends = 0
            self._file = open(path, "a", encoding="utf-8")

        def __exit__(self, *exc):
            self._file.close()
            return super().__exit__(*exc)

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            op = func.__name__.split(".")[0].rstrip("_")
            if func.namespace == "c10d" and op in ("send", "recv", "recv_any_source"):
                pg = dist.ProcessGroup.unbox(args[1])
                if pg is not group:
                    raise Refused(
                        f"rank {rank} called dist.{op} over a process group of "
                        f"{pg.size()} ranks, but this all-reduce runs over the group of {n} ranks "
                        f"{members} passed as `group`: pass group= to every send and receive (and "
                        f"count ranks in it: dist.get_rank(group), dist.get_world_size(group))")
                peer = args[2] if op != "recv_any_source" else None
                if peer is not None and not (0 <= peer < n and members[peer] != rank):
                    raise Refused(
                        f"rank {rank} called dist.{op} with rank {peer} of its group "
                        f"of {n} as its partner. With N = {n}, only ranks "
                        f"0..{power_of_two_core(n) - 1} halve and double after the fold: which "
                        f"partner does your pairing give a rank whose partner would be {n} or "
                        f"more (or itself)?")
                self.sends += op == "send"
                where = members[peer] if peer is not None else "any"
                self._file.write(f"{case} {op} {where} {sum(t.numel() for t in args[0])}\n")
                self._file.flush()
            return super().__torch_dispatch__(func, types_, args, kwargs)

    return P2PObserver()


def inputs(i: int, rank: int, dtype: str, shape: tuple):
    """Rank `rank`'s input for vector i: drawn on the CPU, the same numbers on any device."""

    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randint(-4, 5, shape, generator=g, device="cpu").to(getattr(torch, dtype))


def job(fn, vectors, logdir):
    """Rank side: the reader's all-reduce on each vector, with the kernel's byte count and the
    observer's send count around the reader's call; x after the call (and what the call returned,
    if a tensor) goes back, and the checker computes the sum itself (verdict). A rank outside a
    case's group returns None."""
    rank, n, dev = dist.get_rank(), dist.get_world_size(), device()
    sub = dist.new_group(list(range(1, n)))            # every rank takes part in making it
    out = []
    for i, (dtype, shape, on_sub) in enumerate(vectors):
        group, members = (sub, list(range(1, n))) if on_sub else (dist.group.WORLD, list(range(n)))
        dist.barrier()
        if rank not in members:
            out.append(None)
            continue
        where = f"over ranks {members[0]}..{members[-1]}" if on_sub else "over all ranks"
        note(f"your all-reduce of a {dtype} tensor of shape {shape} {where} (call {i + 1} of "
             f"{len(vectors)})")
        x = inputs(i, rank, dtype, shape).to(dev)       # shape
        dist.barrier(group=group)
        watch = observer(os.path.join(logdir, f"rank{rank}.txt"), i, rank, members, group)
        with netcount.socket_bytes() as net, watch:
            got = fn(x, group=sub) if on_sub else fn(x)
        out.append({"rank": rank, "members": members, "sends": watch.sends, "sent": net.sent,
                    "x": x.cpu(), "got": got.cpu() if isinstance(got, torch.Tensor) else None})
    return out


def verdict(r: dict, i: int, dtype: str, shape: tuple) -> dict:
    """Checker side (under labkit grade: the judge, where no student code runs): rank r's x
    against the sum of every member's input, computed here from the same draws; the fields the
    hints read ("ok", "returned_ok", "unchanged", "missing", "first_bad", "bytes")."""
    x, got, rank, members = r["x"], r.get("got"), r["rank"], r["members"]
    given = inputs(i, rank, dtype, shape)                           # shape
    want = sum(inputs(i, j, dtype, shape) for j in members)         # shape, exact (integers)
    ok = isinstance(x, torch.Tensor) and x.shape == want.shape and x.dtype == want.dtype and \
        torch.equal(x, want)
    out = {"ok": ok, "bytes": want.numel() * want.element_size(), "returned_ok": False,
           "unchanged": False, "missing": None, "first_bad": None}
    if ok or not isinstance(x, torch.Tensor) or x.shape != want.shape:
        return out
    out["returned_ok"] = isinstance(got, torch.Tensor) and got.shape == want.shape and \
        torch.equal(got.to(want.dtype), want)
    x = x.to(want.dtype)
    out["unchanged"] = torch.equal(x, given)
    diff = want - x
    out["missing"] = next((j for j in members if j != rank and torch.equal(
        diff, inputs(i, j, dtype, shape))), None)
    bad = (x != want).reshape(-1).nonzero().reshape(-1)
    if len(bad):
        k = bad[0].item()
        out["first_bad"] = (k, len(bad), x.reshape(-1)[k].item(), want.reshape(-1)[k].item())
    return out


def read_logs(logdir: str, n: int) -> dict:
    """{rank: [(case, op, peer, elements), ...]} from the observer's files (what got written)."""

    logs = {}
    for rank in range(n):
        path = os.path.join(logdir, f"rank{rank}.txt")
        rows = []
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 4:
                        case, op, peer, numel = parts
                        rows.append((int(case), op, peer, int(numel)))
        logs[rank] = rows
    return logs
