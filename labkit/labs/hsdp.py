"""Lab 03b: HSDP on N processes: ZeRO-3 inside groups of S ranks, replicas across R = N/S groups;
equal to one process, and its bytes on the wire per mesh dimension, counted by the kernel.

    labkit run hsdp --nproc 4                    # 2 replicas x 2 shards
    labkit run hsdp --nproc 6 --replicate 2      # 2 x 3: shards of uneven size
    torchrun --nproc-per-node 4 -m labkit run hsdp

Each rank trains the tiny GPT (fp32, AdamW) with labkit.zero.hsdp.HSDP on the ("replicate",
"shard") mesh, and with plain ZeRO-3 over all N ranks for comparison. Rank 0 prints the largest
difference of the parameters and of the first step's gradients from one process, then, per rank
and step, the bytes its TCP sockets sent during forward and backward (the shard dimension's
gathers and reduce-scatter: nothing else runs then) and during the replicas' all-reduce (the
replicate dimension), counted by the kernel (labkit.observe.netcount, not by labkit), against
labkit.costs.zero.hsdp_comm_per_rank. ZeRO-3 over all N ranks sends more, and on a cluster all
of it crosses the slow links; HSDP keeps 3(S-1)/S Ψ inside a node and sends 2(R-1)/R Ψ/S across.
"""
import os

import torch.distributed as dist

from labkit.cliargs import group_lab_args
from labkit.costs import zero as costs_zero
from labkit.labs import ran_on, rank_place
from labkit.labs.zero.measure import LAB_MODEL, moved_numel, predicted_sent
from labkit.labs.zero.train import gathered_grads, real_model, sharded_train
from labkit.launch import device, note, run
from labkit.model import get_batch, shard_rows, tiny_corpus
from labkit.observe import netcount
from labkit.observe.measured import Measured, measured_table
from labkit.progress import Progress
from labkit.reference import TrainSpec, optimizer_spec, train
from labkit.zero.hsdp import HSDP, hsdp_mesh

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank


def hsdp_train(replicate: int, steps: int, batch: int, cfg=None, optimizer: str = "adamw",
               seed: int = 0, against_zero3: bool = True) -> dict:
    """Rank side: train `steps` HSDP steps (cfg: the lab's model by default); {"params",
    "grads" (first step, the mean gradient), "losses", "shard_sent", "replicate_sent"
    (kernel-counted bytes of the last step), "reason" (why not counted, if not), "zero3_sent"
    (one step of ZeRO-3 over every rank, with against_zero3), "place" (backend, device)}."""


    cfg = cfg or LAB_MODEL
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = device()
    mesh = hsdp_mesh(replicate, world // replicate, dev.type)
    model = real_model(cfg, seed).to(dev)
    opt_class, kw = optimizer_spec(optimizer)
    hsdp = HSDP(model, opt_class, mesh, **kw)
    tokens, losses, grads = tiny_corpus(), [], None
    for step in range(steps):
        note(f"HSDP step {step}")
        x, y = get_batch(tokens, batch, cfg.block_size, step, seed)             # (B, T)
        x, y = shard_rows(x, rank, world).to(dev), shard_rows(y, rank, world).to(dev)  # (B/N, T)
        with netcount.socket_bytes() as shard_wire:       # the shard group's collectives only
            loss = model(x, y)[1]
            loss.backward()
        with netcount.socket_bytes() as replicate_wire:   # the replicas' all-reduce only
            hsdp.all_reduce_replicas()
        hsdp.zero3.step()
        if grads is None:
            grads = gathered_grads(hsdp.zero3, model)
        hsdp.zero_grad()
        losses.append(loss.item())
    out = {"params": hsdp.full_parameters(), "grads": grads, "losses": losses,
           "shard_sent": shard_wire.sent, "replicate_sent": replicate_wire.sent,
           "reason": shard_wire.reason, "place": rank_place()}
    if against_zero3:
        out["zero3_sent"] = sharded_train(3, cfg, optimizer, steps=1, batch_size=batch,
                                          seed=seed)["sent"]
    return out


def predicted(replicate: int, world: int) -> dict:
    """labkit.costs' bytes per rank and step for the lab's model (fp32 on the wire), with Ψ as
    ZeRO-3 moves it (each parameter padded to a multiple of its group: labkit.labs.zero.measure)."""

    shard = world // replicate
    psi_s = moved_numel(LAB_MODEL, 3, shard)            # padded to multiples of S
    out = costs_zero.hsdp_comm_per_rank(psi_s, replicate, shard, param_bytes=4, grad_bytes=4)
    out["zero3"] = predicted_sent(LAB_MODEL, 3, world)
    return out


def report(got: list, ref: dict, replicate: int, steps: int) -> str:
    """What the lab prints: the differences from one process (`ref`: reference_train's), then
    the kernel's bytes per mesh dimension against the formula."""

    n = len(got)
    dp = max((g["params"][k] - v).abs().max().item() for g in got for k, v in ref["params"].items())
    dg = max((g["grads"][k] - v).abs().max().item() for g in got for k, v in ref["grads"].items())
    out = [f"{n} ranks = {replicate} replicas x {n // replicate} shards "
           f"({ran_on(*got[0]['place'])}); {steps} AdamW steps, fp32",
           f"  max |param - one process| = {dp:.1e}; max |first-step gradient - one process| = "
           f"{dg:.1e}"]
    if got[0]["shard_sent"] is None:
        return "\n".join(out + [f"bytes on the wire: not counted here ({got[0]['reason']})"])
    want, rows = predicted(replicate, n), []
    parts = [("shard dim (fwd+bwd)", "shard_sent", want["shard"]),
             ("replicate dim (all-reduce)", "replicate_sent", want["replicate"])]
    if "zero3_sent" in got[0]:
        parts.append((f"ZeRO-3 over all {n}", "zero3_sent", want["zero3"]))
    for what, key, pred in parts:
        # one replica (or one shard): the formula is 0 bytes, and Measured takes no ratio
        rows.append(Measured(what, max(g[key] for g in got) / 1e3, pred / 1e3,
                             counter="kernel TCP", unit="KB"))
    out.append(measured_table(rows, title="HSDP: bytes each rank sent, per mesh dimension"))
    out.append("KB = 1e3 bytes, largest rank. predicted: labkit.costs.zero.hsdp_comm_per_rank "
               "(3(S-1)/S Ψ on the shard dimension, 2(R-1)/R Ψ/S on the replicate one; Ψ padded "
               "to multiples of S) and comm_per_rank for ZeRO-3; the excess is Gloo's message "
               "headers. On a cluster with S GPUs per node only the replicate row crosses nodes.")
    return "\n".join(out)


def main(argv=()):
    args = group_lab_args(argv, "hsdp", "--replicate", "replica groups R (the shard groups have "
                          "nproc / R ranks)", steps=2, sizes=False, what="HSDP")
    n, r = args.nproc, args.replicate
    batch = 2 * n
    prog = Progress("hsdp", total=2)
    ref = train(LAB_MODEL, TrainSpec(steps=args.steps, batch=batch, optimizer="adamw"))
    prog.done(f"one process, whole batch: {args.steps} AdamW steps")
    got = run(hsdp_train, n, args=(r, args.steps, batch))
    prog.done(f"HSDP {r} replicas x {n // r} shards on {n} ranks, and ZeRO-3 over all {n}")
    if os.environ.get("RANK", "0") != "0":
        return 0
    print(report(got, ref, r, args.steps))
    return 0
