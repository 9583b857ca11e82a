"""Exercise 9.3's checker: the reader's data-parallel mixed-precision trainer against one fp32
process.

    labkit.check.ch09.mixed_precision_trainer(MixedPrecisionTrainer)

One launch per world size (2 shown; 3 hidden, with another growth interval and a NaN) trains a
small MLP (its last bias frozen) three times on every rank, from the same weights, each rank on
its own batches:
    fp16 compute, gradients all-reduced in fp16;  fp16, all-reduced in fp32;  bf16, in bf16;
STEPS steps each, the global gradient norm clipped to MAX_NORM. The loss is multiplied by 2^-24,
so its fp16 gradients underflow unless scaled, and most updates (89% in fp16, 98% in bf16) are
below half the weights' spacing, so they round away unless applied to fp32 masters. In the fp16 runs one rank's loss
overflows at chosen steps (x2^100, or NaN); in the bf16 run one rank's loss is multiplied by 2^50
at one step (gradients past fp16's max, well inside bf16's range: no skip, the clip tames it).
Seven cases per world size, graded on the one launch:
  storage: the model's parameters are the compute dtype; the masters are fp32 in storage of their
      own (labkit.zero.shard.storage_bytes: 4 bytes per element, no pointer shared); dtype=fp32
      is refused with a ValueError;
  loss scale: the gradient that reaches the loss (a hook the checker registers on the loss tensor
      it returns, a counter the reader's code does not write) is the scale used; it must follow
      GradScaler's rules (x2 after `growth_interval` good steps, x0.5 on an overflow), and step()
      must return False exactly at the overflowed steps, on every rank;
  agreement: every rank's masters are bit-identical after every step (a hash per step), and a
      skipped step leaves them unchanged;
  tracking: the fp16 runs' masters within TRACK of fp32 SGD with the same clip that skips the same
      steps; a failure is compared with the same SGD made with a known mistake (clipping the
      scaled gradient, a sum for the mean, clip_grad_norm_'s epsilon, no clip) to name it;
  wire: the bytes each rank sent during the steps, counted by the kernel (labkit.netcount), within
      the ring optimum of the reduce dtype (steps taken .. all steps, plus WIRE_SLACK and Gloo's
      headers): an fp32 all-reduce where fp16 was asked sends twice as much and fails;
  bf16: the gradient reaching the loss is 1 at every step (no loss scale), no step is skipped,
      the masters track fp32 SGD within TRACK;
  resume: the fp16 run's state_dict() after RESUME steps, loaded into a trainer built the same way
      on a fresh model, continues with the same scales, returns and masters (bit-identical): the
      loss scale and its count of good steps are training state.
torch.amp, labkit.precision, labkit.zero (its sharded loss scaler) and DDP wrappers are refused
by reading the code (labkit.check.guards.forbidden_used).

Long because: seven cases graded on one launch's results share its rank side, the fp32
reference and the references with known mistakes that name a failure.
"""
from __future__ import annotations

import torch

from labkit.check import Checker, fail
from labkit.check.guards import forbidden_used

TINY = 2.0**-24        # the loss is this small: its fp16 gradients underflow unless scaled
LR = 0.002 / TINY      # SGD on the tiny loss: an effective 0.002, most updates below half an ulp
AMP = (0.2, 1.0, 3.0, 0.5)   # the targets' size by step: gradient norms from 1e-8 to 8e-8...
MAX_NORM = 2e-8        # ...so the clip (of the averaged, unscaled gradient) acts at half the steps
BIG = 2.0**50          # the bf16 run's injected loss factor: gradients past fp16's max, not bf16's
STEPS = 8
RESUME = 4             # the fp16 run's state_dict() after this many steps resumes a fresh trainer
TRACK = 0.05           # masters within 5% of how far fp32 training moved the weights (a right
                       # answer: under 1%, bf16 too; the known mistakes: 30% and more)
WIRE_SLACK = 0.05      # over the ring optimum: Gloo's per-message headers, proportionally
WIRE_HEADERS = 3000    # bytes per rank per step, absolute: headers of a few messages and a flag
DIMS = (48, 128, 48)   # 12,464 parameters, 12,416 trainable (the last bias is frozen): / 3 leaves 2
# world -> (growth_interval, fp16 overflows {step: (rank, "inf" or "nan")}, bf16 {step: rank})
WORLDS = {2: (3, {2: (1, "inf"), 6: (1, "inf"), 7: (0, "inf")}, {3: 1}),
          3: (2, {3: (2, "nan"), 6: (0, "inf")}, {5: 2})}
