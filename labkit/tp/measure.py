"""Measurements for chapter 04's lab, benchmark and notebook: count the bytes of every TP
collective on real processes, and time a layer's forward + backward as TP grows.

    from labkit.tp.measure import count_layer_comm, time_layers, train_side_by_side
    run(train_side_by_side, 2, args=(dict(n_layer=2), 2, 4))  # TP GPT next to the reference
    count_layer_comm(tp=2, b=4, s=16, h=32)   # rows: one per collective, measured and predicted
    time_layers(tps=(1, 2, 4), b=8, s=64, h=256)

Each function launches its own processes (labkit.launch.run; under torchrun it runs in place).
"""
from __future__ import annotations

from labkit.costs import tensor_parallel as tpc
from labkit.launch import run


def _config(h: int, s: int, n_head: int, n_layer: int = 1):
    from labkit.model import GPTConfig

    return GPTConfig(n_layer=n_layer, n_embd=h, n_head=n_head, block_size=s, vocab_size=96)


def comm_job(h: int, s: int, b: int, n_head: int, what: str = "layer"):
    """On each rank: one fwd+bwd of a 1-layer TP GPT ('layer'), a TP MLP ('mlp') or the naive
    all-gathering MLP ('naive mlp'), on labkit.launch.device(); returns the CommLog's events,
    each marked by pass."""
    import torch

    from labkit.launch import device
    from labkit.model import GPT, MLP, get_batch, tiny_corpus
    from labkit.tp import CommLog, NaiveTensorParallelMLP, TensorParallelMLP, apply_tp

    cfg, dev = _config(h, s, n_head), device()
    if what in ("mlp", "naive mlp"):
        cls = NaiveTensorParallelMLP if what == "naive mlp" else TensorParallelMLP
        torch.manual_seed(0)
        mlp = cls.from_mlp(MLP(cfg).to(dev), None)
        x = _input(b, s, h, dev)                              # (b, s, h), the same on every rank
        with CommLog() as log:
            y = mlp(x)
            n_fwd = len(log.events)
            y.sum().backward()
    else:
        model = apply_tp(GPT(cfg, seed=0).to(dev), None)
        x, y = (t.to(dev) for t in get_batch(tiny_corpus(), b, s, step=0))  # (b, s) tokens
        with CommLog() as log:
            _, loss = model(x, y)
            n_fwd = len(log.events)
            loss.backward()
    return [dict(e, phase="forward" if i < n_fwd else "backward") for i, e in enumerate(log.events)]


def _input(b: int, s: int, h: int, dev):
    """(b, s, h) activations drawn on the CPU (the same numbers on any device), then moved."""
    import torch

    x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(1), device="cpu")
    return x.to(dev).requires_grad_()


def _comm_jobs(h, s, b, n_head, whats):
    return {what: comm_job(h, s, b, n_head, what) for what in whats}


def count_comm(tp: int, b: int = 4, s: int = 16, h: int = 32, n_head: int = 4,
               whats=("layer",), bytes_per_element: int = 4) -> dict:
    """{what: rows} for several models in one launch; see count_layer_comm."""
    for what in whats:
        if what not in ("layer", "mlp", "naive mlp"):
            raise ValueError(f"what must be 'layer', 'mlp' or 'naive mlp', got {what!r}")
    per_what = run(_comm_jobs, tp, args=(h, s, b, n_head, tuple(whats)), echo=False)[0]
    out = {}
    for what, events in per_what.items():
        # the formula is Megatron's (b*s*h per all-reduce); the naive MLP has no formula here
        predicted = None if what == "naive mlp" else tpc.allreduce_bytes(b, s, h, bytes_per_element)
        out[what] = [{"tp": tp, "phase": e["phase"], "op": e["op"], "where": e["where"],
                      "shape": e["shape"], "measured_bytes": e["bytes"],
                      "predicted_bytes": predicted} for e in events]
    return out


def count_layer_comm(tp: int, b: int = 4, s: int = 16, h: int = 32, n_head: int = 4,
                     what: str = "layer", bytes_per_element: int = 4) -> list:
    """Every collective of one layer's forward + backward at TP=tp, measured on rank 0, with the
    formula's prediction beside it. what: 'layer' (a GPT block), 'mlp', or 'naive mlp'."""
    return count_comm(tp, b, s, h, n_head, (what,), bytes_per_element)[what]


def train_side_by_side(cfg_kwargs: dict, steps: int = 2, batch: int = 4):
    """On each rank: the one-process GPT (on the CPU: the reference) and its TP version (on
    labkit.launch.device(): this rank's GPU under NCCL) trained by SGD on the same batches.

    Returns {"rows": [(step, loss_ref, loss_tp, max |grad diff|)], "events": the last step's
    collectives (CommLog events marked forward/backward), "backend", "device"}."""
    import torch
    import torch.distributed as dist

    from labkit.launch import device
    from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus
    from labkit.tp import CommLog, apply_tp, gather_tp_grads

    cfg, dev = GPTConfig(**cfg_kwargs), device()
    ref, tp = GPT(cfg, seed=0), apply_tp(GPT(cfg, seed=0).to(dev), None)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, tp)]
    tokens, rows, events = tiny_corpus(), [], []
    for step in range(steps):
        x, y = get_batch(tokens, batch, cfg.block_size, step)           # (B, T) on the CPU
        _, loss_r = ref(x, y)
        loss_r.backward()
        with CommLog() as log:
            _, loss_t = tp(x.to(dev), y.to(dev))
            n_fwd = len(log.events)
            loss_t.backward()
        events = [dict(e, phase="forward" if i < n_fwd else "backward")
                  for i, e in enumerate(log.events)]
        grads = gather_tp_grads(tp)                                     # full, on dev
        diff = max((grads[n].cpu() - p.grad).abs().max().item() for n, p in ref.named_parameters())
        rows.append((step, loss_r.item(), loss_t.item(), diff))
        for o in opts:
            o.step()
            o.zero_grad()
    return {"rows": rows, "events": events, "backend": dist.get_backend(), "device": str(dev)}


def time_job(kinds, h: int, s: int, b: int, n_head: int, repeats: int, warmup: int = 2):
    """On each rank: median seconds of fwd+bwd for each kind ('mlp', 'block'), synchronised,
    on labkit.launch.device() (the clock is read after the GPU finished: labkit.timing.now)."""
    import statistics

    import torch
    import torch.distributed as dist

    from labkit.launch import device
    from labkit.model import MLP, Block
    from labkit.timing import now
    from labkit.tp import TensorParallelAttention, TensorParallelMLP

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
