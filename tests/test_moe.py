"""labkit.moe: routing, capacity, balancing, and expert parallelism against the one-process MoE."""
import pytest
import torch

from labkit.labs.parallel.compare import differences
from labkit.labs.parallel.job import train
from labkit.launch import run
from labkit.model import GPT, MLP, GPTConfig, get_batch, tiny_corpus
from labkit.moe import router as R
from labkit.parallel import Plan, PlanError, check_plan
from labkit.reference import reference_train

MOE = dict(n_layer=2, n_embd=32, n_head=4, block_size=16, n_expert=4, expert_top_k=2,
           capacity_factor=1.0, aux_loss_coef=0.01, expert_ffn_mult=2)


# ----------------------------------------------------------------------------- routing
def test_capacity_keeps_first_choices_before_second_choices():
    expert = torch.tensor([[0, 1], [0, 1], [1, 0]])       # 3 tokens, top-2
    kept = R.keep_within_capacity(expert, 2, cap=2)
    # expert 0: first choices of tokens 0, 1 fill it; token 2's second choice is dropped
    # expert 1: token 2's first choice, then token 0's second; token 1's second is dropped
    assert kept.tolist() == [[True, True], [True, False], [True, False]]
    assert R.capacity(10, 2, 4, 1.25) == 7 and R.capacity(10, 2, 4, None) is None


def test_gates_weights_and_switch_loss():
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    for gate in R.GATES:
        r = R.route(logits, k=2, gate=gate)
        assert torch.allclose(r.weight.sum(-1), torch.ones(64))   # renormalised over the k
        assert r.load.sum() == 128
    uniform = R.route(torch.zeros(8, 4), k=1)                      # every expert equally likely
    uniform.load = torch.full((4,), 2)                             # and equally loaded
    assert R.switch_loss(uniform, 4).item() == pytest.approx(1.0)


def test_loss_free_bias_raises_underloaded_experts():
    bias = torch.zeros(3)
    R.bias_update(bias, torch.tensor([10, 1, 4]), rate=0.1)
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.1])
    logits = torch.tensor([[1.0, 0.9]])
    r = R.route(logits, 1, bias=torch.tensor([0.0, 0.5]))
    assert r.expert.item() == 1                           # the bias chose expert 1 ...
    assert r.weight.item() == pytest.approx(torch.softmax(logits, -1)[0, 1].item())  # not weighed


def test_one_expert_top_1_is_the_dense_mlp():
    cfg = GPTConfig(n_layer=1, n_embd=16, n_head=2, n_expert=1, expert_top_k=1)
    moe = GPT(cfg).blocks[0].mlp
    x = torch.randn(2, 5, 16)
    dense = MLP(cfg)
    dense.load_state_dict(moe.experts[0].state_dict())
    assert torch.allclose(moe(x), dense(x), atol=1e-6)


def test_dense_model_is_unchanged_by_the_moe_options():
    torch.manual_seed(0)
    a = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4))
    b = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, capacity_factor=2.0, gate="sigmoid"))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_capacity_drops_tokens_and_the_drops_are_counted():
    model = GPT(GPTConfig(**MOE))
    x, y = get_batch(tiny_corpus(), 5, 16, 0)
    model(x, y)
    stats = model.blocks[0].mlp.stats
    assert stats["dropped"] > 0 and stats["load"].sum() == stats["assignments"] == 5 * 16 * 2


@pytest.mark.parametrize("kw,words", [
    (dict(n_expert=2, expert_top_k=3), ["expert_top_k=3", "n_expert=2"]),
    (dict(n_expert=4, capacity_factor=0.0), ["capacity_factor=0.0", "drop every token"]),
])
def test_bad_moe_configs_say_what_to_change(kw, words):
    with pytest.raises(ValueError) as err:
        GPTConfig(**kw)
    assert all(w in str(err.value) for w in words)


@pytest.mark.parametrize("plan,kw,words", [
    (Plan(dp=2, ep=3), {}, ["ep=3 must divide dp=2"]),
    (Plan(dp=3, ep=3), {}, ["ep=3 does not divide n_expert=4"]),
    (Plan(dp=2, ep=2), dict(n_expert=0), ["no experts"]),
    (Plan(dp=2, ep=2, zero=3), {}, ["ZeRO-3 with ep > 1"]),
])
def test_bad_expert_plans_are_refused_before_launch(plan, kw, words):
    with pytest.raises(PlanError) as err:
        check_plan(plan, GPTConfig(**{**MOE, **kw}), world=plan.world, batch_size=8)
    assert all(w in str(err.value) for w in words), str(err.value)


# ----------------------------------------------------------------------------- expert parallelism
@pytest.mark.parametrize("plan,extra,batch", [
    (Plan(dp=2, ep=2), {}, 5),                                   # rows 3 + 2: uneven tokens
    (Plan(dp=4, ep=4), {}, 5),                                   # rows 2+1+1+1, one expert each
    (Plan(dp=4, ep=2, zero=1), dict(gate="sigmoid", shared_expert=True, aux_loss_coef=0.0,
                                    bias_update_rate=0.01), 6),  # EP x DP, ZeRO-1 outside
    (Plan(dp=2, tp=2, ep=2), {}, 5),                             # EP x TP
    (Plan(dp=2), {}, 5),                                         # MoE under plain DP
    (Plan(dp=2, pp=2, ep=2), dict(aux_loss_coef=0.0, bias_update_rate=0.01), 5),  # EP x PP
], ids=lambda v: v.describe() if isinstance(v, Plan) else None)
def test_expert_parallel_equals_one_process(plan, extra, batch):
    cfg = {**MOE, **extra}
    results = run(train, plan.world, args=(plan, cfg, 3, batch, "sgd"), echo=False)
    ref = reference_train(GPTConfig(**cfg), 3, batch, "sgd",
                          capacity_rows=plan.capacity_rows(batch))
    diffs = differences(results, ref, "sgd")
    assert all(d["ok"] for d in diffs), diffs
    if plan.ep > 1:   # the all-to-alls ran and were logged along ep
        assert all(r["comm"]["ep"]["bytes"] > 0 for r in results)