HIDDEN = (3,)
RUNS = (("fp16", torch.float16, None), ("fp16, fp32 all-reduce", torch.float16, torch.float32),
        ("bf16", torch.bfloat16, None))
FORBIDDEN_MODULES = ("torch.amp", "torch.cuda.amp", "torch.cpu.amp", "labkit.precision",
                     "torch.nn.parallel", "labkit.ddp", "labkit.zero")
FORBIDDEN_NAMES = {"GradScaler", "autocast", "DistributedDataParallel", "DynamicLossScaler",
                   "ShardedLossScaler", "MixedPrecisionPolicy"}
LAUNCH_TIMEOUT = 90.0  # seconds: three short trainings on 3 ranks of a busy 2-core machine


# ----------------------------------------------------------------------------- the problem
def _mlp():
    """The MLP every rank starts from; its last bias is frozen (no gradient, never updated)."""
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIMS[0], DIMS[1]), nn.Tanh(), nn.Linear(DIMS[1], DIMS[2]))
    model[2].bias.requires_grad_(False)
    return model


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, DIMS[0], generator=g)  # cpu: a CPU generator, the same on every device
    y = torch.randn(8, DIMS[2], generator=g)  # cpu: as above; both (8, 48)
    return x, y * AMP[step % len(AMP)]


def _factor(step: int, rank: int, overflows: dict, big: dict) -> float:
    """What the checker multiplies this rank's loss by at this step."""
    hit = overflows.get(step)
    if hit and hit[0] == rank:
        return 2.0**100 if hit[1] == "inf" else float("nan")
    return BIG if big.get(step) == rank else 1.0


def _plan(world: int, dtype) -> tuple:
    """(growth_interval, overflows, big) of a run: fp16 runs overflow, the bf16 run gets BIG."""
    growth, overflows, big = WORLDS[world]
    return (growth, overflows, {}) if dtype == torch.float16 else (growth, {}, big)


def expected_scales(dtype, growth: int, overflows: dict, init: float = 2.0**16,
                    steps: int = STEPS) -> list:
    """The loss scale GradScaler's rules use at each step (1 for bf16: no scaling)."""
    if dtype == torch.bfloat16:
        return [1.0] * steps
    out, scale, good = [], init, 0
    for step in range(steps):
        out.append(scale)
        if step in overflows:
            scale, good = scale * 0.5, 0
        else:
            good += 1
            if good == growth:
                scale, good = scale * 2.0, 0
    return out


def reference(world: int, dtype, mistake: str = "") -> list:
    """fp32 SGD on the same batches: the ranks' gradients averaged, clipped to MAX_NORM (no
    epsilon), the overflowed steps skipped. `mistake` makes a known wrong version, to name it:
    "clip scaled" (the norm of the scaled gradient), "sum" (no mean), "eps" (clip_grad_norm_'s
    1e-6 added to the norm), "no clip", "scale after update" (unscaled by the scale the step's
    update() left: half the gradient at each growth)."""
    growth, overflows, big = _plan(world, dtype)
    scales = expected_scales(dtype, growth, overflows, steps=STEPS + 1)
    model = _mlp()
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(STEPS):
        if step in overflows:
            continue
        model.zero_grad()
        for r in range(world):
            x, y = _batch(step, r)
            loss = ((model(x) - y) ** 2).mean() * TINY * _factor(step, r, overflows, big)
            (loss * (1.0 if mistake == "sum" else 1.0 / world)).backward()
        with torch.no_grad():
            if mistake == "scale after update":
                for p in params:
                    p.grad *= scales[step] / scales[step + 1]
            norm = torch.cat([p.grad.reshape(-1) for p in params]).norm()
            norm = norm * scales[step] if mistake == "clip scaled" else norm
            norm = norm + 1e-6 if mistake == "eps" else norm
            coef = 1.0 if mistake == "no clip" else min(1.0, MAX_NORM / float(norm))
            for p in params:
                p -= LR * coef * p.grad
    return [p.detach().clone() for p in model.parameters()]


