"""Exercise 6.3: predict a sharded checkpoint's bytes on disk, then measure them.

    labkit.check.ch06.checkpoint_size(predict_checkpoint_bytes)   # (n_params, recipe, zero,
                                                                  #  world) -> {"total",
                                                                  #  "largest_file"}

YOUR prediction of a checkpoint's bytes (all files, and the largest one) for a precision recipe,
ZeRO stage and world size is compared with labkit.costs and with the bytes on disk (os.stat) of
labkit's own sharded save of a real GPT's state on real processes.
"""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from labkit.check import Checker, fail, graded
from labkit.check.mistakes import diagnose
from labkit.costs import memory
from labkit.costs.memory import get_recipe
from labkit.model import GPT, GPTConfig

EXERCISE, TITLE, POINTS = ("6.3", "predict a sharded checkpoint's bytes on disk, then measure "
                           "them", 3)
SIZE_MODEL = dict(n_embd=192, n_layer=4, n_head=4, block_size=32)   # about 1.8 M parameters
SIZE_CASES = [("mixed", 3, 4), ("mixed", 1, 2), ("fp32", 0, 2), ("no_master", 2, 3)]  # 4: hidden
TOLERANCE = 0.05   # torch.save adds a few hundred bytes per tensor; meta.json a few kB


def size_model_params() -> int:
    return sum(p.numel() for p in GPT(GPTConfig(**SIZE_MODEL), seed=0).parameters())


def costs_prediction(n_params: float, recipe: str, zero: int, world: int) -> dict:
    """labkit.costs' answer: weights + optimizer states (gradients are never saved); below stage 3
    the weights are replicated and written once, by rank 0; below stage 1 so is the optimizer."""

    r = memory.get_recipe(recipe)
    saved = memory.Precision(r.name, r.weights, 0, r.optimizer)
    return {"total": n_params * saved.total,
            "largest_file": n_params * memory.zero_bytes_per_param(saved, zero, world)}


def _size_state(recipe: str):
    """A real GPT's weights in the recipe's dtype, and its fp32 optimizer states (zeros: the
    bytes on disk do not depend on the values)."""

    r = get_recipe(recipe)
    params = dict(GPT(GPTConfig(**SIZE_MODEL), seed=0).named_parameters())
    wdtype = {2: torch.bfloat16, 4: torch.float32}[r.weights]
    kinds = ["master", "exp_avg", "exp_avg_sq"][3 - int(r.optimizer // 4):]  # fp32 each
    weights = {k: v.detach().to(wdtype) for k, v in params.items()}
    opt = {f"{kind}/{k}": torch.zeros_like(v, dtype=torch.float32)  # cpu: like the model's
           for k, v in params.items() for kind in kinds}
    return weights, opt


def _size_layout(weights: dict, opt: dict, zero: int, world: int) -> dict:
    """ZeRO's layout: optimizer states split from stage 1, weights from stage 3; the rest
    replicated (every rank holds it, labkit's save writes it once, from the lowest rank)."""
    # lazy: a module the ranks import must not load labkit.checkpoint (6.2 watches its import)
    from labkit.checkpoint.sharded import Piece, shapes_of, zero_layout

    shapes = shapes_of({**weights, **opt})
    split = (set(opt) if zero >= 1 else set()) | (set(weights) if zero == 3 else set())
    pieces = zero_layout({k: shapes[k] for k in split}, world)["pieces"]
    for k in shapes.keys() - split:
        n = int(torch.Size(shapes[k][0]).numel())
        pieces += [Piece(k, r, (0,), (n,), flat=True) for r in range(world)]
    return {"world": world, "tensors": shapes, "pieces": pieces}


def _size_job(recipe: str, zero: int, root: str) -> None:
    # lazy: a module the ranks import must not load labkit.checkpoint (6.2 watches its import)
    from labkit.checkpoint import sharded

    weights, opt = _size_state(recipe)
    layout = _size_layout(weights, opt, zero, dist.get_world_size())
    mine = sharded.shard_state({**weights, **opt}, layout, dist.get_rank())
    sharded.save_sharded(root, 1, mine, layout)


def measure_on_disk(folder) -> dict:
    """Bytes of every file of a checkpoint folder, by os.stat: what the disk holds."""

    sizes = [os.stat(os.path.join(folder, f)).st_size for f in os.listdir(folder)]
    return {"total": sum(sizes), "largest_file": max(sizes)}


def size_mistakes(key: str, recipe: str, world: int) -> list:
    """(predicted / measured, hint) of the known wrong answers."""
    r = get_recipe(recipe)
    p, g, o = r.weights, r.grads, r.optimizer
    return ([(1 / world, "That is about one rank's share: 'total' counts every rank's file.")]
            if key == "total" and world > 1 else []) + [
        (p / (p + o), "Only the weights? A checkpoint that can resume training also holds the "
                      "optimizer states: which does this recipe keep, and in which dtype?"),
        ((p + g + o) / (p + o), "Gradients are not saved: the next step recomputes them.")]


def _size_hint(key, got, measured, recipe, zero, world) -> str:
    said = f"{key}: predicted {got / 1e6:.3f} MB, measured {measured / 1e6:.3f} MB. "
    default = ((f"At ZeRO stage {zero}, which states are sharded and which are whole on every "
                "rank? A whole tensor is written once: by which rank?")
               if key == "largest_file" and zero < 3 else
               (f"What does a rank hold at ZeRO stage {zero} under recipe {recipe!r} "
                "(labkit.costs.memory.RECIPES), and which of it goes into a checkpoint?"))
    return said + diagnose(got / measured, size_mistakes(key, recipe, world), default, TOLERANCE)


@graded("6.3")
def checkpoint_size(fn):
    """Exercise 6.3: fn(n_params, recipe, zero, world) -> {"total": bytes of all the
    checkpoint's files, "largest_file": bytes of the largest one}."""
    c = Checker(EXERCISE, TITLE, POINTS)
    n = size_model_params()
    for i, (recipe, zero, world) in enumerate(SIZE_CASES):
        hidden = i == len(SIZE_CASES) - 1
        with c.case("hidden case" if hidden else f"{recipe}, ZeRO-{zero}, {world} ranks"):
            got = fn(n, recipe, zero, world)
            if not (isinstance(got, dict) and all(isinstance(got.get(k), (int, float))
                                                  for k in ("total", "largest_file"))):
                fail('return {"total": bytes, "largest_file": bytes}, numbers')
            with tempfile.TemporaryDirectory(prefix="labkit-ch06-size-") as root:
                c.measure(_size_job, world, args=(recipe, zero, root))
                measured = measure_on_disk(f"{root}/step_00000001")
            want = costs_prediction(n, recipe, zero, world)
            if not hidden:                # predicted beside measured, in the table
                c.cases[-1]["name"] += "".join(
                    f"\n      {k}: predicted {got[k] / 1e6:.2f} MB, measured "
                    f"{measured[k] / 1e6:.2f} MB" for k in ("total", "largest_file"))
            for key in ("total", "largest_file"):
                if abs(want[key] / measured[key] - 1) > TOLERANCE:
                    fail(f"labkit.costs says {want[key]:.4g} B for {key}, the disk {measured[key]}"
                         " B: the checker disagrees with itself (please report it)")
                if abs(got[key] / measured[key] - 1) > TOLERANCE:
                    fail(_size_hint(key, got[key], measured[key], recipe, zero, world))
    return c.finish()
