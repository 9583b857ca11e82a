"""Chapter 01's exercises: known-wrong answers lose points for the reason they are wrong (the hint
says which), a hang is reported as a hang. Full marks for the solutions and zero for the stubs:
tests/test_exercises.py."""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit.check import ch01
from labkit.check.ch01 import halving_doubling as ch01_halving

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks get these functions by value

ONE = [(3, (10, 100_003))]          # one launch: an uneven small size and a large one


def _messages(result) -> str:
    return "\n".join(c["message"] for c in result.cases if not c["passed"])


def _bounds(numel, n, last_takes_rest=False):
    if last_takes_rest:                        # off by one: the remainder all goes to the last
        base = numel // n
        starts = [r * base for r in range(n)] + [numel]
    else:
        base, extra = divmod(numel, n)
        starts = [r * base + min(r, extra) for r in range(n + 1)]
    return list(zip(starts[:-1], starts[1:]))


def _rs(x, *, combine="add", last_takes_rest=False):
    rank, n = dist.get_rank(), dist.get_world_size()
    bounds = _bounds(x.numel(), n, last_takes_rest)
    x = x.reshape(-1).clone()
    for s in range(n - 1):
        a, b = bounds[(rank - s - 1) % n]
        c, d = bounds[(rank - s - 2) % n]
        incoming = torch.empty(d - c, dtype=x.dtype)
        reqs = [dist.isend(x[a:b], dst=(rank + 1) % n), dist.irecv(incoming, src=(rank - 1) % n)]
        for r in reqs:
            r.wait()
        if combine == "add":
            x[c:d] += incoming
        elif combine == "max":                 # the wrong reduction
            x[c:d] = torch.maximum(x[c:d], incoming)
    start, end = bounds[rank]
    return x[start:end]