# ----------------------------------------------------------------------------- rank side
def _train_job(cls):
    """Rank side: the three runs with the reader's class; what the checker sees on the way."""
    import torch.distributed as dist

    from labkit import netcount
    from labkit.launch import note
    from labkit.zero.shard import storage_bytes

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "runs": [], "fp32_refused": False}
    try:                                         # the docstring's bad input: a clear error
        cls(_mlp(), LR, group=None, dtype=torch.float32)
    except ValueError:
        out["fp32_refused"] = True
    for name, dtype, reduce_dtype in RUNS:
        growth, overflows, big = _plan(world, dtype)
        model = _mlp()
        note(f"your constructor ({name}), rank {rank} of {world}")
        trainer = cls(model, LR, group=None, dtype=dtype, reduce_dtype=reduce_dtype,
                      max_norm=MAX_NORM, growth_interval=growth)
        params = list(model.parameters())
        masters = list(trainer.master_params())
        run = {"name": name, "dtypes": sorted({str(p.dtype) for p in params}),
               "master_dtypes": [str(m.dtype) for m in masters],
               "master_shapes": [tuple(m.shape) for m in masters],
               "shapes": [tuple(p.shape) for p in params],
               "master_bytes": storage_bytes(masters),
               "numel": sum(p.numel() for p in params),
               "trainable": sum(p.numel() for p in params if p.requires_grad),
               "shared": bool({m.untyped_storage().data_ptr() for m in masters}
                              & {p.untyped_storage().data_ptr() for p in params}),
               "returned": [], "scales": [], "calls": [], "hashes": []}
        dist.barrier()
        state = {}
        with netcount.socket_bytes() as wire:
            for step in range(STEPS):
                if step == RESUME and name == "fp16":        # a checkpoint, mid-run
                    state["saved"] = _saved(trainer)
                _step(trainer, run, step, rank, overflows, big, name)
        run["sent"] = wire.sent
        run["masters"] = [m.detach().clone().float() for m in trainer.master_params()]
        run["params"] = [p.detach().clone() for p in params]
        if state:                       # a fresh trainer resumed from it: the same steps again
            run["resumed"] = _resume(cls, state["saved"], growth, overflows, big, rank, name)
        out["runs"].append(run)
    return out


def _saved(trainer):
    import copy

    try:
        return copy.deepcopy(trainer.state_dict())
    except Exception as err:  # noqa: BLE001 - the resume case reports it; the others go on
        return err


def _resume(cls, saved, growth, overflows, big, rank, name) -> dict:
    """Steps RESUME.. of a trainer built the same way on a fresh model and loaded from `saved`."""
    resumed = {"returned": [], "scales": [], "calls": [], "hashes": []}
    try:
        if isinstance(saved, Exception):
            raise saved
        trainer = cls(_mlp(), LR, group=None, dtype=torch.float16, max_norm=MAX_NORM,
                      growth_interval=growth)
        trainer.load_state_dict(saved)
        for step in range(RESUME, STEPS):
            _step(trainer, resumed, step, rank, overflows, big, name + ", resumed")
    except Exception as err:  # noqa: BLE001 - a missing or failing state_dict: this case only
        resumed["error"] = f"{type(err).__name__}: {err}"
    return resumed


def _step(trainer, run: dict, step: int, rank: int, overflows: dict, big: dict, name: str):
    """One trainer.step on this rank's batch, recording what the checker sees: the loss_fn
    calls, the gradient that reached the loss (the scale used), the return, the masters' hash."""
    import hashlib

    from labkit.launch import note

    x, y = _batch(step, rank)
    seen = []

    def loss_fn(o, t):
        loss = ((o - t) ** 2).mean() * TINY * _factor(step, rank, overflows, big)
        if loss.requires_grad:      # the gradient reaching it: the scale used
            loss.register_hook(lambda g: seen.append(float(g)))
        seen.append("call")
        return loss
    note(f"your step {step} ({name}), rank {rank}")
    run["returned"].append(trainer.step(x, y, loss_fn))
    run["calls"].append(seen.count("call"))
    grads = [s for s in seen if s != "call"]
    run["scales"].append(grads[0] if len(grads) == 1 else None)
    flat = torch.cat([m.detach().reshape(-1).float() for m in trainer.master_params()])
    run["hashes"].append(hashlib.sha1(flat.numpy().tobytes()).hexdigest())


