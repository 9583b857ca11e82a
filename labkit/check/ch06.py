"""Checkers for chapter 06 (checkpointing and fault tolerance).

    labkit.check.ch06.exact_resume(capture_rng_state, restore_rng_state)   # 6.1
    labkit.check.ch06.resharding(save_sharded, load_resharded)            # 6.2
    labkit.check.ch06.checkpoint_size(predict_checkpoint_bytes)           # 6.3

6.1: the checker trains the chapter's tiny run (dropout on, data reshuffled by NumPy, windows
jittered by Python's `random`, torch drawing dropout masks), interrupts it on real processes,
saves a full checkpoint whose random state comes from YOUR capture function, starts fresh
processes, restores with YOUR restore function, and compares the final weights bit for bit with
a run that was never interrupted, at 1 and 2 ranks.

6.2: a flat-sharded (ZeRO-3) state of bf16 weights and fp32 optimizer states is saved on N real
processes with YOUR save_sharded and loaded on M fresh ones with YOUR load_resharded, for hidden
(N, M) including uneven splits and tensors smaller than the world; every value and dtype is
compared. A rank is SIGKILLed in the middle of a second save: the first must still load. The
reader's code may not use labkit.checkpoint or torch.distributed.checkpoint (source, globals and
the modules imported on the ranks are all looked at).

6.3: YOUR prediction of a checkpoint's bytes (all files, and the largest one) for a precision
recipe, ZeRO stage and world size is compared with labkit.costs and with the bytes on disk
(os.stat) of labkit's own sharded save of a real GPT's state on real processes.

Long because: the notebook imports one checker module per chapter, and 6.2's rank jobs, its
guard against labkit's own checkpoint code and its hints belong together.
"""
from __future__ import annotations

import random
import tempfile

import numpy as np
import torch

from labkit.check import Checker, fail, graded

EXERCISES = {"6.1": ("save and restore the random state for an exact resume", 4),
             "6.2": ("a sharded checkpoint that reshards N -> M ranks, saved atomically", 6),
             "6.3": ("predict a sharded checkpoint's bytes on disk, then measure them", 3)}


def _draws():
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist())


def assert_round_trip(capture, restore) -> None:
    """Capture, draw from each generator, restore, draw again: the draws must repeat."""
    state = capture()
    first = _draws()
    restore(state)
    again = _draws()
    for name, a, b in zip(("Python's random", "NumPy's global generator", "torch's CPU generator"),
                          first, again):
        if a != b:
            fail(f"after restore, {name} gave {b} instead of {a}: capture and restore it too")


