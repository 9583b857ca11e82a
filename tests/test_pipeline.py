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
    assert costs.pipeline.bubble_overhead(P, K, v) == pytest.approx(costs.pipeline.bubble_overhead(P, K) / v)
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


def test_interleaved_needs_k_multiple_of_p():
    with pytest.raises(ValueError, match="K=6, P=4"):
        S.interleaved_1f1b(4, 6, 2)


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
        assert one["peak_activation_bytes"][0] == pytest.approx(gp["peak_activation_bytes"][0] * 5 / 7, rel=0.01)
        assert one["peak_activation_bytes"][3] == pytest.approx(gp["peak_activation_bytes"][3] * 2 / 7, rel=0.01)


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
    with pytest.raises(AssertionError, match=r"stage 0 holds 8 micro-batches.*at most min\(K, P - p\) = 4"):
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
    from labkit.pipeline import executor, measure

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
    for i, s in enumerate(sched):  # the out-of-order one too: on Gloo the tags pair the messages
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
