"""Measured bytes per rank and bytes sent per step for ZeRO stages 0-3, next to labkit.costs.

    from labkit.launch import run
    from labkit.labs.zero.measure import LAB_MODEL, measure_stages, rows, table
    per_rank = run(measure_stages, 4, args=(LAB_MODEL,))
    print(table(rows(per_rank, LAB_MODEL)))

Used by chapter 03's lab, `labkit run zero` and `labkit bench zero`. Everything is fp32 on
CPU with AdamW: 4 bytes of weights, 4 of gradients and 8 of optimizer state (momentum, variance)
per parameter, the calculator's Precision("fp32 Adam", 4, 4, 8). The bytes held are the tensors
each rank keeps after a step (before zero_grad). The bytes sent are counted by the kernel
(labkit.observe.netcount: the payload this rank's TCP sockets moved in one step), not by labkit; the
prediction is labkit.costs.zero.comm_per_rank of the Ψ the stage moves (`moved_numel`).
`collective_bytes` is chapter 03's myth vs measurement: the backend's own reduce-scatter beside
labkit's ring, counted the same way. `precision_traffic`: bf16 gathers counted by the kernel;
`offload_step`: ZeRO-Offload's CPU Adam timed by torch's step hooks, as the CPU bandwidth the
calculator (costs.zero.offload_seconds) and the planner (Cluster.cpu_bw) take.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from labkit.costs import memory
from labkit.costs import zero as costs_zero
from labkit.costs.flops import ADAM_BYTES_PER_PARAM
from labkit.flat import all_gather_flat, chunk_size, reduce_scatter_sum
from labkit.labs.zero.train import sharded_train
from labkit.launch import device
from labkit.model import GPT, GPTConfig, get_batch, shard_rows, tiny_corpus
from labkit.observe import netcount
from labkit.observe.measured import Measured
from labkit.zero.precision import MixedPrecisionPolicy
from labkit.zero.shard import unique_params
from labkit.zero.zero3 import ZeRO3, default_units

# untied embeddings: every parameter belongs to exactly one ZeRO-3 unit, so the traffic is the
# textbook 3(N-1)/N Ψ (a tied embedding is gathered by two units: a little more)
LAB_MODEL = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64,
                      tie_weights=False)
FP32_ADAM = memory.Precision("fp32 Adam", 4, 4, 8, "fp32 weights and gradients, Adam m and v")
PARTS = ("params", "grads", "optimizer")


def measure_stages(cfg: GPTConfig = LAB_MODEL, stages=(0, 1, 2, 3), optimizer: str = "adamw",
                   steps: int = 2, batch_size: int = 8) -> dict:
    """Rank side: {stage: {"held", "sent", "received", "logged", "numel"}} after `steps` steps."""

    out = {}
    for stage in stages:
        res = sharded_train(stage, cfg, optimizer, steps=steps, batch_size=batch_size)
        out[stage] = {k: res[k] for k in ("held", "sent", "received", "wire_reason", "logged",
                                          "numel")}
    return out


def moved_numel(cfg: GPTConfig, stage: int, world: int) -> int:
    """Ψ as the stage moves it: stage 0 all-reduces the Ψ gradients in one flat buffer; stages
    1-2 pad each parameter to a multiple of N (labkit.zero.shard); stage 3 gathers each unit's
    padded parameters, so a tied embedding used by two units counts twice."""

    model = GPT(cfg)

    def padded(params):
        return sum(world * chunk_size(p.numel(), world) for p in params)
    if stage == 0:
        return sum(p.numel() for p in unique_params(model))
    if stage in (1, 2):
        return padded(unique_params(model))
    return sum(padded(unique_params(u)) for u in default_units(model))


def flag_numel(cfg: GPTConfig, stage: int, world: int) -> int:
    """Values the has-grad flags add to the gradient collective's payload (labkit.zero.params.
    with_flags: one per parameter, so that an unused parameter keeps gradient None): stage 0
    all-reduces P, stage 1 reduce-scatters N*P, stage 3 N*P_u per unit; stage 2 none (its hooks
    only fire for parameters that have a gradient). P is tens; Ψ is millions in real models."""

    model = GPT(cfg)
    if stage == 0:
        return len(unique_params(model))
    if stage == 1:
        return world * len(unique_params(model))
    if stage == 3:
        return world * sum(len(unique_params(u)) for u in default_units(model))
    return 0


def flag_bytes(cfg: GPTConfig, stage: int, world: int, bytes_per_value: int = 4) -> float:
    """Bytes per rank the flags add on the wire (ring: all-reduce 2(N-1)/N, reduce-scatter
    (N-1)/N of the payload)."""
    share = 2 * (world - 1) / world if stage == 0 else (world - 1) / world
    return share * flag_numel(cfg, stage, world) * bytes_per_value


def predicted_sent(cfg: GPTConfig, stage: int, world: int, bytes_per_value: int = 4) -> float:
    """labkit.costs' bytes sent per rank per step (ring collectives) for this model and stage
    (without has-grad flags: find_unused_parameters=False; flag_bytes gives what they add)."""
    return costs_zero.comm_per_rank(moved_numel(cfg, stage, world), stage, world,
                                    bytes_per_value=bytes_per_value)["total"]


def rows(per_rank, cfg: GPTConfig = LAB_MODEL, recipe=FP32_ADAM) -> list:
    """One row per stage: held bytes (largest rank) vs labkit.costs.memory, bytes sent (kernel
    count, largest rank) vs labkit.costs.zero, and their ratio."""
    world = len(per_rank)
    out = []
    for stage in [k for k in per_rank[0] if k in (0, 1, 2, 3)]:   # other entries: ignored
        numel = per_rank[0][stage]["numel"]
        ms = memory.model_states(numel, recipe=recipe, zero=stage, dp=world)
        pred = {"params": ms.params, "grads": ms.grads, "optimizer": ms.optimizer}
        held = {k: max(r[stage]["held"][k] for r in per_rank) for k in PARTS}
        counted = [r[stage]["sent"] for r in per_rank]
        sent = None if None in counted else max(counted)
        formula = predicted_sent(cfg, stage, world, recipe.weights)
        out.append({"ranks": world, "stage": stage, "numel": numel,
                    **{f"{k}_measured": held[k] for k in PARTS},
                    **{f"{k}_predicted": pred[k] for k in PARTS},
                    "total_measured": sum(held.values()), "total_predicted": ms.total,
                    "sent_measured": sent, "sent_predicted": formula,
                    # one rank: the formula is 0 bytes and there is no ratio to take
                    "sent_ratio": Measured("bytes sent", sent, formula, counter="kernel TCP",
                                           unit="bytes").ratio,
                    "sent_in_psi": None if sent is None else sent / (numel * recipe.weights),
                    "wire_reason": per_rank[0][stage].get("wire_reason")})
    return out


def table(rs) -> str:
    head = (f"{'ranks':>5} {'stage':>5} {'params KB':>10} {'grads KB':>9} {'optim KB':>9} "
            f"{'total KB':>9} {'predicted':>9} {'sent KB':>8} {'predicted':>9} {'ratio':>6} "
            f"{'Ψ vals':>6}")
    lines = [head, "-" * len(head)]
    for r in rs:
        if r["sent_measured"] is None:
            sent = f"{'n/a':>8} {r['sent_predicted'] / 1e3:>9.1f} {'':>6} {'':>6}"
        else:
            ratio = "n.a." if r["sent_ratio"] is None else f"{r['sent_ratio']:.3f}"
            sent = (f"{r['sent_measured'] / 1e3:>8.1f} {r['sent_predicted'] / 1e3:>9.1f} "
                    f"{ratio:>6} {r['sent_in_psi']:>6.2f}")
        lines.append(f"{r['ranks']:>5} {r['stage']:>5} {r['params_measured'] / 1e3:>10.1f} "
                     f"{r['grads_measured'] / 1e3:>9.1f} {r['optimizer_measured'] / 1e3:>9.1f} "
                     f"{r['total_measured'] / 1e3:>9.1f} {r['total_predicted'] / 1e3:>9.1f} "
                     f"{sent}")
    reasons = {r["wire_reason"] for r in rs if r["sent_measured"] is None}
    lines += [f"sent: not counted ({why})" for why in sorted(reasons)]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- myth vs measurement
def collective_bytes(numel: int = 2**20, repeats: int = 3) -> dict:
    """Rank side: kernel-counted bytes this rank sends for one call of each collective on a
    numel-element fp32 buffer (median over `repeats`), as a multiple of the buffer's bytes D.

    {"backend reduce-scatter", "labkit ring reduce-scatter", "backend all-gather",
     "backend all-reduce"} -> sent / D; "ring" -> (N-1)/N, the reduce-scatter's optimum."""



    n, dev = dist.get_world_size(), device()
    numel -= numel % n                                  # equal chunks for the backend's calls
    full = torch.randn(numel, device=dev)               # (N*c,)
    piece = torch.randn(numel // n, device=dev)         # (c,)
    calls = {
        "backend reduce-scatter": lambda: reduce_scatter_sum(full, algorithm="backend"),
        "labkit ring reduce-scatter": lambda: reduce_scatter_sum(full, algorithm="ring"),
        "backend all-gather": lambda: all_gather_flat(piece),
        "backend all-reduce": lambda: dist.all_reduce(full.clone()),
    }
    out = {"ring": (n - 1) / n, "reason": netcount.why_not()}
    for name, call in calls.items():
        counts = []
        for _ in range(repeats):
            dist.barrier()
            with netcount.socket_bytes() as c:
                call()
            counts.append(c.sent)
        out[name] = None if None in counts else statistics.median(counts) / (numel * 4)
    dist.barrier()
    return out


def accumulation_tradeoff(cfg: GPTConfig = LAB_MODEL, micro_batches: int = 4,
                          stages=(2, 3), batch_size: int = 16) -> dict:
    """Rank side: gradient accumulation over `micro_batches` for ZeRO-2/3, reduce-scattering
    every micro-batch vs holding full gradients (no_sync) until the last one.
    {(stage, "every"|"no_sync"): {"sent": kernel-counted bytes of the step, "peak_grad_bytes":
    gradient storage held at most}}: no_sync sends one reduce-scatter instead of k, but holds Ψ
    full gradients (4Ψ bytes in fp32) instead of about Ψ/N, the memory ZeRO-2/3 set out to save.
    ZeRO-3 also runs (3, "unsharded"): no_sync and reshard_after_backward=False (FSDP2's
    set_requires_gradient_sync(False) and set_reshard_after_backward(False)): the parameters are
    gathered once for the whole step instead of twice per micro-batch, and Ψ whole parameters
    are held across the micro-batches ("peak_full_param_bytes")."""

    out = {}
    for stage in stages:
        for mode in ("every", "no_sync") + (("unsharded",) if stage == 3 else ()):
            kw = {"reshard_after_backward": False} if mode == "unsharded" else {}
            res = sharded_train(stage, cfg, "adamw", steps=1, batch_size=batch_size,
                                accumulate=micro_batches, no_sync=mode != "every", stage_kw=kw)
            out[(stage, mode)] = {"sent": res["sent"], "peak_grad_bytes": res["peak_grad_bytes"],
                                  "peak_full_param_bytes": res["peak_full_param_bytes"],
                                  "numel": res["numel"], "params": res["params"]}
    return out


# ----------------------------------------------------------------------------- mixed precision
def precision_traffic(cfg: GPTConfig = LAB_MODEL, param_dtypes=("float32", "bfloat16"),
                      reduce_dtype: str = "float32", batch_size: int = 8,
                      repeats: int = 3) -> dict:
    """Rank side: kernel-counted bytes this rank sends in one ZeRO-3 forward (all-gathers only)
    and one backward (all-gathers + reduce-scatters), for each param_dtype of the
    MixedPrecisionPolicy (medians over `repeats`).

    {param_dtype: {"forward", "backward", "forward_predicted"}}: the prediction is the ring
    all-gather's (N-1)/N of every unit's padded parameters (moved_numel), at the dtype's size.
    bf16 halves the gathers; with reduce_dtype fp32 the reduce-scatter keeps its 4 bytes."""



    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    x, y = get_batch(tiny_corpus(), batch_size, cfg.block_size, 0)          # (B, T) global
    x, y = shard_rows(x, rank, world).to(dev), shard_rows(y, rank, world).to(dev)  # (B/N, T)
    out = {}
    for name in param_dtypes:
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, name),
                                      reduce_dtype=getattr(torch, reduce_dtype))
        model = GPT(cfg).to(dev)
        zero = ZeRO3(model, torch.optim.SGD, mp_policy=policy, lr=0.0)
        fwd, bwd = [], []
        for _ in range(repeats):
            dist.barrier()
            with netcount.socket_bytes() as f:
                loss = model(x, y)[1]
            dist.barrier()
            with netcount.socket_bytes() as b:
                loss.backward()
            zero.zero_grad()
            fwd.append(f.sent)
            bwd.append(b.sent)
        size = policy.param_dtype.itemsize                                 # bytes per value
        out[name] = {"forward": None if None in fwd else statistics.median(fwd),
                     "backward": None if None in bwd else statistics.median(bwd),
                     "forward_predicted": (world - 1) / world * moved_numel(cfg, 3, world) * size}
    dist.barrier()
    return out


