"""Exercise 6.2: a sharded checkpoint that reshards N -> M ranks, saved atomically.

    labkit.check.ch06.resharding(save_sharded, load_resharded)

A flat-sharded (ZeRO-3) state of bf16 weights and fp32 optimizer states is saved on N real
processes with YOUR save_sharded and loaded on M fresh ones with YOUR load_resharded, for hidden
(N, M) including uneven splits and tensors smaller than the world; every value and dtype is
compared. A rank is SIGKILLed in the middle of a second save: the first must still load. The
reader's code may not use labkit.checkpoint or torch.distributed.checkpoint: its source and
globals are read before anything runs, and the modules it imports on the ranks are watched
(labkit.check.refusal), so no module of this package imports labkit.checkpoint at its top.
"""
from __future__ import annotations

import os
import signal
import tempfile

import torch
import torch.distributed as dist

from labkit.check import Checker, Forbidden, fail, graded, reason_in
from labkit.launch import RankError, device, note

EXERCISE, TITLE, POINTS = ("6.2", "a sharded checkpoint that reshards N -> M ranks, saved "
                           "atomically", 6)
FORBIDDEN = Forbidden(("labkit.checkpoint", "torch.distributed.checkpoint"),
                      frozenset({"zero_layout", "shard_state", "load_sharded", "layout_from_json",
                                 "assemble_local", "save_full", "load_full", "FileSystemWriter",
                                 "FileSystemReader"}),
                      why="that writes the whole checkpoint for you. Write the format yourself "
                          "with torch.save / torch.load, os and json.")
PARAMS = {"wte.weight": (13, 6), "h.0.fc.weight": (10, 6), "h.0.fc.bias": (10,),
          "h.0.ln.bias": (3,)}                         # 3 elements: some ranks hold none
RESHARD_CASES = [(2, 2), (4, 2), (3, 2), (2, 3), (1, 4)]  # (saved at, loaded at); 2-5 hidden


def split_range(numel: int, world: int, rank: int) -> tuple:
    """(offset, length) of rank's run of a flat tensor: the first numel % world ranks get one
    extra."""
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



def _save_job(fn, folder, seed, crash=False):
    """Rank side: YOUR save of this rank's runs. With `crash`, the last rank is the victim: its
    shard kills the process (SIGKILL) the moment the save reads its tensors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = full_state(seed)
    shard = {k: v.clone().to(device()) for k, v in runs_of(full, world, rank).items()}
    if crash and rank == world - 1:
        shard = _DieOnRead(shard)
    note(f"your save_sharded, rank {rank} of {world}")
    with FORBIDDEN.imports_watched("your save_sharded"):
        fn(shard, {k: tuple(v.shape) for k, v in full.items()}, folder, rank, world)


class _DieOnRead(dict):
    """A shard that SIGKILLs its process when its tensors are read: a crash in the middle of the
    save, after every step the save took before touching the data (a first barrier, a cleanup)."""

    def _die(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    items = values = get = keys = copy = __getitem__ = __iter__ = __reduce_ex__ = _die


def _load_job(fn, folder):
    rank, world = dist.get_rank(), dist.get_world_size()
    note(f"your load_resharded, rank {rank} of {world}")
    with FORBIDDEN.imports_watched("your load_resharded"):
        got = fn(folder, rank, world)
    if isinstance(got, dict):
        got = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in got.items()}
    return {"rank": rank, "got": got}



def _assert_loaded(results: list, seed: int, world: int, saved_world: int) -> None:
    """Every rank got its runs of the state saved with `seed`: names, lengths, dtypes, values."""
    full = full_state(seed)
    for r, res in enumerate(results):     # the rank is its place in the launch, not what it says
        got = res["got"]
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
        c.launch(_save_job, saved_world, args=(save, folder, 1))
        res = c.launch(_load_job, world, args=(load, folder))
    _assert_loaded(res, 1, world, saved_world)


def _crash_case(c, save, load, folder):
    """Save seed 1 at 3 ranks, then seed 2 with rank 2 killed mid-save: seed 1 must load at 2."""
    c.launch(_save_job, 3, args=(save, folder, 1))
    try:
        c.launch(_save_job, 3, args=(save, folder, 2, True))
        fail("the save with a killed rank returned: did save_sharded read the shard's tensors?")
    except RankError as err:
        if "SIGKILL" not in str(err) or reason_in(err.remote_traceback):
            raise
    try:
        res = c.launch(_load_job, 2, args=(load, folder))
    except RankError as err:
        if reason_in(err.remote_traceback):
            raise                                       # a refusal says so itself
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
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(save, load))
    for i, (n, m) in enumerate(RESHARD_CASES):
        name = "saved at 2 ranks, loaded at 2" if i == 0 else f"hidden case {i}: {n} -> {m} ranks"
        with c.case(name):
            _reshard_case(c, save, load, n, m)
    with tempfile.TemporaryDirectory(prefix="labkit-ch06-crash-") as folder:
        with c.case("a rank killed mid-save leaves the previous checkpoint loadable"):
            _crash_case(c, save, load, folder)
        with c.case("a later complete save (another world size) replaces it"):
            _resave_case(c, save, load, folder)
    return c.finish()