def assert_weights_only(capture) -> None:
    """The state must survive torch.save + torch.load(weights_only=True)."""
    import io

    buf = io.BytesIO()
    torch.save(capture(), buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as err:  # noqa: BLE001
        fail("the captured state cannot be loaded with torch.load(weights_only=True): keep only "
             "tensors, numbers, strings, lists, tuples and dicts (convert NumPy arrays with "
             f"torch.from_numpy). The loader said: {str(err).splitlines()[0][:160]}")


def assert_resume_matches(first: list, later: list, world: int, expect_equal: bool = True):
    """first[r] = (straight, first-part) results, later[r] = (resumed,) results, per rank."""
    for r in range(world):
        straight, resumed = first[r][0][0], later[r][0][0]
        same = torch.equal(straight, resumed)
        if expect_equal and not same:
            diff = (straight - resumed).abs().max().item()
            fail(f"rank {r} of {world}: the resumed run ends with different weights (max "
                 f"difference {diff:.3g}). Some generator's state is not restored: dropout uses "
                 f"torch, shuffling NumPy, jitter Python's random.")
        if not expect_equal and same:
            fail(f"rank {r}: without the random state the resume should diverge, but it did not")


@graded("6.1")
def exact_resume(capture, restore, worlds=(1, 2)):
    from labkit.checkpoint.resume import RunConfig, resume_jobs

    c = Checker("6.1", EXERCISES["6.1"][0], points=EXERCISES["6.1"][1])
    cfg = RunConfig()
    with c.case("restore repeats the draws of Python, NumPy and torch (in this process)"):
        assert_round_trip(capture, restore)
    with c.case("the state loads with torch.load(weights_only=True)"):
        assert_weights_only(capture)
    for world in worlds:
        with c.case(f"{world} rank(s): stopped at step 3, resumed in fresh processes, "
                    f"bitwise equal at step 8"):
            with tempfile.TemporaryDirectory(prefix="labkit-ch06-") as root:
                first = c.launch(resume_jobs, world,
                                 args=(cfg, 8, 3, root, ("straight", "first"), capture, restore))
                later = c.launch(resume_jobs, world,
                                 args=(cfg, 8, 3, root, ("resume",), capture, restore))
            assert_resume_matches(first, later, world)
    return c.finish()


# ----------------------------------------------------------------------------- 6.2
FORBIDDEN_MODULES = ("labkit.checkpoint", "torch.distributed.checkpoint")
FORBIDDEN_NAMES = {"zero_layout", "shard_state", "load_sharded", "layout_from_json",
                   "assemble_local", "save_full", "load_full", "FileSystemWriter",
                   "FileSystemReader"}
PARAMS = {"wte.weight": (13, 6), "h.0.fc.weight": (10, 6), "h.0.fc.bias": (10,),
          "h.0.ln.bias": (3,)}                         # 3 elements: some ranks hold none
RESHARD_CASES = [(2, 2), (4, 2), (3, 2), (2, 3), (1, 4)]  # (saved at, loaded at); 2-5 hidden


def split_range(numel: int, world: int, rank: int) -> tuple:
    """(offset, length) of rank's run of a flat tensor: the first numel % world ranks get one extra."""
    base, extra = divmod(numel, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def full_state(seed: int) -> dict:
    """What a ZeRO rank shards: bf16 weights, fp32 master copies and Adam moments (CPU, seeded)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in PARAMS.items():
        master = torch.randn(shape, generator=g)  # cpu: the same numbers on every rank
        state[name] = master.to(torch.bfloat16)
        state["master/" + name] = master
        state["exp_avg/" + name] = torch.randn(shape, generator=g) * 1e-3  # cpu: as above
        state["exp_avg_sq/" + name] = torch.rand(shape, generator=g) * 1e-6  # cpu: as above
    return state


def runs_of(state: dict, world: int, rank: int) -> dict:
    """{name: rank's contiguous run of the flattened tensor}."""
    out = {}
    for name, t in state.items():
        off, n = split_range(t.numel(), world, rank)
        out[name] = t.reshape(-1)[off:off + n]
    return out


def _new_forbidden(before: set) -> list:
    import sys
    return sorted(m for m in set(sys.modules) - before if m.startswith(FORBIDDEN_MODULES))


def _save_job(fn, folder, seed, crash=False):
    """Rank side: YOUR save of this rank's runs. With `crash`, the last rank is the victim: its
    shard kills the process (SIGKILL) the moment the save reads its tensors."""
    import sys

    import torch.distributed as dist

    from labkit.launch import device, note

    rank, world = dist.get_rank(), dist.get_world_size()
    full = full_state(seed)
    shard = {k: v.clone().to(device()) for k, v in runs_of(full, world, rank).items()}
    if crash and rank == world - 1:
        shard = _DieOnRead(shard)
    before = set(sys.modules)
    note(f"your save_sharded, rank {rank} of {world}")
    fn(shard, {k: tuple(v.shape) for k, v in full.items()}, folder, rank, world)
    return _new_forbidden(before)


class _DieOnRead(dict):
    """A shard that SIGKILLs its process when its tensors are read: a crash in the middle of the
    save, after every step the save took before touching the data (a first barrier, a cleanup)."""

    def _die(self, *args, **kwargs):
        import os
        import signal
        os.kill(os.getpid(), signal.SIGKILL)

    items = values = get = keys = copy = __getitem__ = __iter__ = __reduce_ex__ = _die


def _load_job(fn, folder):
    import sys

    import torch.distributed as dist

    from labkit.launch import note

    rank, world = dist.get_rank(), dist.get_world_size()
    before = set(sys.modules)
    note(f"your load_resharded, rank {rank} of {world}")
    got = fn(folder, rank, world)
    if isinstance(got, dict):
        got = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in got.items()}
    return {"rank": rank, "got": got, "forbidden": _new_forbidden(before)}


def forbidden_used(*fns) -> list:
    """What of labkit.checkpoint / torch.distributed.checkpoint (and FORBIDDEN_NAMES) the
    functions, and the helpers they call from the same namespace, import, name or reach."""
    from labkit.check.guards import forbidden_used as used

    return used(fns, FORBIDDEN_MODULES, FORBIDDEN_NAMES)


def _assert_loaded(results: list, seed: int, world: int, saved_world: int) -> None:
    """Every rank got its runs of the state saved with `seed`: names, lengths, dtypes, values."""
    full = full_state(seed)
    for res in results:
        r, got = res["rank"], res["got"]
        if res["forbidden"]:
            fail(f"rank {r} imported {', '.join(res['forbidden'])}: write the format yourself")
        if not isinstance(got, dict) or set(got) != set(full):
            have = sorted(got) if isinstance(got, dict) else type(got).__name__
            fail(f"rank {r} of {world}: load_resharded returned {have}; expected a dict with "
                 f"every saved tensor's name: {sorted(full)}")
        want = runs_of(full, world, r)
        for name, w in want.items():
            _assert_run(name, got[name], w, r, world, saved_world)


def _assert_run(name, got, want, rank, world, saved_world) -> None:
    where = f"rank {rank} of {world} (saved at {saved_world}): {name!r}"
    if not isinstance(got, torch.Tensor) or got.numel() != want.numel():
        n = got.numel() if isinstance(got, torch.Tensor) else type(got).__name__
        fail(f"{where} has {n} elements, expected {want.numel()}. A rank's run depends on the "
             f"world you LOAD at: split_range(numel, world, rank), where the first numel % world "
             f"ranks hold one extra element. Which saved runs overlap it?")
    if got.dtype != want.dtype:
        fail(f"{where} came back as {got.dtype}, saved as {want.dtype}: weights are bf16, "
             f"optimizer states fp32. Does every tensor keep the dtype it was saved with?")
    bad = (got.reshape(-1) != want).nonzero()
    if len(bad):
        fail(f"{where}: {len(bad)} of {want.numel()} values differ, the first at element "
             f"{int(bad[0])} of the run. For each saved rank whose run overlaps yours, which "
             f"offset inside ITS run does the overlap start at, and which inside yours?")


def _reshard_case(c, save, load, saved_world, world):
    with tempfile.TemporaryDirectory(prefix="labkit-ch06-shard-") as folder:
        bad = c.launch(_save_job, saved_world, args=(save, folder, 1))
        if any(bad):
            fail(f"save_sharded imported {', '.join(sorted(set(sum(bad, []))))} on the ranks")
        res = c.launch(_load_job, world, args=(load, folder))
    _assert_loaded(res, 1, world, saved_world)


def _crash_case(c, save, load, folder):
    """Save seed 1 at 3 ranks, then seed 2 with rank 2 killed mid-save: seed 1 must load at 2."""
    from labkit.launch import RankError

    c.launch(_save_job, 3, args=(save, folder, 1))
    try:
        c.launch(_save_job, 3, args=(save, folder, 2, True))
        fail("the save with a killed rank returned: did save_sharded read the shard's tensors?")
    except RankError as err:
        if "SIGKILL" not in str(err):
            raise
    try:
        res = c.launch(_load_job, 2, args=(load, folder))
    except RankError as err:
        fail(f"{ATOMIC_HINT}\n(loading raised: {err.remote_traceback.strip().splitlines()[-1]})")
    if _holds_new_values(res, 2):
        fail(ATOMIC_HINT)
    _assert_loaded(res, 1, 2, 3)


ATOMIC_HINT = ("after a save killed half-way (rank 2 of 3 died while the others wrote), the "
               "previous checkpoint must still load whole. Do the others' new files replace the "
               "old ones before every rank has finished? Where could you write them first, and "
               "what single step would make the new checkpoint the one a loader reads?")


def _holds_new_values(results: list, world: int) -> bool:
    """Did any loaded value come from the save that was killed (seed 2)?"""
    old, new = full_state(1), full_state(2)
    for res in results:
        got = res["got"] if isinstance(res["got"], dict) else {}
        for name, want in runs_of(new, world, res["rank"]).items():
            t = got.get(name)
            if isinstance(t, torch.Tensor) and t.numel() == want.numel() and t.dtype == want.dtype:
                before = runs_of(old, world, res["rank"])[name]
                if bool(((t.reshape(-1) == want) & (want != before)).any()):
                    return True
    return False


def _resave_case(c, save, load, folder):
    """After the crash, a complete save at 2 ranks replaces it; loaded at 4."""
    c.launch(_save_job, 2, args=(save, folder, 3))
    res = c.launch(_load_job, 4, args=(load, folder))
    try:
        _assert_loaded(res, 3, 4, 2)
    except AssertionError as err:
        fail("a complete save at 2 ranks into a folder that still holds a 3-rank checkpoint (and "
             "an unfinished save) must load as the new one. Does your loader read only the files "
             f"of the last committed save?\n(what went wrong: {err})")


@graded("6.2")
def resharding(save, load):
    """Exercise 6.2: save(shard, shapes, folder, rank, world) on N ranks, then
    load(folder, rank, world) -> {name: this rank's run} on M ranks."""
    c = Checker("6.2", *EXERCISES["6.2"])
    bad = forbidden_used(save, load)
    refuse = (f"your code uses {', '.join(bad)}: that writes the whole checkpoint for you. Write "
              "the format yourself with torch.save / torch.load, os and json.") if bad else ""
    for i, (n, m) in enumerate(RESHARD_CASES):
        name = "saved at 2 ranks, loaded at 2" if i == 0 else f"hidden case {i}: {n} -> {m} ranks"
        with c.case(name):
            if refuse:
                fail(refuse)
            _reshard_case(c, save, load, n, m)
    with tempfile.TemporaryDirectory(prefix="labkit-ch06-crash-") as folder:
        with c.case("a rank killed mid-save leaves the previous checkpoint loadable"):
            if refuse:
                fail(refuse)
            _crash_case(c, save, load, folder)
        with c.case("a later complete save (another world size) replaces it"):
            if refuse:
                fail(refuse)
            _resave_case(c, save, load, folder)
    return c.finish()


# ----------------------------------------------------------------------------- 6.3
SIZE_MODEL = dict(n_embd=192, n_layer=4, n_head=4, block_size=32)   # about 1.8 M parameters
SIZE_CASES = [("mixed", 3, 4), ("mixed", 1, 2), ("fp32", 0, 2), ("no_master", 2, 3)]  # 4: hidden
TOLERANCE = 0.05   # torch.save adds a few hundred bytes per tensor; meta.json a few kB


def size_model_params() -> int:
    from labkit.model import GPT, GPTConfig
    return sum(p.numel() for p in GPT(GPTConfig(**SIZE_MODEL), seed=0).parameters())


def costs_prediction(n_params: float, recipe: str, stage: int, world: int) -> dict:
    """labkit.costs' answer: weights + optimizer states (gradients are never saved); below stage 3
    the weights are replicated and written once, by rank 0; below stage 1 so is the optimizer."""
    from labkit.costs import memory

    r = memory.get_recipe(recipe)
    saved = memory.Precision(r.name, r.weights, 0, r.optimizer)
    return {"total": n_params * saved.total,
            "largest_file": n_params * memory.zero_bytes_per_param(saved, stage, world)}


def _size_state(recipe: str):
    """A real GPT's weights in the recipe's dtype, and its fp32 optimizer states (zeros: the
    bytes on disk do not depend on the values)."""
    from labkit.costs.memory import get_recipe
    from labkit.model import GPT, GPTConfig

    r = get_recipe(recipe)
    params = dict(GPT(GPTConfig(**SIZE_MODEL), seed=0).named_parameters())
    wdtype = {2: torch.bfloat16, 4: torch.float32}[r.weights]
    kinds = ["master", "exp_avg", "exp_avg_sq"][3 - int(r.optimizer // 4):]  # fp32 each
    weights = {k: v.detach().to(wdtype) for k, v in params.items()}
    opt = {f"{kind}/{k}": torch.zeros_like(v, dtype=torch.float32)  # cpu: like the model's
           for k, v in params.items() for kind in kinds}
    return weights, opt


def _size_layout(weights: dict, opt: dict, stage: int, world: int) -> dict:
    """ZeRO's layout: optimizer states split from stage 1, weights from stage 3; the rest
    replicated (every rank holds it, labkit's save writes it once, from the lowest rank)."""
    from labkit.checkpoint.sharded import Piece, shapes_of, zero_layout

    shapes = shapes_of({**weights, **opt})
    split = (set(opt) if stage >= 1 else set()) | (set(weights) if stage == 3 else set())
    pieces = zero_layout({k: shapes[k] for k in split}, world)["pieces"]
    for k in shapes.keys() - split:
        n = int(torch.Size(shapes[k][0]).numel())
        pieces += [Piece(k, r, (0,), (n,), flat=True) for r in range(world)]
    return {"world": world, "tensors": shapes, "pieces": pieces}


def _size_job(recipe: str, stage: int, root: str) -> None:
    import torch.distributed as dist

    from labkit.checkpoint import sharded

    weights, opt = _size_state(recipe)
    layout = _size_layout(weights, opt, stage, dist.get_world_size())
    mine = sharded.shard_state({**weights, **opt}, layout, dist.get_rank())
    sharded.save_sharded(root, 1, mine, layout)


def measure_on_disk(folder) -> dict:
    """Bytes of every file of a checkpoint folder, by os.stat: what the disk holds."""
    import os

    sizes = [os.stat(os.path.join(folder, f)).st_size for f in os.listdir(folder)]
    return {"total": sum(sizes), "largest_file": max(sizes)}


def _size_hint(key, got, measured, recipe, stage, world) -> str:
    from labkit.costs.memory import get_recipe

    r, ratio = get_recipe(recipe), got / measured
    p, g, o = r.weights, r.grads, r.optimizer
    near = lambda x: abs(ratio - x) <= TOLERANCE * x  # noqa: E731
    said = f"{key}: predicted {got / 1e6:.3f} MB, measured {measured / 1e6:.3f} MB. "
    if key == "total" and world > 1 and near(1 / world):
        return said + "That is about one rank's share: 'total' counts every rank's file."
    if near(p / (p + o)):
        return said + ("Only the weights? A checkpoint that can resume training also holds the "
                       "optimizer states: which does this recipe keep, and in which dtype?")
    if near((p + g + o) / (p + o)):
        return said + "Gradients are not saved: the next step recomputes them."
    if key == "largest_file" and stage < 3:
        return said + (f"At ZeRO stage {stage}, which states are sharded and which are whole on "
                       "every rank? A whole tensor is written once: by which rank?")
    return said + (f"What does a rank hold at ZeRO stage {stage} under recipe {recipe!r} "
                   "(labkit.costs.memory.RECIPES), and which of it goes into a checkpoint?")


@graded("6.3")
def checkpoint_size(fn):
    """Exercise 6.3: fn(n_params, recipe, stage, world) -> {"total": bytes of all the
    checkpoint's files, "largest_file": bytes of the largest one}."""
    c = Checker("6.3", *EXERCISES["6.3"])
    n = size_model_params()
    for i, (recipe, stage, world) in enumerate(SIZE_CASES):
        hidden = i == len(SIZE_CASES) - 1
        with c.case("hidden case" if hidden else f"{recipe}, ZeRO-{stage}, {world} ranks"):
            got = fn(n, recipe, stage, world)
            if not (isinstance(got, dict) and all(isinstance(got.get(k), (int, float))
                                                  for k in ("total", "largest_file"))):
                fail('return {"total": bytes, "largest_file": bytes}, numbers')
            with tempfile.TemporaryDirectory(prefix="labkit-ch06-size-") as root:
                c.launch(_size_job, world, args=(recipe, stage, root))
                measured = measure_on_disk(f"{root}/step_00000001")
            want = costs_prediction(n, recipe, stage, world)
            if not hidden:                # predicted beside measured, in the table
                c.cases[-1]["name"] += "".join(
                    f"\n      {k}: predicted {got[k] / 1e6:.2f} MB, measured "
                    f"{measured[k] / 1e6:.2f} MB" for k in ("total", "largest_file"))
            for key in ("total", "largest_file"):
                if abs(want[key] / measured[key] - 1) > TOLERANCE:
                    fail(f"labkit.costs says {want[key]:.4g} B for {key}, the disk {measured[key]}"
                         " B: the checker disagrees with itself (please report it)")
                if abs(got[key] / measured[key] - 1) > TOLERANCE:
                    fail(_size_hint(key, got[key], measured[key], recipe, stage, world))
    return c.finish()
