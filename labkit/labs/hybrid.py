"""Lab 07: DP x TP on one mesh: the tensor-parallel GPT replicated over data-parallel groups,
trained side by side with the one-process GPT; after several steps they are equal.

    labkit run hybrid --nproc 4 --dp 2 --tp 2 [--steps 4 --batch 5]
    torchrun --nproc-per-node 4 -m labkit run hybrid --dp 2 --tp 2
    labkit run hybrid --nproc 4 --dp 2 --pp 2          # DP x PP: one 1F1B step per replica

Every rank builds the same GPT (seed 0) and keeps its tensor-parallel shards over its TP group
(labkit.tp.apply_tp, Megatron f/g). Ranks with the same DP index form a TP group and see the same
rows of the global batch (labkit.model.shard_rows: uneven when DP does not divide the batch);
after the backward each gradient (shard) is all-reduced over the DP group, weighted by the rows
each replica saw, so the step equals the one-process step on the whole batch. Groups come from
labkit.topology (TP innermost, so a TP group is consecutive ranks, inside a node).

DP x PP the same way: each replica runs one 1F1B step (labkit.pipeline.executor) over its PP
group on its rows; each stage's gradients are then all-reduced over the DP group.

The parallel model lives on labkit.launch.device() (a GPU per rank under NCCL); the one-process
reference runs on the CPU, and the results are compared there.
"""
from __future__ import annotations

import argparse
import os

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank

DEFAULT_CFG = dict(n_layer=2, n_embd=32, n_head=4, block_size=16)


def _optimizer(params, name: str, lr: float):
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def train_dp_tp(dp: int, tp: int, cfg: dict, steps: int, batch: int, lr: float = 1e-2,
                optim: str = "adamw"):
    """Rank side. Returns the global loss per step, the first step's full gradients and the
    final full parameters (gathered over TP, by the one-process GPT's names)."""
    import torch.distributed as dist

    from labkit.labs import rank_place
    from labkit.launch import device
    from labkit.model import GPT, GPTConfig, get_batch, shard_rows, tiny_corpus
    from labkit.topology import Topology, build_groups
    from labkit.tp import apply_tp
    from labkit.tp.gpt import gather_tp_grads, gather_tp_state

    topo = Topology(dist.get_world_size(), dp=dp, tp=tp)
    groups = build_groups(topo)
    d, dev = groups.coords["dp"], device()
    model = apply_tp(GPT(GPTConfig(**cfg), seed=0).to(dev), groups.tp)
    opt = _optimizer(model.parameters(), optim, lr)
    tokens = tiny_corpus()
    losses, first_grads = [], None
    for step in range(steps):
        x, y = get_batch(tokens, batch, cfg["block_size"], step)       # (B, T) global batch
        xs, ys = shard_rows(x, d, dp).to(dev), shard_rows(y, d, dp).to(dev)  # (B_d, T) mine
        _, loss = model(xs, ys)                                          # mean over B_d rows
        weighted = loss * xs.shape[0] / batch                            # share of the global mean
        opt.zero_grad(set_to_none=True)
        weighted.backward()
        for p in model.parameters():                                     # DP: sum the shares
            dist.all_reduce(p.grad, group=groups.dp)
        if step == 0:
            first_grads = gather_tp_grads(model)
        opt.step()
        total = weighted.detach().clone()
        dist.all_reduce(total, group=groups.dp)                          # the global batch's loss
        losses.append(total.item())
    local = sum(p.numel() for p in model.parameters())                  # this rank's shards
    return {"coords": groups.coords, "losses": losses, "grads": first_grads,
            "params": gather_tp_state(model), "local_params": local, "ran_on": rank_place()}


