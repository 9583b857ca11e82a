"""labkit.zero.ZeRO3 with a mixed-precision policy (FSDP2's MixedPrecisionPolicy) and with small
parameters replicated: equal to PyTorch's FSDP2 doing the same casts, bf16 where it claims (seen
by forward hooks, not by labkit), fp32 masters and optimizer state, half the all-gather bytes
(counted by the kernel: observe.netcount), and replicated parameters whole and equal everywhere.

One launch per world size (2, and 3 for uneven shards) runs everything."""
import dataclasses

import pytest
import torch

from labkit.check import ch03
from labkit.labs.zero.train import TINY, real_reference, sharded_train
from labkit.launch import run
from labkit.reference import TrainSpec, train
from labkit.testing import tensors_close
from labkit.zero.precision import MixedPrecisionPolicy, one_dimensional, resolve

STEPS = 3
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# untied: every parameter belongs to one unit in labkit and to one fully_shard group in FSDP2
UNTIED = dataclasses.replace(TINY, tie_weights=False)
CLIPPED = dict(unused=True, stage_kw=dict(replicate=one_dimensional, max_grad_norm=0.5))


class _Watch(torch.overrides.TorchFunctionMode):
    """Records every linear / layer_norm / embedding call's weight and input dtypes in forward:
    a record that the code under test does not write, and that sees inside the modules labkit
    wraps as units (wte, ln_f, lm_head), which module hooks would not. (Not for backward: a mode
    is off while it handles a call, and loss.backward() is one.)"""

    WEIGHT = {"linear": 1, "layer_norm": 2, "embedding": 1}   # position of the weight argument

    def __init__(self):
        super().__init__()
        self.seen = []   # (op, weight dtype, weight numel, input dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.WEIGHT:
            w = kwargs.get("weight", args[self.WEIGHT[name]] if len(args) > self.WEIGHT[name]
                           else None)
            if isinstance(w, torch.Tensor):
                self.seen.append((name, w.dtype, w.numel(), args[0].dtype))
        return func(*args, **kwargs)


def _dtype_probe():
    """ZeRO-3 with BF16: what the layers compute with, and what the masters, their gradients
    and the optimizer state are made of."""
    from labkit.launch import device
    from labkit.model import GPT, get_batch, tiny_corpus
    from labkit.zero import ZeRO3

    model = GPT(UNTIED).to(device())
    full = {n: p.numel() for n, p in model.named_parameters()}
    recomputed = []   # a block's module run again during backward (none: no recomputation)
    in_backward = [False]

    def hook(module, args):
        if in_backward[0]:
            recomputed.append((module.weight.dtype, module.weight.numel(), args[0].dtype))
    for block in model.blocks:
        for m in block.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm)):
                m.register_forward_pre_hook(hook)
    zero = ZeRO3(model, torch.optim.AdamW, mp_policy=BF16, lr=1e-2)
    x, y = get_batch(tiny_corpus(), 4, UNTIED.block_size, 0)                # (B, T)
    with _Watch() as watch:
        loss = model(x.to(device()), y.to(device()))[1]
    in_backward[0] = True
    loss.backward()
    in_backward[0] = False
    zero.step()
    state = [(k, v.dtype, v.numel(), s.numel()) for s in zero.shards
             for k, v in zero.optimizer.state[s].items() if v.dim() > 0]
    return {"seen": watch.seen, "recomputed": recomputed, "full_numel": full,
            "loss_dtype": loss.dtype,
            "masters": [(s.dtype, s.numel(), s.untyped_storage().nbytes()) for s in zero.shards],
            "grads": [s.grad.dtype for s in zero.shards], "state": state,
            "freed": sum(p.numel() for p in model.parameters())}


