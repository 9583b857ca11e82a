"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6): issue 17 item 2.

2P chunks in a V (stage r holds chunks r and 2P-1-r), checked by labkit's validator and by
PyTorch's, compared with PyTorch's ScheduleZBVZeroBubble order, simulated against 1F1B and ZB-H1,
and run on real processes (Gloo) against the one-process reference.
"""
import pytest

from labkit.pipeline import schedules as S
from labkit.pipeline import torch_orders as TO
from labkit.pipeline.causality import depends_on
from labkit.pipeline.schedules import Action, F
from labkit.pipeline.simulate import simulate
from labkit.pipeline.validate import ScheduleError, check_message_order, message_orders, validate

ZBV_CASES = [(P, K) for P in (2, 3, 4) for K in sorted({P, P + 1, 2 * P, 8})]


@pytest.mark.parametrize("P,K", ZBV_CASES)
def test_zb_v_passes_both_validators_with_v_placement(P, K):
    s = S.make("zb-v", P, K)
    validate(s)
    TO.torch_validate(s)              # PyTorch's private _validate_schedule
    assert (s.v, s.placement) == (2, S.v_placement(P))
    assert [s.chunks_of(r) for r in range(P)] == [[r, 2 * P - 1 - r] for r in range(P)]
    assert s.stage_of(0) == s.stage_of(2 * P - 1) == 0   # embeddings and loss both on stage 0
    assert s.split and sum(map(len, s.stages)) == 3 * 2 * P * K


@pytest.mark.parametrize("P,K", ZBV_CASES + [(2, 1), (3, 2), (4, 3), (5, 9)])
def test_zb_v_is_pytorch_zbv_order(P, K):
    """labkit's ZB-V is, action for action, PyTorch's ScheduleZBVZeroBubble (built on the CPU,
    no process group), K < P included (both drop the actions of micro-batches K .. 2P-2)."""
    t = TO.torch_schedule("ScheduleZBVZeroBubble", P, K, 2)
    assert TO.first_difference(S.make("zb-v", P, K), t) is None
    assert TO.same_order(S.make("zb-v", P, K), t)


@pytest.mark.parametrize("P,K", ZBV_CASES)
def test_zb_v_bubble_below_zb_h1_at_1f1b_peak_memory(P, K):
    """t_F = t_B = t_W (a whole stage's; a chunk takes half): ZB-V idles no more than ZB-H1,
    half of it once K >= 2P-1, and holds no more micro-batches than 1F1B's peak (stage 0's, P)."""
    one = simulate(S.make("1f1b", P, K), 1.0, 2.0)
    h1 = simulate(S.make("zb-h1", P, K), 1.0, 2.0, t_w=1.0)
    zv = simulate(S.make("zb-v", P, K), 1.0, 2.0, t_w=1.0)
    assert zv.bubble <= h1.bubble + 1e-12
    if K > P:
        assert zv.bubble < h1.bubble
    if K >= 2 * P - 1:   # idle (P-1) t_F / 2 per stage, ZB-H1's is (P-1) t_F
        assert zv.bubble == pytest.approx((P - 1) / (6 * K + P - 1))
    assert max(zv.peak_in_flight) <= max(one.peak_in_flight) == P
    assert all(x <= P for x in zv.peak_in_flight)


def test_zb_v_numbers_at_p4_k8():
    """The numbers chapter 05 quotes (t_F = t_B = t_W, fused backward 2)."""
    P, K = 4, 8
    bub = {n: simulate(S.make(n, P, K), 1.0, 2.0, t_w=None if n == "1f1b" else 1.0).bubble
           for n in ("1f1b", "zb-h1", "zb-h2", "zb-v")}
    assert bub["1f1b"] == pytest.approx(9 / 33)
    assert bub["zb-h1"] == pytest.approx(3 / 27)
    assert bub["zb-v"] == pytest.approx(3 / 51)
    assert bub["zb-v"] < bub["zb-h1"] < bub["1f1b"]
    assert simulate(S.make("zb-v", P, K)).peak_in_flight == [4.0, 4.0, 4.0, 4.0]


def test_v_turn_is_a_hand_over_not_a_message():
    """At the bottom of the V chunk P-1 feeds chunk P on the same stage: a dependency (causality
    and the replay keep it), no message (no stage sends to itself)."""
    P = 3
    s = S.make("zb-v", P, 6)
    assert all(src != dst for src, dst in message_orders(s))
    assert depends_on(s, P - 1, F(2, 1)) == [(P - 1, Action("F", 2, 0))]
    assert depends_on(s, 1, F(2, 1)) == [(2, Action("F", 2, 1))]     # chunk 4 <- chunk 3
    assert depends_on(s, 0, Action("B", 2, 0)) == [(0, F(2, 0)), (1, Action("B", 2, 0))]


@pytest.mark.parametrize("P", (2, 3, 4))
def test_zb_v_nccl_message_order(P):
    """NCCL matches each pair's messages in order. At K <= P ZB-V's order keeps it; for K > P a
    down-going activation is sent before a gradient the receiver needs first (a property of the
    paper's order, which is PyTorch's): labkit names the pair. The executor's plan then posts
    those receives early, in the order sent, and no stage can block under NCCL's rules."""
    from labkit.pipeline import posting

    for K in range(1, P + 1):
        check_message_order(S.make("zb-v", P, K))
        assert posting.nccl_plan(S.make("zb-v", P, K)) == posting.plan(S.make("zb-v", P, K))
    with pytest.raises(ScheduleError, match=r"sends its messages to stage \d+ in another order"):
        check_message_order(S.make("zb-v", P, P + 1))
    for K in sorted({P + 1, 2 * P, 8, 16}):
        s = S.make("zb-v", P, K)
        plan = posting.nccl_plan(s)
        posting.check_posted_order(s, plan)            # each pair: posted in the order sent
        assert posting.stuck(s, plan) == {}
        for p in range(P):                             # a receive is never posted after its action
            assert all(j >= i for i, batch in enumerate(plan[p]) for j in batch)


