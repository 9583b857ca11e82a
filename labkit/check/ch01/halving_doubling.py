"""Exercise 1.3: an all-reduce in O(log N) rounds from send and receive only: Rabenseifner's
recursive halving (a reduce-scatter) then recursive doubling (an all-gather), with the fold that
makes any world size work (R. Rabenseifner, "Optimization of collective reduction operations",
ICCS 2004; Thakur, Rabenseifner & Gropp, IJHPCA 2005).

    labkit.check.ch01.halving_doubling_all_reduce(my_all_reduce)

my_all_reduce(x, group=None) must sum x over the ranks of `group` (None: all) in place. It runs on
real processes at 4 ranks and at hidden 3 and 6, one launch per world size: on six tensors
over all ranks (float32, float64, int64, bfloat16; 1 to 100,003 elements, 1-D to 3-D, lengths
that no power of two divides), then on two over the group of ranks 1..N-1 (group ranks are not
global ranks there). With N the ranks taking part, P the largest power of two <= N and D the
tensor's bytes, three cases per world size:

- sums: every rank's x equals dist.all_reduce's result on the same integer-valued data, exactly;
- messages: the sends each rank posts in one call, counted by the checker's dispatch-mode observer
  around the reader's call (it also refuses every collective: labkit.check.guards.CollectiveLog),
  at most 2*log2(P), plus 1 when N is not a power of two (the fold); a ring's 2(N-1) fails;
- bytes: what each rank sent, by the kernel's count (labkit.netcount), at most the halving and
  doubling's largest share (2 * sum_k ceil(n/2^k) elements, k = 1..log2 P) plus D for a rank in
  the fold, and the sum over ranks at most 2(P-1)*D + 2(N-P)*D, each +5% and Gloo's headers;
  recursive doubling of the whole vector (log2(P) * D per rank) fails from N = 4.

The observer also writes every send and receive (peer, elements) to a log per rank before it is
posted, and refuses a message to a rank that does not exist (Gloo would crash without a word) or
over another process group than the one passed (it would hang). When a rank dies or a sum is
wrong, the logs are matched across ranks to name the first message whose length its receiver did
not expect: Gloo aborts on a longer one and silently fills a shorter one.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from labkit import netcount
from labkit.check import Checker, Forbidden, Refused, collectives_refusal, fail, graded, reason_in
from labkit.check.guards import CollectiveLog
from labkit.launch import RankError, device, note

EXERCISE, TITLE, POINTS = ("1.3", "all-reduce in O(log N) rounds: recursive halving, then "
                           "doubling, any N", 6)
# (world size, shown): one launch each; 3 and 6 are hidden. With the group of ranks 1..N-1 the
# all-reduce runs on N = 2, 3, 4, 5 and 6 ranks, five of them not powers of two
WORLDS = [(4, True), (3, False), (6, False)]
# (dtype, shape, over the group of ranks 1..N-1 rather than all): integer values in [-4, 4], so
# every sum (and partial sum) is exact, bfloat16 too
VECTORS = [("float32", (1,), False), ("float32", (5, 7), False), ("int64", (37,), False),
           ("bfloat16", (3, 11), False), ("float64", (2, 3, 5), False),
           ("float32", (100_003,), False), ("float32", (1_001,), True), ("int64", (3, 3), True)]
HANG_TIMEOUT = 20.0       # seconds; a correct answer finishes every world size in about one
BYTES_SLACK = 0.05        # over the optimum
HEADER_BYTES = 512        # per message (Gloo's header is under 200 bytes)
FORBIDDEN = Forbidden(("labkit.collectives",), why="write the all-reduce yourself from "
                      "isend/irecv")
WHY = "build the all-reduce from send/recv (or isend/irecv) only"


def power_of_two_core(n: int) -> int:
    """P: the largest power of two <= n (the ranks that halve and double)."""
    return 1 << (n.bit_length() - 1)


def message_bound(n: int) -> int:
    """Sends one rank posts at most: log2(P) halving rounds, as many doubling rounds, and the
    fold's one message (an extra rank's vector in, or the result back out)."""
    p = power_of_two_core(n)
    return 2 * (p.bit_length() - 1) + (n != p)


def optimal_bytes(numel: int, n: int, itemsize: int) -> tuple:
    """(most bytes one rank sends, bytes all ranks send together) in recursive halving and doubling
    with the fold. A rank's share: at round k it sends at most half (rounded up) of what it holds,
    ceil(numel/2^k) elements, in each of the two phases; a rank in the fold also sends a whole
    vector. Together: each halving round moves numel*(P/2^k) elements, numel*(P-1) over the phase,
    the same again to gather, plus two whole vectors per extra rank."""
    p = power_of_two_core(n)
    rounds = p.bit_length() - 1
    one = 2 * sum(-(-numel // 2**k) for k in range(1, rounds + 1)) + (numel if n != p else 0)
    together = 2 * (p - 1) * numel + 2 * (n - p) * numel
    return one * itemsize, together * itemsize


def _observer(path: str, case: int, rank: int, members: list, group):
    """A CollectiveLog (refusing collectives) that also counts this rank's sends, refuses a message
    over another process group than `group` or to a rank that does not exist, and appends
    "case op peer elements" (peer: its global rank) to `path` before each send or receive is
    posted (flushed at once, so the line survives a rank that Gloo aborts)."""


    n = len(members)

    class P2PObserver(CollectiveLog):
        def __init__(self):
            super().__init__(refuse=True, why=WHY)
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


def _inputs(i: int, rank: int, dtype: str, shape: tuple):
    """Rank `rank`'s input for vector i: drawn on the CPU, the same numbers on any device."""

    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randint(-4, 5, shape, generator=g, device="cpu").to(getattr(torch, dtype))


