"""labkit.pipeline and labkit.costs.pipeline: schedules, validator, simulator, executor."""
import pytest

from labkit import costs
from labkit.pipeline import schedules as S
from labkit.pipeline.schedules import B, F
from labkit.pipeline.simulate import simulate
from labkit.pipeline.validate import ScheduleError, validate

CASES = [(P, K) for P in (1, 2, 3, 4, 5) for K in (1, 2, 3, 4, 7, 8)]


# ----------------------------------------------------------------------------- costs
def test_notes_worked_example():
    assert costs.pipeline.bubble_fraction(8, 32) == pytest.approx(7 / 39)
    assert round(100 * costs.pipeline.bubble_fraction(8, 32), 1) == 17.9
    # the notes say K = 133 gives "< 5%": it gives exactly 5%; strictly under needs 134
    assert costs.pipeline.bubble_fraction(8, 133) == pytest.approx(0.05)
    assert costs.pipeline.micro_batches_for_bubble(8, 0.05) == 134


@pytest.mark.parametrize("P,target,v", [(2, 0.1, 1), (4, 0.05, 1), (8, 0.2, 2), (16, 0.01, 4)])
def test_micro_batches_for_bubble_is_the_smallest(P, target, v):
    K = costs.pipeline.micro_batches_for_bubble(P, target, v)
    assert costs.pipeline.bubble_fraction(P, K, v) < target
    assert K == 1 or costs.pipeline.bubble_fraction(P, K - 1, v) >= target


def test_interleaving_divides_bubble_time_by_v():
    P, K, v = 8, 32, 4
    assert costs.pipeline.bubble_overhead(P, K, v) == pytest.approx(
        costs.pipeline.bubble_overhead(P, K) / v)
    t1 = costs.pipeline.step_time(P, K, 1.0, 2.0) - K * 3.0
    tv = costs.pipeline.step_time(P, K, 1.0, 2.0, v=v) - K * 3.0
    assert tv == pytest.approx(t1 / v)


def test_costs_bad_input_names_the_numbers():
    with pytest.raises(ValueError, match="K=0"):
        costs.pipeline.bubble_fraction(4, 0)
    with pytest.raises(ValueError, match="0.05"):
        costs.pipeline.micro_batches_for_bubble(4, 5)
    with pytest.raises(ValueError, match="v=2"):
        costs.pipeline.peak_in_flight("1f1b", 4, 8, v=2)
    with pytest.raises(ValueError, match="stage=4"):
        costs.pipeline.peak_in_flight("1f1b", 4, 8, stage=4)


