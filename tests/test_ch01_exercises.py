"""Chapter 01's exercises: known-wrong answers lose points for the reason they are wrong (the hint
says which), a hang is reported as a hang. Full marks for the solutions and zero for the stubs:
tests/test_exercises.py."""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit.check import ch01

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


def _ring_without_adding(x):
    """A typical mistake: pass chunks around but never add them."""
    return x


def _deadlocking_all_reduce(x):
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


def test_all_reduce_without_adding_says_so():
    result = ch01.ring_all_reduce(_ring_without_adding, cases=ONE)
    assert result.score == 0 and "still this rank's own input" in _messages(result)


def test_all_reduce_not_in_place_says_so():
    def not_in_place(x):
        y = x.clone()
        dist.all_reduce(y)
        return y
    assert "dist.all_reduce" in _messages(ch01.ring_all_reduce(not_in_place, cases=ONE))

    def ring_not_in_place(x):
        n = dist.get_world_size()
        sizes = [b - a for a, b in _bounds(x.numel(), n)]
        return _ag(_rs(x), sizes)
    result = ch01.ring_all_reduce(ring_not_in_place, cases=ONE)
    assert result.score == 0 and "must work in place" in _messages(result)


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


def test_a_hang_is_reported_with_each_rank_step(monkeypatch):
    monkeypatch.setattr(ch01, "HANG_TIMEOUT", 6.0)
    result = ch01.ring_all_reduce(_deadlocking_all_reduce, cases=[(2, (8,)), (3, (8,))])
    msg = result.cases[0]["message"]
    assert msg.startswith("HANG") and "dist.send(big" in msg and "rank 1 stuck" in msg
    assert "skipped after a hang" in result.cases[1]["message"]
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