# ----------------------------------------------------------------------------- offload
def offload_step(cfg: GPTConfig = LAB_MODEL, steps: int = 4, batch_size: int = 8,
                 mp_policy=None) -> dict:
    """Rank side: ZeRO-3 with offload=True; the optimizer's step on the CPU timed by torch's own
    step hooks (Optimizer.register_step_pre_hook / _post_hook, not by labkit), median over
    `steps` after one warm-up. {"adam_s", "numel" (elements this rank's Adam updates),
    "cpu_bw" (the CPU memory bandwidth that time implies at costs.flops.ADAM_BYTES_PER_PARAM
    bytes per element: the number labkit.costs.planner.Cluster(cpu_bw=...) takes), "held"}."""



    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    model = GPT(cfg).to(dev)
    zero = ZeRO3(model, torch.optim.AdamW, offload=True, prefetch=True, mp_policy=mp_policy,
                 lr=1e-3)
    marks = []
    zero.optimizer.register_step_pre_hook(lambda *a: marks.append(time.perf_counter()))
    zero.optimizer.register_step_post_hook(lambda *a: marks.append(time.perf_counter()))
    times = []
    for step in range(steps + 1):
        x, y = get_batch(tiny_corpus(), batch_size, cfg.block_size, step)           # (B, T)
        x, y = shard_rows(x, rank, world).to(dev), shard_rows(y, rank, world).to(dev)
        model(x, y)[1].backward()
        zero.step()
        held = zero.held_bytes()
        zero.zero_grad()
        if step:
            times.append(marks[-1] - marks[-2])
    numel = sum(s.numel() for s in zero.shards if s.requires_grad)
    adam_s = statistics.median(times)
    dist.barrier()
    return {"adam_s": adam_s, "numel": numel, "cpu_bw": numel * ADAM_BYTES_PER_PARAM / adam_s,
            "held": held, "device": str(zero.shards[0].device)}
