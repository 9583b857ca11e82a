"""labkit.tp against the one-process reference (nn.Linear, labkit.model.GPT) on real Gloo
processes at TP = 2, 3 and 4: outputs and gradients, odd sizes, exact communication bytes."""
import pytest
from tp_pairs import grad_pairs, param_pairs

from labkit.check import ch04
from labkit.costs import tensor_parallel as tpc
from labkit.launch import run


def _make_col(gather=False):
    def make(linear, group):
        from labkit.tp import ColumnParallelLinear
        return ColumnParallelLinear.from_linear(linear, group, gather_output=gather)
    return make


def _make_row(parallel=True):
    def make(linear, group):
        from labkit.tp import RowParallelLinear
        return RowParallelLinear.from_linear(linear, group, input_is_parallel=parallel)
    return make


def _gpt_job(cfg_kwargs, batch, steps=2):
    """TP GPT vs one-process GPT: loss, every gradient, a step of SGD, and the comm log."""
    import torch
    import torch.distributed as dist

    from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus
    from labkit.observe import commlog
    from labkit.tp import apply_tp

    cfg = GPTConfig(**cfg_kwargs)
    ref, tp = GPT(cfg, seed=0), apply_tp(GPT(cfg, seed=0), None)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt_t = torch.optim.SGD(tp.parameters(), lr=0.5)
    tokens = tiny_corpus()
    out, logs = {}, []
    for step in range(steps):
        x, y = get_batch(tokens, batch, cfg.block_size, step)
        _, loss_r = ref(x, y)
        loss_r.backward()
        with commlog.record() as log:
            _, loss_t = tp(x, y)
            n_fwd = log.count("all_reduce")
            loss_t.backward()
        logs.append({"forward": n_fwd, "events": log.as_dicts()})
        out[f"step {step} loss"] = (loss_t.detach(), loss_r.detach())
        out.update(grad_pairs(tp, ref, f"step {step}"))
        opt_r.step(), opt_t.step(), opt_r.zero_grad(), opt_t.zero_grad()
    out.update(param_pairs(tp, ref, "param after steps"))
    return out, logs, dist.get_world_size()


def _all_cases(tp, cfg_kwargs):
    """Every layer-level and model-level comparison at one TP degree, in one launch."""
    import torch.distributed as dist

    from labkit.check.ch04 import linear_job, mlp_job

    a, b = 13 * tp, 17 * tp  # odd sizes that divide
    res = {
        "row": linear_job(_make_row(), "row", b, a),
        "row whole input": linear_job(_make_row(False), "row", b, a, parallel_input=False),
        "row no bias": linear_job(_make_row(), "row", b, a, bias=False),
        "column": linear_job(_make_col(), "column", a, b),
        "column gathered": linear_job(_make_col(True), "column", a, b, gather_output=True),
        "mlp": mlp_job(_make_row(), h=4 * tp),
    }
    res["gpt"] = _gpt_job(cfg_kwargs, batch=3)
    assert dist.get_world_size() == tp
    return res


CFGS = {
    2: dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16),
    3: dict(n_layer=1, n_head=6, n_kv_head=3, n_embd=24, block_size=16),
    4: dict(n_layer=1, n_head=8, n_kv_head=4, n_embd=32, block_size=16),
}


@pytest.fixture(scope="module", params=[2, 3, 4])
def tp_results(request):
    tp = request.param
    return tp, run(_all_cases, tp, args=(tp, CFGS[tp]), echo=False, timeout=120)


@pytest.mark.parametrize("case", ["row", "row whole input", "row no bias", "column",
                                  "column gathered", "mlp"])
def test_layers_match_nn_linear(tp_results, case):
    tp, results = tp_results
    ch04.assert_pairs([r[case] for r in results], what=f"TP={tp} {case}: ")


def test_gpt_matches_reference(tp_results):
    tp, results = tp_results
    ch04.assert_pairs([r["gpt"][0] for r in results], what=f"TP={tp} GPT: ", rtol=1e-4, atol=1e-5)


def test_communication_bytes_equal_formula(tp_results):
    """4 all-reduces per layer (2 forward, 2 backward), each exactly b*s*h fp32 elements."""
    tp, results = tp_results
    cfg = CFGS[tp]
    b, s, h, layers = 3, cfg["block_size"], cfg["n_embd"], cfg["n_layer"]
    for rank, r in enumerate(results):
        for log in r["gpt"][1]:
            events = log["events"]
            assert log["forward"] == layers * tpc.allreduces_per_layer("forward")
            assert len(events) == layers * tpc.allreduces_per_layer("both")
            assert all(e["op"] == "all_reduce" for e in events)
            assert {e["bytes"] for e in events} == {tpc.allreduce_bytes(b, s, h, 4)}, rank
            assert sum(e["bytes"] for e in events) == layers * tpc.layer_allreduce_bytes(b, s, h, 4)
            assert sum(e["where"] == "g forward" for e in events) == 2 * layers


