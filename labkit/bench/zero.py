"""Benchmark: step time and bytes per rank of ZeRO stages 0-3, against PyTorch's DDP and FSDP2.

    labkit bench zero [--ranks 4] [--steps 6] [--n-embd 64] [--n-layer 4]

All variants train the same GPT (fp32, AdamW) on the same ranks in the same run, one step of each
in turn (interleaved, so drifting load hits all alike); the step time is the median over steps of
the slowest rank, reported with its ratio to torch DDP. Bytes are what each rank keeps after a
step, next to labkit.costs.memory's prediction. On CPU/Gloo the ratios show the cost of our
per-parameter collectives and of ZeRO-3's recomputation, not what NCCL would do on GPUs.
"""
from __future__ import annotations

import argparse
import statistics

from labkit.launch import run
from labkit.table import table as format_table

VARIANTS = ("torch DDP", "ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3", "torch FSDP2")


def _on_rank(cfg, steps, warmup, batch_size):
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.model import GPT, get_batch, shard_rows, tiny_corpus
    from labkit.zero.shard import optimizer_state_bytes
    from labkit.zero.train import make_stage

    rank, world = dist.get_rank(), dist.get_world_size()
    variants = {}
    for name in VARIANTS:
        model = GPT(cfg, seed=0)
        if name == "torch DDP":
            wrapped = DDP(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            variants[name] = (wrapped, opt.step, lambda o=opt: o.zero_grad(), opt, model)
        elif name == "torch FSDP2":
            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            variants[name] = (model, opt.step, lambda o=opt: o.zero_grad(), opt, model)
        else:
            zero = make_stage(int(name[-1]), model, "adamw")
            variants[name] = (model, zero.step, zero.zero_grad, zero, model)
    tokens = tiny_corpus()
    times = {n: [] for n in VARIANTS}
    held = {}
    for step in range(warmup + steps):
        x, y = get_batch(tokens, batch_size, cfg.block_size, step)
        x, y = shard_rows(x, rank, world), shard_rows(y, rank, world)
        for name, (fwd, step_fn, zero_grad, holder, model) in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            fwd(x, y)[1].backward()
            step_fn()
            dt = time.perf_counter() - t0
            if step >= warmup:
                times[name].append(dt)
            if step == warmup + steps - 1:
                held[name] = _held(name, holder, model, optimizer_state_bytes)
            zero_grad()
    return {"times": times, "held": held}


def _held(name, holder, model, optimizer_state_bytes):
    if name.startswith("ZeRO"):
        return holder.held_bytes()
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    params = [local(p) for p in model.parameters()]
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    state = {k: {kk: local(v) for kk, v in s.items()} for k, s in holder.state.items()}
    class _O:  # optimizer_state_bytes reads .state
        pass
    o = _O()
    o.state = state
    return {"params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(g.numel() * g.element_size() for g in grads),
            "optimizer": optimizer_state_bytes(o)}


def measure(nprocs, cfg, steps=6, warmup=2, batch_size=None, timeout=600) -> list:
    from labkit.costs import memory
    from labkit.zero.measure import FP32_ADAM

    batch_size = batch_size or 2 * nprocs
    per_rank = run(_on_rank, nprocs, args=(cfg, steps, warmup, batch_size), timeout=timeout,
                   echo=False)
    numel = sum(v for v in [_numel(cfg)])
    med = {n: statistics.median(max(r["times"][n][i] for r in per_rank) for i in range(steps))
           for n in VARIANTS}
    rows = []
    for n in VARIANTS:
        stage = {"torch DDP": 0, "torch FSDP2": 3}.get(n, None)
        stage = int(n[-1]) if stage is None else stage
        pred = memory.model_states(numel, recipe=FP32_ADAM, zero_stage=stage, dp=nprocs).total
        held = max(sum(r["held"][n].values()) for r in per_rank)
        rows.append({"ranks": nprocs, "variant": n, "stage": stage, "step_s": med[n],
                     "ratio_to_torch_ddp": med[n] / med["torch DDP"],
                     "ratio_to_fsdp2": med[n] / med["torch FSDP2"],  # ZeRO-3 row: labkit / torch
                     "bytes_per_rank": held, "bytes_predicted": pred, "numel": numel})
    return rows


def _numel(cfg):
    from labkit.costs import models

    return models.num_params(models.from_gpt_config(cfg))


def table(rows) -> str:
    return format_table(rows, [
        ("ranks", "ranks"),
        ("variant", "variant"),
        ("step ms", lambda r: r["step_s"] * 1e3, ".1f"),
        ("vs DDP", "ratio_to_torch_ddp", lambda v: f"{v:.2f}x", ">"),
        ("vs FSDP2", "ratio_to_fsdp2", lambda v: f"{v:.2f}x", ">"),
        ("bytes/rank KB", lambda r: r["bytes_per_rank"] / 1e3, ".1f"),
        ("predicted KB", lambda r: r["bytes_predicted"] / 1e3, ".1f")])


def main(argv=()) -> dict:
    from labkit.model import GPTConfig

    p = argparse.ArgumentParser(prog="labkit bench zero")
    p.add_argument("--ranks", type=int, nargs="+", default=[4])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    args = p.parse_args(list(argv))
    cfg = GPTConfig(block_size=32, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd,
                    tie_weights=False)
    rows = []
    for n in args.ranks:
        rows += measure(n, cfg, steps=args.steps, warmup=args.warmup)
    print(f"GPT n_layer={args.n_layer} n_embd={args.n_embd} (Ψ = {_numel(cfg):,}), fp32 AdamW; "
          f"bytes = params + grads + optimizer state kept by the largest rank after a step")
    print(table(rows), flush=True)
    return {"rows": rows, "units": {"step_s": "s", "bytes_per_rank": "bytes"}}
