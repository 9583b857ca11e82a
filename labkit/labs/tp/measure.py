"""Measurements for chapter 04's lab, benchmark and notebook: log every TP collective on real
processes, count the bytes the kernel saw, and time a layer's forward + backward as TP grows.

    from labkit.labs.tp.measure import count_layer_comm, count_wire, time_layers, train_side_by_side
    run(train_side_by_side, 2, args=(dict(n_layer=2), 2, 4))  # TP GPT next to the reference
    count_layer_comm(tp=2, b=4, s=16, h=32)   # rows: one per collective (the comm log's count)
    count_wire(tps=(2, 4))                    # bytes sent, counted by the kernel, vs the formula
    time_layers(tps=(1, 2, 4), b=8, s=64, h=256)

The comm log (observe.commlog) is what the f/g operators asked for: a count and a timeline. The
bytes on the wire come from the kernel's socket counters (labkit.observe.netcount), which the code
under test does not write.

Each function launches its own processes (labkit.launch.run; under torchrun it runs in place).
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from labkit.costs import tensor_parallel as tpc
from labkit.launch import device, run
from labkit.layers import MLP
from labkit.model import GPT, Block, GPTConfig, get_batch, tiny_corpus
from labkit.observe import commlog, netcount
from labkit.observe.measured import Measured
from labkit.timing import now
from labkit.tp import (
    NaiveTensorParallelMLP,
    TensorParallelAttention,
    TensorParallelMLP,
    apply_tp,
    gather_tp_grads,
)


def _config(h: int, s: int, n_head: int, n_layer: int = 1):
    return GPTConfig(n_layer=n_layer, n_embd=h, n_head=n_head, block_size=s, vocab_size=96)


def comm_job(h: int, s: int, b: int, n_head: int, what: str = "layer"):
    """On each rank: one fwd+bwd of a 1-layer TP GPT ('layer'), a TP MLP ('mlp') or the naive
    all-gathering MLP ('naive mlp'), on labkit.launch.device(); returns the comm log's events,
    each marked by pass."""
    cfg, dev = _config(h, s, n_head), device()
    if what in ("mlp", "naive mlp"):
        cls = NaiveTensorParallelMLP if what == "naive mlp" else TensorParallelMLP
        torch.manual_seed(0)
        mlp = cls.from_mlp(MLP(cfg).to(dev), None)
        x = _input(b, s, h, dev)                              # (b, s, h), the same on every rank
        with commlog.record() as log:
            y = mlp(x)
            n_fwd = len(log.events)
            y.sum().backward()
    else:
        model = apply_tp(GPT(cfg, seed=0).to(dev), None)
        x, y = (t.to(dev) for t in get_batch(tiny_corpus(), b, s, step=0))  # (b, s) tokens
        with commlog.record() as log:
            _, loss = model(x, y)
            n_fwd = len(log.events)
            loss.backward()
    return [dict(vars(e), phase="forward" if i < n_fwd else "backward")
            for i, e in enumerate(log.events)]


def _input(b: int, s: int, h: int, dev):
    """(b, s, h) activations drawn on the CPU (the same numbers on any device), then moved."""
    x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(1), device="cpu")
    return x.to(dev).requires_grad_()


def _comm_jobs(h, s, b, n_head, whats):
    """{what: (events, bytes this rank sent in the fwd+bwd, counted by the kernel or None)}."""
    out = {}
    for what in whats:
        dist.barrier()
        with netcount.socket_bytes() as wire:
            events = comm_job(h, s, b, n_head, what)
        out[what] = (events, wire.sent)
    return out


def count_comm(tp: int, b: int = 4, s: int = 16, h: int = 32, n_head: int = 4,
               whats=("layer",), bytes_per_element: int = 4) -> dict:
    """{what: rows} for several models in one launch; see count_layer_comm. Each row also
    carries "wire_sent": the bytes rank 0 sent in that model's whole fwd+bwd, counted by the
    kernel (labkit.observe.netcount; None where it cannot count). "measured_bytes" is the comm log's
    payload of that one call (what the operator asked for), not a wire count."""
    for what in whats:
        if what not in ("layer", "mlp", "naive mlp"):
            raise ValueError(f"what must be 'layer', 'mlp' or 'naive mlp', got {what!r}")
    per_what = run(_comm_jobs, tp, args=(h, s, b, n_head, tuple(whats)), echo=False)[0]
    out = {}
    for what, (events, sent) in per_what.items():
        # the formula is Megatron's (b*s*h per all-reduce); the naive MLP has no formula here
        predicted = None if what == "naive mlp" else tpc.allreduce_bytes(b, s, h, bytes_per_element)
        out[what] = [{"tp": tp, "phase": e["phase"], "op": e["op"], "where": e["where"],
                      "shape": e["shape"], "measured_bytes": e["bytes"],
                      "predicted_bytes": predicted, "wire_sent": sent} for e in events]
    return out


def count_layer_comm(tp: int, b: int = 4, s: int = 16, h: int = 32, n_head: int = 4,
                     what: str = "layer", bytes_per_element: int = 4) -> list:
    """Every collective of one layer's forward + backward at TP=tp, measured on rank 0, with the
    formula's prediction beside it. what: 'layer' (a GPT block), 'mlp', or 'naive mlp'."""
    return count_comm(tp, b, s, h, n_head, (what,), bytes_per_element)[what]