def train_dp_pp(dp: int, pp: int, cfg: dict, batch: int, micro_batches: int = 2):
    """Rank side of DP x PP: one 1F1B step (labkit.pipeline.executor) per DP replica on its rows,
    then the stage's gradients all-reduced over DP. Returns the global loss (last stage) and the
    gradients of the parameters this stage owns, by the one-process GPT's names."""
    import torch
    import torch.distributed as dist

    from labkit.labs import rank_place
    from labkit.launch import device
    from labkit.model import GPT, GPTConfig, get_batch, shard_rows, tiny_corpus
    from labkit.pipeline import executor, schedules
    from labkit.topology import Topology, build_groups

    torch.set_num_threads(1)
    topo = Topology(dist.get_world_size(), dp=dp, pp=pp)
    groups = build_groups(topo)
    d = groups.coords["dp"]
    gcfg = GPTConfig(**cfg)
    dev = device()
    model = GPT(gcfg, seed=0).to(dev)
    x, y = get_batch(tiny_corpus(), batch, gcfg.block_size, 0)          # (B, T) global batch
    xs, ys = shard_rows(x, d, dp), shard_rows(y, d, dp)                  # (B_d, T) this replica's
    out = executor.run_schedule(schedules.one_f_one_b(pp, micro_batches), model, xs, ys,
                                group=groups.pp)
    share = xs.shape[0] / batch                                          # replica's loss is a mean
    grads = {}
    for name, g in sorted(out["grads"].items()):
        g = g * share
        dist.all_reduce(g, group=groups.dp)
        grads[name] = g
    loss = torch.zeros((), device=dev) if out["loss"] is None else out["loss"].detach() * share
    dist.all_reduce(loss, group=groups.dp)
    return {"coords": groups.coords, "loss": None if out["loss"] is None else loss.item(),
            "grads": grads, "ran_on": rank_place()}


def reference(cfg: dict, steps: int, batch: int, lr: float = 1e-2, optim: str = "adamw"):
    """The one-process GPT on the whole global batch: the same losses, gradients, parameters."""
    from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus

    model = GPT(GPTConfig(**cfg), seed=0)
    opt = _optimizer(model.parameters(), optim, lr)
    tokens = tiny_corpus()
    losses, first_grads = [], None
    for step in range(steps):
        x, y = get_batch(tokens, batch, cfg["block_size"], step)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": first_grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def max_differences(rank_result: dict, ref: dict) -> dict:
    """Largest absolute differences from the reference: losses, first gradients, final params."""
    def worst(a: dict, b: dict) -> float:
        missing = set(b) - set(a)
        if missing:
            raise KeyError(f"the parallel model lacks {sorted(missing)}")
        return max((a[k] - b[k]).abs().max().item() for k in b)

    return {"loss": max(abs(p - q) for p, q in zip(rank_result["losses"], ref["losses"])),
            "grads": worst(rank_result["grads"], ref["grads"]),
            "params": worst(rank_result["params"], ref["params"])}


