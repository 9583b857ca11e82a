"""ZeRO-3 with prefetch, reshard_after_forward=False and CPU offload (labkit.zero.prefetch,
labkit.zero.zero3): equal to plain PyTorch on one process with real training code (frozen,
unused, tied, groups, clipping, accumulation) at 2, 3 and 4 ranks; the next unit's gather posted
before the current unit computes; peak unsharded bytes (by storage, read by module hooks) about
two units with prefetch, one without, all of them when forward keeps them; bytes held with
offload and with replicated parameters equal to labkit.costs.memory up to the padding.

One launch per world size runs everything."""
import math

import pytest
import torch

from labkit.costs import memory
from labkit.labs.zero.train import TINY, real_reference, sharded_train
from labkit.launch import run
from labkit.model import GPT, GPTConfig
from labkit.zero.precision import MixedPrecisionPolicy, one_dimensional
from labkit.zero.unit import fsdp2_units, own_params

REAL = dict(freeze=("wpe.weight",), unused=True, groups=True)
# (ZeRO3 keywords, no_sync for the first of 2 micro-batches)
VARIANTS = {"prefetch": (dict(prefetch=True), False),
            "keep": (dict(prefetch=True, reshard_after_forward=False), True),
            "offload": (dict(prefetch=True, offload=True), True),
            # FSDP2's wrapping: the model as root unit (embeddings, tied head, final norm, the
            # unused head), kept whole from forward to backward, and each block
            "root": (dict(prefetch=True, units=fsdp2_units), True)}
SMALL = GPTConfig(vocab_size=96, block_size=16, n_layer=3, n_head=2, n_embd=32,
                  tie_weights=False)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _bad_inputs():
    """ZeRO-3 refuses a parameter listed in two groups and parameters on two devices."""
    from labkit.zero import ZeRO3

    errors = []
    model = GPT(TINY)
    w = model.lm_head.weight
    for make in (lambda: ZeRO3(GPT(TINY), torch.optim.SGD, lr=0.1,
                               param_groups=[{"params": [w]}, {"params": [w]}]),
                 lambda: ZeRO3(_two_devices(), torch.optim.SGD, lr=0.1)):
        try:
            make()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def _two_devices():
    model = GPT(TINY)
    model.wpe.weight = torch.nn.Parameter(torch.zeros(model.wpe.weight.shape, device="meta"))
    return model


def _root_kept(world):
    """FSDP2's wrapping: which whole-parameter buffers hold storage after forward (the root's,
    kept for backward; no block's) and after the step (none); and the held bytes then."""
    from labkit.model import get_batch, shard_rows, tiny_corpus
    from labkit.zero import ZeRO3

    model = GPT(SMALL)
    zero = ZeRO3(model, torch.optim.AdamW, prefetch=True, units=fsdp2_units, lr=1e-3)
    x, y = get_batch(tiny_corpus(), 6, SMALL.block_size, 0)                        # (B, T)
    rank = torch.distributed.get_rank()
    loss = model(shard_rows(x, rank, world), shard_rows(y, rank, world))[1]
    names = {id(p): n for n, p in model.named_parameters()}
    whole = lambda: {names[k] for k, b in zip(zero.flat, zero.full_buffers())   # noqa: E731
                     if b.untyped_storage().nbytes()}
    after_forward = whole()
    loss.backward()
    zero.step()
    return {"after_forward": after_forward, "after_step": whole(), "held": zero.held_bytes()}


def _everything(world):
    from labkit.labs.zero.overlap import prefetch_lab

    out = {}
    for name, (kw, quiet) in VARIANTS.items():
        out[name] = sharded_train(3, TINY, "adamw", steps=2, accumulate=2, no_sync=quiet,
                                  stage_kw=dict(max_grad_norm=0.5, **kw), **REAL)
    if world == 4:
        return out
    out["lab"] = prefetch_lab(SMALL, steps=1, batch_size=6)
    for name, kw in (("offload", dict(offload=True)),
                     ("offload bf16", dict(offload=True, mp_policy=BF16)),
                     ("replicate", dict(replicate=one_dimensional))):
        out[("held", name)] = sharded_train(3, TINY, "adamw", steps=1, stage_kw=kw)["held"]
    out["bad"] = _bad_inputs()
    out["root kept"] = _root_kept(world)
    return out


@pytest.fixture(scope="module")
def runs():
    ref = real_reference(TINY, "adamw", steps=2, max_grad_norm=0.5, **REAL)
    return ref, {w: run(_everything, w, args=(w,), timeout=300, echo=False) for w in (2, 3, 4)}


def _max_diff(a, b):
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_equals_plain_pytorch(runs, world, variant):
    ref, per_world = runs
    for rank_out in per_world[world]:
        o = rank_out[variant]
        assert _max_diff(o["grads"], ref["grads"]) < 1e-6          # after clipping
        assert _max_diff(o["params"], ref["params"]) < 2e-5
        assert "wpe.weight" not in o["grads"] and "unused_head.weight" not in o["grads"]