# ----------------------------------------------------------------------------- simulator
@pytest.mark.parametrize("P,K", CASES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_simulated_bubble_and_peak_match_formulas(name, P, K):
    r = simulate(S.make(name, P, K), t_f=1.0, t_b=2.0)
    assert r.bubble == pytest.approx(costs.pipeline.bubble_fraction(P, K))
    assert r.makespan == pytest.approx(costs.pipeline.step_time(P, K, 1.0, 2.0))
    assert r.peak_in_flight == [costs.pipeline.peak_in_flight(name, P, K, p) for p in range(P)]


@pytest.mark.parametrize("P,K,v", [(2, 2, 2), (2, 6, 3), (3, 6, 2), (4, 8, 2), (4, 12, 3)])
def test_interleaved_bubble_is_divided_by_v(P, K, v):
    r = simulate(S.interleaved_1f1b(P, K, v), t_f=1.0, t_b=2.0)
    assert r.bubble == pytest.approx(costs.pipeline.bubble_fraction(P, K, v))
    assert r.bubble < costs.pipeline.bubble_fraction(P, K)
    assert r.peak_in_flight == [costs.pipeline.peak_in_flight("interleaved", P, K, p, v)
                                for p in range(P)]


@pytest.mark.parametrize("P,v", [(2, 2), (3, 3), (4, 2), (4, 3), (8, 2)])
def test_interleaved_with_fewer_micro_batches_than_stages_matches_the_simulator(P, v):
    # K < P: micro-batch 0 crosses all vP chunk-stages alone, so the ramp is not divided by v.
    # The Megatron formula (P-1)/(vK+P-1) would say 42.9% at P=4, K=2, v=2; the run idles 55.6%.
    for K in range(1, P):
        r = simulate(S.interleaved_1f1b(P, K, v), t_f=1.0, t_b=2.0)
        assert r.makespan == pytest.approx(costs.pipeline.step_time(P, K, 1.0, 2.0, v=v))
        assert r.bubble == pytest.approx(costs.pipeline.bubble_fraction(P, K, v))
        assert r.bubble == pytest.approx((v * (P - K) + K - 1) / (v * P + K - 1))
    assert costs.pipeline.bubble_fraction(4, 2, 2) == pytest.approx(5 / 9)


def test_1f1b_same_bubble_as_gpipe_with_unequal_times():
    # the bubble is set by the ramp, not by the order of work in between
    for tf, tb in [(1.0, 1.0), (1.0, 3.0), (2.0, 1.0)]:
        g = simulate(S.gpipe(4, 8), tf, tb)
        o = simulate(S.one_f_one_b(4, 8), tf, tb)
        assert g.makespan == pytest.approx(o.makespan)


def test_p2p_time_lengthens_the_step():
    r0 = simulate(S.one_f_one_b(4, 8), 1.0, 2.0)
    r1 = simulate(S.one_f_one_b(4, 8), 1.0, 2.0, t_p2p=0.5)
    assert r1.makespan > r0.makespan and r1.bubble > r0.bubble


# ----------------------------------------------------------------------------- validator
@pytest.mark.parametrize("P,K", CASES)
def test_generated_schedules_are_valid(P, K):
    validate(S.gpipe(P, K))
    validate(S.one_f_one_b(P, K))
    if K % P == 0:
        validate(S.interleaved_1f1b(P, K, 2))


def _with_stage(s, p, actions):
    s.stages[p] = actions
    return s


def test_backward_before_forward_is_named():
    s = _with_stage(S.one_f_one_b(2, 2), 1, [B(0), F(0), F(1), B(1)])
    with pytest.raises(ScheduleError, match=r"stage 1, action #0 \(B0\).*before its forward"):
        validate(s)


def test_missing_and_duplicate_actions_are_named():
    with pytest.raises(ScheduleError, match=r"stage 0 never runs B1"):
        validate(_with_stage(S.gpipe(2, 2), 0, [F(0), F(1), B(0)]))
    with pytest.raises(ScheduleError, match=r"action #1 \(F0\): F0 runs twice"):
        validate(_with_stage(S.gpipe(2, 2), 0, [F(0), F(0), B(0), B(1)]))
    with pytest.raises(ScheduleError, match=r"micro-batch 5 is out of range 0..1 for K=2"):
        validate(_with_stage(S.gpipe(2, 2), 0, [F(0), F(5), B(0), B(1)]))


def test_deadlock_is_found_and_named():
    # stage 0 waits for B0's gradient before it sends F1; stage 1 wants F1 before it runs B0
    s = S.Schedule("bad", 2, 2, 1, [[F(0), B(0), F(1), B(1)], [F(0), F(1), B(0), B(1)]])
    with pytest.raises(ScheduleError, match=r"deadlock(.|\n)*stage 0, action #1 \(B0\) waits for "
                                            r"the gradient of micro-batch 0 from stage 1"):
        validate(s)


def test_interleaved_takes_k_not_a_multiple_of_p_where_the_rounds_allow():
    validate(S.interleaved_1f1b(4, 6, 2))     # one round of 6 micro-batches
    validate(S.interleaved_1f1b(4, 10, 3))    # two rounds of 5
    with pytest.raises(ValueError, match=r"P=4, v=2\) cuts K=9 .* 2 rounds"):
        S.interleaved_1f1b(4, 9, 2)


# ----------------------------------------------------------------------------- executor
from labkit.launch import run  # noqa: E402
from labkit.model import GPTConfig  # noqa: E402
from labkit.pipeline import executor as E  # noqa: E402


def test_split_blocks():
    assert E.split_blocks(4, 3) == [[0, 1], [2], [3]]
    assert E.split_blocks(4, 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="n_layer=2 blocks cannot fill 4"):
        E.split_blocks(2, 4)


EXEC = {  # P: schedules run in one launch (batch 7 rows: uneven micro-batches when K ∤ 7)
    2: [S.gpipe(2, 3), S.one_f_one_b(2, 4), S.interleaved_1f1b(2, 2, 2), S.one_f_one_b(2, 1)],
    3: [S.gpipe(3, 5), S.one_f_one_b(3, 7), S.interleaved_1f1b(3, 3, 2)],
    4: [S.one_f_one_b(4, 6), S.gpipe(4, 6)],
}


@pytest.mark.parametrize("P", sorted(EXEC))
def test_executor_matches_one_process_reference(P):
    cfg = GPTConfig(n_layer=P * 2 if P < 4 else 4, n_embd=16, n_head=2, block_size=16)
    ref = E.reference_step(cfg, 7)
    per_rank = run(E.schedules_job, P, args=(EXEC[P], cfg, 7), timeout=60, echo=False)
    for i, s in enumerate(EXEC[P]):
        merged = E.merge([r[i] for r in per_rank])
        E.compare_to_reference(merged, ref)  # loss and every gradient, tied embedding included
        sim = simulate(s)
        assert merged["peak_in_flight"] == sim.peak_in_flight, s.name
        assert len(merged["timeline"]) == 2 * s.K * s.v * s.P
    # measured bytes: 1F1B's stage 0 holds 4 of the 6 micro-batches (5 of 7 rows), GPipe all
    if P == 4:
        one, gp = (E.merge([r[i] for r in per_rank]) for i in (0, 1))
        peak, gpipe_peak = one["peak_activation_bytes"], gp["peak_activation_bytes"]
        assert peak[0] == pytest.approx(gpipe_peak[0] * 5 / 7, rel=0.01)
        assert peak[3] == pytest.approx(gpipe_peak[3] * 2 / 7, rel=0.01)


def test_executor_rejects_a_wrong_world_size():
    from labkit.launch import RankError

    cfg = GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=16)
    with pytest.raises(RankError) as err:
        run(E.schedules_job, 2, args=([S.one_f_one_b(3, 3)], cfg, 4), timeout=30, echo=False)
    assert "P=3 stages but the process group has 2 ranks" in err.value.remote_traceback