def test_posted_order_check_names_the_pair():
    from labkit.pipeline import posting

    s = S.make("zb-v", 2, 4)
    with pytest.raises(ScheduleError, match=r"stage 1 posts its receives from stage 0 in another "
                                            r"order than stage 0 sends"):
        posting.check_posted_order(s, posting.default_plan(s))


def test_zb_v_bad_input_names_the_numbers():
    with pytest.raises(ValueError, match="K=0"):
        S.make("zb-v", 4, 0)
    with pytest.raises(ValueError, match=r"P=4, K=8, v=3.*exactly 2 chunks"):
        S.make("zb-v", 4, 8, v=3)
    assert S.make("zb-v", 4, 8, v=2).stages == S.make("zb-v", 4, 8).stages
    with pytest.raises(ValueError, match="choose .*'zb-v'"):
        S.make("zb-w", 4, 8)
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        TO.torch_schedule("ScheduleZBVZeroBubble", 4, 8, 3)
    s = S.make("zb-v", 2, 2)
    with pytest.raises(ScheduleError, match=r"puts chunks \[0, 1, 2\] on stage 0"):
        validate(S.Schedule("bad", 2, 2, 2, s.stages, placement=(0, 0, 0, 1)))
    with pytest.raises(ScheduleError, match="placement has 3 entries, expected P\\*v = 4"):
        validate(S.Schedule("bad", 2, 2, 2, s.stages, placement=(0, 1, 0)))


def test_v_turn_in_the_wrong_order_is_named():
    """The bottom stage running the up-chunk's forward before the down-chunk's: it waits for
    itself, and the validator says so."""
    s = S.make("zb-v", 2, 2)
    bottom = list(s.stages[1])
    i, j = bottom.index(F(0, 0)), bottom.index(F(0, 1))
    bottom[i], bottom[j] = bottom[j], bottom[i]
    bad = S.Schedule("bad", 2, 2, 2, [s.stages[0], bottom], placement=s.placement)
    with pytest.raises(ScheduleError, match=r"stage 1, action #0 \(F0.1\) waits for the "
                                            r"activation of micro-batch 0 from stage 1"):
        validate(bad)


ZBV_EXEC = {2: (2, 4), 3: (3, 5), 4: (4, 8)}


def _tagged_and_untagged(schedule_list, cfg, batch):
    """Each schedule twice: as the executor runs it (Gloo pairs messages by tag), then with every
    tag 0, so that Gloo pairs each pair's messages in the order posted, as NCCL does."""
    import torch

    from labkit.launch import device
    from labkit.pipeline import executor

    torch.set_num_threads(1)
    model = executor.GPT(cfg, seed=0).to(device())
    x, y = executor.make_batch(batch, cfg)
    tagged = [executor.run_schedule(s, model, x, y) for s in schedule_list]
    tag, executor._tag = executor._tag, lambda *args: 0
    try:
        untagged = [executor.run_schedule(s, model, x, y) for s in schedule_list]
    finally:
        executor._tag = tag
    return tagged, untagged


@pytest.mark.parametrize("P", sorted(ZBV_EXEC))
def test_zb_v_matches_one_process_reference(P):
    """ZB-V on P real processes (Gloo), chunks in a V: loss and every gradient equal the
    reference's, also with messages paired in posting order only (NCCL's rule); held
    micro-batches as simulated; the measured timeline is causal."""
    from labkit.launch import run
    from labkit.model import GPTConfig
    from labkit.pipeline import executor as E
    from labkit.pipeline.causality import check_causality

    cfg = GPTConfig(n_layer=2 * P, n_embd=16, n_head=2, block_size=16)
    ref = E.reference_step(cfg, 9)
    scheds = [S.make("zb-v", P, K) for K in ZBV_EXEC[P]]
    out = run(_tagged_and_untagged, P, args=(scheds, cfg, 9), timeout=150, echo=False)
    per_rank = [tagged for tagged, _ in out]
    for i, s in enumerate(scheds):
        E.compare_to_reference(E.merge([untagged[i] for _, untagged in out]), ref)
        merged = E.merge([r[i] for r in per_rank])
        E.compare_to_reference(merged, ref)
        assert per_rank[0][i]["loss"] is not None      # the last chunk (and loss) is on stage 0
        assert merged["peak_in_flight"] == simulate(s).peak_in_flight
        assert len(merged["timeline"]) == sum(map(len, s.stages))
        assert check_causality(s, merged["timeline"]) == []


