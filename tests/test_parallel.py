"""labkit.parallel: every composition of dp, tp, pp (and ZeRO over dp) equals the one-process GPT
on the loss, the first step's gradients and the parameters after several steps; breaking any one
dimension on purpose is caught; bytes per dimension equal labkit.costs.parallel."""
import pytest

from labkit.ddp import assign_buckets
from labkit.labs.parallel.compare import bytes_rows, differences
from labkit.labs.parallel.job import train
from labkit.launch import run
from labkit.model import GPT, GPTConfig
from labkit.parallel import Plan, PlanError, check_plan
from labkit.reference import reference_train

CFG = dict(n_layer=4, n_embd=32, n_head=4, block_size=16)
STEPS = 3


def _run(plan, batch, optim="adamw", fn=train, args=()):
    results = run(fn, plan.world, args=args + (plan, CFG, STEPS, batch, optim), echo=False)
    ref = reference_train(GPTConfig(**CFG), STEPS, batch, optim)
    assert ref["losses"][-1] < ref["losses"][0]          # it trains, so equality means something
    return results, ref


@pytest.mark.parametrize("plan,batch,optim", [
    (Plan(dp=2, tp=2), 5, "adamw"),                      # rows 3 + 2: uneven replicas
    (Plan(dp=2, pp=2), 5, "sgd"),
    (Plan(tp=2, pp=2, micro_batches=3, schedule="gpipe"), 5, "adamw"),   # K=3 rows 2+2+1
    (Plan(dp=2, tp=2, zero=1), 5, "adamw"),
    (Plan(dp=2, tp=2, zero=2), 6, "sgd"),
    (Plan(dp=2, tp=2, zero=3), 5, "adamw"),
    (Plan(dp=3, zero=2), 7, "adamw"),                    # shards of uneven size over 3 ranks
    (Plan(tp=4), 4, "sgd"),
    (Plan(dp=2, cp=2), 5, "adamw"),                      # ring attention, zig-zag
    (Plan(tp=2, cp=2, cp_layout="plain"), 3, "sgd"),
    (Plan(cp=3, cp_layout="plain", cp_method="all_gather", zero=0), 3, "sgd"),  # 6+5+5 tokens
    (Plan(dp=2, tp=2, sp=True, zero=1), 5, "adamw"),     # Megatron sequence parallelism
], ids=lambda v: v.describe() if isinstance(v, Plan) else str(v))
def test_composition_equals_one_process(plan, batch, optim):
    results, ref = _run(plan, batch, optim)
    diffs = differences(results, ref, optim)
    assert all(d["ok"] for d in diffs), diffs
    assert len({tuple(r["coords"].values()) for r in results}) == plan.world
    if plan.zero != 3:                                   # ZeRO-3 keeps gradients in shards only
        assert all(r["grads"] for r in results)


@pytest.mark.parametrize("plan", [Plan(dp=2, cp=2), Plan(cp=3, cp_layout="plain"),
                                  Plan(tp=2, sp=True), Plan(tp=2, cp=2)],
                         ids=lambda p: p.describe())
def test_sequence_and_context_bytes_match_costs(plan):
    results, ref = _run(plan, 5, "sgd")
    assert all(d["ok"] for d in differences(results, ref, "sgd"))
    rows = bytes_rows(results, plan, GPTConfig(**CFG), 5)
    assert rows and all(r["logged"] == r["predicted"] > 0 for r in rows), rows


def test_3d_equals_one_process_and_bytes_match_costs():
    plan = Plan(dp=2, tp=2, pp=2, zero=1, micro_batches=2)
    results, ref = _run(plan, 5)
    diffs = differences(results, ref)
    assert all(d["ok"] for d in diffs), diffs
    rows = bytes_rows(results, plan, GPTConfig(**CFG), 5)
    assert {r["dim"] for r in rows} == {"tp", "pp", "dp"}
    for r in rows:
        if r["dim"] in ("tp", "pp"):
            assert r["logged"] == r["predicted"] > 0, r