# ----------------------------------------------------------------------------- checker 5.1
from labkit.check import ch05  # noqa: E402


@pytest.mark.parametrize("P,K", ch05.PAPER_CASES)
def test_checker_accepts_1f1b(P, K):
    ch05.assert_1f1b_schedule(S.one_f_one_b(P, K))


def test_checker_rejects_gpipe_and_lazy_orders():
    with pytest.raises(AssertionError,
                       match=r"stage 0 holds 8 micro-batches.*at most min\(K, P - p\) = 4"):
        ch05.assert_1f1b_schedule(S.gpipe(4, 8))

    def too_few_warmup(p, P, K):  # valid and low-memory, but stage 0 waits: bigger bubble
        return [a for k in range(K) for a in (F(k), B(k))]
    with pytest.raises(AssertionError, match="simulated bubble"):
        ch05.assert_1f1b_schedule(S.from_stage_fn(too_few_warmup, 3, 4))

    def deadlocks(p, P, K):
        return [F(0), B(0)] + [a for k in range(1, K) for a in (F(k), B(k))] if p == 0 else \
            [F(k) for k in range(K)] + [B(k) for k in range(K)]
    with pytest.raises(AssertionError, match="deadlock"):
        ch05.assert_1f1b_schedule(S.from_stage_fn(deadlocks, 2, 2))
    with pytest.raises(AssertionError, match=r"return actions made with F\(k\)"):
        ch05.schedule_from(lambda p, P, K: ["F0"], 2, 1)


