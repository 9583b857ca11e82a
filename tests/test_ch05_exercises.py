"""Chapter 05's exercises 5.3 and 5.4: the reference solutions score full marks, and known-wrong
answers lose points for the reason they are wrong (the hint says which). 5.1 and 5.2's checks
on known-wrong orders are in tests/test_pipeline.py (assert_1f1b_schedule, assert_zb_h1_schedule).

To stay quick, 5.3 runs its P = 2 launch only (1F1B K=3 and ZB-H2 K=4 on 7 rows) and 5.4 its
cases on paper; the full checkers run in the solution notebook (tests/test_exercises.py)."""
import sys

import cloudpickle
import torch
import torch.distributed as dist

from labkit.check import ch05
from labkit.check.ch05.stage import observe as ch05_stage

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks get these functions by value


# ----------------------------------------------------------------------------- 5.3 reference
def run_stage(actions, stage_module, micro_batches, targets, group, *, defer_w=True,
              keep_all=False, w_recomputes_b=False, grad_scale=1.0):
    """The solution notebook's run_stage, with switches that make the known mistakes."""
    stage, P = dist.get_rank(group), dist.get_world_size(group)
    prev = dist.get_global_rank(group, stage - 1) if stage > 0 else None
    nxt = dist.get_global_rank(group, stage + 1) if stage < P - 1 else None
    split = any(a.kind == "W" for a in actions)
    weights = [p for p in stage_module.parameters() if p.requires_grad]
    inputs, outputs, grads_out, sends, kept = {}, {}, {}, [], []
    loss_sum = 0.0

    def receive(k, src):
        buf = torch.empty(*micro_batches[k].shape, stage_module.hidden,
                          device=micro_batches[k].device)                 # (B_k, T, h)
        dist.recv(buf, src=src, group=group)
        return buf

    def send(t, dst):
        sends.append(dist.isend(t.contiguous(), dst=dst, group=group))

    for a in actions:
        k = a.mb
        if a.kind == "F":
            x = micro_batches[k] if stage_module.first else receive(k, prev).requires_grad_()
            if stage_module.last:
                out = stage_module(x, targets[k])
                loss_sum += out.item()
            else:
                out = stage_module(x)
                send(out.detach(), nxt)
            inputs[k], outputs[k] = x, out
            if keep_all:
                kept.append(out)            # mistake: with retain_graph, the graph never goes
        elif a.kind == "B":
            x, out = inputs[k], outputs[k]
            g = torch.ones_like(out) * grad_scale if stage_module.last else receive(k, nxt)
            if not split or not defer_w:
                torch.autograd.backward(out, g, retain_graph=keep_all)
                if prev is not None:
                    send(x.grad, prev)
                del inputs[k], outputs[k]
            else:
                if prev is not None:
                    (gx,) = torch.autograd.grad(out, x, g, retain_graph=True)
                    send(gx, prev)
                grads_out[k] = g
        elif defer_w:
            del inputs[k]
            torch.autograd.backward(outputs.pop(k), grads_out.pop(k), retain_graph=keep_all,
                                    inputs=None if w_recomputes_b else weights)
    for work in sends:
        work.wait()
    return loss_sum if stage_module.last else None


def _no_deferral(*args):
    """Runs every backward whole at B, W does nothing: right gradients, ZB's order lost."""
    return run_stage(*args, defer_w=False)


def _keeps_everything(*args):
    """Keeps every output and retains every graph to the end: GPipe's memory."""
    return run_stage(*args, keep_all=True)


def _w_recomputes_b(*args):
    """W runs the whole backward again: the input gradient is made twice."""
    return run_stage(*args, w_recomputes_b=True)


def _averages_twice(*args):
    """Divides the loss gradient by K again (the losses are already a share of the batch)."""
    return run_stage(*args, grad_scale=1.0 / len(args[2]))


def _all_reduce_loss(actions, stage_module, micro_batches, targets, group):
    """Shares the loss with an all-reduce: a collective where only neighbours should talk."""
    loss = run_stage(actions, stage_module, micro_batches, targets, group)
    t = torch.tensor([loss or 0.0])
    dist.all_reduce(t, group=group)
    return loss


def _hidden_all_reduce(actions, stage_module, micro_batches, targets, group):
    """The same collective, out of the source reader's sight: the observer on the ranks stops it."""
    loss = run_stage(actions, stage_module, micro_batches, targets, group)
    getattr(dist, "all_" + "reduce")(torch.zeros(1), group=group)
    return loss


def _labkit_executor(actions, stage_module, micro_batches, targets, group):
    """Calls labkit's own executor."""
    from labkit.pipeline.executor import run_schedule
    return run_schedule(actions, stage_module, micro_batches, targets)


def _failures(result) -> str:
    return "\n".join(c["message"] for c in result.cases if not c["passed"])