def default_dims(nproc: int, dp=None, tp=None, pp=None) -> tuple:
    """(dp, tp, pp) for `nproc` ranks, filling what the user left out so that the defaults fit
    any world: tp = 2 when it divides (else 1), pp = 1, dp = what is left. What the user gave
    is kept as is: labkit.topology.Topology then says what to change if it does not fit."""
    from labkit.topology import TopologyError

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise TopologyError(f"--nproc must be a positive integer, got {nproc!r}")
    pp = 1 if pp is None else pp
    if pp > 1 and tp not in (None, 1):
        raise TopologyError(f"--pp {pp} with --tp {tp}: this lab runs DP x TP or DP x PP, not "
                            f"both; drop --tp (or --pp)")
    if pp > 1:
        tp = 1
    elif tp is None and dp is None:
        tp = 2 if nproc % 2 == 0 else 1
    elif tp is None:                       # --dp given: TP takes what is left, if it divides
        tp = nproc // dp if dp >= 1 and nproc % dp == 0 else 1
    if dp is None:
        dp = max(1, nproc // (tp * pp)) if tp >= 1 and pp >= 1 else 1
    return dp, tp, pp


def main(argv=()):
    from labkit.labs import ran_on
    from labkit.launch import run
    from labkit.progress import Progress
    from labkit.topology import Topology

    p = argparse.ArgumentParser(prog="labkit run hybrid")
    p.add_argument("--nproc", type=int, default=int(os.environ.get("WORLD_SIZE", 4)))
    p.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default: what "
                   "is left of --nproc)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel shards (default: 2 "
                   "when --nproc is even, else 1)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=5, help="global batch (sequences); need not "
                   "divide by DP")
    p.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--pp", type=int, default=1, help="with --pp > 1: DP x PP instead of DP x TP "
                   "(one 1F1B step, gradients compared)")
    a = p.parse_args(list(argv))
    a.dp, a.tp, a.pp = default_dims(a.nproc, a.dp, a.tp, a.pp)
    if a.batch < a.dp:
        raise ValueError(f"--batch {a.batch} is smaller than --dp {a.dp}: every replica needs "
                         f"at least one row; use --batch >= {a.dp}")
    if a.pp > 1:
        return _main_dp_pp(a)
    topo = Topology(a.nproc, dp=a.dp, tp=a.tp)      # checked here, before any process starts
    prog = Progress("hybrid", total=2)
    prog.say(f"DP {a.dp} x TP {a.tp} on {a.nproc} ranks, {a.steps} {a.optim} steps")
    results = run(train_dp_tp, a.nproc, args=(a.dp, a.tp, DEFAULT_CFG, a.steps, a.batch, 1e-2,
                                               a.optim))
    prog.done(f"DP x TP trained {a.steps} steps, last loss {results[0]['losses'][-1]:.4f}")
    ref = reference(DEFAULT_CFG, a.steps, a.batch, 1e-2, a.optim)
    prog.done(f"one-process reference trained, last loss {ref['losses'][-1]:.4f}")
    if os.environ.get("RANK", "0") != "0":
        return 0
    print(topo.picture())
    print(f"\nGPT {DEFAULT_CFG}, global batch {a.batch}, {a.optim}, fp32; "
          f"{ran_on(*results[0]['ran_on'])} (rank 0)")
    print(f"{'step':>4} {'loss (1 process)':>17} {'loss (DP x TP)':>15}")
    for s, (lr_, lh) in enumerate(zip(ref["losses"], results[0]["losses"])):
        print(f"{s:>4} {lr_:>17.6f} {lh:>15.6f}")
    print(f"\n{'rank':>4} {'(dp, tp)':>9} {'max|loss diff|':>15} {'max|grad diff|':>15} "
          f"{'max|param diff|':>16}")
    for rank, res in enumerate(results):
        d = max_differences(res, ref)
        print(f"{rank:>4} {str((res['coords']['dp'], res['coords']['tp'])):>9} "
              f"{d['loss']:>15.2e} {d['grads']:>15.2e} {d['params']:>16.2e}")
    return 0


def _main_dp_pp(a) -> int:
    from labkit.labs import ran_on
    from labkit.launch import run
    from labkit.model import GPTConfig
    from labkit.pipeline.executor import reference_step
    from labkit.progress import Progress
    from labkit.topology import Topology

    topo = Topology(a.nproc, dp=a.dp, pp=a.pp)
    prog = Progress("hybrid", total=2)
    prog.say(f"DP {a.dp} x PP {a.pp} on {a.nproc} ranks, one 1F1B step per replica")
    results = run(train_dp_pp, a.nproc, args=(a.dp, a.pp, DEFAULT_CFG, a.batch, a.pp))
    prog.done("DP x PP step done")
    ref = reference_step(GPTConfig(**DEFAULT_CFG), a.batch)
    prog.done("one-process reference step done")
    if os.environ.get("RANK", "0") != "0":
        return 0
    print(topo.picture())
    print(f"\nGPT {DEFAULT_CFG}, global batch {a.batch}, one 1F1B step with K={a.pp} per replica; "
          f"{ran_on(*results[0]['ran_on'])} (rank 0)")
    loss = next(r["loss"] for r in results if r["loss"] is not None)
    print(f"loss: one process {ref['loss'].item():.6f}, DP x PP {loss:.6f}")
    print(f"{'rank':>4} {'(pp, dp)':>9} {'params owned':>13} {'max|grad diff|':>15}")
    for rank, r in enumerate(results):
        diff = max((g - ref["grads"][n]).abs().max().item() for n, g in r["grads"].items())
        print(f"{rank:>4} {str((r['coords']['pp'], r['coords']['dp'])):>9} {len(r['grads']):>13} "
              f"{diff:>15.2e}")
    return 0