def test_widget_gantt_shows_the_formula():
    from labkit.widgets import pipeline as W

    fig = W.gantt("gpipe", 8, 32)
    assert "17.9% formula" in fig.layout.title.text and "17.9% simulated" in fig.layout.title.text
    assert sum(len(t.x) for t in fig.data) == 2 * 8 * 32


def test_executor_on_subgroups():
    """Two pipelines of 2 stages side by side (ranks {0,1} and {2,3}), as inside 3D parallelism:
    send/recv address the group's stages by their global ranks."""
    cfg = GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=16)

    def job():
        import torch.distributed as dist

        from labkit.model import GPT
        from labkit.pipeline import executor, schedules

        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = groups[dist.get_rank() // 2]
        x, y = executor.make_batch(5, cfg)
        return executor.run_schedule(schedules.one_f_one_b(2, 3), GPT(cfg), x, y, group=mine)

    out = run(job, 4, timeout=60, echo=False)
    ref = E.reference_step(cfg, 5)
    for pair in (out[:2], out[2:]):
        E.compare_to_reference(E.merge(pair), ref)


# ----------------------------------------------------------------------------- GPU-readiness
def _out_of_order(p, P, K):
    """Valid (no deadlock), but stage 1 takes micro-batch 1 before 0: fine where messages are
    matched by tag (Gloo), wrong where they are matched in order (NCCL)."""
    return [F(0), F(1), B(0), B(1)] if p == 0 else [F(1), B(1), F(0), B(0)]


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_generated_schedules_keep_each_pairs_message_order(P):
    """NCCL ignores tags: between two stages, messages must be received in the order sent.
    GPipe, 1F1B and interleaved 1F1B (any K, v) do so; the check names a schedule that does not."""
    from labkit.pipeline.validate import check_message_order, message_orders

    for K in range(1, 10):
        for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)):
            if name == "interleaved" and K % P:
                continue
            s = S.make(name, P, K, v)
            check_message_order(s)
            if name == "interleaved":  # the wrap-around pair P-1 -> 0 carries messages too
                assert (P - 1, 0) in message_orders(s)
    s = S.from_stage_fn(_out_of_order, 2, 2)
    validate(s)
    with pytest.raises(ScheduleError, match=r"stage 0 sends its messages to stage 1 in another "
                                            r"order.*micro-batch 0.*micro-batch 1.*NCCL"):
        check_message_order(s)


def _pipeline_on_the_model_device(schedule_list, cfg, batch):
    """run_schedule with torch's default device set to "meta" (tests/devicecheck.py): an
    activation or gradient buffer made without device= would be meta and break the step. Then
    the benchmark's rank function, watched for factory calls without device=."""
    import torch
    from devicecheck import RANK_SIDE, ImplicitDevice, default_device

    from labkit.labs.pipeline import measure
    from labkit.pipeline import executor

    torch.set_num_threads(1)
    model = executor.GPT(cfg, seed=0)
    x, y = executor.make_batch(batch, cfg)
    out = []
    for s in schedule_list:
        with default_device("meta"):
            r = executor.run_schedule(s, model, x, y)
        r["devices"] = {str(g.device) for g in r["grads"].values()}
        out.append(r)
    with ImplicitDevice(RANK_SIDE) as mode:
        timed = measure._job([("1f1b", 2, 1)], cfg, batch, None, 1)
    # NCCL ignores tags. With every tag 0, Gloo too pairs a stage's messages in order, as NCCL
    # does: the schedules that keep each pair's order must still give the reference's step.
    tag, executor._tag = executor._tag, lambda *args: 0
    try:
        untagged = [executor.run_schedule(s, model, x, y) for s in schedule_list
                    if s.name != "custom"]
    finally:
        executor._tag = tag
    return out, mode.calls, (timed[0]["backend"], timed[0]["device"]), untagged


