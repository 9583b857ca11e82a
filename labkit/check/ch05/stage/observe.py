"""Exercise 5.3's eyes inside the reader's stage, and what a schedule implies: the observer (order
of F, B and W; saved bytes alive at once), the expected order and peak for a schedule, the rank
job, and the one-process reference.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.check import Refused
from labkit.launch import device, note
from labkit.model import GPT, GPTConfig, shard_rows
from labkit.observe.dispatch import CollectiveLog
from labkit.observe.saved import SavedTensors
from labkit.pipeline import schedules
from labkit.pipeline.executor import build_chunks, make_batch, owned_parameters

# P: [(schedule, K)]; one launch per P, a batch of STAGE_BATCH rows (K need not divide it)
STAGE_CASES = {
    2: [("1f1b", 3), ("zb-h2", 4)],
    3: [("zb-h1", 5), ("gpipe", 2)],
}
STAGE_BATCH = 7
MEMORY_SLACK = 0.05     # the peak may pass what the schedule holds by 5% of a micro-batch's bytes
STAGE_MODULES = ("labkit.pipeline", "torch.distributed.pipelining.schedules",
                     "torch.distributed.pipelining.stage")
STAGE_NAMES = {"run_schedule", "PipelineStage", "ScheduleGPipe", "Schedule1F1B",
                   "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
                   "ScheduleZBVZeroBubble", "schedules_job", "train_step_job"}


def stage_config():
    """The GPT the stages are cut from: untied embeddings, so every weight lives on one stage."""

    return GPTConfig(n_layer=3, n_embd=16, n_head=2, block_size=8, tie_weights=False)


class StageObserver:
    """The checker's eyes inside the reader's stage: what happened, in order ("F" forward, "B"
    input gradient, "W" weight gradient), and the bytes saved for backward that are alive.

    Bytes: labkit.observe.saved's meter in live mode (saved-tensor hooks). Each saved storage
    counts once while any packed reference to it is alive (the packed object dies when autograd
    frees the node or the graph), parameters, buffers and the caller's token ids not at all;
    per_mb: the bytes of the storages each forward saved first. Order: a forward is the module's
    call; B is a hook on the stage's input tensor (it fires when the input's gradient is
    computed); W is a hook on one weight (it fires when that weight's gradient is)."""

    def __init__(self, exclude):
        self.meter = SavedTensors(exclude=exclude, live=True)
        self.events, self.per_mb = [], []

    @property
    def peak(self) -> int:
        return self.meter.peak_live

    @property
    def live_bytes(self) -> int:
        return self.meter.live_bytes

    @contextmanager
    def forward(self):
        """One micro-batch's forward: its F event and the bytes it saves first."""
        self.events.append("F")
        key = len(self.per_mb)
        self.per_mb.append(0)
        try:
            with self.meter.saving(key):
                yield
        finally:
            self.per_mb[key] = self.meter.fresh_bytes_of(key)
            self.meter.bytes_of(key)                    # booked too: forget it


class ObservedStage:
    """The stage module the reader's run_stage gets: one contiguous slice of the GPT
    (labkit.pipeline.executor.PipelineChunk), watched by a StageObserver.

    first: takes token ids (B_k, T); else activations (B_k, T, h), h = hidden. last: called as
    stage(x, y) it returns the micro-batch's loss, its token-sum over all the batch's tokens (the
    K losses add up to the batch mean); else stage(x) returns activations (B_k, T, h)."""

    def __init__(self, model, s, stage, n_tokens, exclude=()):
        self.chunk = build_chunks(model, s, stage)[0]
        self.first, self.last = self.chunk.first, self.chunk.last
        self.hidden, self.n_tokens = model.config.n_embd, n_tokens
        self.observer = StageObserver(
            list(self.chunk.parameters()) + list(self.chunk.buffers()) + list(exclude))
        weights = [p for p in self.chunk.parameters() if p.requires_grad]
        self._hook = weights[-1].register_hook(self._weight_grad)
        assert isinstance(self.chunk, nn.Module)

    def _weight_grad(self, g):
        self.observer.events.append("W")
        return g

    def _input_grad(self, g):
        self.observer.events.append("B")
        return g

    def parameters(self):
        return self.chunk.parameters()

    def named_parameters(self):
        return self.chunk.named_parameters()

    def __call__(self, x, y=None):
        if x.requires_grad:
            x.register_hook(self._input_grad)
        with self.observer.forward():
            out = self.chunk(x)                                        # (B_k, T, h) or logits
            if self.last:
                if y is None:
                    raise ValueError("the last stage returns the loss: call it as "
                                     "stage_module(x, targets[k])")
                out = F.cross_entropy(out.flatten(0, 1), y.flatten(),
                                      reduction="sum") / self.n_tokens  # () scalar
        return out

    def close(self):
        self._hook.remove()


def expected_order(actions, first: bool) -> list:
    """The F/B/W events a stage running `actions` shows: a split schedule's own kinds (the first
    stage has no input gradient: its B shows nothing), or for a fused backward B and W together."""
    split = any(a.kind == "W" for a in actions)
    out = []
    for a in actions:
        if a.kind == "F" or a.kind == "W":
            out.append(a.kind)
        elif split:
            out += [] if first else ["B"]
        else:
            out += ["W"] if first else ["B", "W"]
    return out


def fused_pairs(events) -> list:
    """A fused backward makes its input and weight gradients in one autograd call, in the
    graph's order (the weight hook may fire first): count each such W-then-B pair as B, W."""
    out, i = [], 0
    while i < len(events):
        if events[i:i + 2] == ["W", "B"]:
            out += ["B", "W"]
            i += 2
        else:
            out.append(events[i])
            i += 1
    return out


def expected_peak(actions, per_mb) -> int:
    """The most bytes a stage running `actions` holds: a micro-batch's bytes from its F to its W
    (split backward) or its B (fused). per_mb: bytes each forward saved, in forward order."""
    split = any(a.kind == "W" for a in actions)
    size, held, peak, i = {}, 0, 0, 0
    for a in actions:
        if a.kind == "F":
            size[a.mb] = per_mb[i] if i < len(per_mb) else 0
            i += 1
            held += size[a.mb]
            peak = max(peak, held)
        elif a.kind == ("W" if split else "B"):
            held -= size.get(a.mb, 0)
    return peak


def stage_job(fn, specs, batch_size):
    torch.set_num_threads(1)
    cfg = stage_config()
    rank, P = dist.get_rank(), dist.get_world_size()
    model = GPT(cfg, seed=0).to(device())                  # this rank's GPU under NCCL, else CPU
    x, y = (t.to(device()) for t in make_batch(batch_size, cfg))
    out = []
    for name, K in specs:
        s = schedules.make(name, P, K)
        stage = ObservedStage(model, s, rank, y.numel(), exclude=(x, y))
        params = owned_parameters(model, {0: stage.chunk})
        for p in model.parameters():
            p.grad = None
        xs = [shard_rows(x, k, K) for k in range(K)]       # K x (B_k, T) token ids
        ys = [shard_rows(y, k, K) for k in range(K)]
        before = set(sys.modules)
        dist.barrier()
        note(f"your run_stage: {name}, K={K}, stage {rank} of {P}")
        log = CollectiveLog(allow=(), error=Refused,
                            why="pipeline stages send to their neighbours only")
        try:
            with log:
                loss = fn(list(s.stages[rank]), stage, xs, ys, dist.group.WORLD)
        except RuntimeError:
            if log.collectives():
                return {"collectives": log.collectives()}
            raise
        stage.close()
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().reshape(()).double().item()
        out.append({"stage": rank, "loss": loss, "events": list(stage.observer.events),
                    "per_mb": list(stage.observer.per_mb), "peak": stage.observer.peak,
                    "grads": {n: p.grad.detach().clone() for n, p in params.items()
                              if p.grad is not None},
                    "new_modules": sorted(m for m in set(sys.modules) - before
                                          if m.startswith(STAGE_MODULES))})
        dist.barrier()   # nobody starts the next schedule while a neighbour still sends
    return {"runs": out}


def reference(batch_size):
    """The one-process GPT: loss and every gradient of the whole batch (the checker's own, on
    purpose: it stays independent of labkit.pipeline's executor, which it would grade against)."""

    cfg = stage_config()
    model = GPT(cfg, seed=0)
    x, y = make_batch(batch_size, cfg)
    _, loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}
