"""Chapter 07's checkers, lab and calculators: the reference solutions score full marks, known-wrong
answers score less (each for the reason it is wrong), and `labkit run context` prints measured
activation bytes equal to the formula and parallel runs equal to the reference."""
import sys

import cloudpickle
import pytest
import torch

from labkit.check import ch07

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks get these functions by value


# ----------------------------------------------------------------------------- reference answers
def merge(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)                                 # (B, H, T)
    w1 = torch.exp(lse1 - lse).nan_to_num(0.0).unsqueeze(-1)          # -inf - -inf: no keys
    w2 = torch.exp(lse2 - lse).nan_to_num(0.0).unsqueeze(-1)
    return w1 * out1 + w2 * out2, lse


def merge_naive_exp(out1, lse1, out2, lse2):                          # overflows: exp(100) in fp32
    s1, s2 = torch.exp(lse1), torch.exp(lse2)
    lse = torch.log(s1 + s2)
    return (s1.unsqueeze(-1) * out1 + s2.unsqueeze(-1) * out2) / (s1 + s2).unsqueeze(-1), lse


def merge_average(out1, lse1, out2, lse2):
    return (out1 + out2) / 2, torch.maximum(lse1, lse2)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter(dy, ctx.group), None


def _reduce_scatter(t, group):
    import torch.distributed as dist
    n = dist.get_world_size(group)
    out = torch.empty_like(t.chunk(n, dim=1)[0]).contiguous()
    dist.reduce_scatter(out, [c.contiguous() for c in t.chunk(n, dim=1)], group=group)
    return out


def _all_gather(t, group):
    import torch.distributed as dist
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather(dy, ctx.group), None


class _GatherSliceBack(_Gather):                                       # forgets to sum over ranks
    @staticmethod
    def backward(ctx, dy):
        import torch.distributed as dist
        r, n = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return dy.chunk(n, dim=1)[r].contiguous(), None


def sp_gather(x, group):
    return _Gather.apply(x, group)


def sp_reduce_scatter(x, group):
    return _ReduceScatter.apply(x, group)


def sp_gather_wrong(x, group):
    return _GatherSliceBack.apply(x, group)


# ----------------------------------------------------------------------------- the checkers
def test_merge_reference_scores_full_and_wrong_answers_less():
    assert ch07.merge(merge).score == 3
    naive = ch07.merge(merge_naive_exp)
    assert naive.score < 3 and any("exp(0)" in c["message"] for c in naive.cases)
    avg = ch07.merge(merge_average)
    assert avg.score < 3 and not avg.cases[0]["passed"]


def test_sp_pair_reference_scores_full_and_slicing_backward_fails():
    assert ch07.sp_pair(sp_gather, sp_reduce_scatter).score == 3
    assert ch07.sp_pair(sp_gather).score == 3                           # the notebook's call
    wrong = ch07.sp_pair(sp_gather_wrong)
    assert wrong.score == 0 and "gather_grad" in wrong.cases[0]["message"]
    swapped = ch07.sp_pair(sp_gather, sp_gather)                       # not a reduce-scatter
    assert swapped.score == 0


def test_unimplemented_stub_scores_zero():
    def stub(*a):
        raise NotImplementedError("Exercise 7.1: merge")
    assert ch07.merge(stub).score == 0          # 7.3 and 7.4: tests/test_ch07_exercises.py


# ----------------------------------------------------------------------------- the lab
def test_lab_activation_bytes_equal_formula_and_runs_equal_reference(capsys):
    from labkit.labs import context

    rows = context.activation_rows(dict(n_layer=2, n_embd=32, n_head=4, block_size=16), 2, 2)
    assert {r["case"] for r in rows} >= {"none", "TP", "TP + SP", "selective", "full"}
    for r in rows:
        assert r["measured"] == r["predicted"], r
    by = {r["case"]: r["measured"] for r in rows}
    assert by["TP + SP"] * 2 == by["none"] and by["full"] < by["selective"] < by["none"]
    assert by["TP + SP"] < by["TP"] < by["none"]


@pytest.mark.parametrize("argv,needle", [
    (["--cp", "3", "--seq", "32"], "2*cp = 6"),
    (["--tp", "3", "--seq", "32", "--cp", "1"], "--tp 3 must divide"),
    (["--tp", "0"], "--tp: must be 1 or more")])
def test_lab_bad_input_is_one_line_exit_2(argv, needle):
    import subprocess

    p = subprocess.run([sys.executable, "-m", "labkit", "run", "context", *argv],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-500:])
    assert needle in p.stderr and "Traceback" not in p.stderr, p.stderr


# ----------------------------------------------------------------------------- calculators
def test_calculators_build_and_agree_with_costs():
    from labkit.costs import context as cc
    from labkit.widgets import context as view

    fig = view.activation_figure(s=4096, b=1, h=4096, a=32, tp=4, cp=2)
    total = sum(sum(t.y) for t in fig.data)
    want = sum(cc.activation_bytes(4096, 1, 4096, 32, tp=4, sp=sp, cp=2, recompute=rc)
               for sp, rc in view.BARS)
    assert abs(total - want / 1e9) < 1e-6 * want / 1e9
    comm = view.comm_figure(b=1, s=8192, h=4096, kv=1024, degrees=(2, 4, 8))
    assert len(comm.data) == 4
    view.activation_calculator(), view.comm_calculator()
