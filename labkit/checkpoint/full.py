"""A full checkpoint: everything needed to continue as if the run had never stopped.

    save_full(root, step, model, opt, data_state=loader.state_dict())   # on every rank
    info = load_full(root, model, opt)           # newest committed step; info["step"], ["data"]

What "everything" means: model weights, optimizer state (Adam's moments and step count), the
step, the position in the data, and each rank's random generators (labkit.checkpoint.rng). With
data-parallel replicas the weights are the same on every rank, so rank 0 writes them once; the
RNG and the data position differ per rank, so each rank writes its own small `rank{r}.pt`.

Layout of one checkpoint folder (committed atomically, see labkit.checkpoint.atomic):
    step_00000010/model.pt     model + optimizer (rank 0)
    step_00000010/rank0.pt     rank 0's RNG and data position   (rank1.pt, ...)
    step_00000010/meta.json    kind, step, world size, tensor names/shapes, sizes, SHA-256
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from labkit.checkpoint import atomic
from labkit.checkpoint.errors import (
    CheckpointError,
    LayoutError,
    WrongModelError,
    describe_mismatch,
)
from labkit.checkpoint.rng import rng_state, set_rng_state


def rank_world(group=None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _barrier(group):
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group)


def _gather_objects(obj, group):
    if dist.is_available() and dist.is_initialized():
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out
    return [obj]


def fingerprint(state_dict: dict) -> dict:
    """{name: [shape..., dtype]}: enough to tell another model apart before loading a byte."""
    return {k: [*v.shape, str(v.dtype)] for k, v in state_dict.items() if torch.is_tensor(v)}


def save_full(root, step: int, model, optimizer=None, *, data_state=None, extra=None,
              group=None, capture=rng_state) -> Path:
    """Save a full checkpoint of `step` under `root`; call on every rank. Returns its folder.

    capture: the function that captures this rank's random state (the exercise swaps it)."""
    rank, world = rank_world(group)
    name = atomic.step_name(step)
    if rank == 0:
        atomic.begin(root, name)
    _barrier(group)  # the temporary folder exists before anyone writes into it
    tmp = atomic.tmp_dir(root, name)
    files = {}
    if rank == 0:
        files["model.pt"] = atomic.save_file(
            {"model": model.state_dict(),
             "optimizer": optimizer.state_dict() if optimizer is not None else None,
             "extra": extra}, tmp / "model.pt")
    files[f"rank{rank}.pt"] = atomic.save_file({"rng": capture(), "data": data_state},
                                               tmp / f"rank{rank}.pt")
    everyone = _gather_objects(files, group)  # also a barrier: every file is written and fsynced
    if rank == 0:
        meta = {"kind": "full", "step": step, "world": world,
                "fingerprint": fingerprint(model.state_dict()),
                "files": {k: v for f in everyone for k, v in f.items()}}
        atomic.commit(root, name, meta)
    _barrier(group)  # nobody returns before the checkpoint is committed
    return Path(root) / name


def resolve(path) -> Path:
    """A checkpoint folder, or a root folder whose `latest` pointer names one."""
    path = Path(path)
    if (path / atomic.LATEST).exists():
        return atomic.latest(path)
    if (path / atomic.META).exists() or path.name.startswith("step_"):
        return path
    raise CheckpointError(f"{path.name}/ holds no committed checkpoint (no `latest` pointer and "
                          f"no {atomic.META}); nothing to resume from")


def load_full(path, model, optimizer=None, *, group=None, restore_rng: bool = True,
              restore=set_rng_state) -> dict:
    """Load a full checkpoint into `model`/`optimizer` on every rank; return step, data, extra.

    Everything is read and checked before anything is changed: a bad checkpoint raises and
    leaves the model, the optimizer, the random state and the files on disk as they were."""
    rank, world = rank_world(group)
    ckpt = resolve(path)
    meta = atomic.read_meta(ckpt)
    if meta.get("kind") != "full":
        raise CheckpointError(f"{ckpt.name}/ is a {meta.get('kind')!r} checkpoint; load it with "
                              f"labkit.checkpoint.sharded.load_sharded")
    if restore_rng and meta["world"] != world:
        raise LayoutError(
            f"{ckpt.name}/ holds the random state of {meta['world']} rank(s); this job has "
            f"{world}. Per-rank RNG cannot be mapped to another world size: resume with "
            f"{meta['world']} ranks, or pass restore_rng=False and accept a different stream.")
    wanted = fingerprint(model.state_dict())
    if meta["fingerprint"] != wanted:
        raise WrongModelError(f"{ckpt.name}/ was saved from another model:\n"
                              + describe_mismatch(meta["fingerprint"], wanted))
    main = atomic.load_file(ckpt / "model.pt", meta["files"]["model.pt"])
    own = f"rank{rank}.pt"
    mine = (atomic.load_file(ckpt / own, meta["files"][own]) if own in meta["files"]
            else {"rng": None, "data": None})
    # all checks passed: now change state
    model.load_state_dict(main["model"])
    if optimizer is not None:
        if main["optimizer"] is None:
            raise CheckpointError(f"{ckpt.name}/ was saved without an optimizer state")
        optimizer.load_state_dict(main["optimizer"])
    if restore_rng:
        restore(mine["rng"])
    return {"step": meta["step"], "data": mine["data"], "extra": main["extra"], "path": ckpt}
