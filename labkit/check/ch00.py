"""Checkers for chapter 00: count the bytes of a model, a first collective, a first send/recv.

The reader writes
    state_bytes(spec, recipe) -> {"weights", "grads", "optimizer", "total"}: bytes of the model
        states of `spec` (a labkit.costs.models.ModelSpec) under `recipe` (a name in
        labkit.costs.memory.RECIPES), on one GPU, no sharding
    global_mean(x) -> the element-wise mean of x over all ranks, on every rank (one collective)
    shift_right(x) -> the tensor of the rank on the left (rank - 1, wrapping), with send/recv
The byte count is compared with labkit.costs.memory on several models and recipes; the two
distributed functions run on real processes at 2 and 3 ranks with awkward shapes.
"""
from __future__ import annotations

from labkit.check import Checker, fail, tensors_close

EXERCISES = {
    "0.1": ("bytes of a model under a recipe", 2),
    "0.2": ("a first collective: the mean over ranks", 2),
    "0.3": ("a first send/recv: shift right around a ring", 2),
}

BYTES_CASES = ["gpt2-124m", "llama2-7b", "llama2-70b", "gpt3-175b"]
WORLDS = (2, 3)  # one launch each: ~4 s of process start-up per launch on a laptop


# ----------------------------------------------------------------------------- 0.1
def expected_state_bytes(spec, recipe: str) -> dict:
    """The reference: labkit.costs.memory's model states of `spec`, one GPU, no sharding."""
    from labkit.costs import memory, models

    s = memory.model_states(models.num_params(spec), recipe=recipe)
    return {"weights": s.params, "grads": s.grads, "optimizer": s.optimizer, "total": s.total}


def state_bytes(fn):
    from labkit.costs import memory, models

    c = Checker("0.1", *EXERCISES["0.1"])
    recipes = list(memory.RECIPES)
    for i, name in enumerate(BYTES_CASES):
        spec = models.preset(name)
        for recipe in (recipes[i % len(recipes)], recipes[(i + 2) % len(recipes)]):
            with c.case(f"{spec.name}, recipe {recipe!r}"):
                got = fn(spec, recipe)
                want = expected_state_bytes(spec, recipe)
                if not isinstance(got, dict) or set(got) != set(want):
                    fail(f"return a dict with keys {sorted(want)}, got {got!r:.80}")
                n = models.num_params(spec)
                for key in want:
                    if abs(got[key] - want[key]) > 1e-6 * max(want[key], 1):
                        fail(f"{key}: got {got[key]:.5g} bytes, expected {want[key]:.5g} "
                             f"({want[key] / n:g} bytes per parameter x {n:,} parameters). "
                             f"Count the parameters with costs.models.num_params and take "
                             f"the bytes per parameter from costs.memory.RECIPES[{recipe!r}].")
    return c.finish()


# ----------------------------------------------------------------------------- 0.2 and 0.3
def _run_on_rank(kind, fn, shapes):
    """Rank side: the reader's function on rank-dependent data, next to the expected answer.
    The data are drawn on the CPU (the same numbers on any machine), then put on this rank's
    device (its GPU under NCCL); results come back on the CPU."""
    import torch
    import torch.distributed as dist

    from labkit.launch import device

    rank, n, dev = dist.get_rank(), dist.get_world_size(), device()
    out = []
    for shape in shapes:
        def data(r):
            g = torch.Generator().manual_seed(1000 * r + len(shape))
            return torch.randn(shape, generator=g, device="cpu").to(dev)
        x = data(rank)
        before = x.clone()
        got = fn(x)
        if kind == "mean":
            want = sum(data(r) for r in range(n)) / n
        else:
            want = data((rank - 1) % n)
        out.append({"got": got.cpu() if isinstance(got, torch.Tensor) else got,
                    "want": want.cpu(), "unchanged": torch.equal(x, before)})
    return out


def _distributed(exercise, kind, fn, shapes):
    c = Checker(exercise, *EXERCISES[exercise])
    for world in WORLDS:
        with c.case(f"{world} rank{'s' if world > 1 else ''}, shapes {shapes}"):
            for rank, rows in enumerate(c.launch(_run_on_rank, world, args=(kind, fn, shapes))):
                for shape, row in zip(shapes, rows):
                    what = f"rank {rank}'s result for shape {shape}"
                    tensors_close(row["got"], row["want"], rtol=1e-5, atol=1e-6, what=what)
                    if kind == "shift" and not row["unchanged"]:
                        fail(f"{what}: the input x was overwritten; receive into a new tensor "
                             f"(torch.empty_like(x)) so the caller keeps its data")
    return c.finish()


def global_mean(fn):
    return _distributed("0.2", "mean", fn, [(5,), (2, 3)])


def shift_right(fn):
    return _distributed("0.3", "shift", fn, [(7,), (1, 4)])
