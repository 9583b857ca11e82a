"""Lab 08: mixture of experts. Expert parallelism against the one-process MoE, all-to-all bytes
counted by the kernel against the formula, load balancing over training, capacity vs drops.

    labkit run moe --nproc 4 [--steps 3 --batch 5]
    torchrun --nproc-per-node 4 -m labkit run moe

The jobs below are what chapter 08 runs too:
  bytes_job        one MoE layer, expert-parallel over all ranks, uneven tokens per rank: the
                   bytes each rank's sockets sent in forward + backward (observe.netcount, the
                   kernel's count) beside 4 * rows-to-other-ranks * h * 4 bytes
  balance_run      one process: tokens per expert at every step of a short training run,
                   with no balancing, the Switch loss, or DeepSeek-V3's loss-free bias
  drops_at         one process: dropped assignments of a random router at capacity factors

Beside it: alltoall (labkit.moe.alltoall's schedules timed against dist.all_to_all_single, for
`labkit bench moe` and chapter 08).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from labkit.cliargs import count, lab_parser, positive
from labkit.labs import ran_on
from labkit.labs.parallel.compare import differences
from labkit.labs.parallel.job import train
from labkit.launch import device, run
from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus
from labkit.moe.expert_parallel import ExpertParallelMoE
from labkit.moe.layer import MoE, moe_layers, update_biases
from labkit.moe.router import capacity, route
from labkit.observe import netcount
from labkit.observe.measured import Measured
from labkit.parallel import Plan, check_plan
from labkit.progress import Progress
from labkit.reference import reference_train
from labkit.table import table

BACKEND = "auto"

LAYER = dict(n_layer=1, n_embd=64, n_head=4, block_size=16, n_expert=8, expert_top_k=2,
             expert_ffn_mult=2)


def bytes_job(tokens_per_rank: list, cfg_kwargs: dict | None = None, seed: int = 0) -> dict:
    """On each rank of the world (= ep): its tokens through an expert-parallel MoE layer, forward
    and backward, inside the kernel's socket counter. Routing rows are recounted here from the
    router (not from the all-to-all code): rows this rank's tokens send to each rank."""


    torch.set_num_threads(1)
    rank, ep, dev = dist.get_rank(), dist.get_world_size(), device()
    cfg = GPTConfig(**{**LAYER, **(cfg_kwargs or {})})
    torch.manual_seed(seed)
    layer = ExpertParallelMoE(MoE(cfg).to(dev), None)
    n = tokens_per_rank[rank]
    g = torch.Generator().manual_seed(seed + 1 + rank)
    x = torch.randn(1, n, cfg.n_embd, generator=g).to(dev).requires_grad_()   # (1, n, h)
    with torch.no_grad():                                                    # independent recount
        cap = capacity(n, cfg.expert_top_k, cfg.n_expert, cfg.capacity_factor)
        r = route(layer.router(x[0]), cfg.expert_top_k, cfg.gate, cap)
        dest = r.expert[r.kept] // (cfg.n_expert // ep)                       # (A,) rank per row
        to_rank = torch.bincount(dest, minlength=ep).tolist()
    y = layer(x)                                                             # warm-up, same shapes
    y.sum().backward()
    dist.barrier()
    with netcount.socket_bytes() as c:
        y = layer(x)
        y.sum().backward()
    recv_rows = [0] * ep
    counts = torch.tensor(to_rank, device=dev)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts)
    recv_rows = got.tolist()
    return {"rank": rank, "tokens": n, "to_rank": to_rank, "from_rank": recv_rows,
            "sent": c.sent, "reason": c.reason, "h": cfg.n_embd, "k": cfg.expert_top_k}


def bytes_rows(per_rank: list, ep: int) -> list:
    """Per rank: measured socket bytes vs 2 x (rows out + rows back in) ... as the formula
    counts them: dispatch sends my rows to others, combine sends others' rows back, and backward
    repeats both; ids (8 bytes a row, once) and the counts (8 bytes a rank) ride along."""
    out = []
    for r in per_rank:
        me, h = r["rank"], r["h"]
        mine_out = sum(v for j, v in enumerate(r["to_rank"]) if j != me)      # dispatch rows
        theirs_back = sum(v for j, v in enumerate(r["from_rank"]) if j != me)  # combine rows
        payload = 2 * (mine_out + theirs_back) * h * 4                       # fwd + bwd, fp32
        extra = mine_out * 8 + (ep - 1) * 8                                  # expert ids, counts
        out.append({"rank": me, "tokens": r["tokens"], "rows out": mine_out,
                    "rows back": theirs_back, "formula B": payload, "ids+counts B": extra,
                    "kernel B": r["sent"],
                    "ratio": Measured("all-to-all bytes", r["sent"], payload + extra,
                                      counter="kernel TCP", unit="bytes").ratio})
    return out


