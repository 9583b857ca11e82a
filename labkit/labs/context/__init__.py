"""Lab 07: where activation memory goes, and sequence / context parallelism against one process.

    labkit run context [--nproc 2] [--tp 2 --cp 2 --seq 32 --batch 2]   (--nproc: tp and cp)

Part 1, activations: one block of the tiny GPT (fp32, eager attention, which keeps its s x s scores
as in Korthikanti et al.'s count; no dropout: the book's TP has none) saves tensors for backward;
PyTorch's saved-tensor hooks count their storages (labkit.activation_memory's counter, which the
formula never feeds) for: no parallelism, TP t, TP t + SP, selective recomputation (the attention
core under torch.utils.checkpoint) and full recomputation (the block under it). Beside each, the
formula of labkit.costs.activations for the same architecture.

Part 2, runs: Plan(tp=t, sp=True) and Plan(cp=c) (and Plan(dp=2, cp=2) when 4 ranks are asked
for) train through labkit.parallel and are compared with the one-process reference (losses, first
step's gradients, parameters), with the bytes each mesh dimension moved (the comm log's payload
and the kernel's socket count) beside labkit.costs.parallel.

Bad input (a --seq that 2*cp or tp does not divide, a tp that does not divide the 4 heads, a
degree below 1) is a one-line error naming the flags and values that work, exit status 2, before
any process starts.

The experiment beside the lab (labkit.context holds the algorithms):
    crossover   a ring hop against its block of attention, per tokens per rank: where ring
                attention stops hiding (labkit run overlap_cp, costs.hiding.cp)
"""
from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from labkit.checkpoint.activation import with_recompute
from labkit.cliargs import count, lab_parser
from labkit.context import apply_sp
from labkit.context.sequence_parallel import check_sequence
from labkit.costs import activations, models
from labkit.labs import ran_on
from labkit.labs.parallel.compare import bytes_rows, differences
from labkit.labs.parallel.job import train
from labkit.launch import device, run
from labkit.model import GPT, GPTConfig
from labkit.observe.measured import Measured, measured_table
from labkit.observe.saved import SavedTensors
from labkit.parallel import Plan, check_plan
from labkit.progress import Progress
from labkit.reference import reference_train
from labkit.table import table
from labkit.tp import apply_tp

BACKEND = "auto"
CASES = ("none", "TP", "TP + SP", "selective", "full")


@contextlib.contextmanager
def attention_core_recomputed():
    """Selective recomputation (Korthikanti et al. 2022): inside this block every call of
    scaled_dot_product_attention runs under torch.utils.checkpoint, so its scores, softmax and
    dropout mask are recomputed in backward instead of kept (only q, k, v are saved)."""

    plain = F.scaled_dot_product_attention

    def core(*args, **kw):
        return checkpoint(lambda *a: plain(*a, **kw), *args, use_reentrant=False)

    F.scaled_dot_product_attention = core
    try:
        yield
    finally:
        F.scaled_dot_product_attention = plain


def block_saved_bytes(block, h) -> int:
    """Bytes block(h) keeps for backward (saved-tensor hooks; parameters and repeats left out)."""


    torch.manual_seed(0)
    with SavedTensors(exclude=block.parameters()) as saved:
        y = block(h)
    y.sum().backward()                                       # frees the graph
    return saved.bytes


def activation_job(cfg_kwargs: dict, batch: int) -> dict:
    """Rank side (tp ranks): bytes block 0 saves under each CASES entry, on this rank."""


    cfg, dev = GPTConfig(**cfg_kwargs), device()
    T, h = cfg.block_size, cfg.n_embd
    x = torch.randn(batch, T, h, generator=torch.Generator().manual_seed(1)).to(dev)

    def leaf():                                              # (B, T, h) the block's input
        return x.clone().requires_grad_()

    def plain():
        return GPT(cfg, seed=0).to(dev).train()

    out = {}
    with sdpa_kernel([SDPBackend.MATH]):                     # eager attention: keeps the scores
        out["none"] = block_saved_bytes(plain().blocks[0], leaf())
        out["TP"] = block_saved_bytes(apply_tp(plain(), None).blocks[0], leaf())
        out["TP + SP"] = block_saved_bytes(apply_sp(plain(), None).blocks[0], leaf())
        with attention_core_recomputed():
            out["selective"] = block_saved_bytes(plain().blocks[0], leaf())
            out["TP + SP, selective"] = block_saved_bytes(apply_sp(plain(), None).blocks[0],
                                                          leaf())
        model = plain()
        with_recompute(model)
        out["full"] = block_saved_bytes(model.blocks[0], leaf())
    out["flash"] = block_saved_bytes(plain().blocks[0], leaf())  # CPU's fused kernel: no scores
    out["tp"] = dist.get_world_size()
    return out