def wire_job(cfg_kwargs: dict, b: int, repeats: int = 3) -> dict:
    """On each rank: one forward + backward of the TP GPT, the bytes this rank's sockets sent
    counted by the kernel (median over `repeats`), and the all-reduces the comm log saw."""
    cfg, dev = GPTConfig(**cfg_kwargs), device()
    model = apply_tp(GPT(cfg, seed=0).to(dev), None)
    x, y = (t.to(dev) for t in get_batch(tiny_corpus(), b, cfg.block_size, step=0))  # (b, s)
    sent = []
    for _ in range(repeats):
        dist.barrier()
        with netcount.socket_bytes() as wire, commlog.record() as log:
            model(x, y)[1].backward()
        model.zero_grad(set_to_none=True)
        sent.append(wire.sent)
    return {"sent": None if None in sent else statistics.median(sent), "reason": wire.reason,
            "all_reduces": log.count("all_reduce"), "logged_bytes": log.bytes("all_reduce"),
            "other_calls": len(log.events) - log.count("all_reduce")}


def count_wire(tps=(2, 4), b: int = 4, n_layer: int = 2, h: int = 64, s: int = 32,
               n_head: int = 4, repeats: int = 3) -> list:
    """Rows {tp, all_reduces, sent, predicted, ratio}: bytes rank 0..tp-1 sent in one TP
    forward + backward (largest rank, kernel count) vs labkit.costs.tensor_parallel's
    n_layer * 4 * 2(tp-1)/tp * b*s*h*4 bytes (fp32)."""
    cfg = dict(n_layer=n_layer, n_embd=h, n_head=n_head, block_size=s, vocab_size=96)
    rows = []
    for tp in tps:
        res = run(wire_job, tp, args=(cfg, b, repeats), echo=False, timeout=300)
        sent = None if any(r["sent"] is None for r in res) else max(r["sent"] for r in res)
        pred = n_layer * tpc.layer_bytes_sent_per_rank(b, s, h, tp, 4)
        rows.append({"tp": tp, "b": b, "s": s, "h": h, "n_layer": n_layer,
                     "all_reduces": res[0]["all_reduces"], "other_calls": res[0]["other_calls"],
                     "logged_bytes": res[0]["logged_bytes"], "sent": sent, "predicted": pred,
                     "ratio": Measured("bytes sent", sent, pred, "kernel TCP", "bytes").ratio,
                     "reason": res[0]["reason"]})
    return rows


def wire_table(rows) -> str:
    lines = [f"{'tp':>3} {'all-reduces':>11} {'logged KB':>10} {'sent KB (kernel)':>17} "
             f"{'predicted KB':>13} {'ratio':>6}"]
    for r in rows:
        sent = "n/a" if r["sent"] is None else f"{r['sent'] / 1e3:.1f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"{r['tp']:>3} {r['all_reduces']:>11} {r['logged_bytes'] / 1e3:>10.1f} "
                     f"{sent:>17} {r['predicted'] / 1e3:>13.1f} {ratio:>6}")
    lines += [f"sent: not counted ({r['reason']})" for r in rows[:1] if r["sent"] is None]
    return "\n".join(lines)


