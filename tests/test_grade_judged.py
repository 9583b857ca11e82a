"""What a case's answer should be is computed by the checker (under `labkit grade`: the judge,
where no student code runs), never taken from the ranks, which run beside the student's code: a
rank job that comes back with a forged "expected" value (equal to a wrong answer) still fails.
No process is started: Checker.launch is replaced by the forged replies."""
import pytest
import torch

from labkit.check import Checker, ch00, ch01, ch04
from labkit.check.ch01 import rings


def _forged(monkeypatch, reply):
    """Every launch of a checker returns reply(job, nprocs, args)."""
    monkeypatch.setattr(Checker, "launch", lambda self, job, nprocs, args=(), kwargs=None,
                        timeout=30.0: reply(job, nprocs, args))


def _no_case_passes(result):
    assert result.cases and not any(c["passed"] for c in result.cases), result.cases
    return [c["message"] for c in result.cases]


def mine(x):      # an answer whose source names no collective: the checks run
    return x


def mine_group(x, group=None):
    return x


def mine_attention(q, k, v, group, T):
    return q


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
def test_rings_ignore_a_ranks_own_expected_value(monkeypatch, kind):
    def reply(job, n, args):
        _, _, numels = args
        zeros = [torch.zeros(numel) for numel in numels]   # a wrong answer, and a "want" to match
        return [[{"got": z, "want": z, "input": z, "rank": r, "sent": None} for z in zeros]
                for r in range(n)]

    _forged(monkeypatch, reply)
    check = ch01.ring_reduce_scatter if kind == "reduce_scatter" else ch01.ring_all_gather
    said = _no_case_passes(check(mine))
    assert "values wrong" in said[0] or "elements, expected" in said[0], said


def test_rings_expected_is_the_sum_of_the_ranks_draws():
    n, numel = 3, 10
    total = sum(rings.rank_input(numel, r) for r in range(n))
    lo, hi = rings.chunk_bounds(numel, n)[1]
    assert torch.equal(rings.expected("reduce_scatter", numel, n, 1), total[lo:hi])
    assert torch.equal(rings.expected("all_gather", numel, n, 1), total)


def test_halving_doubling_recomputes_the_sums(monkeypatch):
    def reply(job, n, args):
        _, vectors, _ = args
        return [[{"rank": r, "members": list(range(n)), "sends": 0, "sent": None,
                  "x": torch.zeros(shape, dtype=getattr(torch, dtype)), "got": None, "ok": True,
                  "bytes": 4} for dtype, shape, _ in vectors] for r in range(n)]

    _forged(monkeypatch, reply)
    result = ch01.halving_doubling_all_reduce(mine_group, worlds=[(4, True)],
                                              vectors=[("float32", (5,), False)])
    assert not result.cases[0]["passed"], result.cases
    assert "wrong" in result.cases[0]["message"], result.cases[0]["message"]


def test_shift_right_recomputes_the_neighbours_tensor(monkeypatch):
    def reply(job, n, args):
        _, shapes = args
        return [[{"got": torch.zeros(s), "want": torch.zeros(s), "unchanged": True,
                  "wrong_way": torch.ones(s), "x": torch.zeros(s)} for s in shapes]
                for _ in range(n)]

    _forged(monkeypatch, reply)
    said = _no_case_passes(ch00.shift_right(mine, worlds=(2,)))
    assert "overwritten" in said[0] or "differs" in said[0], said


@pytest.mark.parametrize("check", [ch04.f_operator, ch04.g_operator])
def test_f_and_g_recompute_their_definitions(monkeypatch, check):
    def reply(job, n, args):   # (actual, expected) pairs that agree, on wrong values
        quantities = ch04.operators.expected("4.1" if check is ch04.f_operator else "4.2", n, 0)
        return [{k: (torch.zeros(3, 5), torch.zeros(3, 5)) for k in quantities}
                for _ in range(n)]

    _forged(monkeypatch, reply)
    said = _no_case_passes(check(mine_group))
    assert "differs" in said[0], said