# ----------------------------------------------------------------------------- judging
def _check_storage(res: list, world: int) -> None:
    for r in res:
        if not r["fp32_refused"]:
            fail(f"rank {r['rank']}: MixedPrecisionTrainer(model, lr, dtype=torch.float32) did "
                 f"not raise ValueError: the compute dtype is float16 or bfloat16; say so")
        for run, (name, dtype, _) in zip(r["runs"], RUNS):
            where = f"rank {r['rank']}, {name} run"
            if run["dtypes"] != [str(dtype)]:
                fail(f"{where}: the model's parameters are {run['dtypes']} after construction; "
                     f"the forward and backward compute with a {dtype} copy. Which copy is it?")
            if run["master_shapes"] != run["shapes"] or set(run["master_dtypes"]) != {
                    "torch.float32"}:
                fail(f"{where}: master_params() gave {len(run['master_shapes'])} tensors of "
                     f"{sorted(set(run['master_dtypes']))}: one fp32 tensor per parameter, in "
                     f"model.parameters() order, shaped like it")
            if run["shared"]:
                fail(f"{where}: a master shares its storage with a model parameter: the masters "
                     f"must be separate fp32 tensors")
            if run["master_bytes"] != 4 * run["numel"]:
                fail(f"{where}: the masters' storage holds {run['master_bytes']:,} bytes for "
                     f"{run['numel']:,} elements; fp32 masters hold 4 bytes each "
                     f"({4 * run['numel']:,}). Are they fp32, and stored once?")


def _check_scale(res: list, world: int) -> None:
    for r in res:
        for run, (name, dtype, _) in zip(r["runs"][:2], RUNS[:2]):    # the fp16 runs
            growth, overflows, _big = _plan(world, dtype)
            want = expected_scales(dtype, growth, overflows)
            where = f"rank {r['rank']}, {name} run"
            for step, (calls, got, w, ret) in enumerate(zip(run["calls"], run["scales"], want,
                                                            run["returned"])):
                if calls != 1:
                    fail(f"{where}, step {step}: loss_fn was called {calls} times; call it once "
                         f"per step")
                if got is None:
                    fail(f"{where}, step {step}: no gradient reached the loss loss_fn returned: "
                         f"backward from it (times the scale)")
                if got != w:
                    fail(f"{where}, step {step}: the loss was scaled by {got:g} (the gradient "
                         f"that reached it), expected {w:g}. " + _scale_hint(got, w, step,
                                                                             growth, want))
                skip = step in overflows
                if bool(ret) == skip:
                    who = overflows.get(step)
                    fail(f"{where}, step {step}: step() returned {ret!r}, expected {not skip}"
                         + (f" (rank {who[0]}'s loss was {who[1]}: every rank must skip it)"
                            if who else " (no gradient overflowed)")
                         + ". Is found_inf the same on every rank? What does an inf or a NaN "
                           "in one rank's gradient become in the all-reduced sum?")


def _scale_hint(got, want, step, growth, scales) -> str:
    if got == 1.0:
        return ("The loss was not scaled: multiply it by the current scale before the "
                "backward (fp16 gradients of 1e-9 are 0 otherwise).")
    if step and got == scales[step - 1] and want > got:
        return (f"The scale should have grown x2 after {growth} good steps in a row: does your "
                f"count of good steps reach growth_interval, and restart after growing?")
    if want < got:
        return "After an overflowed step the scale halves: is the backoff applied?"
    return ("Which scale does the backward of the next step use: the one after this step's "
            "update?")


def _check_agreement(res: list, world: int) -> None:
    for i, (name, dtype, _) in enumerate(RUNS):
        base = res[0]["runs"][i]["hashes"]
        for r in res[1:]:
            hashes = r["runs"][i]["hashes"]
            bad = [s for s, (a, b) in enumerate(zip(base, hashes)) if a != b]
            if bad:
                fail(f"{name} run: after step {bad[0]}, rank {r['rank']}'s masters differ from "
                     f"rank 0's. Do all ranks apply the same averaged gradient, and skip the "
                     f"same steps?")
        growth, overflows, _big = _plan(world, dtype)
        for step in overflows:
            before = base[step - 1] if step else None
            if before is not None and base[step] != before:
                fail(f"{name} run: step {step} overflowed, yet the masters changed: a skipped "
                     f"step must leave them as they were")


