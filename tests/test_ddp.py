"""labkit.ddp against one process trained on the whole batch and against torch's DDP.

World sizes 2 and 3 (3 does not divide the batch of 7), SGD and AdamW, a frozen weight and a
frozen bias, tied embeddings (the GPT's default), bucket sizes giving one, two, several and one
bucket per parameter, no_sync accumulation, all-reduces counted per step and timed against the
moment backward produced its last gradient. One launch per world size (start-up is costly)."""
import pytest
import torch

from labkit.ddp import assign_buckets
from labkit.labs.ddp.verify import SMALL, assert_launches, assert_matches, build_model, spec
from labkit.launch import run
from labkit.reference import train

FROZEN = ("blocks.0.mlp.fc.weight", "blocks.0.attn.q_proj.bias")


def _trainable():
    return [p for p in build_model(SMALL, frozen=FROZEN).parameters() if p.requires_grad]


def _mb_for(n_buckets):
    """A bucket size (MiB) that splits the trainable parameters into exactly n_buckets."""
    params = _trainable()
    total = sum(p.numel() * p.element_size() for p in params)
    for k in range(1, 2000):
        mb = total * k / 2000 / 2**20
        if len(assign_buckets(params, mb)) == n_buckets:
            return mb
    raise AssertionError(f"no size gives {n_buckets} buckets")


def _configs():
    several = _mb_for(4)
    return [("naive", "sgd", 25.0), ("overlap", "sgd", 25.0), ("bucketed", "sgd", 25.0),
            ("bucketed", "sgd", _mb_for(2)), ("bucketed", "sgd", several),
            ("bucketed", "sgd", 1e-6), ("torch", "sgd", 25.0),
            ("naive", "adamw", 25.0), ("overlap", "adamw", 25.0),
            ("bucketed", "adamw", several), ("torch", "adamw", 25.0)]


def _job(configs, batch, frozen, accum_cfg):
    from labkit.labs.ddp.verify import train_on_rank

    out = [train_on_rank(kind, optimizer=opt, bucket_mb=mb, batch=batch, frozen=frozen)
           for kind, opt, mb in configs]
    if accum_cfg:
        out.append(train_on_rank("bucketed", bucket_mb=accum_cfg["mb"], batch=batch,
                                 frozen=frozen, accum=accum_cfg["accum"]))
    return out


@pytest.fixture(scope="module")
def results():
    configs = _configs()
    res = {}
    for world, batch in [(2, 6), (3, 7)]:
        accum = {"mb": _mb_for(4), "accum": 3} if world == 2 else None
        res[world] = (batch, configs, run(_job, world, args=(configs, batch, FROZEN, accum)))
    return res


def test_assign_buckets_sizes_and_order():
    params = _trainable()
    assert len(assign_buckets(params, None)) == 1
    assert len(assign_buckets(params, 1e-6)) == len(params)          # one per parameter
    assert [len(b) for b in assign_buckets(params, 25.0)] == [len(params)]
    buckets = assign_buckets(params, _mb_for(3))
    flat = [p for b in buckets for p in b]
    assert [id(p) for p in flat] == [id(p) for p in reversed(params)]  # reverse registration
    with pytest.raises(ValueError, match="bucket_mb=0"):
        assign_buckets(params, 0)


@pytest.mark.parametrize("world", [2, 3])
def test_matches_one_process_and_torch_ddp(results, world):
    batch, configs, per_rank = results[world]
    refs = {opt: train(*spec(optimizer=opt, batch=batch, frozen=FROZEN)).params
            for opt in ("sgd", "adamw")}
    torch_runs = {opt: i for i, (kind, opt, _) in enumerate(configs) if kind == "torch"}
    n_params = len(_trainable())
    for reports in per_rank:
        for (kind, opt, mb), rep in zip(configs, reports):
            what = f"{kind}/{opt}/{mb:.3g} MiB: "
            assert_matches(rep, refs[opt], what=what)
            assert_matches(rep, reports[torch_runs[opt]]["params"], what=what + "vs torch DDP: ")
            # frozen parameters never move (they are skipped, not averaged)
            start = build_model(SMALL, frozen=FROZEN)
            for name in FROZEN:
                assert torch.equal(rep["params"][name], dict(start.named_parameters())[name])
            if kind == "torch":
                continue
            assert rep["param_names"] == list(refs[opt])            # the wrapped model's names
            assert rep["state_keys"] == list(start.state_dict())
            if kind == "bucketed":
                expected = len(assign_buckets(_trainable(), mb))
                assert rep["n_buckets"] == expected
                assert_launches(rep, expected=expected, overlapped=True if expected > 1 else None)
            else:
                assert_launches(rep, expected=n_params, overlapped=kind == "overlap")


