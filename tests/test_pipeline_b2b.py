"""labkit.labs.pipeline.back_to_back: steps back to back (no flush) on real processes, and the
bookkeeping that reads a period and a bubble off a timeline. No timing is asserted."""
import pytest

from labkit import costs
from labkit.labs.pipeline import back_to_back
from labkit.model import GPTConfig
from labkit.pipeline import schedules
from labkit.pipeline.simulate import repeat, simulate, steady_state


def _synthetic(steps=4):
    """P=2, K=1: step i on stage 0 is F [10i, 10i+2] and B [10i+5, 10i+8]; on stage 1, F
    [10i+2, 10i+4] and B [10i+4, 10i+5]."""
    out = []
    for i in range(steps):
        t = 10.0 * i
        out += [dict(stage=0, kind="F", mb=i, chunk=0, start=t, end=t + 2),
                dict(stage=1, kind="F", mb=i, chunk=0, start=t + 2, end=t + 4),
                dict(stage=1, kind="B", mb=i, chunk=0, start=t + 4, end=t + 5),
                dict(stage=0, kind="B", mb=i, chunk=0, start=t + 5, end=t + 8)]
    return out


def test_period_of_a_synthetic_timeline_by_hand():
    # back to back: stage 0 ends steps 1 and 2 at 18 and 28, stage 1 at 15 and 25: period 10
    # on both; step 2 keeps stage 0 busy 2 + 3 = 5 and stage 1 2 + 1 = 3: 1 - 8/20 = 0.6
    got = back_to_back.period(_synthetic(), K=1, steps=4)
    assert got["periods"] == [10.0, 10.0] and got["busies"] == [5.0, 3.0]
    assert got["bubble"] == pytest.approx(0.6)
    # with a flush: the period is step 2's makespan, 20 .. 28 = 8: 1 - 8/16 = 0.5; between
    # step 1's last end (18) and step 2's first start (20): 2
    got = back_to_back.period(_synthetic(), K=1, steps=4, flush=True)
    assert got["period"] == 8.0 and got["between"] == 2.0
    assert got["bubble"] == pytest.approx(0.5)
    # steps 1..3 of 5: two periods averaged
    assert back_to_back.period(_synthetic(5), K=1, steps=5)["period"] == 10.0


def test_period_names_what_to_change():
    with pytest.raises(ValueError, match="steps >= 4"):
        back_to_back.period(_synthetic(3), K=1, steps=3)
    with pytest.raises(ValueError, match="no action in step"):
        back_to_back.period(_synthetic(), K=4, steps=4)       # K is not one step's micro-batches
    with pytest.raises(ValueError, match="steps >= 4"):
        back_to_back.measure(2, [("1f1b", 2, 1)], steps=3)


@pytest.mark.parametrize("name,v,t_b", [("1f1b", 1, 2.0), ("zb-h1", 1, 2.0), ("zb-h2", 1, 2.0),
                                        ("zb-h2", 1, 3.0), ("zb-v", 2, 2.0)])
def test_period_of_the_simulators_timelines_equals_its_own_bubbles(name, v, t_b):
    """The timeline bookkeeping, on the simulator's timelines, gives what the simulator computes
    its own way (steady_state: makespan differences; simulate: one step)."""
    P, K, steps = 4, 8, 5
    s = schedules.make(name, P, K, v)
    b2b = simulate(repeat(s, steps), 1.0, t_b, t_w=1.0).timeline
    assert back_to_back.period(b2b, K, steps)["bubble"] == pytest.approx(
        steady_state(s, 1.0, t_b, t_w=1.0, steps=steps)["bubble"], abs=1e-9)
    one = simulate(s, 1.0, t_b, t_w=1.0)
    gap = one.makespan + 0.5
    flush = [dict(e, mb=e["mb"] + i * K, start=e["start"] + i * gap, end=e["end"] + i * gap)
             for i in range(steps) for e in one.timeline]
    got = back_to_back.period(flush, K, steps, flush=True)
    assert got["bubble"] == pytest.approx(one.bubble, abs=1e-9)
    assert got["between"] == pytest.approx(0.5)
    # a replay with each action's own time rebuilds both (the flush's 0.5 gaps left out)
    for timeline, way in ((b2b, False), (flush, True)):
        again = back_to_back.replay(s, timeline, K, steps, flush=way)
        assert back_to_back.period(again, K, steps, flush=way)["bubble"] == pytest.approx(
            back_to_back.period(timeline, K, steps, flush=way)["bubble"], abs=1e-9)


