"""Exercise 9.3's seven checks, graded on one launch's results, with the hints for the known
mistakes (each replayed by an fp32 reference that made it, to name a failure).
"""
from __future__ import annotations

import torch

from labkit.check import fail
from labkit.check.ch09.trainer.run import (
    RESUME,
    RUNS,
    STEPS,
    TRACK,
    WIRE_HEADERS,
    WIRE_SLACK,
    expected_scales,
    mlp,
    plan,
    reference,
)
from labkit.costs.comm import ring_bytes_sent_per_rank


# ----------------------------------------------------------------------------- judging
def check_storage(res: list, world: int) -> None:
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


def check_scale(res: list, world: int) -> None:
    for r in res:
        for run, (name, dtype, _) in zip(r["runs"][:2], RUNS[:2]):    # the fp16 runs
            growth, overflows, _big = plan(world, dtype)
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


def check_agreement(res: list, world: int) -> None:
    for i, (name, dtype, _) in enumerate(RUNS):
        base = res[0]["runs"][i]["hashes"]
        for r in res[1:]:
            hashes = r["runs"][i]["hashes"]
            bad = [s for s, (a, b) in enumerate(zip(base, hashes)) if a != b]
            if bad:
                fail(f"{name} run: after step {bad[0]}, rank {r['rank']}'s masters differ from "
                     f"rank 0's. Do all ranks apply the same averaged gradient, and skip the "
                     f"same steps?")
        growth, overflows, _big = plan(world, dtype)
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


def check_tracking(res: list, world: int, runs=(0, 1), track: float = TRACK) -> None:
    start = [p.detach() for p in mlp().parameters()]
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
            frozen = [m for m, p in zip(run["masters"], mlp().parameters())
                      if not p.requires_grad and not torch.equal(m, p.detach())]
            if frozen:
                fail(f"rank {r['rank']}, {run['name']} run: the frozen parameter's master "
                     f"changed: a parameter with requires_grad=False has no gradient to apply")


def _stalled_hint(res, i, world) -> str:
    """The weights barely moved: no loss scale, an unscale in fp16 or a clip of the scaled
    gradient (fp16 only, the bf16 run moves), clip_grad_norm_'s epsilon, or no masters?"""
    start = [p.detach() for p in mlp().parameters()]
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


def element_bytes(run_spec) -> int:
    """Bytes per gradient element on the wire for a run of RUNS."""
    _name, dtype, reduce_dtype = run_spec
    return torch.finfo(reduce_dtype or dtype).bits // 8


def ring(nbytes: float, world: int) -> float:
    return ring_bytes_sent_per_rank("all_reduce", nbytes, world)


def check_wire(res: list, world: int) -> None:
    for r in res:
        for run, spec in zip(r["runs"], RUNS):
            name, dtype, reduce_dtype = spec
            if run["sent"] is None:          # NCCL: no TCP counter sees the bytes
                continue
            width = element_bytes(spec)
            per_step = ring(run["trainable"] * width, world)
            taken = STEPS - len(plan(world, dtype)[1])
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


def check_bf16(res: list, world: int) -> None:
    _growth, _overflows, big = plan(world, torch.bfloat16)
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
    check_tracking(res, world, runs=(2,))


def check_resume(res: list, world: int) -> None:
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