def train_side_by_side(cfg_kwargs: dict, steps: int = 2, batch: int = 4):
    """On each rank: the one-process GPT (on the CPU: the reference) and its TP version (on
    labkit.launch.device(): this rank's GPU under NCCL) trained by SGD on the same batches.

    Returns {"rows": [(step, loss_ref, loss_tp, max |grad diff|)], "events": the last step's
    collectives (comm log events marked forward/backward), "sent": bytes this rank's sockets
    sent in the last step's TP forward + backward, counted by the kernel (observe.netcount; None
    where it cannot count, "wire_reason" says why), "backend", "device"}."""
    cfg, dev = GPTConfig(**cfg_kwargs), device()
    ref, tp = GPT(cfg, seed=0), apply_tp(GPT(cfg, seed=0).to(dev), None)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, tp)]
    tokens, rows, events = tiny_corpus(), [], []
    for step in range(steps):
        x, y = get_batch(tokens, batch, cfg.block_size, step)           # (B, T) on the CPU
        _, loss_r = ref(x, y)
        loss_r.backward()
        dist.barrier()
        with netcount.socket_bytes() as wire, commlog.record() as log:
            _, loss_t = tp(x.to(dev), y.to(dev))
            n_fwd = len(log.events)
            loss_t.backward()
        events = [dict(vars(e), phase="forward" if i < n_fwd else "backward")
                  for i, e in enumerate(log.events)]
        grads = gather_tp_grads(tp)                                     # full, on dev
        diff = max((grads[n].cpu() - p.grad).abs().max().item() for n, p in ref.named_parameters())
        rows.append((step, loss_r.item(), loss_t.item(), diff))
        for o in opts:
            o.step()
            o.zero_grad()
    return {"rows": rows, "events": events, "sent": wire.sent, "wire_reason": wire.reason,
            "backend": dist.get_backend(), "device": str(dev)}


def time_job(kinds, h: int, s: int, b: int, n_head: int, repeats: int, warmup: int = 2):
    """On each rank: median seconds of fwd+bwd for each kind ('mlp', 'block'), synchronised,
    on labkit.launch.device() (the clock is read after the GPU finished: labkit.timing.now)."""
    cfg, dev = _config(h, s, n_head), device()
    torch.manual_seed(0)
    out = {}
    for kind in kinds:
        if kind == "mlp":
            mod = TensorParallelMLP.from_mlp(MLP(cfg).to(dev), None)
        else:
            mod = Block(cfg).to(dev)
            mod.attn = TensorParallelAttention.from_attention(mod.attn, None)
            mod.mlp = TensorParallelMLP.from_mlp(mod.mlp, None)
        x = _input(b, s, h, dev)                                        # (b, s, h)
        times = []
        for i in range(warmup + repeats):
            dist.barrier()
            t0 = now(dev)
            mod(x).sum().backward()
            dist.barrier()
            if i >= warmup:
                times.append(now(dev) - t0)
        out[kind] = statistics.median(times)
    out["threads"] = torch.get_num_threads()
    return out


def time_layers(tps=(1, 2, 4), b: int = 8, s: int = 64, h: int = 256, n_head: int = 8,
                kinds=("mlp", "block"), repeats: int = 10) -> list:
    """Rows {tp, kind, seconds, vs_tp1}: forward + backward time of one TP layer (rank 0)."""
    rows, base = [], {}
    for tp in tps:
        res = run(time_job, tp, args=(kinds, h, s, b, n_head, repeats), echo=False,
                  kwargs=None, timeout=300)[0]
        for kind in kinds:
            base.setdefault(kind, res[kind])
            rows.append({"tp": tp, "kind": kind, "seconds": res[kind],
                         "vs_tp1": res[kind] / base[kind],
                         "threads_per_rank": res["threads"]})
    return rows