def test_replay_leaves_out_the_time_between_actions():
    """Stage 1 of the synthetic run starts each action 1 s late (an executor's overhead): the
    measured bubble has it, the replay with the same durations does not."""
    late = [dict(e, start=e["start"] + 1, end=e["end"] + 1) if e["stage"] == 1 else
            dict(e, start=e["start"] + 2, end=e["end"] + 2) if e["kind"] == "B" else e
            for e in _synthetic()]
    s = schedules.make("1f1b", 2, 1)
    measured = back_to_back.period(late, K=1, steps=4)
    again = back_to_back.period(back_to_back.replay(s, late, 1, 4, flush=False), K=1, steps=4)
    assert again["busies"] == measured["busies"] == [5.0, 3.0]
    assert again["period"] < measured["period"]


def test_steady_state_takes_measured_durations():
    s = schedules.make("zb-h2", 3, 6)
    even = {(p, k, 0): 1.0 for p in range(3) for k in "FBW"}
    assert steady_state(s, durations=even)["bubble"] == pytest.approx(
        steady_state(s, 1.0, 2.0, 1.0)["bubble"])
    slow_b = {**even, **{(p, "B", 0): 2.0 for p in range(3)}}   # t_B > t_F: the ramp shows
    formula = costs.pipeline.schedule_bubble("zb-h2", 3, 6, 1, 1.0, 3.0, 1.0, flush=False)
    assert formula > 0 and steady_state(s, durations=slow_b)["bubble"] == pytest.approx(formula)


SPECS3 = [("1f1b", 4, 1), ("zb-h2", 5, 1), ("zb-v", 5, 2)]


@pytest.fixture(scope="module")
def rows3():
    """One launch, P=3 (7 blocks over 3 or 6 chunks, 7 rows over 5 micro-batches: nothing
    divides evenly), 4 steps each way."""
    cfg = GPTConfig(n_layer=7, n_embd=16, n_head=2, block_size=8)
    return back_to_back.measure(3, SPECS3, steps=4, repeats=1, cfg=cfg, batch_size=7, timeout=180)


def test_back_to_back_run_equals_the_reference_and_is_causal(rows3):
    """The back-to-back run equals the one-process reference on the same 20 micro-batches
    (measure raises otherwise), both ways' timelines are causal, and a stage holds no more back
    to back than in one step."""
    assert [(r["schedule"], r["K"], r["v"]) for r in rows3] == SPECS3
    for r in rows3:
        assert r["max_grad_error"] < 1e-5
        assert r["violations"] == [], r["violations"][:3]
        assert r["peak_b2b"] == r["peak_flush"]
        s = repeat(schedules.make(r["schedule"], 3, r["K"], r["v"]), 4)
        assert len(r["timeline_b2b"]) == sum(len(actions) for actions in s.stages)
        assert len(r["timeline_flush"]) == len(r["timeline_b2b"])


def test_bench_back_to_back_prints_and_returns_json(rows3, monkeypatch, capsys):
    """The bench's glue, on the rows of the launch above (no second launch)."""
    import copy
    import json

    from labkit.bench import pipeline as bench

    monkeypatch.setattr(bench.back_to_back, "measure", lambda *a, **k: copy.deepcopy(rows3))
    got = bench.main(["--back-to-back", "--stages", "3", "--K", "5", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "back to back" in out and "zb-h2 K=5" in out
    assert all("timeline_b2b" not in r and "shed" in r for r in got["rows"])
    json.dumps(got)                                    # what `labkit bench --json` writes