def test_5_3_reference_scores_full_marks():
    r = ch05.pipeline_stage(run_stage, Ps=[2])
    assert r.passed, _failures(r)


def test_5_3_known_wrong_answers_fail_for_their_reason():
    r = ch05.pipeline_stage(_no_deferral, Ps=[2])
    assert not r.passed and "weight gradient (W)" in _failures(r)
    assert all(c["passed"] for c in r.cases if "reference" in c["name"])   # the numbers are right

    r = ch05.pipeline_stage(_keeps_everything, Ps=[2])
    assert not r.passed and "saved for backward were alive at once" in _failures(r)

    r = ch05.pipeline_stage(_w_recomputes_b, Ps=[2])
    assert not r.passed and "input gradient (B)" in _failures(r)

    r = ch05.pipeline_stage(_averages_twice, Ps=[2])
    assert not r.passed and "gradient of" in _failures(r)


def test_5_3_collectives_and_labkit_are_refused():
    r = ch05.pipeline_stage(_all_reduce_loss, Ps=[2])
    assert r.score == 0 and "dist.all_reduce" in _failures(r)
    r = ch05.pipeline_stage(_hidden_all_reduce, Ps=[2])
    assert not r.passed and "dist.all_reduce called while run_stage ran" in _failures(r)
    r = ch05.pipeline_stage(_labkit_executor, Ps=[2])
    assert r.score == 0 and "labkit.pipeline" in _failures(r)


def test_expected_order_and_peak_of_a_split_schedule():
    from labkit.pipeline import schedules

    s = schedules.make("zb-h1", 2, 3)
    # W(i) after B(i+1)
    assert "".join(ch05_stage.expected_order(s.stages[1], first=False)) == "FBFBWFBWW"
    assert "".join(ch05_stage.expected_order(s.stages[0], first=True)).count("B") == 0
    assert ch05_stage.expected_peak(s.stages[0], [10, 20, 30]) == 50        # F0 F1 held, then F1 F2
    assert ch05_stage.fused_pairs(["F", "W", "B", "F"]) == ["F", "B", "W", "F"]


# ----------------------------------------------------------------------------- 5.4 reference
def predict(schedule, P, K, t_f, t_b, t_w, act_bytes, *, no_flush=False, gpipe_memory=False,
            bubble_of_work=False, w_frees=False):
    t_B, t_W = t_b - t_w, t_w
    if schedule == "zb-h1":
        idle, held = (P - 1) * max(0.0, t_f + t_B - t_W), [min(K, P)] * P
        if w_frees:
            held = [min(K, P - p) for p in range(P)]              # mistake: as if B freed them
    elif schedule == "zb-h2":
        idle = (P - 1) * max(0.0 if no_flush else t_f, t_f + t_B - 2 * t_W, t_B - t_f)
        held = [min(K, 2 * P - 1)] * P
    else:
        idle = (P - 1) * (t_f + t_b)
        held = [K] * P if schedule == "gpipe" or gpipe_memory else [min(K, P - p) for p in range(P)]
    work = K * (t_f + t_b)
    bubble = idle / work if bubble_of_work else idle / (work + idle)
    return {"bubble": bubble, "peak_bytes": [n * b for n, b in zip(held, act_bytes)]}


def _uses_costs(schedule, P, K, t_f, t_b, t_w, act_bytes):
    from labkit import costs
    return {"bubble": costs.pipeline.schedule_bubble(schedule, P, K, 1, t_f, t_b, t_w),
            "peak_bytes": [costs.pipeline.peak_in_flight(schedule, P, K, p) * b
                           for p, b in enumerate(act_bytes)]}


def test_5_4_reference_scores_full_marks_on_paper():
    r = ch05.predict_then_measure(predict, run=False)
    assert r.passed, _failures(r)


def test_5_4_known_wrong_answers_fail_for_their_reason():
    def fails(msg, **mistake):
        r = ch05.predict_then_measure(lambda *a: predict(*a, **mistake), run=False)
        assert not r.passed and msg in _failures(r), (mistake, _failures(r))
        return r

    r = fails("flush", no_flush=True)                    # the paper's zero, without the flush
    assert [c["passed"] for c in r.cases if "zb-h2" in c["name"]] == [False, False]
    assert all(c["passed"] for c in r.cases if "zb-h2" not in c["name"])
    fails("stage 0 holds", gpipe_memory=True)            # 1F1B holding K, not P - p
    fails("labkit's simulator gives", bubble_of_work=True)   # idle / work: the Megatron ratio
    fails("stage 1 holds", w_frees=True)                 # ZB-H1 forgetting W holds activations
    r = ch05.predict_then_measure(_uses_costs, run=False)
    assert r.score == 0 and "labkit.costs" in _failures(r)
