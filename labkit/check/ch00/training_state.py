"""Exercise 0.1: YOUR prediction of the bytes of weights, gradients and optimizer states (master
copy included) for a dtype/optimizer combination, compared with labkit.costs.memory and with the
storage bytes (untyped_storage().nbytes(), deduplicated) of a real GPT after one real optimizer
step in that combination, within 1%.

    labkit.check.ch00.state_bytes(predict_state_bytes)
"""
from __future__ import annotations

import torch

from labkit.check import Checker, Forbidden, fail, graded
from labkit.costs import memory
from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus

EXERCISE, TITLE, POINTS = "0.1", "predict a model's training-state bytes, then measure them", 3
STATE_MODEL = dict(n_layer=2, n_embd=64, n_head=4, block_size=32)    # about 0.13 M parameters
# (weights dtype, gradients dtype, fp32 master copy, optimizer); the last two are hidden
STATE_CASES = [(torch.bfloat16, torch.bfloat16, True, "adam"),
               (torch.float32, torch.float32, False, "adam"),
               (torch.bfloat16, torch.float32, True, "adam"),
               (torch.float16, torch.float16, True, "momentum"),
               (torch.float32, torch.float32, False, "sgd")]
STATE_TOLERANCE = 0.01   # Adam's per-tensor `step` counters add 4 bytes per tensor
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}    # fp32 tensors per parameter
# the checker's own answer: a prediction that calls it predicts nothing (refused when read, and
# at run time under the grader: labkit.grade.guard)
ORACLE = Forbidden(("labkit.costs",), why="predict it yourself: labkit.costs is the checker's "
                   "own answer")


def costs_prediction(n_params: int, weights, grads, master: bool, optimizer: str) -> dict:
    """labkit.costs' answer: a Precision with the bytes per parameter of this combination."""

    opt = 4 * master + 4 * OPTIMIZER_STATES[optimizer]
    r = memory.Precision("case", weights.itemsize, grads.itemsize, opt)
    s = memory.model_states(n_params, recipe=r)
    return {"weights": s.params, "grads": s.grads, "optimizer": s.optimizer, "total": s.total}


def state_model_params() -> int:
    return sum(p.numel() for p in GPT(GPTConfig(**STATE_MODEL), seed=0).parameters())


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`: what the allocator really holds."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def measure_state(weights, grads, master: bool, optimizer: str) -> tuple:
    """(parameters, {"weights", "grads", "optimizer", "total"} measured in storage bytes) of a
    real GPT after one real step: forward and backward in the weights' dtype; gradients kept in
    `grads` (an fp32 copy, as Megatron's main_grad, when it differs); the optimizer updating an
    fp32 master copy when `master`, else the weights themselves."""

    model = GPT(GPTConfig(**STATE_MODEL), seed=0).to(weights)
    params = list(model.parameters())                           # tied weights listed once
    x, y = get_batch(tiny_corpus(), 2, STATE_MODEL["block_size"], 0)       # (2, T)
    model(x, y)[1].float().backward()
    grad = [p.grad if p.grad.dtype == grads else p.grad.to(grads) for p in params]
    for p in params:
        if p.grad.dtype != grads:
            p.grad = None                                       # only the kept copy remains
    updated = [p.detach().float().clone().requires_grad_() for p in params] if master else params
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
            "momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
            "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3)}[optimizer]
    opt = make(updated)
    if master:
        for m, g in zip(updated, grad):
            m.grad = g.float()                                  # transient: dropped after step
    opt.step()
    if master:
        for m in updated:
            m.grad = None
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    got = {"weights": _storage_bytes(params), "grads": _storage_bytes(grad),
           "optimizer": _storage_bytes((updated if master else []) + states)}
    got["total"] = got["weights"] + got["grads"] + got["optimizer"]
    return sum(p.numel() for p in params), got


def _state_hint(key, got, measured, n, weights, grads, master, optimizer) -> str:
    per = got / n
    said = (f"{key}: predicted {got:,.0f} B ({per:g} B/param), measured {measured:,} B "
            f"({measured / n:.3g} B/param). ")
    if key == "weights":
        return said + f"How many bytes does one {weights} element take (dtype.itemsize)?"
    if key == "grads":
        return said + f"Gradients are kept in {grads} here: how many bytes per element is that?"
    if key == "optimizer":
        return said + (f"What does {optimizer!r} keep per parameter besides the weights "
                       f"(momentum? variance?), in which dtype, and does the fp32 master copy "
                       f"(master={master}) belong to the optimizer's bytes?")
    return said + "total = weights + grads + optimizer"


@graded("0.1")
def state_bytes(fn, cases=None):
    """Exercise 0.1: fn(n_params, weights, grads, master, optimizer) -> {"weights", "grads",
    "optimizer", "total"} in bytes."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(ORACLE.refusal(fn))
    cases = STATE_CASES if cases is None else cases
    for i, (w, g, master, optimizer) in enumerate(cases):
        hidden = i >= 3
        name = (f"hidden case {i - 2}" if hidden else
                f"{str(w)[6:]} weights, {str(g)[6:]} grads, master={master}, {optimizer}")
        with c.case(name):
            got = fn(state_model_params(), w, g, master, optimizer)   # a stub stops here
            n, measured = measure_state(w, g, master, optimizer)
            keys = ("weights", "grads", "optimizer", "total")
            if not (isinstance(got, dict) and all(isinstance(got.get(k), (int, float))
                                                  for k in keys)):
                fail(f"return a dict of numbers with keys {list(keys)}, got {got!r:.80}")
            if not hidden:                    # predicted beside measured, in the table
                c.cases[-1]["name"] += "".join(
                    f"\n      {k}: predicted {got[k]:>10,.0f} B, measured {measured[k]:>10,} B"
                    for k in keys)
            want = costs_prediction(n, w, g, master, optimizer)
            for key in keys:
                if abs(want[key] - measured[key]) > STATE_TOLERANCE * max(measured[key], 1):
                    fail(f"labkit.costs says {want[key]:.4g} B for {key}, the storages "
                         f"{measured[key]} B: the checker disagrees with itself (please report)")
                if abs(got[key] - measured[key]) > STATE_TOLERANCE * measured["total"] or \
                        abs(got[key] - measured[key]) > STATE_TOLERANCE * measured[key] > 0:
                    fail(_state_hint(key, got[key], measured[key], n, w, g, master, optimizer))
    return c.finish()
