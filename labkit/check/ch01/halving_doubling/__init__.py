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
  around the reader's call (it also refuses every collective: observe.dispatch.CollectiveLog),
  at most 2*log2(P), plus 1 when N is not a power of two (the fold); a ring's 2(N-1) fails;
- bytes: what each rank sent, by the kernel's count (observe.netcount), at most the halving and
  doubling's largest share (2 * sum_k ceil(n/2^k) elements, k = 1..log2 P) plus D for a rank in
  the fold, and the sum over ranks at most 2(P-1)*D + 2(N-P)*D, each +5% and Gloo's headers;
  recursive doubling of the whole vector (log2(P) * D per rank) fails from N = 4.

The observer also writes every send and receive (peer, elements) to a log per rank before it is
posted, and refuses a message to a rank that does not exist (Gloo would crash without a word) or
over another process group than the one passed (it would hang). When a rank dies or a sum is
wrong, the logs are matched across ranks to name the first message whose length its receiver did
not expect: Gloo aborts on a longer one and silently fills a shorter one.

Parts: run.py (the observer, the inputs, the rank job, the logs), this module (the bounds, the
checks and their hints).
"""
from __future__ import annotations

import math
import shutil
import tempfile

from labkit.check import Checker, Forbidden, collectives_refusal, fail, graded, reason_in
from labkit.check.ch01.halving_doubling.run import job, power_of_two_core, read_logs, verdict
from labkit.launch import RankError

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
        results = c.launch(job, n, args=(fn, vectors, logdir), timeout=HANG_TIMEOUT)
        for rank, per_vector in enumerate(results):    # the sums, computed here
            for i, r in enumerate(per_vector):
                if r is not None:
                    if r.get("rank") != rank:
                        fail(f"rank {rank}'s result came back as rank {r.get('rank')!r}'s")
                    r["members"] = list(range(1, n)) if vectors[i][2] else list(range(n))
                    r.update(verdict(r, i, *vectors[i][:2]))
        return {"ranks": results, "logs": read_logs(logdir, n), "vectors": vectors}
    except RankError as err:
        trace = err.remote_traceback
        if reason_in(trace):
            raise                                      # the Checker reports the refusal
        if "is not part of group" in trace:
            fail(f"rank {err.rank}: {trace.strip().splitlines()[-1]}. With a group, dst= and "
                 f"src= are GLOBAL ranks: pass group ranks as group_dst=/group_src= (or convert "
                 f"with dist.get_global_rank(group, r))")
        why = _length_mismatch(read_logs(logdir, n), n, vectors)
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
    for i, (_dtype, shape, _) in enumerate(res["vectors"]):
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
    for i, (_dtype, shape, _) in enumerate(res["vectors"]):
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