def _replace_and_errors():
    """Parameters replaced after construction are used; bad sizes give errors naming numbers."""
    import torch
    import torch.nn as nn

    from labkit.model import GPT, GPTConfig
    from labkit.tp import ColumnParallelLinear, RowParallelLinear, apply_tp

    out = {}
    lin = nn.Linear(6, 4)
    row = RowParallelLinear.from_linear(lin, None)
    row.weight = nn.Parameter(torch.ones_like(row.weight))   # a user loading weights
    row.bias = nn.Parameter(torch.zeros(4))
    out["replaced"] = row(torch.ones(1, 1, 3)).detach()       # 2 ranks * 3 ones = 6
    col = ColumnParallelLinear.from_linear(lin, None)
    col.weight.data.zero_()
    out["replaced col"] = col(torch.ones(1, 1, 6)).detach() - col.bias.detach()
    errors = []
    for build in (lambda: ColumnParallelLinear(5, 7), lambda: RowParallelLinear(7, 5),
                  lambda: apply_tp(GPT(GPTConfig(n_head=3, n_embd=24)), None),
                  lambda: row(torch.ones(1, 1, 6))):
        try:
            build()
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    from labkit.model import MLP
    from labkit.tp import NaiveTensorParallelMLP

    torch.manual_seed(0)  # nn.Linear draws from the global generator: same weights on all ranks
    mlp = MLP(GPTConfig(n_embd=8, n_head=2))
    naive = NaiveTensorParallelMLP.from_mlp(mlp, None)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    mlp(x).square().sum().backward()
    naive(x2).square().sum().backward()
    out["naive"] = {"naive MLP input grad": (x2.grad, x.grad),
                    "naive MLP output": (naive(x2).detach(), mlp(x).detach())}
    return out


def test_replaced_parameters_and_clear_errors():
    import torch

    res = run(_replace_and_errors, 2, echo=False)
    for r in res:
        assert torch.equal(r["replaced"], torch.full((1, 1, 4), 6.0))
        assert torch.equal(r["replaced col"], torch.zeros(1, 1, 2))
        e = r["errors"]
        assert "out_features=7" in e[0] and "degree 2" in e[0]
        assert "in_features=7" in e[1]
        assert "n_head" in e[2] and "3" in e[2] and "degree 2" in e[2]
        assert "expected 3" in e[3]
    ch04.assert_pairs([r["naive"] for r in res])


def test_costs_formula():
    assert tpc.allreduce_elements(2, 8, 16) == 256
    assert tpc.layer_allreduce_bytes(2, 8, 16, 2) == 4 * 256 * 2
    assert tpc.layer_bytes_sent_per_rank(1, 1, 4, 4, 1) == 4 * 2 * 3 / 4 * 4
    assert tpc.weight_elements_per_layer(16) == 12 * 16 * 16
    with pytest.raises(ValueError, match="passes"):
        tpc.allreduces_per_layer("sideways")


def _operators_and_wrong_row():
    """labkit's f and g through the checker's jobs, and a wrong row layer (bias before g)."""
    import torch.nn.functional as F

    from labkit.check.ch04 import f_job, g_job, linear_job
    from labkit.tp import RowParallelLinear, f, g

    class BiasTooEarly(RowParallelLinear):
        def forward(self, x):
            return g(F.linear(x, self.weight, self.bias), self.group)

    def wrong(linear, group):
        return BiasTooEarly.from_linear(linear, group)

    return {"f": f_job(f), "g": g_job(g), "wrong": linear_job(wrong, "row", 9, 6),
            "bad f": f_job(lambda x, group: x.detach())}


def test_operators_and_checker_hints():
    from labkit.check import ch04

    res = run(_operators_and_wrong_row, 3, echo=False)
    ch04.assert_pairs([r["f"] for r in res])
    ch04.assert_pairs([r["g"] for r in res])
    with pytest.raises(AssertionError, match="bias once, after the all-reduce"):
        ch04._hint_bias([r["wrong"] for r in res], 3)
    with pytest.raises(AssertionError, match="autograd graph"):
        ch04.assert_pairs([r["bad f"] for r in res])


