"""What ZeRO-3's backward keeps and runs, next to PyTorch's FSDP2 (chapter 03, section 4).

    from labkit.launch import run
    from labkit.labs.zero.backward import backward_lab
    per_rank = run(backward_lab, 2, args=(OVERLAP_MODEL,))
    per_rank[0]["ZeRO-3"]   # {"step_s", "forwards_in_backward", "saved_bytes", "inputs_bytes"}
    per_rank[0]["plain"]    # {"saved_bytes"}: one process's model on the same rows

labkit's ZeRO-3 gathers a unit's parameters again in backward through hooks and keeps the
activations (labkit.zero.unit), as FSDP2 does; the other way to drop the parameters between
forward and backward is to recompute each unit (keep only its input, run its forward again in
backward), which saves activation memory and costs one more forward per unit. Read by probes
the code under test does not write:

    forwards_in_backward   module forward calls while loss.backward() runs (forward pre-hooks)
    saved_bytes            what autograd holds from forward to backward, by storage, read after
                           forward: the pack hook of torch.autograd.graph.saved_tensors_hooks
                           collects every saved tensor's storage, and their sizes are summed once
                           forward is over (a freed whole-parameter buffer counts 0 bytes
                           then); for the plain model its parameters are left out. Not read
                           for FSDP2, whose root keeps its parameters whole after forward
                           (torch/distributed/fsdp/_fully_shard/_fsdp_state.py, _lazy_init).
    inputs_bytes           the units' inputs (forward pre-hooks): what a unit that recomputes
                           would keep instead
    step_s                 median seconds of forward + backward + step, slowest rank, the
                           variants interleaved step by step so drifting load hits all alike
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from labkit.model import GPT, GPTConfig, get_batch, shard_rows, tiny_corpus
from labkit.zero.zero3 import ZeRO3, default_units

VARIANTS = ("ZeRO-3", "ZeRO-3 prefetch", "torch FSDP2")


class _Saved:
    """Storages autograd saves inside the block; `bytes` sums their sizes when read."""

    def __init__(self):
        self.storages = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        st = t.untyped_storage()
        self.storages.setdefault(st._cdata, st)    # by storage object, not address: a freed
        return t                                   # parameter's address can be reused

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)

    def bytes(self, exclude=()) -> int:
        skip = {t.untyped_storage()._cdata for t in exclude}
        return sum(st.nbytes() for key, st in self.storages.items() if key not in skip)


def _build(name: str, cfg: GPTConfig, world: int):
    """(model, optimizer step, zero_grad, units) for one variant."""
    model = GPT(cfg, seed=0)
    units = default_units(model)
    if name == "torch FSDP2":
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt.step, lambda: opt.zero_grad(set_to_none=True), units
    zero = ZeRO3(model, torch.optim.AdamW, prefetch=name.endswith("prefetch"), lr=1e-3)
    return model, zero.step, zero.zero_grad, units


def backward_lab(cfg: GPTConfig, steps: int = 4, batch_size: int = 8, variants=VARIANTS) -> dict:
    """Rank side: {variant: {"step_s", "forwards_in_backward", "saved_bytes", "inputs_bytes"}},
    saved_bytes and inputs_bytes from the last step (the same on every step)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    built = {name: _build(name, cfg, world) for name in variants}
    probe = {name: {"phase": "idle", "backward": 0, "inputs": 0} for name in variants}
    for name, (model, _, _, units) in built.items():
        rec = probe[name]

        def count(module, args, rec=rec):
            if rec["phase"] == "backward":
                rec["backward"] += 1

        def inputs(module, args, rec=rec):
            if rec["phase"] == "forward" and args and isinstance(args[0], torch.Tensor):
                rec["inputs"] += args[0].untyped_storage().nbytes()
        for m in model.modules():
            m.register_forward_pre_hook(count)
        for u in units:
            u.register_forward_pre_hook(inputs)
    times = {name: [] for name in variants}
    out = {name: {} for name in variants}
    tokens = tiny_corpus()
    plain = GPT(cfg, seed=0)
    x, y = get_batch(tokens, batch_size, cfg.block_size, 0)                       # (B, T)
    with _Saved() as saved:
        loss = plain(shard_rows(x, rank, world), shard_rows(y, rank, world))[1]
    out["plain"] = {"saved_bytes": saved.bytes(exclude=plain.parameters())}
    loss.backward()
    for step in range(steps + 1):                    # step 0 warms up (and records the order)
        x, y = get_batch(tokens, batch_size, cfg.block_size, step)                # (B, T)
        x, y = shard_rows(x, rank, world), shard_rows(y, rank, world)            # (B/N, T)
        for name, (model, step_fn, zero_grad, _) in built.items():
            rec = probe[name]
            rec.update(backward=0, inputs=0)
            dist.barrier()
            t0 = time.perf_counter()
            rec["phase"] = "forward"
            with _Saved() as saved:
                loss = model(x, y)[1]
            nbytes = None if name.startswith("torch") else saved.bytes()
            rec["phase"] = "backward"
            loss.backward()
            rec["phase"] = "idle"
            step_fn()
            dt = time.perf_counter() - t0
            zero_grad()
            if step:
                times[name].append(dt)
            out[name] = {"forwards_in_backward": rec["backward"], "saved_bytes": nbytes,
                         "inputs_bytes": rec["inputs"]}
    for name in variants:
        slowest = [0.0] * steps
        for i, t in enumerate(times[name]):
            box = torch.tensor([t])  # cpu: this lab runs on the CPU (its FSDP2 mesh is "cpu")
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            slowest[i] = box.item()
        out[name]["step_s"] = statistics.median(slowest)
    return out