def _replicated_probe():
    """Replicated 1-D parameters (bf16 policy too): whole on this rank, and their values."""
    import torch.distributed as dist

    from labkit.launch import device
    from labkit.model import GPT, get_batch, shard_rows, tiny_corpus
    from labkit.zero import ZeRO3

    rank, world = dist.get_rank(), dist.get_world_size()
    model = GPT(TINY).to(device())
    names = {id(p): n for n, p in model.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    zero = ZeRO3(model, torch.optim.AdamW, mp_policy=BF16, replicate=one_dimensional, lr=1e-2)
    for step in range(STEPS):
        x, y = get_batch(tiny_corpus(), 12, TINY.block_size, step)         # (B, T)
        x, y = shard_rows(x, rank, world), shard_rows(y, rank, world)        # (B/N, T)
        model(x.to(device()), y.to(device()))[1].backward()
        zero.step()
        zero.zero_grad()
    rep = {names[id(p)]: s.detach().clone() for p, s in zip(zero.params, zero.shards)
           if id(p) in zero.replicated}
    sharded = {names[id(p)]: s.numel() for p, s in zip(zero.params, zero.shards)
               if id(p) not in zero.replicated}
    return {"replicated": rep, "sharded_numel": sharded, "shapes": shapes}


def _bad_policies():
    """ZeRO-3 refuses a narrower reduce_dtype, FSDP2's own policy with a non-float dtype, and a
    replicate= that is not a function (each a ValueError before anything is sharded)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    from labkit.model import GPT
    from labkit.zero import ZeRO3

    errors = []
    for kw in (dict(mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)),
               dict(mp_policy=TorchPolicy(param_dtype=torch.int32)),
               dict(replicate="1d")):
        try:
            ZeRO3(GPT(TINY), torch.optim.SGD, lr=0.1, **kw)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def _everything(world):
    from labkit.labs.zero.fsdp import fsdp2_train
    from labkit.labs.zero.measure import precision_traffic

    out = {}
    for opt in ("sgd", "adamw"):
        for name, cfg in (("untied", UNTIED), ("tied", TINY)):
            out[(opt, name, "labkit")] = sharded_train(3, cfg, opt, steps=STEPS,
                                                       stage_kw=dict(mp_policy=BF16))
            out[(opt, name, "fsdp2")] = fsdp2_train(cfg, opt, steps=STEPS, mp_policy=BF16)
        out[(opt, "replicate")] = sharded_train(3, TINY, opt, steps=STEPS,
                                                stage_kw=dict(replicate=one_dimensional))
    out["clipped"] = sharded_train(3, TINY, "adamw", steps=2, **CLIPPED)
    for mode in ("every", "no_sync"):   # 2 micro-batches: reduce each, or hold and reduce once
        out[("accumulate", mode, "replicate")] = sharded_train(
            3, TINY, "sgd", steps=STEPS, accumulate=2, no_sync=mode == "no_sync",
            stage_kw=dict(replicate=one_dimensional))
        out[("accumulate", mode, "bf16")] = sharded_train(
            3, TINY, "sgd", steps=STEPS, accumulate=2, no_sync=mode == "no_sync",
            stage_kw=dict(mp_policy=BF16))
    out["dtypes"] = _dtype_probe()
    out["replicated"] = _replicated_probe()
    out["traffic"] = precision_traffic()
    out["traffic_bf16_reduce"] = precision_traffic(param_dtypes=("bfloat16",),
                                                   reduce_dtype="bfloat16")
    out["bad"] = _bad_policies()
    return out


@pytest.fixture(scope="module", params=[2, 3])
def runs(request):
    world = request.param
    return world, run(_everything, world, args=(world,), timeout=400, echo=False)


def _global_losses(per_rank, key):
    """Mean over ranks of each rank's mean loss (equal rows per rank): the global batch's."""
    return torch.tensor([r[key]["losses"] for r in per_rank]).mean(0)               # (steps,)


# ----------------------------------------------------------------------------- (a) vs FSDP2
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_bf16_policy_equals_fsdp2_on_the_untied_gpt(runs, opt):
    """Same casts at the same places (gather in bf16, compute in bf16, reduce in fp32, fp32
    step): measured difference 0.0 at 2 and 3 ranks, losses and parameters. We still allow fp32's
    tolerance (1e-5 rel): a different summation order in a reduction may round differently."""
    world, per_rank = runs
    for r in per_rank:
        ours, theirs = r[(opt, "untied", "labkit")], r[(opt, "untied", "fsdp2")]
        tensors_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]),
                      what=f"{world} ranks {opt} losses vs FSDP2")
        for n, t in theirs["params"].items():
            tensors_close(ours["params"][n], t, what=f"{world} ranks {opt} {n} vs FSDP2")


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_bf16_policy_on_the_tied_gpt_differs_from_fsdp2_only_in_rounding(runs, opt):
    """A tied embedding is used by two units here (wte, lm_head) and by one group in FSDP2: FSDP2
    adds the two bf16 gradients in bf16 and then casts to fp32; labkit casts each to fp32 and adds
    in fp32. Losses (bf16 numbers: 1 ulp is 0.03125 near 4.5) stay within one bf16 ulp (measured:
    equal at step 0, at most 1 ulp later). SGD parameters: measured max |diff| 1.6e-4 (2 ranks),
    1.2e-4 (3); we allow 1e-3. AdamW is not held to a parameter tolerance: its normalised update
    turns the rounding difference of a near-zero gradient (key biases: softmax ignores a shift
    shared by all keys, so their true gradient is 0) into a step of up to lr = 1e-2 (measured:
    0.0135 in blocks.1.attn.k_proj.bias)."""
    world, per_rank = runs
    for r in per_rank:
        ours, theirs = r[(opt, "tied", "labkit")], r[(opt, "tied", "fsdp2")]
        ulp = torch.finfo(torch.bfloat16).eps * 4     # spacing of bf16 numbers in [4, 8)
        diff = (torch.tensor(ours["losses"]) - torch.tensor(theirs["losses"])).abs()
        assert diff.max() <= ulp, (world, opt, ours["losses"], theirs["losses"])
        if opt == "sgd":
            worst = max((ours["params"][n] - t).abs().max().item()
                        for n, t in theirs["params"].items())
            assert worst < 1e-3, (world, worst)


def test_bf16_loss_is_close_to_the_fp32_reference_and_not_equal(runs):
    """bf16 compute rounds every activation to 8 significant bits: the global loss moves by
    ~1e-2 relative at most (measured 6e-3 at step 0); a policy that silently did nothing would
    give the fp32 loss to ~1e-7."""
    world, per_rank = runs
    ref = torch.tensor(train(TINY, TrainSpec(steps=STEPS, batch=12, optimizer="adamw")).losses)
    bf16 = _global_losses(per_rank, ("adamw", "tied", "labkit"))
    rel = ((bf16 - ref).abs() / ref).max().item()
    assert 1e-4 < rel < 2e-2, (world, rel, bf16.tolist(), ref.tolist())


# ----------------------------------------------------------------------------- (b) dtypes
def test_layers_compute_in_bf16_from_fp32_masters(runs):
    world, per_rank = runs
    for r in per_rank:
        d = r["dtypes"]
        # every linear, layer norm and embedding ran in forward with a whole (gathered) bf16
        # weight and a bf16 input (token ids stay int64); the model has 2 of each per block
        # (+1 lm_head, +1 ln_f, wte and wpe)
        ops = [op for op, *_ in d["seen"]]
        assert ops.count("linear") == 6 * 2 + 1 and ops.count("layer_norm") == 2 * 2 + 1
        assert ops.count("embedding") == 2
        assert all(w == torch.bfloat16 for _, w, *_ in d["seen"])
        assert all(x == (torch.int64 if op == "embedding" else torch.bfloat16)
                   for op, _, _, x in d["seen"])
        assert {n for _, _, n, _ in d["seen"]} <= set(d["full_numel"].values())
        # backward gathered again but ran no module's forward (FSDP2's way: activations kept)
        assert d["recomputed"] == []
        assert d["loss_dtype"] == torch.bfloat16     # FSDP2's output_dtype=None: as computed
        assert d["freed"] == 0                       # only shards remain between units
        # masters: fp32, 4 bytes per element of storage, 1/N of the model (plus < N padding
        # per tensor); their gradients fp32; AdamW's m and v fp32, one per master element
        assert all(dt == torch.float32 and nbytes == 4 * n for dt, n, nbytes in d["masters"])
        assert sum(n for _, n, _ in d["masters"]) <= sum(d["full_numel"].values()) / world \
            + world * len(d["masters"])
        assert set(d["grads"]) == {torch.float32}
        assert {k for k, *_ in d["state"]} >= {"exp_avg", "exp_avg_sq"}
        assert all(dt == torch.float32 and n == m for _, dt, n, m in d["state"])


# ----------------------------------------------------------------------------- (c) bytes
def test_bf16_halves_the_all_gather_bytes_counted_by_the_kernel(runs):
    """Forward sends only all-gathers. Kernel-counted, 2 ranks: fp32 230,592 B, bf16 116,160 B
    (ratio 0.504); the difference equals the prediction (N-1)/N * padded Ψ * 2 bytes exactly,
    what is left is Gloo's per-message headers, the same in both."""
    world, per_rank = runs
    for r in per_rank:
        t = r["traffic"]
        f32, b16 = t["float32"]["forward"], t["bfloat16"]["forward"]
        assert f32 is not None, "the kernel could not count (see labkit.observe.netcount.why_not)"
        assert 0.49 < b16 / f32 < 0.52, (world, f32, b16)
        saved, predicted = f32 - b16, t["bfloat16"]["forward_predicted"]
        assert abs(saved - predicted) < 0.01 * predicted, (world, saved, predicted)
        # backward: gathers halve, the fp32 reduce-scatter does not: ~3/4 of fp32's bytes;
        # reducing in bf16 as well halves the whole backward
        b32 = t["float32"]["backward"]
        assert 0.72 < t["bfloat16"]["backward"] / b32 < 0.78, (world, t)
        all16 = r["traffic_bf16_reduce"]["bfloat16"]["backward"]
        assert 0.49 < all16 / b32 < 0.53, (world, all16, b32)


# ----------------------------------------------------------------------------- (d) replicate
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_replicated_small_parameters_equal_one_process(runs, opt):
    """fp32, replicate=one_dimensional: the same tolerance as every other stage (labkit.check.
    ch03, the chapter's own), and bitwise the same parameters on every rank."""
    world, per_rank = runs
    ref = train(TINY, TrainSpec(steps=STEPS, batch=12, optimizer=opt)).as_dict()
    results = [r[(opt, "replicate")] for r in per_rank]
    ch03.assert_matches_reference(results, ref, what=f"ZeRO-3 replicate 1-D, {opt}, {world} ranks")
    ch03.assert_ranks_agree(results)
    tensors_close(_global_losses(per_rank, (opt, "replicate")), torch.tensor(ref["losses"]),
                  what="global loss")


def test_replicated_with_clipping_and_an_unused_head_equals_plain_pytorch(runs):
    """The global norm counts a replicated gradient once (not N times), and the unused head's
    bias (replicated) keeps gradient None through the all-reduce's has-grad flags. Bounds as in
    tests/test_zero.py's real-model test."""
    world, per_rank = runs
    ref = real_reference(TINY, "adamw", steps=2, unused=True, max_grad_norm=0.5)
    for r in per_rank:
        got = r["clipped"]
        assert set(got["grads"]) == set(ref["grads"])      # no unused_head.* gradient
        assert max((got["grads"][n] - t).abs().max().item() for n, t in ref["grads"].items()) < 1e-6
        assert max((got["params"][n] - t).abs().max().item()
                   for n, t in ref["params"].items()) < 2e-5


def test_accumulation_with_replication_and_with_bf16(runs):
    """2 micro-batches per step, with and without no_sync: replicated (fp32) equals one process;
    bf16 held gradients are kept in reduce_dtype (fp32), so holding them and reducing once
    differs from reducing each micro-batch only by fp32 rounding (measured max |diff| 0 at 2
    ranks, 1.5e-8 at 3; we allow 1e-5, fp32's tolerance at these magnitudes)."""
    world, per_rank = runs
    ref = train(TINY, TrainSpec(steps=STEPS, batch=12, optimizer="sgd")).as_dict()
    for mode in ("every", "no_sync"):
        results = [r[("accumulate", mode, "replicate")] for r in per_rank]
        ch03.assert_matches_reference(results, ref, what=f"replicate, {mode}, {world} ranks")
    for r in per_rank:
        every, held = r[("accumulate", "every", "bf16")], r[("accumulate", "no_sync", "bf16")]
        worst = max((every["params"][n] - t).abs().max().item() for n, t in held["params"].items())
        assert worst < 1e-5, (world, worst)


def test_replicated_parameters_are_whole_and_equal_on_every_rank(runs):
    world, per_rank = runs
    first = per_rank[0]["replicated"]
    shapes = first["shapes"]
    one_d = {n for n, s in shapes.items() if len(s) < 2}
    assert set(first["replicated"]) == one_d                     # norms and biases, nothing else
    for r in per_rank:
        rep = r["replicated"]["replicated"]
        assert all(tuple(t.shape) == shapes[n] and t.dtype == torch.float32
                   for n, t in rep.items())                      # whole fp32 masters
        for n, t in rep.items():   # the same all-reduced gradient, the same update: bitwise
            assert torch.equal(t, first["replicated"][n]), (world, n)
        assert set(r["replicated"]["sharded_numel"]).isdisjoint(one_d)


# ----------------------------------------------------------------------------- (e) bad input
def test_bad_policy_is_a_clear_error(runs):
    errors = runs[1][0]["bad"]
    assert all(e is not None for e in errors), errors
    assert "reduce_dtype=torch.bfloat16 is narrower" in errors[0] and "float32" in errors[0]
    assert "param_dtype=torch.int32 is not a floating dtype" in errors[1]
    assert "replicate='1d' must be None or a function" in errors[2]


@pytest.mark.parametrize("kw, says", [
    (dict(param_dtype=torch.int8), "param_dtype=torch.int8 is not a floating dtype"),
    (dict(reduce_dtype="bf16"), "reduce_dtype='bf16' is not a torch.dtype: pass torch.bfloat16"),
    (dict(param_dtype=torch.float8_e4m3fn), "float8 needs a scale"),
    (dict(output_dtype=torch.bool), "output_dtype=torch.bool is not a floating dtype"),
])
def test_policy_checks_its_dtypes_when_made(kw, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(".", r"\.")):
        MixedPrecisionPolicy(**kw)


def test_policy_defaults_are_fsdp2s():
    assert resolve(None, torch.float32) == (None, None, None, False)     # no policy: no casts
    p = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert resolve(p, torch.float32) == (torch.bfloat16, torch.bfloat16, None, True)
    with pytest.raises(ValueError, match="narrower"):
        resolve(MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float16),
                torch.float32)
