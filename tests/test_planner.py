"""costs.planner: the notes' worked examples, the search's rules, and its arithmetic."""
import pytest

from labkit.costs import memory, pipeline, planner

GB = 1e9
A100_256 = planner.Cluster(256, 8, "A100 80GB")
GPT3 = planner.Job("gpt3-175b", global_batch=1536, seq_len=2048, recipe="mixed")
A100_128 = planner.Cluster(128, 8, "A100 80GB")
LLAMA70 = planner.Job("llama2-70b", global_batch=1024, seq_len=4096, recipe="mixed")


def test_notes_175b_states_per_gpu_12_and_16_byte_recipes():
    # TP 8 x PP 4 x DP 8, ZeRO-2, Psi = 175e9 exactly as the notes count
    kw = dict(zero_stage=2, dp=8, tp=8, pp=4)
    assert memory.model_states(175e9, recipe="no_master", **kw).total / GB == pytest.approx(17.77, abs=0.01)
    assert memory.model_states(175e9, recipe="mixed", **kw).total / GB == pytest.approx(20.51, abs=0.01)
    # the preset's exact count (174.6B) through the planner gives the same to within 0.5%
    for recipe, want in (("no_master", 17.77), ("mixed", 20.51)):
        job = planner.Job("gpt3-175b", global_batch=1536, seq_len=2048, recipe=recipe)
        est = planner.evaluate(planner.Config(8, 4, 8, zero=2), job, A100_256)
        states = est.memory.params + est.memory.grads + est.memory.optimizer
        assert states / GB == pytest.approx(want, rel=5e-3) and est.fits


def test_notes_configurations_are_feasible_and_found():
    ranked = planner.plan(GPT3, A100_256)
    assert planner.rank_of(planner.Config(8, 4, 8, zero=2), ranked) is not None
    ranked70 = planner.plan(LLAMA70, A100_128)
    for zero in (1, 2):
        assert planner.rank_of(planner.Config(8, 4, 4, zero=zero), ranked70) is not None


def test_where_the_notes_go_astray():
    # "each GPU stores 1/(N_tp * N_dp) of the model": without ZeRO, DP divides nothing
    a = memory.model_states(70e9, recipe="mixed", dp=1, tp=8, pp=4).total
    b = memory.model_states(70e9, recipe="mixed", dp=4, tp=8, pp=4).total
    assert a == b == 16 * 70e9 / 32
    # "ZeRO-3: 105 GB across 8 GPUs, ~13 GB per GPU": 105 GB is already per GPU
    assert memory.model_states(70e9, recipe="no_master", zero_stage=3, dp=8).total == pytest.approx(105e9)


def test_zero2_pays_a_reduce_scatter_per_micro_batch_zero1_does_not():
    few = planner.Job("gpt3-175b", global_batch=256, seq_len=2048)
    c1, c2 = planner.Config(8, 4, 8, zero=1), planner.Config(8, 4, 8, zero=2)
    t1 = [planner.evaluate(c1, j, A100_256).dp_comm_s for j in (few, GPT3)]
    t2 = [planner.evaluate(c2, j, A100_256).dp_comm_s for j in (few, GPT3)]
    assert t1[0] == pytest.approx(t1[1])            # once per step, whatever K
    assert t2[1] > 4 * t2[0]                        # K grows 6x: 32 -> 192 micro-batches


def test_estimate_arithmetic():
    est = planner.evaluate(planner.Config(8, 4, 8, zero=1, micro_batch=2), GPT3, A100_256)
    assert est.K == 1536 // (8 * 2)
    assert est.bubble == pipeline.bubble_fraction(4, est.K)
    assert est.memory.total == pytest.approx(memory.plan(
        "gpt3-175b", recipe="mixed", zero_stage=1, dp=8, tp=8, pp=4, seq_len=2048, micro_batch=2,
        recompute="selective", sequence_parallel=True, microbatches_alive=4).total)
    assert est.step_s > est.compute_s * est.K      # the bubble and exposed traffic only add