def _rs_with_all_reduce(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    y = x.clone()
    dist.all_reduce(y)
    start, end = _bounds(x.numel(), n)[rank]
    return y[start:end]


def _rs_hidden_collective(x):
    """The collective behind getattr: reading the source misses it, the dispatcher does not."""
    rank, n = dist.get_rank(), dist.get_world_size()
    y = x.clone()
    getattr(dist, "all_" + "reduce")(y)
    start, end = _bounds(x.numel(), n)[rank]
    return y[start:end]


def _rs_labkit(x):
    from labkit.collectives import ring_reduce_scatter
    return ring_reduce_scatter(x.clone())


def _rs_whole_tensor(x):
    """Right values, the wrong traffic: the whole running sum goes round the ring."""
    rank, n = dist.get_rank(), dist.get_world_size()
    acc, cur = x.clone(), x.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(cur)
        reqs = [dist.isend(cur, dst=(rank + 1) % n), dist.irecv(incoming, src=(rank - 1) % n)]
        for r in reqs:
            r.wait()
        acc += incoming
        cur = incoming
    start, end = _bounds(x.numel(), n)[rank]
    return acc[start:end]


def _deadlocking_all_reduce(x, group=None):
    """Every rank sends first with a blocking send of a large tensor: nobody receives."""
    big = torch.zeros(4_000_000)
    dist.send(big, dst=(dist.get_rank() + 1) % dist.get_world_size())
    dist.recv(big, src=(dist.get_rank() - 1) % dist.get_world_size())
    return x


@pytest.mark.parametrize("fn, hint", [
    (lambda x: _rs(x, combine="max"), "values wrong"),
    (lambda x: _rs(x, last_takes_rest=True), "the chunks have [4, 3, 3] elements"),
    (_rs_with_all_reduce, "your function calls dist.all_reduce"),
    (_rs_hidden_collective, "collective dist.all_reduce called"),
    (_rs_labkit, "labkit.collectives"),
    (_rs_whole_tensor, "Does every step send ONE chunk"),
], ids=["max, not sum", "off-by-one chunking", "a collective", "a collective behind getattr",
        "labkit's ring", "the whole tensor every step"])
def test_reduce_scatter_wrong_answers_fail_with_the_reason(fn, hint):
    result = ch01.ring_reduce_scatter(fn, cases=ONE)
    assert result.score == 0 and hint in _messages(result), _messages(result)


def _ag(chunk, sizes, *, order=1):
    rank, n = dist.get_rank(), dist.get_world_size()
    offsets = [sum(sizes[:i]) for i in range(n + 1)]
    out = torch.empty(offsets[-1], dtype=chunk.dtype)
    out[offsets[rank]:offsets[rank + 1]] = chunk
    for s in range(n - 1):
        send_i, recv_i = (rank - s) % n, (rank - order * (s + 1)) % n
        reqs = [dist.isend(out[offsets[send_i]:offsets[send_i + 1]], dst=(rank + 1) % n),
                dist.irecv(out[offsets[recv_i]:offsets[recv_i + 1]], src=(rank - 1) % n)]
        for r in reqs:
            r.wait()
    return out


def test_all_gather_received_into_the_wrong_place_fails():
    result = ch01.ring_all_gather(lambda c, s: _ag(c, s, order=-1), cases=[(3, (9, 30))])
    assert result.score == 0 and "values wrong" in _messages(result), _messages(result)


# ----------------------------------------------------------------------------- 1.3
def _hd(x, group=None, *, whole=False, cut_by_role=False, ignore_group=False):
    """Recursive halving and doubling with the fold, and a switch per known mistake:
    whole: plain recursive doubling, the whole vector every round (right sums, log2 P messages,
    log2(P) * D bytes per rank); cut_by_role: each partner cuts an odd segment its own way;
    ignore_group: ranks and messages of the whole world, whatever group it is given."""
    if ignore_group:
        group = None
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    flat, p = x.view(-1), 1 << (n.bit_length() - 1)
    g = {} if ignore_group else {"group": group}

    def peer(kind, r):                         # dst=/src= are global ranks, group_dst= the group's
        return {kind: r} if ignore_group else {"group_" + kind: r}

    def swap(out, into, partner):
        for req in [dist.isend(out, **g, **peer("dst", partner)),
                    dist.irecv(into, **g, **peer("src", partner))]:
            req.wait()

    if rank >= p:
        dist.send(flat, **g, **peer("dst", rank - p))
        dist.recv(flat, **g, **peer("src", rank - p))
        return x
    if rank < n - p:
        incoming = torch.empty_like(flat)
        dist.recv(incoming, **g, **peer("src", rank + p))
        flat += incoming
    if whole:
        d = 1
        while d < p:
            incoming = torch.empty_like(flat)
            swap(flat, incoming, rank ^ d)
            flat += incoming
            d *= 2
    else:
        lo, hi, held, d = 0, flat.numel(), [], p // 2
        while d >= 1:
            mid = (lo + hi + (1 if cut_by_role and rank & d else 0)) // 2
            held.append((lo, hi))
            send, keep = ((lo, mid), (mid, hi)) if rank & d else ((mid, hi), (lo, mid))
            incoming = torch.empty(keep[1] - keep[0], dtype=flat.dtype)
            swap(flat[send[0]:send[1]], incoming, rank ^ d)
            flat[keep[0]:keep[1]] += incoming
            (lo, hi), d = keep, d // 2
        d = 1
        while d < p:
            plo, phi = held.pop()
            olo, ohi = (plo, lo) if lo > plo else (hi, phi)
            swap(flat[lo:hi], flat[olo:ohi], rank ^ d)
            lo, hi, d = plo, phi, d * 2
    if rank < n - p:
        dist.send(flat, **g, **peer("dst", rank + p))
    return x


def _xor_without_fold(x, group=None):
    """Recursive doubling paired by rank ^ d over all N ranks: at N = 3, rank 2's partner is 3."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    flat, d = x.view(-1), 1
    while d < n:
        incoming = torch.empty_like(flat)
        for req in [dist.isend(flat, group=group, group_dst=rank ^ d),
                    dist.irecv(incoming, group=group, group_src=rank ^ d)]:
            req.wait()
        flat += incoming
        d *= 2
    return x


def _ring(x, group=None):
    """A correct ring all-reduce (reduce-scatter, all-gather): 2(N - 1) messages, too many."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    flat, bounds = x.view(-1), _bounds(x.numel(), n)
    for phase in (0, 1):
        for s in range(n - 1):
            a, b = bounds[(rank - s - 1 + phase) % n]
            c, d = bounds[(rank - s - 2 + phase) % n]
            incoming = torch.empty(d - c, dtype=flat.dtype)
            for req in [dist.isend(flat[a:b].clone(), group=group, group_dst=(rank + 1) % n),
                        dist.irecv(incoming, group=group, group_src=(rank - 1) % n)]:
                req.wait()
            if phase == 0:
                flat[c:d] += incoming
            else:
                flat[c:d] = incoming
    return x


def _with_all_reduce(x, group=None):
    dist.all_reduce(x, group=group)
    return x


def _labkit_ring(x, group=None):
    from labkit.collectives import ring_all_reduce
    return ring_all_reduce(x, group=group)


N3, N4 = [(3, True)], [(4, True)]
# one launch each: an odd length, one large enough that headers do not hide a doubled byte count,
# and one over the group of ranks 1..N-1
SMALL = [("float32", (37,), False), ("float32", (20_001,), False), ("int64", (9,), True)]


@pytest.mark.parametrize("fn, worlds, hint, only", [
    (_ring, N3, "A ring posts 2(N-1) = 4", "messages"),
    (lambda x, group=None: _hd(x, group, whole=True), N4, "send only the HALF of your segment",
     "bytes"),
    (_xor_without_fold, N3, "which partner does your pairing give a rank whose partner would be",
     None),
    (lambda x, group=None: _hd(x, group, cut_by_role=True), N4,
     "do both partners cut it at the same index", None),
    (lambda x, group=None: _hd(x, group, ignore_group=True), N3, "pass group= to every send",
     None),
    (_with_all_reduce, N3, "your function calls dist.all_reduce", None),
    (_labkit_ring, N3, "labkit.collectives", None),
], ids=["a ring: too many messages", "recursive doubling of the whole vector: bytes",
        "xor pairing without the fold", "odd segment cut differently by each partner",
        "the group ignored", "dist.all_reduce", "labkit's ring"])
def test_halving_doubling_wrong_answers_fail_with_the_reason(fn, worlds, hint, only):
    """Each known-wrong answer fails with its own hint: only the case it gets wrong when its sums
    are right (`only`), every case when it cannot run."""
    result = ch01.halving_doubling_all_reduce(fn, worlds=worlds, vectors=SMALL)
    failed = [c["name"] for c in result.cases if not c["passed"]]
    assert hint in _messages(result), _messages(result)
    if only:
        assert failed and all(only in name for name in failed), failed
    else:
        assert result.score == 0, failed


def test_a_hang_is_reported_with_each_rank_step(monkeypatch):
    monkeypatch.setattr(ch01_halving, "HANG_TIMEOUT", 6.0)
    result = ch01.halving_doubling_all_reduce(_deadlocking_all_reduce,
                                              worlds=[(2, True), (3, True)], vectors=SMALL)
    msg = result.cases[0]["message"]
    assert msg.startswith("HANG") and "dist.send(big" in msg and "rank 1 stuck" in msg, msg
    assert "skipped after a hang" in result.cases[-1]["message"]
    assert result.score == 0


# ----------------------------------------------------------------------------- 1.4
def _predict(algorithm, nbytes, n, alpha, bandwidth, *, phases=2, unit=1.0, root=True):
    if algorithm == "ring":
        messages, sent = phases * (n - 1), phases * (n - 1) / n * nbytes
        crossing = sent
    else:
        messages, sent = 2 * (n - 1), (n - 1) * nbytes if root else nbytes
        crossing = 2 * (n - 1) * nbytes
    return {"bytes_sent": sent, "seconds": (messages * alpha + crossing / bandwidth) * unit}


SHOWN = ch01.PREDICT_CASES[:1]       # 3 ranks: a ring and a parameter server, one launch


@pytest.mark.parametrize("wrong, hint", [
    (dict(phases=1), "how many phases"),
    (dict(root=False), "Which rank sends the most"),
    (dict(unit=1e3), "seconds, not milliseconds"),
], ids=["ring without its second phase", "parameter server: a leaf's bytes", "milliseconds"])
def test_predict_wrong_answers_fail_with_the_reason(wrong, hint):
    result = ch01.predict_all_reduce(lambda *a: _predict(*a, **wrong), cases=SHOWN)
    assert result.score < result.points and hint in _messages(result), _messages(result)
    assert "measured" in result.cases[0]["name"]           # predicted beside measured