@pytest.mark.parametrize("world", [2, 3])
def test_next_units_gather_is_posted_before_this_unit_computes(runs, world):
    """After the first step only the first unit of forward and of backward wait for their own
    gather; every other unit's arrived as a prefetch posted before the previous unit began."""
    for r in runs[1][world]:
        ev = r["lab"][("prefetch", True)]["events"]
        assert sum(e["name"] == "gather" for e in ev) == 2
        spans = {ph: [e for e in ev if e["lane"] == "compute" and e["name"] == ph]
                 for ph in ("forward", "backward")}
        turn = spans["forward"][-1]["end"]              # forward's last unit is done
        flights = {"forward": [f for f in ev if f["name"] == "prefetch" and f["start"] < turn],
                   "backward": [f for f in ev if f["name"] == "prefetch" and f["start"] >= turn]}
        for phase, units in spans.items():
            for j, unit in enumerate(units[:-1]):
                # the gathers of units j+1 (and earlier) were posted before unit j computed
                posted = sum(f["start"] <= unit["start"] for f in flights[phase])
                assert posted >= j + 1, (phase, unit["unit"], posted)
        assert r["lab"][("prefetch", False)]["gathers"] == r["lab"][("prefetch", True)]["gathers"]


@pytest.mark.parametrize("world", [2, 3])
def test_peak_unsharded_bytes_by_storage(runs, world):
    for r in runs[1][world]:
        lab = r["lab"]
        sizes = [b for _, b in lab["units"]]
        one, pairs, every = max(sizes), max(a + b for a, b in zip(sizes, sizes[1:])), sum(sizes)
        arriving = one * (1 + 1 / world)        # a gather in flight: its output and its input
        assert lab[("prefetch", False)]["peak"] == one
        assert one < lab[("prefetch", True)]["peak"] <= one + arriving
        assert lab[("prefetch", True)]["peak"] <= pairs + one / world     # about two units
        assert lab[("keep", True)]["peak"] >= every                       # forward keeps all
        # no gathers in backward: half the gathers (each unit once)
        assert 2 * lab[("keep", True)]["gathers"] == lab[("prefetch", True)]["gathers"]


def _padded(world, replicated=False):
    """(elements of this rank's shards, elements kept whole) for GPT(TINY)."""
    params = {id(p): p for p in GPT(TINY).parameters()}.values()
    whole = sum(p.numel() for p in params if replicated and p.dim() < 2)
    shard = sum(math.ceil(p.numel() / world) for p in params
                if not (replicated and p.dim() < 2))
    return shard, whole


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_held_with_offload_and_replication_match_the_calculator(runs, world):
    numel = sum(p.numel() for p in GPT(TINY).parameters())
    s, _ = _padded(world)
    rs, whole = _padded(world, replicated=True)
    for r in runs[1][world]:
        # offload: a device copy of the shard in the compute dtype; on the CPU the fp32 master
        # with Adam's m and v (12 bytes) and the fp32 gradient shard (4)
        for name, w in (("offload", 4), ("offload bf16", 2)):
            held = r[("held", name)]
            assert held == {"params": w * s, "grads": 0, "optimizer": 0,
                            "cpu_grads": 4 * s, "cpu_optimizer": 12 * s}, (name, held)
            ms = memory.model_states(numel, recipe=memory.Precision(name, w, 4, 12),
                                     zero=3, dp=world, offload_optimizer=True)
            assert ms.params <= held["params"] < ms.params + w * world * 30
            assert ms.cpu_total <= held["cpu_grads"] + held["cpu_optimizer"] \
                < ms.cpu_total + 16 * world * 30
        held = r[("held", "replicate")]
        assert held == {"params": 4 * (rs + whole), "grads": 4 * (rs + whole),
                        "optimizer": 8 * (rs + whole)}, held
        ms = memory.model_states(numel, recipe="fp32", zero=3, dp=world, replicated=whole)
        assert ms.total <= sum(held.values()) < ms.total + 16 * world * 30


def test_a_unit_manages_what_no_unit_inside_it_manages():
    """fsdp2_units: the model is the root unit, holding what no block holds; each parameter
    belongs to exactly one unit (the tied embedding/head weight once, to the root)."""
    model = GPT(TINY)
    units = fsdp2_units(model)
    owned = [own_params(u, units) for u in units]
    ids = [id(p) for ps in owned for p in ps]
    assert sorted(ids) == sorted({id(p) for p in model.parameters()})     # each exactly once
    root = {id(p) for m in (model.wte, model.wpe, model.ln_f, model.lm_head)
            for p in m.parameters()}
    assert {id(p) for p in owned[0]} == root
    assert [len(ps) for ps in owned[1:]] == [len(list(b.parameters())) for b in model.blocks]


@pytest.mark.parametrize("world", [2, 3])
def test_the_root_unit_stays_whole_from_forward_to_backward(runs, world):
    """As FSDP2's root: its parameters are not freed after forward (backward starts with
    them), every block's are; after the step nothing is whole and the bytes are the shards'."""
    s = sum(math.ceil(p.numel() / world) for p in GPT(SMALL).parameters())
    for r in runs[1][world]:
        root = r["root kept"]
        assert root["after_forward"] == {"wte.weight", "wpe.weight", "ln_f.weight",
                                         "ln_f.bias", "lm_head.weight"}, root
        assert root["after_step"] == set()
        assert root["held"] == {"params": 4 * s, "grads": 4 * s, "optimizer": 8 * s}, root


def test_bad_input_is_a_clear_error(runs):
    errors = runs[1][2][0]["bad"]
    assert errors[0] is not None and "registered twice" in errors[0]
    assert errors[1] is not None and "different devices" in errors[1]