def test_cost_formula_equals_the_simulator_where_it_claims_a_closed_form():
    """labkit.costs.pipeline's zb-v bubble is the simulator's at equal times and K >= 2P-1, and
    None (no closed form) elsewhere."""
    from labkit.costs.pipeline import schedule_bubble
    from labkit.pipeline import schedules
    from labkit.pipeline.simulate import simulate

    for P in (2, 3, 4):
        for K in range(1, 17):
            f = schedule_bubble("zb-v", P, K, 2, 1.0, 2.0, 1.0)
            if K < 2 * P - 1:
                assert f is None
                continue
            sim = simulate(schedules.make("zb-v", P, K, 2), t_f=1.0, t_b=2.0, t_w=1.0).bubble
            assert abs(f - sim) < 1e-9, (P, K, f, sim)
    assert schedule_bubble("zb-v", 4, 8, 2, 1.0, 3.0, 1.0) is None      # unequal times


def test_zb_h2_formula_equals_the_simulator_with_and_without_the_flush():
    """ZB-H2 (K >= 2P-1) is a parallelogram: under a flush it idles
    (P-1) max(t_F, t_F + t_B - 2 t_W, t_B - t_F) per stage (no v = 1 schedule beats (P-1) t_F
    there), back to back (post-validation) (P-1) max(0, t_F + t_B - 2 t_W, t_B - t_F): the
    paper's zero at equal times. costs.pipeline equals labkit's simulator in both modes."""
    import random

    from labkit.costs.pipeline import schedule_bubble
    from labkit.pipeline import schedules
    from labkit.pipeline.simulate import simulate, steady_state

    rng = random.Random(0)
    times = [0.25, 0.5, 1.0, 1.5, 2.0, 3.0]
    for P in (2, 3, 4):
        for K in (2 * P - 1, 2 * P + 2, 16):
            s = schedules.make("zb-h2", P, K)
            for t_f, t_B, t_w in [(1.0, 1.0, 1.0)] + [tuple(rng.choice(times) for _ in "xyz")
                                                      for _ in range(4)]:
                t_b = t_B + t_w
                flushed = simulate(s, t_f, t_b, t_w=t_w).bubble
                assert schedule_bubble("zb-h2", P, K, 1, t_f, t_b, t_w) == pytest.approx(flushed)
                free = steady_state(s, t_f, t_b, t_w)["bubble"]
                f = schedule_bubble("zb-h2", P, K, 1, t_f, t_b, t_w, flush=False)
                assert f == pytest.approx(free, abs=1e-12), (P, K, t_f, t_B, t_w)
        assert schedule_bubble("zb-h2", P, 2 * P - 2, 1) is None    # below the paper's 2P-1


def test_flush_is_what_separates_zb_h2_from_zb_h1_at_equal_times():
    """At t_F = t_B = t_W and P=4, K=8: with the flush ZB-H1 and ZB-H2 both idle (P-1) t_F, the
    floor of any v = 1 schedule; back to back ZB-H2 (and ZB-V) reach zero, ZB-H1 and 1F1B do
    not (their last stage, resp. first, finishes last)."""
    from labkit.pipeline import schedules
    from labkit.pipeline.simulate import simulate, steady_state

    P, K = 4, 8
    got = {n: (simulate(schedules.make(n, P, K), 1.0, 2.0, t_w=1.0).bubble,
               steady_state(schedules.make(n, P, K), 1.0, 2.0, 1.0)["bubble"])
           for n in ("1f1b", "zb-h1", "zb-h2", "zb-v")}
    assert got["zb-h2"][0] == pytest.approx(got["zb-h1"][0]) == pytest.approx(3 / 27)
    assert got["zb-h2"][1] == pytest.approx(0.0) and got["zb-v"][1] == pytest.approx(0.0)
    assert got["zb-h1"][1] == pytest.approx(3 / 27) and got["1f1b"][1] == pytest.approx(9 / 33)
    for n in ("gpipe", "1f1b"):  # no gain without the flush: equal to the closed form
        for K in (2, 5, 8):
            assert steady_state(schedules.make(n, 3, K), 1.0, 2.0)["bubble"] == pytest.approx(
                2 / (K + 2))


def test_zero_bubble_peak_in_flight_formula_equals_the_simulator():
    from labkit.costs.pipeline import peak_in_flight
    from labkit.pipeline import schedules
    from labkit.pipeline.simulate import simulate

    for P in range(1, 7):
        for K in range(1, 20):
            for name in ("zb-h1", "zb-h2"):
                got = simulate(schedules.make(name, P, K)).peak_in_flight
                assert got == [peak_in_flight(name, P, K, p) for p in range(P)], (name, P, K)