def _distance(a: list, b: list) -> float:
    return sum(float((x - y).pow(2).sum()) for x, y in zip(a, b)) ** 0.5


_REFS: dict = {}        # (world, dtype, mistake) -> masters: the same in every check


def _ref(world, dtype, mistake=""):
    key = (world, str(dtype), mistake)
    if key not in _REFS:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)       # tiny matmuls: threads on a busy machine cost 10-30x
        try:
            _REFS[key] = reference(world, dtype, mistake)
        finally:
            torch.set_num_threads(threads)
    return _REFS[key]


MISTAKES = {        # a known mistake -> the hint, when the masters match fp32 SGD that made it
    "clip scaled": "They match fp32 training that clipped the SCALED gradient: is the norm you "
                   "clip taken before or after dividing by the loss scale?",
    "sum": "They match fp32 training with the ranks' gradients summed: an all-reduce sums; what "
           "turns the sum into the mean?",
    "eps": "They match clipping with torch's clip_grad_norm_, which adds 1e-6 to the norm (the "
           "gradients here are about 1e-9 each): clip exactly as the docstring says.",
    "no clip": "They match fp32 training without clipping: is max_norm applied, to the global "
               "norm of the whole model's averaged gradient?",
    "scale after update": "They match fp32 training whose gradient was halved at each growth of "
                          "the scale: do you unscale by the scale the backward used, or by the "
                          "one update() has just changed?",
}


def _check_tracking(res: list, world: int, runs=(0, 1), track: float = TRACK) -> None:
    start = [p.detach() for p in _mlp().parameters()]
    for i in runs:
        name, dtype, _ = RUNS[i]
        got = res[0]["runs"][i]["masters"]
        ref = _ref(world, dtype)
        moved, off = _distance(ref, start), _distance(got, ref)
        if off == off and off <= track * moved:          # NaN fails too
            continue
        hint = ("Are the gradients averaged over the ranks and unscaled (divided by the scale, "
                "in fp32) before the clip and the update?")
        rounded = sum(int((m == m.to(dtype).float()).sum()) for m in got) / sum(
            m.numel() for m in got)
        if off != off:
            hint = ("The masters hold NaN: was an overflowed step applied?" if dtype ==
                    torch.float16 else "The masters hold NaN: a bf16 gradient of 1e6 is finite; "
                    "where did it pass through a type with a smaller range?")
        elif rounded > 0.9:
            hint = (f"{rounded:.0%} of your masters are exactly {dtype} values: the update is "
                    f"made to the {dtype} weights (or rounded to them), where an update below "
                    f"half the spacing at the weight vanishes. Apply it to the fp32 masters, "
                    f"then copy them into the model.")
        elif _distance(got, start) < 0.2 * moved:
            hint = _stalled_hint(res, i, world)
        else:
            for mistake, said in MISTAKES.items():
                if _distance(got, _ref(world, dtype, mistake)) <= track * moved:
                    hint = said
                    break
        fail(f"{name} run: the fp32 masters are {off:.3g} away from fp32 training, which moved "
             f"the weights {moved:.3g} (allowed {track:.0%} of that). {hint}")
    for r in res:
        for i in runs:
            run = r["runs"][i]
            dtype = RUNS[i][1]
            if any(not torch.equal(m.to(dtype), p) for m, p in zip(run["masters"],
                                                                   run["params"])):
                fail(f"rank {r['rank']}, {run['name']} run: the model's parameters are not the "
                     f"masters rounded to {dtype} after the last step: refresh the compute copy "
                     f"from the masters after each update")
            frozen = [m for m, p in zip(run["masters"], _mlp().parameters())
                      if not p.requires_grad and not torch.equal(m, p.detach())]
            if frozen:
                fail(f"rank {r['rank']}, {run['name']} run: the frozen parameter's master "
                     f"changed: a parameter with requires_grad=False has no gradient to apply")