def test_search_follows_the_rules_and_ranks():
    ranked = planner.plan(GPT3, A100_256)
    assert ranked and all(e.fits for e in ranked)
    assert all(e.config.tp <= 8 for e in ranked)                       # TP inside a node
    assert [e.step_s for e in ranked] == sorted(e.step_s for e in ranked)
    every = planner.plan(GPT3, A100_256, include_unfit=True)
    assert any(not e.fits for e in every)          # e.g. TP1 x PP1: 175B does not fit one GPU
    _, skipped = planner.candidates(GPT3, A100_256)
    assert skipped["TP larger than a node (TP stays on the fast links)"] > 0
    why = "\n".join(planner.reasons(ranked[0], GPT3, A100_256))
    assert "inside a node" in why and "DP=" in why


def test_bad_input_names_the_numbers():
    with pytest.raises(ValueError, match=r"8 x 4 x 4 = 128.*256"):
        planner.evaluate(planner.Config(8, 4, 4), GPT3, A100_256)
    with pytest.raises(ValueError, match="multiple of 8"):
        planner.Cluster(12, 8)


# ----------------------------------------------------------------------------- chapter 07 checkers
def _rules_of_thumb(job, cluster):
    """ZeRO only as far as memory needs, TP inside a node before PP, micro-batch 1."""
    n, g = cluster.n_gpus, cluster.gpus_per_node
    for zero in (1, 2, 3):
        for tp in (t for t in (1, 2, 4, 8) if t <= g and n % t == 0):
            for pp in (d for d in range(1, n // tp + 1) if (n // tp) % d == 0):
                dp = n // (tp * pp)
                if dp == 1 or job.global_batch % dp or job.global_batch // dp < pp:
                    continue
                c = planner.Config(tp, pp, dp, zero, 1)
                if planner.evaluate(c, job, cluster).fits:
                    return c


def test_ch07_judge_accepts_sound_plans_and_says_why_others_fail():
    from labkit.check import ch07

    for job, cluster in ch07.SCENARIOS.values():
        ch07.judge(_rules_of_thumb(job, cluster), job, cluster)
        ch07.judge(planner.plan(job, cluster)[0].config, job, cluster)
    ch07.judge(planner.Config(8, 4, 4, zero=1), LLAMA70, A100_128)        # the notes' 70B plan
    with pytest.raises(AssertionError, match="slower than the best"):
        ch07.judge(planner.Config(8, 4, 8, zero=2), GPT3, A100_256)       # ZeRO-2 x K=192 RS
    with pytest.raises(AssertionError, match="usable"):
        ch07.judge(planner.Config(2, 1, 128, zero=0), GPT3, A100_256)
    with pytest.raises(AssertionError, match="product is 256"):
        ch07.judge(planner.Config(8, 4, 4, zero=1), GPT3, A100_256)
    with pytest.raises(AssertionError, match="spans nodes"):
        ch07.judge(planner.Config(16, 4, 4, zero=1), GPT3, A100_256)


def test_widgets_draw_what_the_planner_computes():
    from labkit.topology import Topology
    from labkit.widgets import intro
    from labkit.widgets import planner as pw

    ranked = planner.plan(GPT3, A100_256)[:5]
    fig = pw.ranked_figure(ranked, A100_256)
    parts = [t for t in fig.data if t.xaxis == "x"]          # the time panel
    for i, e in enumerate(ranked[::-1]):                     # bars are drawn bottom-up
        assert sum(t.x[i] for t in parts) == pytest.approx(e.step_s)
    mesh = pw.mesh_figure(Topology(16, dp=2, tp=4, pp=2, gpus_per_node=8))
    assert len(mesh.data[0].z) == 2 and mesh.data[0].text[1][5] == "r13<br>dp1 tp1"
    rows = intro.state_rows("llama2-7b", "mixed")
    assert rows["total"] == pytest.approx(16 * 6_738_415_616 / 1e9)
    assert pw.planner() is not None and intro.calculator() is not None