def balance_run(mode: str, steps: int = 20, batch: int = 4, seed: int = 0, lr: float = 1e-3,
                aux: float = 0.1, rate: float = 0.002, cfg_kwargs: dict | None = None) -> dict:
    """One process: train a 2-layer MoE GPT; tokens per expert of the first MoE layer at every
    step. mode: "none", "switch" (aux loss coefficient `aux`) or "bias" (loss-free, `rate`)."""


    extra = {"none": dict(aux_loss_coef=0.0, bias_update_rate=0.0),
             "switch": dict(aux_loss_coef=aux, bias_update_rate=0.0),
             "bias": dict(aux_loss_coef=0.0, bias_update_rate=rate)}[mode]
    cfg = GPTConfig(**{**dict(n_layer=2, n_embd=32, n_head=4, block_size=16, n_expert=8,
                              expert_top_k=2, expert_ffn_mult=2), **(cfg_kwargs or {}), **extra})
    model = GPT(cfg, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tokens, loads, losses = tiny_corpus(), [], []
    for step in range(steps):
        x, y = get_batch(tokens, batch, cfg.block_size, step)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        update_biases(model)
        loads.append(moe_layers(model)[0].stats["load"].tolist())
        losses.append(loss.item())
    return {"mode": mode, "loads": loads, "losses": losses}


def imbalance(load) -> float:
    """max load / mean load: 1.0 is perfectly even; an expert's capacity must cover the max."""
    return max(load) / (sum(load) / len(load))


def drops_at(factor: float, tokens: int, n_expert: int = 8, k: int = 2, seed: int = 0) -> float:
    """Share of assignments dropped by a random router (logits ~ N(0, 1)) at this factor."""


    logits = torch.randn(tokens, n_expert, generator=torch.Generator().manual_seed(seed))
    r = route(logits, k, capacity=capacity(tokens, k, n_expert, factor))
    return float((~r.kept).sum()) / r.kept.numel()


def main(argv=()):

    p = lab_parser("moe", nproc=4,
                   nproc_help="ranks: the expert-parallel degree (and DP); it divides --experts")
    p.add_argument("--steps", type=count, default=3, help="SGD steps")
    p.add_argument("--batch", type=count, default=5, help="global batch (sequences)")
    p.add_argument("--experts", type=count, default=8, help="experts per MoE layer")
    p.add_argument("--top-k", type=count, default=2, help="experts each token is routed to")
    p.add_argument("--capacity-factor", type=positive, default=1.0,
                   help="expert capacity, in multiples of an even share of the assignments")
    a = p.parse_args(list(argv))
    if a.experts % a.nproc:
        fit = [d for d in range(1, a.experts + 1) if a.experts % d == 0]
        raise ValueError(f"--nproc {a.nproc} ranks cannot share --experts {a.experts} evenly "
                         f"(expert parallelism: each rank holds experts/nproc); use --nproc "
                         f"{' or '.join(map(str, fit[1:] or fit))}, or --experts "
                         f"{a.experts // a.nproc * a.nproc or a.nproc}")
    if a.top_k > a.experts:
        raise ValueError(f"--top-k {a.top_k} is more than the {a.experts} experts; use --top-k "
                         f"{min(2, a.experts)}")
    cfg = dict(n_layer=2, n_embd=32, n_head=4, block_size=16, n_expert=a.experts,
               expert_top_k=a.top_k, capacity_factor=a.capacity_factor, aux_loss_coef=0.01,
               expert_ffn_mult=2)
    plan = Plan(dp=a.nproc, ep=a.nproc)
    check_plan(plan, GPTConfig(**cfg), world=plan.world, batch_size=a.batch)   # one clear line
    prog = Progress("moe", total=2)
    prog.say(f"EP={a.nproc}: {a.experts} experts, top-{a.top_k}, capacity factor "
             f"{a.capacity_factor}; {a.steps} SGD steps against the one-process MoE")
    results = run(train, plan.world, args=(plan, cfg, a.steps, a.batch, "sgd"), echo=False)
    ref = reference_train(GPTConfig(**cfg), a.steps, a.batch, "sgd",
                          capacity_rows=plan.capacity_rows(a.batch))
    diffs = differences(results, ref, "sgd")
    same = all(d["ok"] for d in diffs)
    prog.done(f"expert parallel vs one process: {'equal' if same else 'DIFFERENT'}")
    tokens = [16 * r for r in plan.capacity_rows(a.batch)]
    per_rank = run(bytes_job, a.nproc,
                   args=(tokens, dict(n_expert=a.experts, expert_top_k=a.top_k)), echo=False)
    rows = bytes_rows(per_rank, a.nproc)
    prog.done("all-to-all bytes counted by the kernel")
    if os.environ.get("RANK", "0") != "0":
        return 0
    print(f"EP={a.nproc} (x DP={a.nproc}); {ran_on(*results[0]['ran_on'])}")
    print(table(diffs, [("rank", "rank"), ("|loss diff|", "loss", ".1e"),
                        ("|grad diff|", "grads", ".1e"), ("|param diff|", "params", ".1e"),
                        ("ok", "ok")], title="expert parallel vs one-process MoE (same drops)"))
    print()
    print(table(rows, ["rank", "tokens", "rows out", "rows back", "formula B", "ids+counts B",
                       "kernel B", ("ratio", "ratio", ".3f")],
                title="one MoE layer, forward + backward: bytes each rank sent"))
    return 0