def _zeros_like_all(obj):
    """Every tensor in obj as zeros: an answer and its forged "expected" value that agree."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: _zeros_like_all(v) for k, v in obj.items()}
    return obj


def test_tp_block_recomputes_the_full_modules(monkeypatch):
    def reply(job, n, args):
        pairs = {"output": (torch.zeros(2, 5, 12), torch.zeros(2, 5, 12))}
        side = {"pairs": pairs, "got": {}, "missing": [], "fwd": [], "bwd": [], "sent": None,
                "elements": 120}
        return [{"refused": "ValueError: tp=2", "mlp": dict(side), "attention": dict(side)}
                for _ in range(n)]

    _forged(monkeypatch, reply)
    monkeypatch.setattr(ch04.block, "BLOCK_CASES", {2: ch04.block.BLOCK_CASES[2]})
    result = ch04.tp_block(mine, mine)
    assert not result.cases[0]["passed"] and not result.cases[1]["passed"], result.cases


def test_sp_pair_and_ring_attention_recompute_one_process(monkeypatch):
    from labkit.check import ch07

    def reply(job, n, args):
        if job.__name__ == "_sp_job":
            _, _, T, B, h = args
            want = _zeros_like_all(ch07.sequence_parallel.expected(T, B, h, n, 0))
            return [{**want, "want": want, "rank": r} for r in range(n)]
        T, B, H, Hk, d = args[1:]
        want = _zeros_like_all(ch07.ring.expected(T, B, H, Hk, d, n)[0])
        return [{"rank": r, "bad": None, "out": want["out"], "want": want["out"],
                 "grads": want["grads"], "saved": 0, "saved_limit": 1, "own": 0, "sent": None}
                for r in range(n)]

    _forged(monkeypatch, reply)
    assert "is wrong" in _no_case_passes(ch07.sp_pair(mine_group, mine_group))[0]
    result = ch07.ring_attention(mine_attention)
    assert not result.cases[0]["passed"], result.cases
    assert "wrong output" in result.cases[0]["message"], result.cases[0]["message"]


def test_expert_parallel_recomputes_the_reference_layer(monkeypatch):
    from labkit.check import ch08

    def reply(job, n, args):
        return [{"rank": r, "forbidden": [], "c10d": [], "foreign": [], "sent": None,
                 "optimum": 0, "compare": {"output": (torch.zeros(1), torch.zeros(1))},
                 "got": {}, "bad_E": f"ValueError: 5 experts on {n} ranks"} for r in range(n)]

    _forged(monkeypatch, reply)
    result = ch08.expert_parallel_layer(mine)
    layer = [c for c in result.cases if "a ValueError" not in c["name"]]
    assert len(layer) == 3 and not any(c["passed"] for c in layer), result.cases
    assert "no output" in layer[0]["message"], layer[0]["message"]


def test_a_measurement_that_needs_no_answer_runs_in_the_judge(monkeypatch):
    """Checker.measure never goes to the sandbox (the link), launch does; both stop once the
    checker has stopped."""
    import labkit.check as check
    from labkit.check.answers import checking

    class Link:
        judge_only = True
        sent = []

        def launch(self, job, nprocs, args, kwargs, timeout):
            self.sent.append(job)
            return "from the sandbox"

    monkeypatch.setattr(check, "run", lambda job, n, args, kwargs, timeout, echo: "from here")
    c = Checker("0.0", "measure", 1)
    with checking(Link()) as link:
        assert c.measure(mine, 2) == "from here" and link.sent == []
        assert c.launch(mine, 2) == "from the sandbox" and link.sent == [mine]
        c.refuse("refused")
        with c.case("stopped"):
            c.measure(mine, 2)
    assert not c.cases[0]["passed"] and c.cases[0]["message"] == "refused", c.cases