def predicted(cfg, batch: int, tp: int) -> dict:
    """labkit.costs.activations for the same block on this CPU: fp32 values (D = 4), keys and
    values repeated to every head before attention, eager attention (PyTorch's math kernel), no
    dropout (the book's TP has none); "flash": the fused kernel, which keeps a log-sum-exp."""

    spec = models.from_gpt_config(cfg)
    kw = dict(seq_len=cfg.block_size, micro_batch=batch, dtype_bytes=4, mask_bytes=4,
              attention="eager", kv_expanded=True, dropout=False)
    return {"none": activations.layer_bytes(spec, **kw),
            "TP": activations.layer_bytes(spec, tp=tp, **kw),
            "TP + SP": activations.layer_bytes(spec, tp=tp, sequence_parallel=True, **kw),
            "selective": activations.layer_bytes(spec, recompute="selective", **kw),
            "TP + SP, selective": activations.layer_bytes(spec, tp=tp, sequence_parallel=True,
                                                          recompute="selective", **kw),
            "full": activations.layer_bytes(spec, recompute="full", **kw),
            "flash": activations.layer_bytes(spec, **dict(kw, attention="flash"))}


def activation_rows(cfg_kwargs: dict, batch: int = 2, tp: int = 2) -> list:
    """Measured (rank 0 of a tp group) beside predicted, one row per case."""

    cfg = GPTConfig(**cfg_kwargs)
    check_sequence(cfg.block_size, tp)
    got = run(activation_job, tp, args=(cfg_kwargs, batch))[0]
    want = predicted(cfg, batch, tp)
    rows = [Measured(k, got[k], want[k], "saved-tensor hooks", "bytes") for k in want]
    return [{"case": r.what, "measured": r.measured, "predicted": r.predicted, "ratio": r.ratio}
            for r in rows]


def parallel_runs(plans: list, cfg_kwargs: dict, steps: int = 2, batch: int = 4) -> list:
    """Each plan trained through labkit.parallel vs the one-process reference: a summary per plan
    {"plan", "worst": {loss, grads, params}, "ok", "bytes": bytes_rows}."""

    cfg = GPTConfig(**cfg_kwargs)
    ref = reference_train(cfg, steps, batch, "sgd")
    out = []
    for plan in plans:
        check_plan(plan, cfg, world=plan.world, batch_size=batch)
        res = run(train, plan.world, args=(plan, cfg_kwargs, steps, batch, "sgd"), timeout=300)
        diffs = differences(res, ref, "sgd")
        worst = {k: max(d[k] for d in diffs) for k in ("loss", "grads", "params")}
        rows = bytes_rows(res, plan, cfg, batch)
        out.append({"plan": plan, "worst": worst, "ok": all(d["ok"] for d in diffs),
                    "bytes": rows, "kernel_sent": res[0]["kernel_sent"],
                    "ran_on": res[0]["ran_on"],
                    "wire_predicted": sum(r["wire"] for r in rows if r["rank"] == 0)})
    return out


def check_sizes(seq: int, tp: int, cp: int, layout: str = "zigzag", n_head: int = 4) -> None:
    """The sizes a run needs, checked before any process starts: one line naming the flags and
    values that work."""
    for name, v in (("tp", tp), ("cp", cp), ("seq", seq)):
        if v < 1:
            raise ValueError(f"--{name} {v} must be at least 1")
    if tp > 1 and n_head % tp:
        fit = [d for d in range(1, n_head + 1) if n_head % d == 0]
        raise ValueError(f"--tp {tp} must divide the model's {n_head} attention heads (tensor "
                         f"parallelism splits them); use --tp {' or '.join(map(str, fit))} "
                         f"(--nproc sets --tp and --cp where they are not given)")
    # SP cuts the sequence into tp pieces; zig-zag CP into 2*cp chunks
    step = math.lcm(tp if tp > 1 else 1, 2 * cp if cp > 1 and layout == "zigzag" else 1)
    if seq % step:
        lo, hi = seq // step * step, (seq // step + 1) * step
        why = " and ".join(w for w in (f"--tp {tp} (sequence parallelism)" if tp > 1 else "",
                                       f"2*cp = {2 * cp} (zig-zag layout, --cp {cp})"
                                       if cp > 1 and layout == "zigzag" else "") if w)
        raise ValueError(f"--seq {seq} must be a multiple of {step}: {why} cut it evenly; use "
                         f"--seq {lo or hi}" + (f" or {hi}" if lo else "")
                         + (", or --cp-layout plain" if cp > 1 and layout == "zigzag"
                            and seq % max(tp, 1) == 0 else ""))
    if cp > seq:
        raise ValueError(f"--seq {seq} is shorter than --cp {cp}: a rank would hold no tokens; "
                         f"use --seq {2 * cp} or more")