def test_no_sync_accumulation_equals_large_batch(results):
    batch, _, per_rank = results[2]
    ref = train(*spec(batch=batch, frozen=FROZEN)).params
    n_buckets = len(assign_buckets(_trainable(), _mb_for(4)))
    for reports in per_rank:
        rep = reports[-1]
        assert_matches(rep, ref, what="accumulation x3: ")
        # 3 micro-batches, one synchronisation: the all-reduce count falls by the factor 3
        assert_launches(rep, expected=n_buckets, overlapped=True)


def _errors():
    import torch.distributed as dist

    from labkit.ddp import BucketedDDP, NaiveDDP, OverlapDDP
    from labkit.model import GPT, GPTConfig

    model = GPT(GPTConfig(**SMALL))
    ddp = BucketedDDP(model, bucket_mb=1e-6)
    x = torch.zeros(2, 4, dtype=torch.long)
    ddp.module.blocks[0](ddp.module.wte(x)).sum().backward()  # wpe, ln_f never used
    msgs = []
    try:
        ddp.finish_gradient_synchronization()
    except RuntimeError as err:
        msgs.append(str(err))
    model2 = GPT(GPTConfig(**SMALL))
    model2.wte(x).sum().backward()
    try:
        NaiveDDP(model2).finish_gradient_synchronization()
    except RuntimeError as err:
        msgs.append(str(err))
    # a second synced backward before finishing is an error, not silently wrong gradients
    model3 = GPT(GPTConfig(**SMALL))
    BucketedDDP(model3, bucket_mb=1e-6)   # kept alive by its hooks on model3's parameters
    model3(x, x)[1].backward()
    try:
        model3(x, x)[1].backward()
    except RuntimeError as err:
        msgs.append(str(err))
    # buffers are broadcast from rank 0 too (BatchNorm's running statistics)
    bn = torch.nn.BatchNorm1d(3)
    bn.running_mean.fill_(float(dist.get_rank() + 1))
    OverlapDDP(bn)
    msgs.append(bn.running_mean.tolist())
    dist.barrier()
    return msgs


def test_unused_parameter_is_a_clear_error_and_buffers_are_broadcast():
    per_rank = run(_errors, 2)
    assert [m[-1] for m in per_rank] == [[1.0, 1.0, 1.0]] * 2
    msgs = per_rank[0][:-1]
    assert len(msgs) == 3
    assert "became ready twice" in msgs[2] and "no_sync" in msgs[2]
    assert "never became ready" in msgs[0] and "ln_f" in msgs[0]
    assert "has no gradient" in msgs[1]


def test_scaling_calculator_worked_example():
    from labkit.costs import scaling

    # a classic example: 100 ms compute, 10 ms communication, 8 GPUs
    assert scaling.efficiency(100, 10, 8) == pytest.approx(100 / 110)
    assert scaling.speedup(100, 10, 8) == pytest.approx(8 * 100 / 110)          # 7.27x
    assert scaling.efficiency(100, 10, 8, overlap=1.0) == 1.0
    assert scaling.efficiency(100, 10, 8, overlap=0.5) == pytest.approx(100 / 105)
    assert scaling.efficiency(100, 10, 1) == 1.0                                # nothing to sync
    assert scaling.efficiency(100, 10, 8, accum=4) == pytest.approx(400 / 410)
    # a common claim's formula disagrees with its own speedup by a factor N
    assert scaling.common_claim_efficiency(100, 10, 8) * 8 == pytest.approx(
        scaling.efficiency(100, 10, 8))
    # per-rank bytes approach 2D, never grow linearly; buckets add only latency
    assert scaling.bytes_per_rank(1e9, 64) < 2e9 and scaling.bytes_per_rank(1e9, 2) == 1e9
    one, many = (scaling.comm_time(1e8, 8, 5e-6, 50e9, b) for b in (1, 10))
    assert many - one == pytest.approx(9 * 2 * 7 * 5e-6)
    with pytest.raises(ValueError, match="overlap=1.5"):
        scaling.efficiency(100, 10, 8, overlap=1.5)