def _job(fn, vectors, logdir):
    """Rank side: the reader's all-reduce on each vector, beside dist.all_reduce's result on the
    same data; compared here (only a summary goes back), with the kernel's byte count and the
    observer's send count around the reader's call. A rank outside a case's group returns None."""



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
        x = _inputs(i, rank, dtype, shape).to(dev)
        given, want = x.clone(), x.clone()
        dist.all_reduce(want, group=group)
        dist.barrier(group=group)                      # its bytes acknowledged before we count
        watch = _observer(os.path.join(logdir, f"rank{rank}.txt"), i, rank, members, group)
        with netcount.socket_bytes() as net, watch:
            got = fn(x, group=sub) if on_sub else fn(x)
        x, want, given = x.cpu(), want.cpu(), given.cpu()
        r = {"rank": rank, "members": members, "sends": watch.sends, "sent": net.sent,
             "ok": torch.equal(x, want), "bytes": x.numel() * x.element_size(),
             "returned_ok": False, "unchanged": False, "missing": None, "first_bad": None}
        if not r["ok"]:
            r["returned_ok"] = isinstance(got, torch.Tensor) and got.shape == want.shape and \
                torch.equal(got.cpu(), want)
            r["unchanged"] = torch.equal(x, given)
            diff = want - x
            r["missing"] = next((j for j in members if j != rank and torch.equal(
                diff, _inputs(i, j, dtype, shape))), None)
            bad = (x != want).reshape(-1).nonzero().reshape(-1)
            if len(bad):
                k = bad[0].item()
                r["first_bad"] = (k, len(bad), x.reshape(-1)[k].item(), want.reshape(-1)[k].item())
        out.append(r)
    return out


def _read_logs(logdir: str, n: int) -> dict:
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


