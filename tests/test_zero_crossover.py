"""The ZeRO-3 crossover sweep's pieces (labkit.labs.zero.crossover, labs.overlap_zero3) and the
PP vs ZeRO-3 byte count (labkit.labs.pipeline.versus_zero3) on tiny cases: quantities, not
timings."""
import pytest

from labkit.costs import hiding
from labkit.labs.zero.crossover import spans, sweep
from labkit.labs.zero.measure import moved_numel
from labkit.launch import run
from labkit.model import GPT, GPTConfig
from labkit.observe.commlog import Event

TINY = GPTConfig(vocab_size=96, block_size=8, n_layer=2, n_head=4, n_embd=32, tie_weights=False)


def test_spans_are_unions_of_the_records():
    compute = [{"name": "forward", "lane": "compute", "start": 0.0, "end": 1.0},
               {"name": "backward", "lane": "compute", "start": 2.0, "end": 4.0},
               {"name": "backward", "lane": "compute", "start": 3.0, "end": 5.0}]   # nested
    t0 = 10.0
    log = [Event("all_gather", "world", 100, 2, t0 + 0.5, t0 + 1.5, blocked=0.5),
           Event("all_gather", "world", 100, 2, t0 + 1.0, t0 + 2.5, blocked=0.0),
           Event("reduce_scatter", "world", 100, 2, t0 + 5.0, t0 + 6.0, blocked=1.0)]
    s = spans(compute, log, t0)
    assert s["forward"] == 1.0 and s["backward"] == 3.0 and s["compute"] == 4.0
    assert s["gather"] == 2.0                 # [0.5, 2.5]
    assert s["comm"] == 3.0                   # [0.5, 2.5] + [5, 6]
    assert s["exposed"] == 1.5 and s["bytes"] == 200


def test_zero3_crossover_pays_alpha_per_unit():
    # 2 ranks, P = 1e6 fp32, C = 1e10, bw = 1e9, alpha = 1e-3, 6 units: each of the two
    # gathers and the reduce-scatter takes 6 * 1 * 1e-3 + 0.5 * 4e6 / 1e9 = 0.008 s;
    # backward binds: 0.016 s * 1e10 / (4 * 1e6) = 40 tokens (the forward: 0.008 * 1e10 / 2e6)
    z = hiding.zero3(1e6, 2, 1e10, 1e9, 1e-3, weight_bytes=4, grad_bytes=4, n_units=6)
    assert z.terms["all_gather_s"] == pytest.approx(0.008)
    assert z.value == pytest.approx(40.0)
    assert hiding.zero3(1e6, 2, 1e10, 1e9, 1e-3, 4, 4).value == pytest.approx(
        (0.001 + 0.002) * 2 * 1e10 / 4e6)


def _tiny_sweep():
    return sweep(TINY, rows=(1, 2), rounds=1)


def test_sweep_counts_every_gather_and_its_bytes():
    res = run(_tiny_sweep, 2, timeout=120)[0]
    gathered = moved_numel(TINY, 3, 2)                   # padded, as the units gather it
    assert res["units"] == 6
    assert res["params"] == sum(p.numel() for p in GPT(TINY).parameters())
    for b in (1, 2):
        (step,) = res["steps"][b]
        assert step["gathers"] == 2 * res["units"]        # each unit, forward and backward
        assert step["bytes"] == 2 * 4 * gathered           # whole outputs, fp32
        assert 0 < step["forward"] and 0 < step["backward"]
        assert step["compute"] <= step["step"] and step["gather"] <= step["comm"]


def test_pp_and_zero3_bytes_match_their_formulas():
    from labkit.labs.pipeline.versus_zero3 import measure

    res = measure(2, rows=(8, 32), cfg=TINY)
    if not res["steps"]:
        pytest.skip(res["reason"])
    for r in res["steps"]:
        # the payload, plus Gloo's few hundred bytes of headers per step
        assert 0 <= r["pp_boundary"] - r["pp_formula"] < 1024
        assert r["zero3_rank"] == pytest.approx(r["zero3_formula"], rel=0.03)
    assert res["measured_tokens"] == pytest.approx(res["predicted_tokens"], rel=0.05)