def test_executor_makes_its_buffers_on_the_model_device():
    cfg = GPTConfig(n_layer=4, n_embd=16, n_head=2, block_size=16)
    # interleaved (2, 4, 2): its NCCL posting plan receives some inputs early (posting.plan)
    sched = [S.one_f_one_b(2, 3), S.interleaved_1f1b(2, 4, 2), S.from_stage_fn(_out_of_order, 2, 2)]
    per_rank = run(_pipeline_on_the_model_device, 2, args=(sched, cfg, 5), timeout=60, echo=False)
    ref = E.reference_step(cfg, 5)
    for i in range(len(sched)):  # the out-of-order one too: on Gloo the tags pair the messages
        E.compare_to_reference(E.merge([r[0][i] for r in per_rank]), ref)
        assert all(r[0][i]["devices"] == {"cpu"} for r in per_rank)
    for _, calls, ran_on, _ in per_rank:
        assert calls == [], f"tensors made without device=: {calls}"
        assert ran_on == ("gloo", "cpu")
    for i in range(2):  # 1F1B and interleaved, messages matched in order only (as under NCCL)
        E.compare_to_reference(E.merge([r[3][i] for r in per_rank]), ref)


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_posting_plan_cannot_deadlock_under_nccl_rules(P):
    """Under NCCL a stage's batches run in order and a send waits for its receive. GPipe and
    1F1B need nothing more; interleaved 1F1B needs some receives posted early, and gets them."""
    from labkit.pipeline import posting

    for K in range(1, 10):
        for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)):
            if name == "interleaved" and K % P:
                continue
            s = S.make(name, P, K, v)
            plan = posting.plan(s)
            assert posting.stuck(s, plan) == {}, (name, P, K, v)
            if name != "interleaved":
                assert plan == posting.default_plan(s), (name, P, K)
            for p in range(P):  # receives only move earlier, in order, never past their action
                order = [j for batch in plan[p] for j in batch]
                assert order == sorted(order) == [j for j, a in enumerate(s.stages[p])
                                                  if posting.needs(s, p, a) is not None]
                assert all(j >= i for i, batch in enumerate(plan[p]) for j in batch)
    s = S.interleaved_1f1b(2, 4, 2)
    assert posting.stuck(s, posting.default_plan(s)) == {0: 5, 1: 4}   # why the plan exists
    with pytest.raises(ScheduleError, match="no order of posting receives"):
        posting.plan(S.from_stage_fn(_out_of_order, 2, 2))


# ----------------------------------------------------------------------------- causality
from labkit.pipeline import causality as C  # noqa: E402


@pytest.mark.parametrize("name,P,K,v", [("gpipe", 4, 8, 1), ("1f1b", 3, 5, 1), ("1f1b", 2, 1, 1),
                                        ("interleaved", 4, 8, 2)])
def test_simulated_timelines_are_causal_and_on_the_floor(name, P, K, v):
    import random

    s = S.make(name, P, K, v)
    r = simulate(s, 1.0, 2.0)
    assert C.check_causality(s, r.timeline) == [] and C.check_bubble_floor(s, r.timeline) == []
    rep = C.bubble_report(s, r.timeline)  # equal durations, no overhead: all three agree
    assert rep["bubble"] == pytest.approx(rep["critical_path"]) == pytest.approx(rep["formula"])
    rng = random.Random(0)  # uneven durations: the critical-path floor is still met exactly
    d = {(p, kind, c): rng.uniform(0.5, 3.0) for p in range(P) for kind in "FB" for c in range(v)}
    r = simulate(s, durations=d, t_p2p=0.1)
    assert C.check_causality(s, r.timeline) == []
    assert C.check_bubble_floor(s, r.timeline) == []


