"""Measure where a ZeRO-3 step turns communication-bound: the pieces of costs.hiding.zero3, on
real ranks.

Rank side only (call inside labkit.launch.run). `sweep` runs ZeRO3 (prefetch=True, as FSDP2)
steps at several per-rank micro-batches, in interleaved rounds, and reads two records the ZeRO-3
code keeps: its Timeline (one compute span per unit and phase: the unit's own forward, and its
backward from the pre-backward hook to the post-backward hook) and the commlog events of its
collectives (the gathers, posted or blocking, from post to completion; the gradients'
reduce-scatters). From them, per step:

    compute   the union of the compute spans (forward, backward apart): the 6 P t FLOPs
    comm      the union of the collectives' in-flight intervals: the 2 all-gathers and the
              reduce-scatter of 3(N-1)/N P e bytes, hidden or not
    gather    the same for the all-gathers alone
    exposed   seconds the compute thread was blocked in a collective (commlog's `blocked`:
              a blocking call's whole time, a prefetch's wait only)

Their ratio comm / compute crosses 1 where costs.hiding.zero3 says the traffic stops hiding.
The FLOP/s and the all-gather's alpha-beta fit come from labkit.labs.ddp.crossover.matmul_rate and
labkit.labs.intro (the lab, labkit.labs.overlap_zero3, measures them on the same processes).
"""
from __future__ import annotations

import torch

from labkit.labs.ddp.crossover import batches, busy, rotated_rounds
from labkit.launch import device
from labkit.model import GPT, GPTConfig
from labkit.observe import commlog
from labkit.observe.timeline import Timeline
from labkit.timing import now
from labkit.zero.zero3 import ZeRO3

# wide enough that a block's matmuls, not the hooks' Python, set its time near the crossover;
# untied embeddings: each parameter is gathered by one unit (the textbook 3(N-1)/N P e)
WIDE = GPTConfig(vocab_size=96, block_size=8, n_layer=2, n_head=8, n_embd=512, tie_weights=False)
FIELDS = ("forward", "backward", "compute", "comm", "gather", "exposed", "step")


def spans(timeline_events, log_events, t0: float) -> dict:
    """One step's seconds from its records: compute (forward, backward and their union), the
    collectives' busy time (all of them; the all-gathers alone) and the exposed wait.
    timeline_events: Timeline.events (seconds since t0); log_events: commlog Events (clock)."""
    compute = [e for e in timeline_events if e["lane"] == "compute"]
    comm = [{"start": e.start - t0, "end": (e.end if e.end is not None else e.start) - t0}
            for e in log_events]
    gathers = [c for c, e in zip(comm, log_events) if e.op == "all_gather"]
    return {"forward": busy([e for e in compute if e["name"] == "forward"]),
            "backward": busy([e for e in compute if e["name"] == "backward"]),
            "compute": busy(compute), "comm": busy(comm), "gather": busy(gathers),
            "exposed": sum(e.blocked for e in log_events),
            "bytes": sum(e.bytes for e in log_events if e.op == "all_gather")}


def sweep(cfg: GPTConfig = WIDE, rows=(1, 4, 16), *, rounds: int = 3, warmup: int = 1,
          prefetch: bool = True) -> dict:
    """One timed ZeRO-3 step (forward, backward, SGD step) per (round, per-rank batch of `rows`
    sequences), batches rotated across rounds so drifting load hits every batch alike. The first
    step records the units' order (no prefetch) and is not timed. Returns {"params", "units",
    "param_bytes", "steps": {rows: [spans(...) + {"step", "gathers"} per round]}}, seconds."""
    dev = device()
    model = GPT(cfg, seed=0).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    tl = Timeline(dev)
    zero = ZeRO3(model, torch.optim.SGD, prefetch=prefetch, timeline=tl, lr=1e-4)
    data = batches(rows, cfg.block_size, dev)

    def step(x, y):
        with commlog.record() as log:
            model(x, y)[1].backward()
            zero.step()
        end = now(dev) - tl.t0
        zero.zero_grad()
        return dict(spans(tl.events, log.events, tl.t0), step=end,
                    gathers=sum(e.op == "all_gather" for e in log.events))

    # the first step records the units' order (no prefetch): one more untimed step
    rotated_rounds(step, {rows[0]: data[rows[0]]}, tl, 0, 1)
    out = rotated_rounds(step, data, tl, rounds, warmup)
    return {"params": n_params, "units": len(zero.units),
            "param_bytes": n_params * next(model.parameters()).element_size()
            if n_params else 0, "steps": out}