def _stalled_hint(res, i, world) -> str:
    """The weights barely moved: no loss scale, an unscale in fp16 or a clip of the scaled
    gradient (fp16 only, the bf16 run moves), clip_grad_norm_'s epsilon, or no masters?"""
    start = [p.detach() for p in _mlp().parameters()]
    run, dtype = res[0]["runs"][i], RUNS[i][1]
    if dtype == torch.float16 and set(run["scales"]) == {1.0}:
        return ("The weights barely moved, and the loss was never scaled (the gradient that "
                "reached it was 1): a gradient of 1e-9 is 0 in fp16. Multiply the loss by the "
                "scale before the backward.")
    eps = _ref(world, dtype, "eps")                 # moves a few % of the way: match it closely
    if _distance(run["masters"], eps) <= 0.1 * _distance(eps, start):
        return MISTAKES["eps"]
    bf16 = res[0]["runs"][2]["masters"]
    if dtype == torch.float16 and _distance(bf16, start) >= 0.2 * _distance(
            _ref(world, torch.bfloat16), start):
        return ("The weights barely moved, yet your bf16 run moved. Is the gradient divided by "
                "the scale in fp32 (in fp16 a gradient of 1e-9 is 0), and before the clip (the "
                "norm of the scaled gradient is scale times too big)?")
    return ("The weights barely moved: are the updates made to the fp32 masters (an update "
            "below half the spacing of fp16 or bf16 at the weight vanishes there)?")


def _width(run_spec) -> int:
    """Bytes per gradient element on the wire for a run of RUNS."""
    _name, dtype, reduce_dtype = run_spec
    return torch.finfo(reduce_dtype or dtype).bits // 8


def _ring(nbytes: float, world: int) -> float:
    from labkit.costs.comm import ring_bytes_sent_per_rank

    return ring_bytes_sent_per_rank("all_reduce", nbytes, world)


def _check_wire(res: list, world: int) -> None:
    for r in res:
        for run, spec in zip(r["runs"], RUNS):
            name, dtype, reduce_dtype = spec
            if run["sent"] is None:          # NCCL: no TCP counter sees the bytes
                continue
            width = _width(spec)
            per_step = _ring(run["trainable"] * width, world)
            taken = STEPS - len(_plan(world, dtype)[1])
            lo = taken * per_step
            hi = STEPS * (per_step * (1 + WIRE_SLACK) + WIRE_HEADERS)
            if lo <= run["sent"] <= hi:
                continue
            said = (f"rank {r['rank']}, {name} run: sent {run['sent']:,} bytes in {STEPS} steps "
                    f"(counted by the kernel); an all-reduce of {run['trainable']:,} gradients in "
                    f"{reduce_dtype or dtype} ({width} bytes each) sends {per_step:,.0f} per "
                    f"step over a ring of {world}: allowed {lo:,.0f} .. {hi:,.0f}. ")
            ratio = run["sent"] / (STEPS * per_step)
            if abs(ratio - 2) < 0.3:
                fail(said + "About twice that: in which dtype do the gradients travel? Cast them "
                            "to reduce_dtype before the all-reduce.")
            if abs(ratio - 0.5) < 0.15:
                fail(said + "About half: reduce_dtype=torch.float32 asks for fp32 on the wire.")
            fail(said + "Is each gradient all-reduced exactly once per step (a frozen "
                        "parameter has none), and nothing else sent but at most one small flag?")


def _check_bf16(res: list, world: int) -> None:
    _growth, _overflows, big = _plan(world, torch.bfloat16)
    for r in res:
        run = r["runs"][2]
        for step, (calls, got, ret) in enumerate(zip(run["calls"], run["scales"],
                                                     run["returned"])):
            where = f"rank {r['rank']}, bf16 run, step {step}"
            if calls != 1 or got is None:
                fail(f"{where}: loss_fn was called {calls} times / no gradient reached its loss: "
                     f"call it once and backward from it")
            if got != 1.0:
                fail(f"{where}: the loss was scaled by {got:g}. bf16 has fp32's 8 exponent "
                     f"bits: it needs no loss scale, and never skips a step")
            if not ret:
                extra = (f" (rank {big[step]}'s gradients passed fp16's max of 65504 there, "
                         f"far inside bf16's range)" if step in big else "")
                fail(f"{where}: step() returned {ret!r}: a bf16 step is never skipped{extra}. "
                     f"Which check, or which cast, belongs to fp16 only?")
    _check_tracking(res, world, runs=(2,))