def _length_mismatch(logs: dict, n: int, vectors: list, case: int | None = None) -> str:
    """The first message (in case order) whose receiver posted a buffer of another length, as a
    hint; "" if every matched pair of send and receive agrees."""
    cases = sorted({row[0] for rows in logs.values() for row in rows} if case is None else {case})
    for i in cases:
        for src in range(n):
            for dst in range(n):
                sends = [k for c, op, p, k in logs[src] if (c, op, p) == (i, "send", str(dst))]
                recvs = [k for c, op, p, k in logs[dst] if (c, op, p) == (i, "recv", str(src))]
                for j, (a, b) in enumerate(zip(sends, recvs)):
                    if a != b:
                        dtype, shape, _ = vectors[i]
                        return (f"rank {src} sent {a} elements to rank {dst} (its message {j + 1} "
                                f"to that rank, {dtype} tensor of shape {shape}), but rank {dst} "
                                f"posted a receive of {b}: Gloo aborts on a longer message and "
                                f"leaves the rest of a shorter one's buffer untouched. When a "
                                f"segment has an odd length, do both partners cut it at the same "
                                f"index, and agree on who keeps which half?")
    return ""


def _launch(c: Checker, fn, n: int, vectors: list):
    logdir = tempfile.mkdtemp(prefix="labkit-ch01-")
    try:
        results = c.launch(_job, n, args=(fn, vectors, logdir), timeout=HANG_TIMEOUT)
        return {"ranks": results, "logs": _read_logs(logdir, n), "vectors": vectors}
    except RankError as err:
        trace = err.remote_traceback
        if reason_in(trace):
            raise                                      # the Checker reports the refusal
        if "is not part of group" in trace:
            fail(f"rank {err.rank}: {trace.strip().splitlines()[-1]}. With a group, dst= and "
                 f"src= are GLOBAL ranks: pass group ranks as group_dst=/group_src= (or convert "
                 f"with dist.get_global_rank(group, r))")
        why = _length_mismatch(_read_logs(logdir, n), n, vectors)
        if why:
            fail(f"{why}\n(rank {err.rank}: {err.remote_traceback.strip().splitlines()[-1]})")
        raise
    finally:
        shutil.rmtree(logdir, ignore_errors=True)


def _members(res: dict, i: int) -> list:
    """The results of vector i from the ranks that took part."""
    return [r[i] for r in res["ranks"] if r[i] is not None]


def _label(res: dict, i: int, n: int) -> str:
    dtype, shape, on_sub = res["vectors"][i]
    over = f"over the group of ranks 1..{n - 1}" if on_sub else f"over all {n} ranks"
    return f"{dtype} tensor of shape {shape} {over}"


def _check_sums(res: dict, n: int) -> None:
    for i, (dtype, shape, _) in enumerate(res["vectors"]):
        per_rank = _members(res, i)
        wrong = [r for r in per_rank if not r["ok"]]
        if not wrong:
            continue
        r = wrong[0]
        size, p = len(r["members"]), power_of_two_core(len(r["members"]))
        where = f"{_label(res, i, n)}, rank {r['rank']}"
        mismatch = _length_mismatch(res["logs"], n, res["vectors"], i)
        if mismatch:
            fail(f"{where}: wrong sum. {mismatch}")
        if r["returned_ok"]:
            fail(f"{where}: you returned the right sum but x is unchanged: work in place, like "
                 f"dist.all_reduce (write the result into x; x.view(-1) shares x's memory)")
        if r["unchanged"]:
            fail(f"{where}: x still holds this rank's own input. Does every rank get the "
                 f"result, the ranks that folded their vector into a partner included?")
        if r["missing"] is not None:
            fail(f"{where}: the sum lacks exactly rank {r['missing']}'s input. Is every rank's "
                 f"vector added in: with N = {size} and P = {p}, who receives the {size - p} "
                 f"extra ranks' vectors, and before which round?")
        k, count, got, want = r["first_bad"]
        fail(f"{where}: {count} of {math.prod(shape)} values wrong (first at flat index {k}: got "
             f"{got:g}, expected {want:g}). In each round, does a rank add the half its partner "
             f"sent into the half it keeps, and in the all-gather, does it receive its partner's "
             f"half into the place that half came from?")