def main(argv=()):
    return run_lab(argv, "context")


def run_lab(argv, name: str):
    """The lab under its name: "context", or "sequence" (labkit.labs.sequence: --cp 1)."""


    p = lab_parser(name, nproc=2, nproc_help="the default of --tp and --cp")
    p.add_argument("--tp", type=count, default=None,
                   help="tensor/sequence-parallel degree (default: --nproc; 1: no SP run)")
    p.add_argument("--cp", type=count, default=None,
                   help="context-parallel degree (default: --nproc; 1: no CP run)")
    p.add_argument("--cp-layout", choices=("zigzag", "plain"), default="zigzag",
                   help="how CP cuts the sequence (zigzag: 2*cp divides --seq)")
    p.add_argument("--seq", type=count, default=32, help="sequence length T")
    p.add_argument("--batch", type=count, default=2, help="sequences per rank group and step")
    p.add_argument("--steps", type=count, default=2, help="SGD steps")
    a = p.parse_args(list(argv))
    a.tp = a.nproc if a.tp is None else a.tp
    a.cp = a.nproc if a.cp is None else a.cp
    cfg = dict(n_layer=2, n_embd=32, n_head=4, block_size=a.seq)
    check_sizes(a.seq, a.tp, a.cp, a.cp_layout, cfg["n_head"])
    plans = [Plan(tp=a.tp, sp=True)] if a.tp > 1 else []
    plans += [Plan(cp=a.cp, cp_layout=a.cp_layout)] if a.cp > 1 else []
    for plan in plans:                         # every plan's own checks, before any process
        check_plan(plan, GPTConfig(**cfg), world=plan.world, batch_size=2 * a.batch)
    prog = Progress(name, total=2)
    rows = []
    if a.tp > 1:
        rows = activation_rows(cfg, a.batch, a.tp)
    prog.done(f"activation bytes of one block measured ({len(rows)} cases)")
    runs = parallel_runs(plans, cfg, a.steps, 2 * a.batch)
    prog.done(f"{len(runs)} plans trained against the one-process reference")
    ok = all(r["ok"] for r in runs)
    if os.environ.get("RANK", "0") != "0":     # under torchrun: rank 0 prints the report
        return 0 if ok else 1
    if runs:
        print(f"{name}: {ran_on(*runs[0]['ran_on'])} (rank 0)")
    if rows:
        print(measured_table([Measured(r["case"], r["measured"], r["predicted"],
                                       "saved-tensor hooks", "bytes") for r in rows],
                             title=f"activation bytes one block saves, rank 0, tp={a.tp}, "
                                   f"s={a.seq}, b={a.batch}, h=32, a=4, fp32 (saved-tensor "
                                   "hooks vs labkit.costs.activations)"))
    print()
    print(table([(_short(r["plan"]), r["worst"]["loss"],
                  r["worst"]["grads"], r["worst"]["params"], "yes" if r["ok"] else "NO")
                 for r in runs],
                [("plan", 0), ("max |loss diff|", 1, ".1e"), ("max |grad diff|", 2, ".1e"),
                 ("max |param diff|", 3, ".1e"), ("equal", 4)],
                title=f"{a.steps} SGD steps vs the one-process reference"))
    print()
    print(measured_table([Measured(f"{_short(r['plan'])} {b['dim']}", b["logged"], b["predicted"],
                                   "commlog", "bytes")
                          for r in runs for b in r["bytes"] if b["rank"] == 0],
                         title="payload per mesh dimension, rank 0, one step (comm log vs "
                               "formula)"))
    print()
    print(measured_table([Measured(_short(r["plan"]), r["kernel_sent"],
                                   r["wire_predicted"], "kernel TCP", "bytes") for r in runs],
                         title="bytes rank 0 sent in one step, counted by the kernel "
                               "(observe.netcount), against the ring formula"))
    if any(r["plan"].sp for r in runs):
        print("(on Gloo a reduce-scatter sends as many bytes as an all-reduce, twice the ring's: "
              "chapter 03; so a plan with SP sends more than the ring formula)")
    return 0 if ok else 1


def _short(plan) -> str:
    parts = [f"{k}={getattr(plan, k)}" for k in ("dp", "tp", "cp") if getattr(plan, k) > 1]
    return "Plan(" + ", ".join(parts + (["sp=True"] if plan.sp else [])) + ")"