def test_causality_check_catches_a_fabricated_bad_timeline():
    """The check can fail: a receiver that starts before its sender ended (as the saved outputs
    of an earlier executor showed: end was read after the send was posted)."""
    s = S.gpipe(2, 1)
    good = [dict(stage=0, kind="F", mb=0, chunk=0, start=0.0, end=1.0),
            dict(stage=1, kind="F", mb=0, chunk=0, start=1.0, end=2.0),
            dict(stage=1, kind="B", mb=0, chunk=0, start=2.0, end=3.0),
            dict(stage=0, kind="B", mb=0, chunk=0, start=3.0, end=4.0)]
    assert C.check_causality(s, good) == [] and C.check_bubble_floor(s, good) == []
    bad = [dict(e) for e in good]
    for e in bad[1:]:        # stage 1 starts 0.5 s early, everything after it follows
        e["start"] -= 0.5
        e["end"] -= 0.5
    problems = C.check_causality(s, bad)
    assert len(problems) == 1 and "stage 1 F0" in problems[0] and "stage 0 F0" in problems[0]
    floors = C.check_bubble_floor(s, bad)  # 1 - 4/(2*3.5) = 0.43 < (P-1)/P = 0.5
    assert len(floors) == 2 and "critical-path" in floors[0] and "(P-1)/P" in floors[1]
    assert C.measured_bubble(bad, 2)[0] == pytest.approx(1 - 4 / 7)
    overlap = [dict(e) for e in good]   # a stage running two actions at once
    overlap[3]["start"] = 2.5
    assert any("stage 0 B0" in m and "stage 1 B0" in m for m in C.check_causality(s, overlap))
    assert "missing" in C.check_causality(s, good[:3])[0]
    with pytest.raises(ValueError, match="lacks 1 actions.*stage 0 B0"):
        C.check_bubble_floor(s, good[:3])
    wrong_b = S.one_f_one_b(2, 2)    # B needs its own F: a backward before its forward is named
    tl = simulate(wrong_b).timeline
    f = next(e for e in tl if (e["stage"], e["kind"], e["mb"]) == (0, "F", 1))
    b = next(e for e in tl if (e["stage"], e["kind"], e["mb"]) == (0, "B", 1))
    f["start"], f["end"] = b["end"] + 1, b["end"] + 2
    assert any("stage 0 B1" in m and "stage 0 F1" in m for m in C.check_causality(wrong_b, tl))


def _causality_specs(P):
    """K = 1, P, 2P and P+1 (not a multiple of P) for GPipe and 1F1B; interleaved where allowed."""
    Ks = sorted({1, P, 2 * P, P + 1})
    return ([(n, K, 1) for n in ("gpipe", "1f1b") for K in Ks]
            + [("interleaved", K, 2) for K in Ks if K % P == 0])


@pytest.mark.parametrize("P", [2, 3, 4])
def test_measured_runs_are_causal_and_above_the_floor(P):
    """Real processes (Gloo): every repeat of every run is causal, its bubble is on or above the
    critical path of its own durations, and at K = 1 on or above (P-1)/P."""
    from labkit.labs.pipeline import measure

    specs = _causality_specs(P)
    rows = measure.measure(P, specs, pad=(0.002, 0.004), repeats=2, timeout=120)
    assert [(r["schedule"], r["K"], r["v"]) for r in rows] == specs
    for r in rows:
        assert r["dependencies"] > 0 and len(r["timelines"]) == 2
        assert all(len(t) == 2 * r["K"] * r["v"] * P for t in r["timelines"])
        assert r["violations"] == [], "\n".join(r["violations"])
        assert all(b >= C.formula_floor(S.make(r["schedule"], P, 1)) for b in r["bubbles"]) \
            if r["K"] == 1 else r["bubble"] >= r["critical_path_floor"]
    if P == 4:  # real compute only, 4 processes on few cores: still causal, above its critical path
        for r in measure.measure(P, [("1f1b", 8, 1), ("interleaved", 8, 2)], repeats=2):
            assert r["violations"] == [], "\n".join(r["violations"])


