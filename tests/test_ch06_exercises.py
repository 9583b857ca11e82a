"""Chapter 06's exercises 6.2 and 6.3: the reference solutions score full marks, the stubs score
zero, and known-wrong answers lose points for the reason they are wrong (the hint says which)."""
import json
import os
import shutil
import sys

import cloudpickle
import torch
import torch.distributed as dist

from labkit.check import ch06

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks get these functions by value

LATEST = "LATEST"


# ----------------------------------------------------------------------------- 6.2 reference
def _committed(folder):
    """The folder name of the last committed save, or None."""
    try:
        with open(os.path.join(folder, LATEST)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _write_atomic(path, data: bytes):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)                  # readers see the old file or the new one, never half


def save_sharded(shard, shapes, folder, rank, world):
    last = _committed(folder)              # every rank reads it before rank 0 can change it
    new = os.path.join(folder, f"v{int(last[1:]) + 1 if last else 0}")
    if rank == 0:
        shutil.rmtree(new, ignore_errors=True)   # debris of a save that died half-way
        os.makedirs(new)
    dist.barrier()
    path = os.path.join(new, f"shard{rank}.pt")
    with open(path, "wb") as f:
        torch.save({k: v.detach().cpu() for k, v in shard.items()}, f)
        f.flush()
        os.fsync(f.fileno())
    dist.barrier()                         # every shard is on disk before anyone can see them
    if rank == 0:
        meta = {"world": world, "shapes": {k: list(s) for k, s in shapes.items()},
                "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in shard.items()}}
        _write_atomic(os.path.join(new, "meta.json"), json.dumps(meta).encode())
        _write_atomic(os.path.join(folder, LATEST), os.path.basename(new).encode())  # commit
        if last:
            shutil.rmtree(os.path.join(folder, last), ignore_errors=True)
    dist.barrier()                         # nobody returns before the checkpoint is committed


def load_resharded(folder, rank, world):
    ckpt = os.path.join(folder, _committed(folder))
    with open(os.path.join(ckpt, "meta.json")) as f:
        meta = json.load(f)
    files, out = {}, {}
    for name, shape in meta["shapes"].items():
        numel = int(torch.Size(shape).numel())
        start, length = ch06.split_range(numel, world, rank)
        run = torch.empty(length, dtype=getattr(torch, meta["dtypes"][name]))  # cpu: host copy
        for r in range(meta["world"]):     # every saved run that overlaps mine
            s, n = ch06.split_range(numel, meta["world"], r)
            lo, hi = max(start, s), min(start + length, s + n)
            if lo >= hi:
                continue
            if r not in files:
                files[r] = torch.load(os.path.join(ckpt, f"shard{r}.pt"), weights_only=True,
                                      mmap=True)
            run[lo - start:hi - start] = files[r][name][lo - s:hi - s]
        out[name] = run
    return out


# ----------------------------------------------------------------------------- 6.2 wrong answers
def save_in_place(shard, shapes, folder, rank, world):
    """Not atomic: every rank overwrites its file under the final name; rank 0 the metadata."""
    os.makedirs(folder, exist_ok=True)
    torch.save({k: v.detach().cpu() for k, v in shard.items()},
               os.path.join(folder, f"shard{rank}.pt"))
    if rank == 0:
        meta = {"world": world, "shapes": {k: list(s) for k, s in shapes.items()},
                "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in shard.items()}}
        with open(os.path.join(folder, "meta.json"), "w") as f:
            json.dump(meta, f)
        with open(os.path.join(folder, LATEST), "w") as f:
            f.write(".")                   # the checkpoint is the folder itself
    dist.barrier()


def load_own_file(folder, rank, world):
    """No resharding: each rank reads the file of the same rank number."""
    ckpt = os.path.join(folder, _committed(folder))
    return torch.load(os.path.join(ckpt, f"shard{rank}.pt"), weights_only=True)


def load_as_fp32(folder, rank, world):
    return {k: v.float() for k, v in load_resharded(folder, rank, world).items()}


def save_with_labkit(shard, shapes, folder, rank, world):
    from labkit.checkpoint import sharded
    layout = sharded.zero_layout({k: (s, "float32") for k, s in shapes.items()}, world)
    sharded.save_sharded(folder, 0, shard, layout)


def load_with_dcp(folder, rank, world):
    import torch.distributed.checkpoint as dcp
    state = {}
    dcp.load(state, checkpoint_id=folder)
    return state


# ----------------------------------------------------------------------------- 6.2 tests
def _messages(res):
    return "\n".join(c["message"] for c in res.cases if not c["passed"])


def test_resharding_reference_scores_full():
    res = ch06.resharding(save_sharded, load_resharded)
    assert res.score == res.points == 6, res.table()


def test_resharding_stub_scores_zero():
    def stub(*args):
        raise NotImplementedError("Exercise 6.2: write your code here")
    assert ch06.resharding(stub, stub).score == 0


def test_loading_the_same_rank_file_fails_when_the_world_changes():
    res = ch06.resharding(save_sharded, load_own_file)
    passed = [c["passed"] for c in res.cases]
    assert passed[0] and not any(passed[1:5]), res.table()   # only 2 -> 2 loads right
    assert "depends on the world you LOAD at" in _messages(res)


def test_losing_the_dtype_fails_with_its_hint():
    res = ch06.resharding(save_sharded, load_as_fp32)
    assert res.score == 0 and "Does every tensor keep the dtype" in _messages(res), res.table()


def test_in_place_save_fails_only_the_crash():
    res = ch06.resharding(save_in_place, load_resharded)
    by = {c["name"]: c for c in res.cases}
    crash = by["a rank killed mid-save leaves the previous checkpoint loadable"]
    assert not crash["passed"] and "previous checkpoint must still load" in crash["message"]
    assert all(c["passed"] for c in res.cases[:5]), res.table()


def test_labkit_and_dcp_are_refused():
    for save, load in [(save_with_labkit, load_resharded), (save_sharded, load_with_dcp)]:
        res = ch06.resharding(save, load)
        assert res.score == 0 and "Write the format yourself" in _messages(res), res.table()


def load_via_helper(folder, rank, world):          # the forbidden call one helper down
    return load_with_dcp(folder, rank, world)


def test_forbidden_used_follows_helpers_and_globals():
    assert any("torch.distributed.checkpoint" in f for f in ch06.FORBIDDEN.used(load_via_helper))
    assert ch06.FORBIDDEN.used(save_sharded, load_resharded) == []


# ----------------------------------------------------------------------------- 6.3
def predict_checkpoint_bytes(n_params, recipe, zero, world):
    from labkit.costs import memory

    r = memory.get_recipe(recipe)
    weights, opt = r.weights * n_params, r.optimizer * n_params   # gradients are never saved
    largest = {0: weights + opt, 1: weights + opt / world, 2: weights + opt / world,
               3: (weights + opt) / world}[zero]
    return {"total": weights + opt, "largest_file": largest}


def predict_per_rank(n_params, recipe, zero, world):      # one rank's share called the total
    got = predict_checkpoint_bytes(n_params, recipe, zero, world)
    return {"total": got["total"] / world, "largest_file": got["largest_file"]}


def predict_weights_only(n_params, recipe, zero, world):  # forgets the optimizer states
    from labkit.costs import memory

    w = memory.get_recipe(recipe).weights * n_params
    return {"total": w, "largest_file": w if zero < 3 else w / world}


def predict_with_gradients(n_params, recipe, zero, world):  # training memory, not a checkpoint
    from labkit.costs import memory

    total = memory.get_recipe(recipe).total * n_params
    return {"total": total, "largest_file": total / world}


def predict_everything_sharded(n_params, recipe, zero, world):  # ignores the ZeRO stage
    got = predict_checkpoint_bytes(n_params, recipe, 3, world)
    return got


def test_checkpoint_size_reference_scores_full_and_costs_agree():
    res = ch06.checkpoint_size(predict_checkpoint_bytes)
    assert res.score == res.points == 3, res.table()
    from labkit.costs import checkpoint
    n = ch06.size_model_params()
    assert ch06.costs_prediction(n, "mixed", 3, 4)["total"] == checkpoint.checkpoint_bytes(n)
    assert ch06.costs_prediction(n, "mixed", 3, 4)["largest_file"] == checkpoint.shard_bytes(n, 4)


def test_checkpoint_size_stub_scores_zero():
    def stub(*args):
        raise NotImplementedError("Exercise 6.3: write your code here")
    assert ch06.checkpoint_size(stub).score == 0


def test_checkpoint_size_wrong_formulas_fail_with_their_hint():
    for fn, needle in [(predict_per_rank, "one rank's share"),
                       (predict_weights_only, "optimizer states"),
                       (predict_with_gradients, "Gradients are not saved")]:
        res = ch06.checkpoint_size(fn)
        assert res.score == 0 and needle in _messages(res), (fn.__name__, res.table())
    res = ch06.checkpoint_size(predict_everything_sharded)
    assert res.cases[0]["passed"] and not res.cases[1]["passed"], res.table()
    assert "which are whole on every rank" in res.cases[1]["message"]
