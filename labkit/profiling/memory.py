"""One ZeRO-3 step's memory over time, per rank: what is held at each moment, and by whom.

    from labkit.launch import run
    from labkit.profiling import memory
    out = run(memory.zero3_memory_job, 2)
    memory.figure(out[0]).show()

On a GPU: the CUDA caching allocator's own history (torch.cuda.memory._record_memory_history and
_snapshot: every alloc and free with its time), summed into bytes allocated over time.

On the CPU, three counters sampled before every operator (a TorchDispatchMode sees each aten
call, in forward, in backward and in the collectives), none written by the code under test:
  full params   bytes of the storages ZeRO-3 gathers parameters into (ZeRO3.full_buffers()):
                0 while sharded, a unit's parameters while it works, forward and backward
  model states  ZeRO3.held_bytes() less the full params: shards, their gradients, the
                optimizer's state (storages)
  saved         bytes autograd holds for backward, alive now (labkit.observe.saved, live: a
                storage counts from its first pack until autograd drops every packed reference,
                at its size now), the gathered weights' views excluded: they are the full params
The three are disjoint storages, so the figure stacks them.
Each sample carries the phase (forward, backward, optimizer) and the unit working: in forward
the one whose forward began last (module forward pre-hooks on the blocks and other top-level
modules), in backward the one whose output's gradient arrived last (a hook on that output, which
fires as the unit's backward begins): only public
entry points of labkit.zero.ZeRO3 (its constructor, step, zero_grad, held_bytes, full_buffers)
are used.
"""
from __future__ import annotations

import time

import plotly.graph_objects as go
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.launch import device
from labkit.model import GPT, GPTConfig, get_batch, shard_rows, tiny_corpus
from labkit.observe.saved import SavedTensors
from labkit.observe.storage import storage_bytes
from labkit.zero import ZeRO3

MEMORY_CFG = GPTConfig(vocab_size=96, block_size=32, n_layer=3, n_head=4, n_embd=64)