def test_interleaving_sends_more_messages_of_the_same_size():
    """2(vP-1)K messages per step, each one micro-batch's (b, s, h): more, not smaller. Counted
    by the comm log (what the executor asked for) and by the kernel's TCP counters (a counter the
    executor does not write: Gloo's small per-message headers on top)."""
    from labkit.labs.pipeline import measure

    P, K = 3, 3
    cfg = GPTConfig(n_layer=6, n_embd=32, n_head=2, block_size=32)  # 8 KiB messages
    one, inter = measure.messages(P, [("1f1b", K, 1), ("interleaved", K, 2)], cfg, batch_size=6)
    assert (one["sends"], inter["sends"]) == (2 * (P - 1) * K, 2 * (2 * P - 1) * K)
    assert one["shapes"] == inter["shapes"] == [(2, 32, 32)]
    assert one["pipeline_bytes"] == one["sends"] * 2 * 32 * 32 * 4
    for r in (one, inter):
        assert r["kernel_sent"] is not None, r["kernel_reason"]
        assert r["logged_bytes"] <= r["kernel_sent"] <= 1.1 * r["logged_bytes"]


# ------------------------------------------------------------------------ zero bubble (issue 17)
from labkit.pipeline import torch_orders as TO  # noqa: E402
from labkit.pipeline import zero_bubble as ZB  # noqa: E402
from labkit.pipeline.schedules import W  # noqa: E402
from labkit.pipeline.validate import check_message_order  # noqa: E402

ZB_CASES = [(P, K) for P in (2, 3, 4) for K in (1, 2, 3, 4, 5, 8, 16)]


@pytest.mark.parametrize("P,K", ZB_CASES)
@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_zero_bubble_schedules_pass_both_validators(name, P, K):
    s = S.make(name, P, K)
    validate(s)
    check_message_order(s)       # NCCL-safe: each pair's messages in the same order
    TO.torch_validate(s)         # PyTorch's private _validate_schedule
    assert s.split and sum(map(len, s.stages)) == 3 * P * K


@pytest.mark.parametrize("P,K", [(2, 2), (2, 6), (3, 3), (3, 6), (4, 4), (4, 8), (4, 16)])
def test_zb_h1_is_pytorch_zb1p_order(P, K):
    """labkit's ZB-H1 is, action for action, PyTorch's ScheduleInterleavedZeroBubble at v=1."""
    t = TO.torch_schedule("ScheduleInterleavedZeroBubble", P, K, 1)
    assert TO.first_difference(S.make("zb-h1", P, K), t) is None


@pytest.mark.parametrize("P", (2, 3, 4, 5))
@pytest.mark.parametrize("v", (2, 3))
def test_interleaved_is_pytorch_order_for_every_k_it_takes(P, v):
    taken = 0
    for K in range(1, 21):
        try:
            s = S.interleaved_1f1b(P, K, v)
        except ValueError:
            with pytest.raises(ValueError):  # PyTorch refuses the same K
                TO.torch_schedule("ScheduleInterleaved1F1B", P, K, v)
            continue
        taken += 1
        validate(s)
        check_message_order(s)
        t = TO.torch_schedule("ScheduleInterleaved1F1B", P, K, v)
        assert TO.first_difference(s, t) is None, (P, K, v)
    assert taken > 20 // P  # more K than the multiples of P the old rule took


@pytest.mark.parametrize("K", (4, 8, 16))
def test_zero_bubble_simulated_bubble_and_memory(K):
    P = 4  # t_F = t_B = t_W = 1 (the paper's assumption): fused backward 2
    one = simulate(S.make("1f1b", P, K), 1.0, 2.0)
    h1 = simulate(S.make("zb-h1", P, K), 1.0, 2.0, t_w=1.0)
    h2 = simulate(S.make("zb-h2", P, K), 1.0, 2.0, t_w=1.0)
    work = 3 * K
    assert one.bubble == pytest.approx(3 * (P - 1) / (work + 3 * (P - 1)))
    assert h1.bubble == pytest.approx((P - 1) / (work + P - 1))   # (P-1)(t_F + t_B - t_W)
    assert max(h1.peak_in_flight) == max(one.peak_in_flight) == P  # 1F1B's peak
    assert h2.bubble <= h1.bubble + 1e-12
    assert max(h2.peak_in_flight) <= 2 * P - 1