def test_overlap_costs_the_compute_it_overlaps():
    """The contention term: hidden comm slows the overlapped compute by s (Lee et al.'s 18.9%)."""
    from labkit.costs import scaling

    assert scaling.OVERLAP_SLOWDOWN == 0.189
    s = scaling.OVERLAP_SLOWDOWN
    # 100 ms compute, 10 ms comm all hidden: the ideal 100 ms becomes 100 + 0.189 * 10
    assert scaling.step_time(100, 10, 8, overlap=1.0, slowdown=s) == pytest.approx(101.89)
    assert scaling.efficiency(100, 10, 8, overlap=1.0, slowdown=s) == pytest.approx(100 / 101.89)
    # half hidden: T = 100 + s*5 + 5; still better than not overlapping at all while s < 1
    half = scaling.step_time(100, 10, 8, overlap=0.5, slowdown=s)
    assert half == pytest.approx(100 + s * 5 + 5) and half < scaling.step_time(100, 10, 8)
    # comm longer than compute: only the compute there is can be slowed
    assert scaling.step_time(10, 100, 8, overlap=0.5, slowdown=0.5) == pytest.approx(10 + 5 + 50)
    assert scaling.step_time(100, 10, 1, overlap=1.0, slowdown=s) == 100     # nothing to hide
    assert scaling.table(100, 10, (8,), 1.0, 1, s)[0]["step"] == pytest.approx(101.89)
    with pytest.raises(ValueError, match="OVERLAP_SLOWDOWN"):
        scaling.step_time(100, 10, 8, overlap=0.5, slowdown=-0.1)

def test_step_model_sends_the_sizes_each_version_sends():
    from labkit.labs.ddp.stepmodel import message_sizes

    params = list(build_model(SMALL).parameters())
    total = sum(p.numel() for p in params)
    assert message_sizes("naive", params, None) == [p.numel() for p in params]
    assert message_sizes("torch", params, 25.0) == [total]
    for mb in (1e-6, 0.002, None):
        sizes = message_sizes("bucketed", params, mb)
        assert sum(sizes) == total and len(sizes) == len(assign_buckets(params, mb))


def _model_job(variants):
    from labkit.labs.ddp.stepmodel import model_vs_measured

    return model_vs_measured(variants, SMALL, batch=4, rounds=1, warmup=1)


def test_step_model_pieces_are_the_slowest_ranks_and_add_up():
    variants = [("naive", None), ("torch", 25.0), ("bucketed", 1e-6), ("bucketed", None)]
    ranks = run(_model_job, 2, args=(variants,))
    assert ranks[0] == ranks[1], "every piece is the max over ranks: both ranks hold the same rows"
    params = list(build_model(SMALL, dtype="float32").parameters())
    for row, (kind, mb) in zip(ranks[0], variants):
        n = (len(params) if kind == "naive" else 1 if kind == "torch"
             else len(assign_buckets(params, mb)))
        assert (row["version"], row["bucket_mb"], row["messages"]) == (kind, mb, n)
        assert row["step"] > 0 and row["compute"] > 0 and row["comm"] > 0
        assert (row["pack"] > 0) == (kind == "bucketed")
        assert row["model"] == row["compute"] + row["pack"] + row["comm"]
        assert row["ratio"] == row["step"] / row["model"]
