"""Chapter 10's exercises: the reference solutions score full marks, the stubs score zero, and
known-wrong answers lose points for the reason they are wrong (the hint says which)."""
import sys

import cloudpickle
import pytest
from grading_helpers import WrongAnswers, assert_case_fails, assert_reference_full_stub_zero

from labkit.check import ch10
from labkit.costs import activations, flops, models
from labkit.costs.plan_inputs import Config

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks get these by value


# ----------------------------------------------------------------------------- 10.1 reference
def estimate(config, job, cluster, *, alive=None, logits=True, bubble=True, overlap=True,
             gathered=True, layers_of=None, grad_bytes=None):
    spec, c = job.spec, config
    L, h, s, b = spec.n_layers, spec.hidden, job.seq_len, c.micro_batch
    K = job.global_batch // (c.dp * b)
    layers = (layers_of or (lambda L, p: -(-L // p)))(L, c.pp)
    psi = models.num_params(spec) / (c.tp * c.pp)
    states = (2 * psi / (c.dp if c.zero >= 3 else 1) + 2 * psi / (c.dp if c.zero >= 2 else 1)
              + 12 * psi / (c.dp if c.zero >= 1 else 1))
    per_layer = activations.layer_bytes(spec, seq_len=s, micro_batch=b, tp=c.tp,
                                        attention="flash")
    tail = activations.head_terms(spec, seq_len=s, micro_batch=b, tp=c.tp)
    fp32_logits = tail.pop("logits (fp32, kept by the loss)")
    memory = (states + layers * (alive or min)(K, c.pp) * per_layer
              + (fp32_logits if logits else 0)
              + sum(tail.values())
              + (2 * models.layer_params(spec) / c.tp if c.zero == 3 and gathered else 0))
    shape = (models.active_matmul_params(spec), L, h, s)
    f_model, f_hw = flops.model_flops_per_token(*shape), flops.hardware_flops_per_token(
        *shape, "none", "flash")
    compute = f_hw * b * s / (c.tp * c.pp) / (flops.peak_flops(cluster.gpu)
                                              * cluster.flop_efficiency)
    t_f = compute * (f_model / 3) / f_hw
    t_b = compute - t_f

    def link(spans):
        return ((cluster.inter_alpha, cluster.inter_bw) if spans
                else (cluster.intra_alpha, cluster.intra_bw))

    def ring(op, nbytes, n, spans):
        a, bw = link(spans)
        k = 2 if op == "all_reduce" else 1
        return k * (n - 1) * a + k * (n - 1) / n * nbytes / bw

    g, act = cluster.gpus_per_node, 2 * b * s * h
    tp_mb = layers * 4 * ring("all_reduce", act, c.tp, c.tp > g) if c.tp > 1 else 0.0
    t_f, t_b = t_f + tp_mb / 2, t_b + tp_mb / 2
    t_p2p = 0.0
    if c.pp > 1:
        a, bw = link(c.tp * c.dp >= g and cluster.n_gpus > g)
        t_p2p = a + act / bw
    step = (K + (c.pp - 1 if bubble else 0)) * (t_f + t_b) + 2 * (c.pp - 1) * t_p2p
    if c.dp > 1:
        spans = c.tp * c.dp > g
        gb = job.grad_reduce_bytes if grad_bytes is None else grad_bytes
        rs, ag = (ring("reduce_scatter", gb * psi, c.dp, spans),
                  ring("all_gather", 2 * psi, c.dp, spans))
        ov = cluster.overlap if overlap else 0.0

        def exposed(traffic, window):
            return traffic - ov * min(traffic, window)
        if c.zero == 0:
            step += exposed(2 * rs, t_b)
        elif c.zero in (1, 2):
            step += ((1 if c.zero == 1 else K) * exposed(rs, t_b)
                     + (exposed(ag, t_f) if job.overlap_param_gather else ag))
        else:
            step += K * (exposed(ag, t_f) + exposed(ag + rs, t_b))
    return {"memory": memory, "step_s": step}


def search(job, cluster, estimate, *, ignore_memory=False, zeros=(0, 1, 2, 3),
           micro_batches=(1, 2, 4, 8)):
    n, g = cluster.n_gpus, cluster.gpus_per_node
    best = None
    for tp in (t for t in (1, 2, 4, 8) if t <= g and n % t == 0 and job.spec.n_heads % t == 0):
        for pp in (p for p in range(1, n // tp + 1) if (n // tp) % p == 0
                   and p <= job.spec.n_layers):
            dp = n // (tp * pp)
            for zero in zeros:
                for mb in micro_batches:
                    if job.global_batch % (dp * mb):
                        continue
                    cfg = Config(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=mb)
                    est = estimate(cfg, job, cluster)
                    if (ignore_memory or est["memory"] <= cluster.usable) and (
                            best is None or est["step_s"] < best[0]):
                        best = (est["step_s"], cfg)
    return best[1]


# ----------------------------------------------------------------------------- 10.1 tests
wrong = WrongAnswers()   # 10.1's and 10.3's, tested at the end of the file


def _estimator(fn, case, monkeypatch):
    return ch10.estimator(fn)


def _hybrid_bytes(fn, case, monkeypatch):   # the cases up to the one that fails: fewer launches
    monkeypatch.setattr(ch10.hybrid_wire, "HYBRID_CASES", ch10.HYBRID_CASES[:case + 1])
    return ch10.hybrid_bytes(fn)


def _messages(res):
    return "\n".join(c["message"] for c in res.cases if not c["passed"])


def test_estimator_reference_full_stub_zero():
    assert_reference_full_stub_zero(ch10.estimator, estimate, 6, "10.1")


@wrong(_estimator, 0, "memory:")
def all_micro_batches_alive(config, job, cluster):      # GPipe's memory, not 1F1B's
    return estimate(config, job, cluster, alive=lambda K, P: K)


def _leaving_out(term):
    """The reference estimator without one of its terms (that flag False): named no_<term>."""
    def answer(config, job, cluster):
        return estimate(config, job, cluster, **{term: False})
    answer.__name__ = answer.__qualname__ = f"no_{term}"
    return answer


for _term, _case, _needle in [("logits", 2, "about the logits term: did you leave it out"),
                              ("bubble", 0, "about the bubble term: did you leave it out"),
                              ("overlap", 2, "about the DP not hidden term"),
                              ("gathered", 4, "about the ZeRO-3's gathered layer term")]:
    wrong(_estimator, _case, _needle)(_leaving_out(_term))


@wrong(_estimator, 1, "step_s: yours")
def bf16_gradient_reduction(config, job, cluster):       # the job reduces in fp32 (referee D1)
    return estimate(config, job, cluster, grad_bytes=2)


@wrong(_estimator, 6, "memory:")
def floor_layers(config, job, cluster):                 # 40 layers on 3 stages: 13, not 14
    return estimate(config, job, cluster, layers_of=lambda L, p: L // p)


@wrong(_estimator, 0, "write it from the formulas")
def with_the_planner(config, job, cluster):
    from labkit.costs import planner
    e = planner.evaluate(config, job, cluster)
    return {"memory": e.memory.total, "step_s": e.step_s}


def test_the_planner_is_refused_at_run_time_too():
    def sneaky(config, job, cluster):
        import labkit.costs as costs
        mod = getattr(costs, "plan" + "ner")
        e = getattr(mod, "eval" + "uate")(config, job, cluster)
        return {"memory": e.memory.total, "step_s": e.step_s}
    res = ch10.estimator(sneaky)
    assert res.score == 0 and "planner.evaluate was called" in _messages(res), res.table()


# ----------------------------------------------------------------------------- 10.2 tests
def test_search_reference_full_stub_zero():
    assert_reference_full_stub_zero(lambda fn: ch10.search_plans(fn, estimate), search, 3, "10.2")


def search_ignoring_memory(job, cluster, estimate):
    return search(job, cluster, estimate, ignore_memory=True)


def search_zero3_only(job, cluster, estimate):
    # ZeRO-3 and micro-batches of 2 only: on the hidden cluster ZeRO-0 at micro-batch 1 is
    # faster (with fp32 gradient reduction and ZeRO-1's gather charged after the step, ZeRO-3
    # is the best plan elsewhere, where DP is 1 and its stage costs nothing)
    return search(job, cluster, estimate, zeros=(3,), micro_batches=(2,))


def search_with_the_planner(job, cluster, estimate):
    from labkit.costs import planner
    return planner.plan(job, cluster)[0].config


@pytest.mark.parametrize("fn,needle", [
    (search_ignoring_memory, "GB are usable"),
    (search_zero3_only, "slower than the best found"),
    (search_with_the_planner, "search with your own estimator"),
])
def test_search_wrong_answers(fn, needle):
    res = ch10.search_plans(fn, estimate)
    assert res.score < res.points and needle in _messages(res), res.table()


# ----------------------------------------------------------------------------- 10.3
def predict(cfg, dp, tp, zero, rows, local_params, *, blocks_ar=4, ring=True, zero_factor=1.0,
            dp_phases=2, rows_of=None):
    act = (rows_of or rows) * cfg.block_size * cfg.n_embd * 4
    tp_share = 2 * (tp - 1) / tp if ring else float(tp > 1)
    dp_share = dp_phases * (dp - 1) / dp if ring else (1.0 if zero == 0 else 2.0)
    return (blocks_ar * cfg.n_layer * act * tp_share
            + zero_factor * dp_share * local_params * 4 * (dp > 1))


@wrong(_hybrid_bytes, 0, "how many all-reduces per block")
def tp_forward_only(*a):
    return predict(*a, blocks_ar=2)


@wrong(_hybrid_bytes, 1, "the payload")
def payload_not_wire(*a):
    return predict(*a, ring=False)


@wrong(_hybrid_bytes, 1, "1.5x is ZeRO-3's")
def zero1_as_zero3(*a):
    return predict(*a, zero_factor=1.5 if a[3] else 1.0)


@wrong(_hybrid_bytes, 0, "replica's")
def global_rows(cfg, dp, tp, zero, rows, local_params):   # every replica's rows
    return predict(cfg, dp, tp, zero, rows, local_params, rows_of=rows * dp)


@wrong(_hybrid_bytes, 0, "derive the bytes yourself")
def with_costs_parallel(cfg, dp, tp, zero, rows, local_params):
    from labkit.costs import parallel
    return sum(parallel.wire_bytes(cfg, dp=dp, tp=tp, zero=zero, batch=rows * dp).values())


def test_hybrid_bytes_reference_full():
    res = ch10.hybrid_bytes(predict)
    assert res.score == res.points == 3, res.table()


# ----------------------------------------------------------------------------- 10.1 and 10.3 wrong
@pytest.mark.parametrize("grade,fn,case,needle", wrong)
def test_wrong_answers(monkeypatch, grade, fn, case, needle):
    res = grade(fn, case, monkeypatch)
    assert_case_fails(res, case, needle)
    assert res.score < res.points