def _broken(dim, plan, cfg, steps, batch, optim):
    """train() with one dimension silently skipped (a monkeypatch inside this rank only)."""
    if dim == "tp":      # g forgets its all-reduce: each TP rank keeps its partial sum
        from labkit.tp import operators
        reduce = operators._all_reduce
        operators._all_reduce = lambda x, group, where: (x if where == "g forward"
                                                         else reduce(x, group, where))
    elif dim == "dp":    # replicas step on their own gradients, never averaged
        from labkit.ddp import BucketedDDP
        from labkit.zero import ZeRO1

        BucketedDDP.finish_gradient_synchronization = lambda self: None
        BucketedDDP.synchronize_accumulated = lambda self: None
        ZeRO1.step = lambda self: None
    elif dim == "pp":    # the tied embedding's two gradients are never summed
        from labkit.pipeline import executor
        executor._sum_tied_embedding = lambda *a, **k: None
    return train(plan, cfg, steps, batch, optim)


def test_composed_dp_is_chapter_02s_bucketed_ddp():
    """zero=0 is labkit.ddp.BucketedDDP: one logged all-reduce per bucket of the book's rule,
    several buckets here, and the run still equals one process."""
    plan, batch, mb = Plan(dp=2), 5, 0.05
    results = run(train, plan.world, args=(plan, CFG, STEPS, batch, "adamw"),
                  kwargs=dict(bucket_mb=mb), echo=False)
    ref = reference_train(GPTConfig(**CFG), STEPS, batch, "adamw")
    assert all(d["ok"] for d in differences(results, ref, "adamw"))
    buckets = assign_buckets(list(GPT(GPTConfig(**CFG)).parameters()), mb)
    assert len(buckets) >= 3
    for r in results:
        assert r["comm"]["dp"]["calls"] == len(buckets), r["comm"]


@pytest.mark.parametrize("dim", ["tp", "dp", "pp"])
def test_3d_catches_a_skipped_dimension(dim):
    plan = Plan(dp=2, tp=2, pp=2, micro_batches=2)
    results, ref = _run(plan, 5, fn=_broken, args=(dim,))
    assert not all(d["ok"] for d in differences(results, ref)), f"breaking {dim} went unnoticed"


@pytest.mark.parametrize("plan,world,batch,words", [
    (Plan(dp=2, tp=2), 3, 5, ["1 x 2 x 2 = 4", "3 ranks"]),
    (Plan(tp=3), 3, 5, ["tp=3", "n_head=4", "MLP hidden"]),
    (Plan(pp=5), 5, 5, ["pp=5", "n_layer=4"]),
    (Plan(dp=2, pp=2, zero=2), 4, 8, ["ZeRO-2", "zero=1"]),
    (Plan(dp=2, pp=2, micro_batches=4), 4, 5, ["K=4", "batch_size >= 8"]),
    (Plan(dp=3, tp=3, pp=5), 8, 2, ["45", "tp=3", "pp=5", "batch_size=2 < dp=3"]),
    (Plan(cp=3), 3, 4, ["cp=3", "T=16", "2*cp=6", "layout='plain'"]),
    (Plan(tp=2, pp=2, cp=2), 8, 8, ["cp with pp=2", "not built"]),
    (Plan(sp=True), 1, 4, ["sp=True with tp=1"]),
])
def test_bad_plans_are_refused_before_launch_naming_every_factor(plan, world, batch, words):
    with pytest.raises(PlanError) as err:
        check_plan(plan, GPTConfig(**CFG), world=world, batch_size=batch)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_lab_exits_nonzero_on_bad_plan_before_any_process():
    from labkit.labs import hybrid

    # the lab checks the plan before any process (PlanError, or the CLI's ValueError around it)
    with pytest.raises((PlanError, ValueError), match="does not fit"):
        hybrid.main(["--nproc", "8", "--dp", "2", "--tp", "2", "--pp", "3"])


def test_default_dims_fit_any_world():
    from labkit.labs.hybrid import default_dims

    for n in range(1, 9):
        dp, tp, pp = default_dims(n)
        assert dp * tp * pp == n
    assert default_dims(8, pp=2) == (2, 2, 2)
    assert default_dims(8, dp=2, pp=2) == (2, 2, 2)


def _watched(plan):
    """The rank code, watched for tensors made without device= (tests/devicecheck.py)."""
    from devicecheck import RANK_SIDE, ImplicitDevice

    with ImplicitDevice(RANK_SIDE) as mode:
        res = train(plan, CFG, 1, 4)
    return mode.calls, res["ran_on"]


def test_rank_code_names_the_device_of_every_tensor():
    for calls, ran_on in run(_watched, 4, args=(Plan(tp=2, pp=2),), echo=False):
        assert calls == [], f"tensors made without device=: {calls}"
        assert ran_on == ("gloo", "cpu")