def test_w_before_b_and_missing_w_are_named():
    with pytest.raises(ScheduleError, match=r"weight gradient of micro-batch 0 comes before its B"):
        validate(S.Schedule("bad", 1, 1, 1, [[F(0), W(0), B(0)]]))
    with pytest.raises(ScheduleError, match=r"never runs W1"):
        validate(S.Schedule("bad", 1, 2, 1, [[F(0), B(0), W(0), F(1), B(1)]]))


ZB_EXEC = {
    2: [S.make("zb-h1", 2, 3), S.make("zb-h2", 2, 5), ZB.split_backward(S.one_f_one_b(2, 4))],
    3: [S.make("zb-h1", 3, 5), S.make("zb-h2", 3, 4), S.interleaved_1f1b(3, 4, 2)],
    4: [S.make("zb-h1", 4, 6), S.make("zb-h2", 4, 7), S.one_f_one_b(4, 6)],
}


@pytest.mark.parametrize("P", sorted(ZB_EXEC))
def test_split_backward_matches_one_process_reference(P):
    """B and W run as separate actions on real processes: loss and every gradient equal the
    reference's; the bytes held follow the schedule (W holds a micro-batch until it runs)."""
    from labkit.pipeline.causality import check_causality

    cfg = GPTConfig(n_layer=P * 2 if P < 4 else 4, n_embd=16, n_head=2, block_size=16)
    ref = E.reference_step(cfg, 7)
    per_rank = run(E.schedules_job, P, args=(ZB_EXEC[P], cfg, 7), timeout=90, echo=False)
    for i, s in enumerate(ZB_EXEC[P]):
        merged = E.merge([r[i] for r in per_rank])
        E.compare_to_reference(merged, ref)
        assert merged["peak_in_flight"] == simulate(s).peak_in_flight, s.name
        assert len(merged["timeline"]) == sum(map(len, s.stages))
        assert check_causality(s, merged["timeline"]) == []
        kinds = {"F", "B", "W"} if s.split else {"F", "B"}
        assert {e["kind"] for e in merged["timeline"]} == kinds
    if P == 4:  # ZB-H1 holds 1F1B's stage-0 peak on the last stage too (measured bytes)
        h1, one = (E.merge([r[i] for r in per_rank]) for i in (0, 2))
        assert h1["peak_activation_bytes"][0] == pytest.approx(one["peak_activation_bytes"][0])
        assert h1["peak_activation_bytes"][3] > one["peak_activation_bytes"][3] * 1.5


@pytest.mark.parametrize("P,K", ch05.ZB_PAPER_CASES)
def test_checker_accepts_zb_h1(P, K):
    ch05.assert_zb_h1_schedule(S.make("zb-h1", P, K))


def test_checker_rejects_known_wrong_zb_h1():
    with pytest.raises(AssertionError, match="no W actions"):
        ch05.assert_zb_h1_schedule(S.one_f_one_b(3, 3))
    with pytest.raises(AssertionError, match="simulated bubble"):   # split, nothing deferred
        ch05.assert_zb_h1_schedule(ZB.split_backward(S.one_f_one_b(4, 8)))

    def all_w_last(p, P, K):  # no bubble lost, but every stage holds all K micro-batches
        return [a for a in S.one_f_one_b_stage(p, P, K)] + [W(k) for k in range(K)]
    with pytest.raises(AssertionError, match="holds 8 micro-batches"):
        ch05.assert_zb_h1_schedule(S.from_stage_fn(all_w_last, 4, 8))

    def w_first(p, P, K):
        return [x for a in S.one_f_one_b_stage(p, P, K)
                for x in ((W(a.mb), a) if a.kind == "B" else (a,))]
    with pytest.raises(AssertionError, match="comes before its B"):
        ch05.assert_zb_h1_schedule(S.from_stage_fn(w_first, 2, 2))