def test_alpha_beta_prediction_and_views():
    """No processes: TP scales worse on InfiniBand than on NVLink; the views build from costs."""
    from labkit.costs import comm
    from labkit.widgets import tp as view

    nv = dict(tpc.tp_speedup(1, 4096, 8192, (2, 8), comm.LINKS["NVLink 4 (H100 SXM)"], 400e12))
    ib = dict(tpc.tp_speedup(1, 4096, 8192, (2, 8), comm.LINKS["InfiniBand NDR 400 Gb/s"], 400e12))
    assert 1 < ib[8] < nv[8] < 8 and ib[2] < nv[2] < 2
    t = tpc.layer_time(1, 2048, 12288, 8, comm.LINKS["NVLink 4 (H100 SXM)"], 400e12)
    assert t["total"] == pytest.approx(t["compute"] + t["comm"])
    assert len(view.scaling_figure(1, 256, 512, tps=(1, 2)).data) == 3
    rows = [{"tp": 2, "phase": "forward", "measured_bytes": 8, "predicted_bytes": 8}]
    assert len(view.bytes_figure(rows).data) == 2
    wire = [{"tp": 2, "sent": 110, "predicted": 100}, {"tp": 4, "sent": None, "predicted": 150}]
    bars, marks = view.wire_figure(wire).data          # a row the kernel could not count: left out
    assert list(bars.y) == [110] and list(marks.y) == [100]
    view.split_picture(3)


# ----------------------------------------------------------------------------- GPU-readiness
def _tp_on_the_model_device(cfg_kwargs):
    """The TP GPT's forward, backward and gathers with torch's default device set to "meta"
    (tests/devicecheck.py): a tensor made without device= would be meta and break them. Then
    the lab's and benchmark's rank functions, watched for factory calls without device=."""
    import torch.distributed as dist
    from devicecheck import RANK_SIDE, ImplicitDevice, default_device

    from labkit.labs.tp.measure import comm_job, time_job, train_side_by_side
    from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus
    from labkit.tp import apply_tp, gather_tp_grads, gather_tp_state

    cfg = GPTConfig(**cfg_kwargs)
    ref, tp = GPT(cfg, seed=0), apply_tp(GPT(cfg, seed=0), None)
    x, y = get_batch(tiny_corpus(), 3, cfg.block_size, 0)
    ref(x, y)[1].backward()
    with default_device("meta"):
        _, loss = tp(x, y)
        loss.backward()
        grads, state = gather_tp_grads(tp), gather_tp_state(tp)
    diff = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
    devices = {str(t.device) for t in list(grads.values()) + list(state.values())}
    with ImplicitDevice(RANK_SIDE) as mode:
        lab = train_side_by_side(cfg_kwargs, 1, 2)
        h, heads = cfg.n_embd, cfg.n_head
        comm_job(h, 8, 2, heads, "naive mlp")
        time_job(("mlp", "block"), h, 8, 2, heads, repeats=1, warmup=0)
    return {"diff": diff, "devices": devices, "calls": mode.calls,
            "ran_on": (lab["backend"], lab["device"]), "world": dist.get_world_size()}


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_makes_its_tensors_on_the_model_device(tp):
    cfg = dict(n_layer=1, n_head=2 * tp, n_embd=8 * tp, block_size=8)
    for res in run(_tp_on_the_model_device, tp, args=(cfg,), echo=False, timeout=120):
        assert res["devices"] == {"cpu"} and res["diff"] < 1e-5, res
        assert res["calls"] == [], f"tensors made without device=: {res['calls']}"
        assert res["ran_on"] == ("gloo", "cpu") and res["world"] == tp


def test_tp_bytes_counted_by_the_kernel_match_the_ring_formula():
    """One TP forward + backward at tp=2 and 4: the bytes each rank's sockets sent, counted by the
    kernel (observe.netcount), are labkit.costs' n_layer * 4 * 2(tp-1)/tp * b*s*h*4 plus Gloo's
    message headers (under 300 bytes per ring step); the comm log saw exactly the 4 per layer."""
    from labkit.labs.tp.measure import count_wire

    for r in count_wire(tps=(2, 4), repeats=1):
        assert r["all_reduces"] == 4 * r["n_layer"] and r["other_calls"] == 0
        assert r["sent"] is not None, r["reason"]
        steps = r["all_reduces"] * 2 * (r["tp"] - 1)
        assert r["predicted"] <= r["sent"] <= r["predicted"] + 300 * steps, r
