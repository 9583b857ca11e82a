"""The DDP step-time model against the measured step: which terms the textbook model leaves out.

Rank side only (call inside labkit.launch.run). The textbook model is T = compute + b*alpha +
D/bandwidth, with alpha and bandwidth from lone blocking all-reduces. On a real step three
things it leaves out show up: the ranks wait for the slowest one (compute is a max over ranks,
not one rank's median), a message's cost depends on its size in a way alpha + n/bandwidth does
not capture (Gloo picks its algorithm by size), and labkit's DDPs pay Python per message (an
async launch, a callback on completion) and per gradient (hooks, packing into buckets).
`model_vs_measured` times each of those pieces at the sizes a variant really sends, in the same
interleaved rounds as the step itself, and compares."""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from labkit.ddp.bucketed import assign_buckets
from labkit.labs.ddp.timing import BENCH, _setup, _step
from labkit.labs.ddp.verify import build_model
from labkit.launch import device
from labkit.model import get_batch, tiny_corpus
from labkit.observe.measured import Measured
from labkit.observe.timeline import Timeline
from labkit.timing import now


def _median_block(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls, each started together by a barrier (the
    first call warms up and is dropped)."""
    dev, ts = device(), []
    for _ in range(repeats + 1):
        dist.barrier()
        start = now(dev)
        fn()
        ts.append(now(dev) - start)
    return statistics.median(ts[1:])


def _launched(flat):
    """One all-reduce the way labkit's DDPs send it: async, a Python callback on completion
    (DDPBase._launch records the end time there), then wait."""
    return dist.all_reduce(flat, async_op=True).get_future().then(lambda f: None)


def measure_parts(cfg: dict = BENCH, *, batch: int = 8, repeats: int = 9) -> dict:
    """The textbook model's pieces, measured on this rank (medians, seconds; interleaved rounds):
    compute (forward + backward + optimizer of the plain model, no communication), alpha (a
    lone blocking all-reduce of one element) and full_comm (every gradient as one message)."""
    dev = device()
    model = build_model(cfg, seed=0, dtype="float32").to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = (t.to(dev) for t in get_batch(tiny_corpus(), batch, cfg["block_size"],
                                         step=dist.get_rank()))
    numel = sum(p.numel() for p in model.parameters())
    flat = torch.zeros(numel, device=dev)                                   # (numel,)
    one = torch.zeros(1, device=dev)
    pieces = {"compute": lambda: _step(model, opt, x, y), "alpha": lambda: dist.all_reduce(one),
              "full_comm": lambda: dist.all_reduce(flat)}
    times = {k: [] for k in pieces}
    for _ in range(repeats):  # interleaved: each round measures every piece once
        for k, fn in pieces.items():
            times[k].append(_median_block(fn, 1))
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update(grad_bytes=4 * numel, n_params=len(list(model.parameters())))
    return out


def textbook_step(parts: dict, n_messages: int) -> float:
    """The textbook's no-overlap step: compute + b*alpha + the whole gradient as one message
    (alpha and bandwidth from lone blocking calls; every message assumed to cost alpha more)."""
    return parts["compute"] + n_messages * parts["alpha"] + parts["full_comm"]


def breakdown(variants, cfg: dict = BENCH, *, batch: int = 8, steps: int = 9, warmup: int = 2):
    """Median milliseconds per phase of a step (forward, backward, pack, wait, unpack, optimizer,
    total) for each variant (kind, bucket_mb), from the DDP's own timeline; steps interleaved
    across variants. Phases a variant does not have are absent (PyTorch's DDP packs and waits
    inside backward, in C++)."""
    dev = device()
    x, y = (t.to(dev) for t in get_batch(tiny_corpus(), batch, cfg["block_size"],
                                         step=dist.get_rank()))
    lines = []
    for kind, mb in variants:
        tl = Timeline(dev)
        ddp, opt = _setup(kind, cfg, mb, timeline=tl)
        for _ in range(warmup):
            _step(ddp, opt, x, y)
        lines.append((tl, ddp, opt, {}))
    for _ in range(steps):
        for tl, ddp, opt, per in lines:
            dist.barrier()
            tl.reset()
            start = now(dev)
            _step(ddp, opt, x, y, tl)
            per.setdefault("total", []).append(now(dev) - start)
            for e in tl.events:
                per.setdefault(e["name"], []).append(e["end"] - e["start"])
    rows = []
    for (kind, mb), (*_, per) in zip(variants, lines):
        row = {"version": kind, "bucket_mb": mb}
        row.update({k: 1e3 * statistics.median(v) for k, v in per.items()})
        rows.append(row)
    return rows


def _slowest(seconds: float) -> float:
    """The largest of every rank's `seconds`: a collective waits for the slowest rank."""
    t = torch.tensor([seconds], device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def message_sizes(kind: str, params, bucket_mb) -> list:
    """Elements of each all-reduce one step sends: one per parameter (naive, overlap) or one per
    bucket (bucketed, and torch's reducer: the same rule, labkit.buckets)."""
    if kind in ("naive", "overlap"):
        return [p.numel() for p in params]
    return [sum(p.numel() for p in b) for b in assign_buckets(params, bucket_mb)]


def model_vs_measured(variants, cfg: dict = BENCH, *, batch: int = 8, rounds: int = 9,
                      warmup: int = 2) -> list:
    """For each variant (kind, bucket_mb), in interleaved rounds (so drifting load hits all alike):
    the measured step (slowest rank) and the pieces of the no-overlap model, each timed alone:

    compute  the step of the plain model (with one Python hook per parameter where the variant
             registers them), slowest rank: a collective waits for the slowest rank
    pack     flattening the gradients into buckets and back (BucketedDDP; PyTorch's reducer
             does the same copy in C++)
    comm     this variant's messages, each at its real size, sent back to back as the variant
             sends them (labkit: async + Python callback + wait; torch: one blocking call)

    model = compute + pack + comm (seconds, medians over rounds; ratio = step / model) is an
    upper bound when an
    all-reduce hides under backward. Also the textbook's pieces: compute on this rank (median),
    alpha (one element, blocking) and the whole gradient as one message (see predict_step)."""
    dev = device()
    x, y = (t.to(dev) for t in get_batch(tiny_corpus(), batch, cfg["block_size"],
                                         step=dist.get_rank()))
    plain = build_model(cfg, seed=0, dtype="float32").to(dev)
    hooked = build_model(cfg, seed=0, dtype="float32").to(dev)
    for p in hooked.parameters():
        p.register_post_accumulate_grad_hook(lambda p: None)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-3) for m in (plain, hooked)}
    params = list(plain.parameters())
    setups = [_setup(kind, cfg, mb) for kind, mb in variants]
    bufs = [[torch.zeros(n, device=dev) for n in message_sizes(kind, params, mb)]   # (n,)
            for kind, mb in variants]
    grads = [torch.randn_like(p) for p in params]
    for ddp, opt in setups:
        for _ in range(warmup):
            _step(ddp, opt, x, y)

    def timed(fn, *args):
        dist.barrier()
        start = now(dev)
        fn(*args)
        return now(dev) - start

    def pack(mb):
        for bucket in assign_buckets(grads, mb):  # as BucketedDDP: cat, average, copy back
            flat = torch.cat([g.reshape(-1) for g in bucket])                   # (bucket numel,)
            flat.div_(dist.get_world_size())
            for g, piece in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(piece.view_as(g))

    def comm(kind, bs):
        for buf in bs:
            (dist.all_reduce(buf) if kind == "torch" else _launched(buf).wait())

    raw = [{k: [] for k in ("step", "compute", "pack", "comm")} for _ in variants]
    for r in range(rounds):
        for i in list(range(len(variants)))[r % len(variants):] + \
                list(range(len(variants)))[:r % len(variants)]:
            kind, _ = variants[i]
            ddp, opt = setups[i]
            model = hooked if kind in ("overlap", "bucketed") else plain
            raw[i]["step"].append(_slowest(timed(_step, ddp, opt, x, y)))
            raw[i]["compute"].append(_slowest(timed(_step, model, opts[id(model)], x, y)))
            raw[i]["pack"].append(_slowest(timed(pack, variants[i][1]))
                                  if kind == "bucketed" else 0.0)
            raw[i]["comm"].append(_slowest(timed(comm, kind, bufs[i])))
    rows = []
    for (kind, mb), d, bs in zip(variants, raw, bufs):
        row = {"version": kind, "bucket_mb": mb, "messages": len(bs)}
        row.update({k: statistics.median(v) for k, v in d.items()})
        row["model"] = row["compute"] + row["pack"] + row["comm"]
        # measured / predicted (the model has no overlap)
        row["ratio"] = Measured("step", row["step"], row["model"], unit="s").ratio
        rows.append(row)
    return rows