def _check_resume(res: list, world: int) -> None:
    for r in res:
        run, resumed = r["runs"][0], r["runs"][0].get("resumed", {})
        where = f"rank {r['rank']}, fp16 run resumed at step {RESUME}"
        if "error" in resumed:
            fail(f"{where}: {resumed['error']}. state_dict() -> dict; load_state_dict(state) "
                 f"into a trainer built the same way on a fresh model")
        for i, step in enumerate(range(RESUME, STEPS)):
            got, want = resumed["scales"][i], run["scales"][step]
            if got != want:
                fail(f"{where}, step {step}: the loss was scaled by {got:g}, without the break "
                     f"by {want:g}. " + ("Is the loss scale part of the state?" if i == 0 else
                                    "Is the count of good steps since the last change of scale "
                                    "part of the state (it decides when the scale grows)?"))
            if resumed["returned"][i] != run["returned"][step]:
                fail(f"{where}, step {step}: step() returned {resumed['returned'][i]}, without "
                     f"the break {run['returned'][step]}")
            if resumed["hashes"][i] != run["hashes"][step]:
                fail(f"{where}, step {step}: the masters differ from the run without the break. "
                     f"Does load_state_dict restore every master, and refresh the model (the "
                     f"compute copy the next forward reads) from them?")


CHECKS = (("fp16/bf16 compute copy, fp32 masters in their own storage", _check_storage),
          ("loss scale: back off and skip on overflow, grow after the interval", _check_scale),
          ("every rank skips together; masters bit-identical after every step", _check_agreement),
          ("fp16 runs (fp16 and fp32 all-reduce) track fp32 SGD with clipping", _check_tracking),
          ("bytes on the wire match the all-reduce dtype (kernel-counted)", _check_wire),
          ("bf16: no loss scale, no skipped step, tracks fp32 SGD", _check_bf16),
          (f"state_dict() at step {RESUME}, loaded into a fresh trainer: the same steps follow",
           _check_resume))


def train_many(classes, world: int) -> list:
    """The rank side of several trainers in ONE launch (the tests' known-wrong answers):
    [per class: [per rank: results]]."""
    from labkit.launch import run

    per_rank = run(_train_many_job, world, args=(list(classes),), timeout=LAUNCH_TIMEOUT,
                   echo=False)
    return [[r[k] for r in per_rank] for k in range(len(classes))]


def _train_many_job(classes):
    return [_train_job(cls) for cls in classes]


def mixed_precision_trainer(cls, title: str, points: float, launched=None):
    """Exercise 9.3: cls(model, lr, group, dtype, reduce_dtype, max_norm, init_scale,
    growth_interval) with .step(x, y, loss_fn) -> bool and .master_params(). `launched`:
    {world: results} already run (train_many), graded without launching again."""
    c = Checker("9.3", title, points)
    bad = forbidden_used([cls], FORBIDDEN_MODULES, FORBIDDEN_NAMES)
    refuse = (f"your trainer uses {', '.join(bad)}: write the loss scaling, the master weights "
              f"and the all-reduce yourself") if bad else ""
    for world in (launched or WORLDS):
        label = "hidden case" if world in HIDDEN else f"{world} ranks"
        checks = [(name, lambda res, f=f, w=world: f(res, w)) for name, f in CHECKS]
        got: dict = {}
        launch = (lambda w=world: launched[w]) if launched else (lambda w=world: c.launch(
            _train_job, w, args=(cls,), timeout=LAUNCH_TIMEOUT))
        c.cases_on_one_launch(label, checks, lambda: got.setdefault("res", launch()),
                              refuse=refuse)
        wire = c.cases[-3]
        if wire["passed"] and world not in HIDDEN:       # the kernel's count, shown
            wire["name"] += "".join(
                f"\n      {run['name']}: rank 0 sent {run['sent']:,} B in {STEPS} steps; "
                f"ring all-reduces of {run['trainable']:,} x {_width(r)} B: "
                f"{STEPS * _ring(run['trainable'] * _width(r), world):,.0f} B"
                for run, r in zip(got["res"][0]["runs"], RUNS) if run["sent"] is not None)
    return c.finish()