def _check_messages(res: dict, n: int) -> None:
    for i in range(len(res["vectors"])):
        per_rank = _members(res, i)
        size = len(per_rank[0]["members"])
        bound = message_bound(size)
        busiest = max(per_rank, key=lambda r: r["sends"])
        if busiest["sends"] > bound:
            rounds = power_of_two_core(size).bit_length() - 1
            plural = "s" if rounds != 1 else ""
            fold = " and 1 for the fold" if size != power_of_two_core(size) else ""
            fail(f"{_label(res, i, n)}: rank {busiest['rank']} posted {busiest['sends']} sends "
                 f"in one all-reduce (counted by the checker's observer); at most {bound} are "
                 f"allowed: {rounds} round{plural} of halving, {rounds} of doubling{fold}. A ring "
                 f"posts 2(N-1) = {2 * (size - 1)}. Does every round pair each rank with ONE "
                 f"partner and send it ONE message?")


def _check_bytes(res: dict, n: int) -> None:
    hint = ("Does each halving round send only the HALF of your segment that your partner "
            "keeps, and each doubling round only the part your partner lacks?")
    for i, (dtype, shape, _) in enumerate(res["vectors"]):
        per_rank = _members(res, i)
        if any(r["sent"] is None for r in per_rank):
            continue                                   # NCCL: no TCP counter sees it
        size, d, numel = len(per_rank), per_rank[0]["bytes"], math.prod(shape)
        one, together = optimal_bytes(numel, size, d // numel)
        allowed = one * (1 + BYTES_SLACK) + HEADER_BYTES * message_bound(size)
        r = max(per_rank, key=lambda r: r["sent"])
        if r["sent"] > allowed:
            fail(f"{_label(res, i, n)} ({d:,} bytes): rank {r['rank']} sent {r['sent']:,} bytes "
                 f"(the kernel's count); halving and doubling send at most {one:,} "
                 f"(+{BYTES_SLACK:.0%} and {HEADER_BYTES} B per message: {allowed:,.0f}). " + hint)
        total = sum(r["sent"] for r in per_rank)
        allowed = together * (1 + BYTES_SLACK) + HEADER_BYTES * message_bound(size) * size
        if total > allowed:
            fail(f"{_label(res, i, n)} ({d:,} bytes): the {size} ranks sent {total:,} bytes "
                 f"together (the kernel's count); halving and doubling send 2(P-1)*D + 2(N-P)*D = "
                 f"{together:,} (+{BYTES_SLACK:.0%} and headers: {allowed:,.0f}). " + hint)


@graded("1.3")
def halving_doubling_all_reduce(fn, worlds=WORLDS, vectors=VECTORS):
    """Exercise 1.3: fn(x, group=None) sums x over the group's ranks in place, in O(log N)
    rounds (see the module). worlds, vectors: as WORLDS and VECTORS (tests pass fewer)."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(collectives_refusal(fn, "build the all-reduce from point-to-point messages only "
                                     "(isend/irecv or send/recv)")
             or FORBIDDEN.refusal(fn))
    hidden = 0
    for n, shown in worlds:
        if shown:
            label = f"{n} ranks"
        else:
            hidden += 1
            label = f"hidden world size {'ABCDEF'[hidden - 1]}"
        on_all = sum(not v[2] for v in vectors)
        checks = [(f"sums of {on_all} tensors over all ranks ({len({v[0] for v in vectors})} "
                   f"dtypes, up to {max(math.prod(v[1]) for v in vectors):,} elements) and "
                   f"{len(vectors) - on_all} over a group",
                   lambda res, n=n: _check_sums(res, n)),
                  (f"at most {message_bound(n)} messages sent per rank ({message_bound(n - 1)} in "
                   f"the group of {n - 1})" if shown else "messages sent per rank: O(log N)",
                   lambda res, n=n: _check_messages(res, n)),
                  ("bytes sent, per rank and in all: halving-doubling's (kernel count)",
                   lambda res, n=n: _check_bytes(res, n))]
        c.cases_on_one_launch(label, checks, lambda n=n: _launch(c, fn, n, vectors))
    return c.finish()
