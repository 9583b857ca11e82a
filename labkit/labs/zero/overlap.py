"""Measuring ZeRO-3's prefetch: a timeline of one step, how much of the gathers hid behind
compute, and the most unsharded parameter bytes a rank held, by storage.

    from labkit.launch import run
    from labkit.labs.zero.overlap import OVERLAP_MODEL, prefetch_lab
    per_rank = run(prefetch_lab, 2, args=(OVERLAP_MODEL,))
    per_rank[0][("prefetch", True)]    # {"events", "step_s", "hidden", "blocked_s", "peak", ...}

The peak is read by a probe the code under test does not write: on every module inside the
model, a forward pre-hook (forward) and a hook on its output's gradient (backward, just before
the module's own backward) sum the storages behind the units' whole-parameter buffers and
behind the gathers in flight, each storage once, as the allocator sized them.
It is compared with the units' sizes (`unit_bytes`): about two units with prefetch (the one
computing, the one arriving), one without, all of them with reshard_after_forward=False (the
forward keeps every unit whole until its backward).
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from labkit.flat import chunk_size
from labkit.launch import device
from labkit.model import GPT, GPTConfig, get_batch, shard_rows, tiny_corpus
from labkit.observe import commlog
from labkit.observe.storage import storage_bytes
from labkit.observe.timeline import Timeline
from labkit.timing import now
from labkit.zero.zero3 import ZeRO3

# big enough that a block's matmuls take as long as its gather on 2 cores; untied embeddings
OVERLAP_MODEL = GPTConfig(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=128,
                          tie_weights=False)
MODES = (("prefetch", False), ("prefetch", True), ("keep", True))   # keep: no reshard, prefetch


def unit_bytes(zero) -> list:
    """[(unit name, bytes of its full parameters in the compute dtype, padded as gathered)]."""

    world = torch.distributed.get_world_size(zero.group)
    out = []
    for unit in zero.units:
        ps = [p for p in zero.unit_params[id(unit)] if id(p) not in zero.replicated]
        out.append((zero._unit_name[id(unit)],
                    sum(world * chunk_size(zero.shapes[id(p)].numel(), world)
                        * zero.compute_dtype_of(p).itemsize for p in ps)))
    return out


class UnshardedProbe:
    """On every leaf module inside `model`, in forward (pre-hook) and in backward (a hook on
    its output's gradient): the bytes of the storages behind zero's whole-parameter buffers and
    the model's parameters, plus the buffers of zero's gathers in flight; keeps the max."""

    def __init__(self, model, zero):
        self.model, self.zero, self.peak, self.samples = model, zero, 0, 0
        self._bytes = storage_bytes
        leaves = [m for m in model.modules() if not list(m.children())]
        self.handles = [m.register_forward_pre_hook(self._sample) for m in leaves]
        self.handles += [m.register_forward_hook(self._hook_grad) for m in leaves]

    def _hook_grad(self, module, args, out) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self._sample(module, ()))

    def _sample(self, module, args) -> None:
        flying = [b for _, work in self.zero._pending.values() for b in work.buffers()]
        held = self._bytes(list(self.zero.flat.values())
                           + [p.data for p in self.model.parameters()] + flying)
        self.peak, self.samples = max(self.peak, held), self.samples + 1

    def reset(self) -> None:
        self.peak, self.samples = 0, 0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def hidden_fraction(events) -> float:
    """Share of the prefetches' in-flight time that overlaps this rank's compute spans."""
    compute = [(e["start"], e["end"]) for e in events if e["lane"] == "compute"]
    flights = [(e["start"], e["end"]) for e in events if e["name"] == "prefetch"]
    total = sum(b - a for a, b in flights)
    if not total:
        return 0.0
    merged = []                        # backward spans may nest (a unit's backward inside
    for a, b in sorted(compute):       # another's, as the autograd engine orders them)
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    hid = sum(max(0.0, min(b, d) - max(a, c)) for a, b in flights for c, d in merged)
    return hid / total


def _step_events(timeline, log, rank: int) -> list:
    """Compute spans and collectives of one step, in ms since the step began."""
    ms = 1e3
    out = [{**e, "rank": rank, "start": e["start"] * ms, "end": e["end"] * ms}
           for e in timeline.events]
    for e in log.events:
        name = {"ZeRO-3 prefetch": "prefetch", "ZeRO-3 gather": "gather"}.get(e.where, e.op)
        end = e.end if e.end is not None else e.start
        out.append({"name": name, "lane": "comm", "rank": rank, "unit": e.where,
                    "start": (e.start - timeline.t0) * ms, "end": (end - timeline.t0) * ms,
                    "blocked": e.blocked * ms, "bytes": e.bytes})
    return out


def prefetch_lab(cfg: GPTConfig = OVERLAP_MODEL, steps: int = 4, batch_size: int = 8,
                 modes=MODES, mp_policy=None) -> dict:
    """Rank side: ZeRO-3 without and with prefetch (and with reshard_after_forward=False), the
    same batches, steps interleaved so drifting load hits all alike. Per mode:
    {"step_s": median seconds, "events": the last step's timeline, "hidden": hidden_fraction,
    "blocked_s": median seconds the compute thread waited in gathers, "peak": bytes by storage,
    "gathers": all-gathers per step}; and "units": unit_bytes."""


    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    runs = {}
    for name, on in modes:
        model = GPT(cfg, seed=0).to(dev)
        kw = dict(prefetch=on) if name == "prefetch" else dict(prefetch=on,
                                                              reshard_after_forward=False)
        zero = ZeRO3(model, torch.optim.AdamW, mp_policy=mp_policy, timeline=Timeline(dev),
                     lr=1e-3, **kw)
        runs[(name, on)] = (model, zero, UnshardedProbe(model, zero))
    out = {key: {"times": [], "blocked": [], "peaks": []} for key in runs}
    tokens = tiny_corpus()
    for step in range(steps + 1):                      # step 0 records the order: not timed
        x, y = get_batch(tokens, batch_size, cfg.block_size, step)              # (B, T)
        x, y = shard_rows(x, rank, world).to(dev), shard_rows(y, rank, world).to(dev)
        for key, (model, zero, probe) in runs.items():
            dist.barrier()
            probe.reset()
            zero.timeline.reset()
            with commlog.record() as log:
                t0 = now(dev)
                model(x, y)[1].backward()
                zero.step()
                dt = now(dev) - t0
            zero.zero_grad()
            if step:
                rec = out[key]
                rec["times"].append(dt)
                rec["blocked"].append(sum(e.blocked for e in log.events
                                          if e.op == "all_gather"))
                rec["peaks"].append(probe.peak)
                rec["events"] = _step_events(zero.timeline, log, rank)
                rec["gathers"] = sum(e.op == "all_gather" for e in log.events)
    result = {"units": unit_bytes(next(iter(runs.values()))[1])}
    for key, rec in out.items():
        result[key] = {"step_s": statistics.median(rec["times"]), "events": rec["events"],
                       "hidden": hidden_fraction(rec["events"]),
                       "blocked_s": statistics.median(rec["blocked"]), "peak": max(rec["peaks"]),
                       "gathers": rec["gathers"]}
    for _, _, probe in runs.values():
        probe.remove()
    dist.barrier()
    return result