class Sampler(TorchDispatchMode):
    """Before every aten call: (seconds, phase, unit, full params, model states, saved)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False    # else the first dispatch imports torch._dynamo: seconds on a cold rank

    def __init__(self, zero, saved: SavedTensors):
        super().__init__()
        self.zero, self.saved = zero, saved
        self.phase, self.unit, self.samples, self.t0 = "forward", "", [], time.perf_counter()
        self._busy = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._busy:          # the counters' own calls are not sampled
            self._busy = True
            try:
                held = self.zero.held_bytes()              # its "params" include the full ones
                full = storage_bytes(self.zero.full_buffers())
                self.samples.append(dict(
                    t=time.perf_counter() - self.t0, phase=self.phase, unit=self.unit,
                    op=str(func.__name__), full_params=full,
                    model_states=sum(held.values()) - full, saved=self.saved.live_bytes))
            finally:
                self._busy = False
        return func(*args, **(kwargs or {}))


def _units(model) -> dict:
    """The modules whose forward marks a unit: each block and each other top-level child."""
    out = {}
    for name, m in model.named_children():
        if name == "blocks":
            out.update({f"blocks.{i}": b for i, b in enumerate(m)})
        elif any(True for _ in m.parameters()):
            out[name] = m
    return out


def zero3_memory_job(steps: int = 2, batch: int = 4, cfg: GPTConfig = MEMORY_CFG) -> dict:
    """ZeRO-3 (AdamW) on this rank; the last step's memory timeline (GPU: the allocator's
    history; CPU: the sampled counters)."""

    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    torch.set_num_threads(1)
    model = GPT(cfg, seed=0).to(dev)
    zero = ZeRO3(model, torch.optim.AdamW, lr=1e-3)
    x, y = get_batch(tiny_corpus(), batch * world, cfg.block_size, 0)          # (B, T)
    x, y = shard_rows(x, rank, world).to(dev), shard_rows(y, rank, world).to(dev)
    for _ in range(steps - 1):
        model(x, y)[1].backward()
        zero.step()
        zero.zero_grad()
    dist.barrier()
    if dev.type == "cuda":
        return {"rank": rank, "kind": "cuda", "samples": _cuda_step(model, zero, x, y)}
    # the gathered weights' views autograd saves are the full parameters, counted once (there)
    saved = SavedTensors(exclude=list(model.parameters()) + zero.full_buffers(), live=True)
    sampler = Sampler(zero, saved)
    def entered(name):      # forward: the unit's forward begins
        return lambda m, a: setattr(sampler, "unit", name)

    def left(name):         # backward: a hook on the unit's output fires as its backward begins
        def hook(m, a, out):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: setattr(sampler, "unit", name))
        return hook

    hooks = [h for name, m in _units(model).items()
             for h in (m.register_forward_pre_hook(entered(name)),
                       m.register_forward_hook(left(name)))]
    try:
        with saved, sampler:
            loss = model(x, y)[1]
            sampler.phase = "backward"
            loss.backward()
            sampler.phase, sampler.unit = "optimizer", ""
            zero.step()
            zero.zero_grad()
    finally:
        for h in hooks:
            h.remove()
    return {"rank": rank, "kind": "cpu", "samples": sampler.samples}


def _cuda_step(model, zero, x, y) -> list:
    """The allocator's history of one step: bytes allocated after each event (GPU only)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        model(x, y)[1].backward()
        zero.step()
        zero.zero_grad()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][torch.cuda.current_device()]
    out, now = [], base
    t0 = events[0]["time_us"] if events else 0
    for e in events:
        if e["action"] == "alloc":
            now += e["size"]
        elif e["action"] == "free_completed":
            now -= e["size"]
        else:
            continue
        out.append(dict(t=(e["time_us"] - t0) / 1e6, phase="", unit="", op=e["action"],
                        allocated=now))
    return out


def figure(result: dict, title: str = ""):
    """Bytes over the step's operators (CPU: the three counters stacked) or time (GPU)."""

    s = result["samples"]
    fig = go.Figure()
    if result["kind"] == "cuda":
        fig.add_trace(go.Scatter(x=[r["t"] * 1e3 for r in s], y=[r["allocated"] / 1e6 for r in s],
                                 name="allocated (CUDA caching allocator)"))
        xtitle = "ms"
    else:
        xs = list(range(len(s)))
        for key, name in (("model_states", "model states (shards, grads, optimizer)"),
                          ("full_params", "full parameters (gathered)"),
                          ("saved", "saved for backward")):
            fig.add_trace(go.Scatter(x=xs, y=[r[key] / 1e3 for r in s], name=name,
                                     stackgroup="one", mode="lines",
                                     text=[f"{r['phase']} {r['unit']}" for r in s],
                                     hovertemplate="%{text}: %{y:.1f} KB<extra></extra>"))
        starts = [i for i in range(1, len(s)) if s[i]["phase"] != s[i - 1]["phase"]]
        for i in starts:
            fig.add_vline(x=i, line_dash="dot", annotation_text=s[i]["phase"])
        xtitle = "operator (aten call) in the step"
    fig.update_layout(title=title or f"rank {result['rank']}: one ZeRO-3 step's memory",
                      xaxis_title=xtitle, yaxis_title="KB" if result["kind"] == "cpu" else "MB",
                      height=380, margin=dict(l=10, r=10, t=50, b=40))
    return fig


def peaks(result: dict) -> dict:
    """The largest value of each counter over the step, with the phase and unit where it was."""
    out = {}
    for key in ("full_params", "model_states", "saved", "allocated"):
        rows = [r for r in result["samples"] if key in r]
        if rows:
            top = max(rows, key=lambda r: r[key])
            out[key] = dict(bytes=top[key], phase=top["phase"], unit=top["unit"])
    return out
