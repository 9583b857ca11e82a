"""labkit bench context: its rows on a tiny sequence (structure, the result against SDPA, the
kernel's byte count against labkit.costs.context), and bad input refused before any rank starts.
Timings are never asserted: the machine is shared."""
from __future__ import annotations

import pytest

from labkit import cli
from labkit.bench import context


@pytest.fixture(scope="module")
def tiny():
    return context.measure(cp_list=(2, 4), seq=128, heads=2, dim=16, repeats=1)


def test_rows_per_cp_and_per_rank(tiny):
    assert [r["cp"] for r in tiny["rows"]] == [2, 4]
    want = [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]
    assert [(r["cp"], r["rank"]) for r in tiny["ranks"]] == want
    assert set(tiny["one_process_seconds"]) == {"tiled", "sdpa"}
    for r in tiny["rows"]:
        assert r["seconds"] > 0 and r["vs_tiled"] > 0 and r["vs_sdpa"] > 0
        assert r["hidden_min"] <= r["hidden_max"] <= 1.0
        assert r["max_err"] < 1e-4                       # ring attention = SDPA, out and grads


def test_hidden_is_one_minus_exposed_over_standalone(tiny):
    for r in tiny["ranks"]:
        assert r["exposed"] >= 0 and r["standalone"] > 0
        assert r["hidden"] == pytest.approx(1 - r["exposed"] / r["standalone"])
        assert r["exposed"] == pytest.approx(r["exposed_forward"] + r["exposed_backward"])
        assert r["posting"] >= 0


def test_kernel_bytes_match_the_cost_formula(tiny):
    for r in tiny["ranks"]:
        if r["sent"] is None:
            pytest.skip("the kernel cannot count this backend's traffic")
        assert 1.0 <= r["bytes_ratio"] <= 1.1, r


@pytest.mark.parametrize("kw, words", [(dict(seq=100, cp_list=(2, 4)), ["--seq 100", "2*cp = 8"]),
                                       (dict(cp_list=(1,)), ["--cp 1"]),
                                       (dict(repeats=0), ["--repeats"])])
def test_bad_config_is_refused(kw, words):
    with pytest.raises(ValueError) as err:
        context.check_config(**{"cp_list": (2,), "seq": 64, "heads": 2, "dim": 8, "repeats": 1,
                                **kw})
    assert all(w in str(err.value) for w in words), err.value


def test_cli_says_one_line_and_exits_2(capsys, tmp_path):
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "context", "--seq", "1020", "--json", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "not divisible by 2*cp = 8" in err and err.startswith("labkit: bench context:")
    assert not out.exists()
