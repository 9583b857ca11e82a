"""Run a pipeline schedule on real processes: labkit.model's GPT split into stages.

    from labkit.launch import run
    from labkit.model import GPTConfig
    from labkit.pipeline import executor, schedules
    cfg = GPTConfig(n_layer=4, n_embd=32)
    out = run(executor.train_step_job, 2, args=(schedules.one_f_one_b(2, 4), cfg, 8))
    out[-1]["loss"]            # equals the one-process reference's loss

Rank p of the group is stage p and holds v model chunks; local chunk j is global chunk j*P + p,
or where the schedule carries a placement (ZB-V's V), the j-th of the chunks it puts on p. Two
consecutive chunks on one stage (the bottom of the V) hand over without a message.
The GPT's blocks are split over the P*v chunks as evenly as possible (earlier chunks get the
extra block); chunk 0 also holds the embeddings, the last chunk ln_f and the output head.
The global batch (B rows) is split into K micro-batches of rows (uneven splits allowed).

A forward receives the previous chunk's activations (B_k, T, h) and waits for them, runs the
chunk and posts the output without waiting for it to be taken (so 1F1B's
send-while-the-neighbour-sends cannot deadlock); a backward receives the output's gradient, runs
autograd and posts the input's gradient. Before each action the stage posts one batch
(labkit.collectives.exchange; Megatron's send_forward_recv_backward): the previous action's
output and the receives labkit.pipeline.posting plans there (the action's own input, or a later
one's, early, where NCCL would otherwise deadlock: see that module). Gloo matches messages by tag,
which names (micro-batch, chunk, direction); NCCL ignores tags and matches them in order, so under
NCCL each stage posts a pair's receives in the order the other stage sends them: the order it needs
them where those agree (labkit.pipeline.validate.check_message_order; true of GPipe, 1F1B,
interleaved 1F1B, ZB-H1/H2), else some receives early (ZB-V; posting.nccl_plan). Parameter gradients
accumulate over the K micro-batches (each micro-batch's loss is its token-sum divided by all B*T
tokens, so the sum is the whole batch's mean loss).

Tensors live on the device of the model's parameters (labkit.launch.device() in the jobs below:
this rank's GPU under NCCL); results are moved to the CPU by labkit.launch.run, where the
one-process reference is computed.

The embedding is tied to the output head (GPT-2), but they live on the first and last stage:
as in Megatron-LM, the two copies' gradients are summed after the step (a send/recv pair).

Every action is timed with labkit.timing.now (perf_counter, CLOCK_MONOTONIC on Linux: one clock
for all processes of a machine; read after the GPU finished its queued work). `start` is read
after the action's input has ARRIVED (its receive waited for) and `end` after its output exists
and before the send of that output is posted (in the next batch), so a consumer can never start
before its producer's `end`: labkit.pipeline.causality checks that on every measured run. (An
earlier executor read `end` after posting the send; on a loaded machine the receiver then often
started first, by milliseconds.) Each stage also counts the micro-batches and the bytes of saved
activations it holds (saved-tensor hooks), to measure the peak: booked from each forward to its
backward (or W), and live, until autograd frees them (labkit.observe.saved.SavedTensors).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.profiler import record_function

from labkit.collectives import exchange
from labkit.launch import device, note
from labkit.model import GPT, GPTConfig, get_batch, shard_rows, tiny_corpus
from labkit.observe.saved import SavedTensors
from labkit.pipeline import posting
from labkit.pipeline.base import Schedule
from labkit.pipeline.validate import ScheduleError, is_local, needs, validate
from labkit.reference import TrainSpec, train
from labkit.shard import even_ranges
from labkit.testing import compare_dicts, tensors_close
from labkit.timing import now


def split_blocks(n_layer: int, n_chunks: int) -> list:
    """Block indices of each chunk: contiguous, as even as possible, earlier chunks larger."""
    if n_layer < n_chunks:
        raise ValueError(f"n_layer={n_layer} blocks cannot fill {n_chunks} pipeline chunks "
                         f"(P*v); use n_layer >= {n_chunks} or fewer stages/chunks")
    return [list(range(lo, hi)) for lo, hi in even_ranges(n_layer, n_chunks)]


class PipelineChunk(nn.Module):
    """A contiguous slice of the GPT: [embeddings] + blocks[ids] + [ln_f, head]."""

    def __init__(self, model: GPT, block_ids, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.wte, self.wpe = (model.wte, model.wpe) if first else (None, None)
        self.blocks = nn.ModuleList(model.blocks[i] for i in block_ids)
        self.ln_f, self.lm_head = (model.ln_f, model.lm_head) if last else (None, None)

    def forward(self, x):                          # first: (B, T) int64; else (B, T, h)
        if self.first:
            T = x.shape[1]
            x = self.wte(x) + self.wpe(torch.arange(T, device=x.device))  # (B, T, h)
        for block in self.blocks:
            x = block(x)                           # (B, T, h)
        if self.last:
            x = self.lm_head(self.ln_f(x))         # (B, T, V) logits
        return x


def build_chunks(model: GPT, s: Schedule, stage: int) -> dict:
    """This stage's chunks {local j: PipelineChunk}, cut from a full model built on every rank."""
    n = s.n_chunks
    ids = split_blocks(model.config.n_layer, n)
    return {j: PipelineChunk(model, ids[s.global_chunk(stage, j)],
                             first=s.global_chunk(stage, j) == 0,
                             last=s.global_chunk(stage, j) == n - 1) for j in range(s.v)}


def owned_parameters(model: GPT, chunks: dict) -> dict:
    """{name: parameter} for the parameters this stage's chunks use, named as in the full GPT."""
    mine = {id(p) for c in chunks.values() for p in c.parameters()}
    return {name: p for name, p in model.named_parameters() if id(p) in mine}


def _tag(s: Schedule, kind: str, mb: int, g: int) -> int:
    return (mb * s.n_chunks + g) * 2 + (0 if kind == "F" else 1)


def run_schedule(s: Schedule, model: GPT, x: torch.Tensor, y: torch.Tensor, *, group=None,
                 pad=None, check: bool = True, loss_scale: float = 1.0) -> dict:
    """Run one training step of schedule `s` as this rank's stage. Call on every rank of `group`.

    x, y: the whole batch (B, T) (every rank passes the same; only the first and last chunks
    read it). pad: optional (seconds per forward, per backward) slept after each action's
    compute: a stand-in for each stage having its own accelerator when many ranks share few
    CPU cores. Returns loss (last stage; None elsewhere), grads {name: tensor} of the parameters
    this stage owns, timeline (absolute perf_counter times), peaks."""
    group = group or dist.group.WORLD
    nccl = dist.get_backend(group) == "nccl"
    if check:
        validate(s)
    if nccl:  # batched P2P uses the group's communicator: every stage joins it first, together
        dist.barrier(group=group)
    P, stage = dist.get_world_size(group), dist.get_rank(group)
    if P != s.P:
        raise ValueError(f"the schedule has P={s.P} stages but the process group has {P} ranks")
    if x.shape[0] < s.K:
        raise ValueError(f"batch of {x.shape[0]} rows cannot make K={s.K} micro-batches; "
                         f"use batch_size >= K")
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    chunks = build_chunks(model, s, stage)
    params = owned_parameters(model, chunks)
    for p in params.values():
        p.grad = None
    xs = [shard_rows(x, k, s.K).to(dev) for k in range(s.K)]  # K x (B_k, T)
    ys = [shard_rows(y, k, s.K).to(dev) for k in range(s.K)]
    n_tokens, h = y.numel(), model.config.n_embd

    def post(t, kind, mb, g_from, g_to):  # sent in the next batch: never waited for here
        if s.stage_of(g_to) == stage:     # the next chunk is here too (V's turn): hand it over
            local[(kind, mb, g_from)] = t
            return
        pending.append((dist.isend, t, s.stage_of(g_to), group, _tag(s, kind, mb, g_from)))

    def receive_op(j):  # the receive of action j's input: (B_k, T, h) from the next/previous chunk
        a = actions[j]
        g = s.global_chunk(stage, a.chunk)
        g_from = g - 1 if a.kind == "F" else g + 1
        buf = torch.empty(xs[a.mb].shape + (h,), dtype=dtype, device=dev)   # (B_k, T, h)
        return (dist.irecv, buf, s.stage_of(g_from), group, _tag(s, a.kind, a.mb, g_from))

    def post_batch(i):
        """Batch i: what action i-1 produced, and the receives the plan posts here."""
        recvs = [receive_op(j) for j in layout[i]]
        works = exchange(pending + recvs, where="pipeline")
        sends.extend(zip((op[1] for op in pending), works))
        for j, op, work in zip(layout[i], recvs, works[len(pending):]):
            inbox[j] = (op[1], work)
        pending.clear()

    def take(i):  # action i's input, once it has arrived
        key = needs(s, stage, actions[i])
        if is_local(s, key):              # produced by this stage's other chunk, earlier
            return local.pop(key)
        buf, work = inbox.pop(i)
        work.wait()
        return buf

    actions = s.stages[stage]
    layout = _layout(s, stage, nccl)  # layout[i]: actions whose input is received in batch i
    meter = SavedTensors(exclude=params.values(), live=True)
    saved, sends, pending, inbox, timeline, split_pending = {}, [], [], {}, [], {}
    local = {}  # message key -> tensor handed from one of this stage's chunks to the other
    held = held_bytes = peak = peak_bytes = 0.0
    loss_total = torch.zeros((), dtype=dtype, device=dev)
    for i, a in enumerate(actions):
        g = s.global_chunk(stage, a.chunk)
        chunk = chunks[a.chunk]
        note(f"stage {stage}: action #{i} {a!r}")
        post_batch(i)
        if a.kind == "F":
            if chunk.first:
                inp = xs[a.mb]                                           # (B_k, T) tokens
            else:
                inp = take(i).requires_grad_(True)                       # (B_k, T, h)
            t0 = now(dev)
            span = record_function(f"{a.kind}{a.mb} chunk {a.chunk}").__enter__()  # in traces
            with meter.saving((a.mb, a.chunk)):
                out = chunk(inp)                                         # (B_k, T, h) or logits
                if chunk.last:  # token-sum / all tokens: the K losses add up to the batch mean
                    out = F.cross_entropy(out.flatten(0, 1), ys[a.mb].flatten(),
                                          reduction="sum") / n_tokens    # () scalar
            _pad(pad, 0, s.v)
            if chunk.last:
                loss_total += out.detach()
            else:
                post(out.detach(), "F", a.mb, g, g + 1)                  # (B_k, T, h)
            nbytes = meter.bytes_of((a.mb, a.chunk))
            saved[(a.mb, a.chunk)] = (inp, out, nbytes)
            held, held_bytes = held + 1 / s.v, held_bytes + nbytes
            peak, peak_bytes = max(peak, held), max(peak_bytes, held_bytes)
        elif a.kind == "B":
            inp, out, nbytes = saved[(a.mb, a.chunk)] if s.split else saved.pop((a.mb, a.chunk))
            # loss_scale: the gradient of the loss itself (1 for the plain step; a data-parallel
            # replica's weight under labkit.parallel, before any rank mixes its gradients in)
            grad_out = torch.full_like(out, loss_scale) if chunk.last else take(i)  # (B_k, T, h)
            t0 = now(dev)
            span = record_function(f"{a.kind}{a.mb} chunk {a.chunk}").__enter__()  # in traces
            if not s.split:
                torch.autograd.backward(out, grad_out)
            else:
                split_pending[(a.mb, a.chunk)] = _backward_input(chunk, inp, out, grad_out)
            _pad(pad, 1, s.v, 0.5 if s.split else 1.0)
            if not chunk.first:
                post(inp.grad, "B", a.mb, g, g - 1)                      # (B_k, T, h)
            if not s.split:
                held, held_bytes = held - 1 / s.v, held_bytes - nbytes
        else:  # W: the weight gradients; the activations are held until here
            inp, out, nbytes = saved.pop((a.mb, a.chunk))
            t0 = now(dev)
            span = record_function(f"{a.kind}{a.mb} chunk {a.chunk}").__enter__()  # in traces
            _backward_weight(split_pending.pop((a.mb, a.chunk)))
            _pad(pad, 1, s.v, 0.5)
            held, held_bytes = held - 1 / s.v, held_bytes - nbytes
        timeline.append(dict(stage=stage, kind=a.kind, mb=a.mb, chunk=a.chunk,
                             start=t0, end=now(dev)))
        span.__exit__(None, None, None)
    post_batch(len(actions))
    for _, work in sends:
        work.wait()
    note(f"stage {stage}: tied embedding gradient")
    _sum_tied_embedding(s, model, stage, group)
    return {"stage": stage, "loss": loss_total if s.stage_of(s.n_chunks - 1) == stage else None,
            "grads": {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None},
            "timeline": timeline, "peak_in_flight": peak, "peak_activation_bytes": peak_bytes,
            "peak_live_bytes": meter.peak_live}


_PLANS: dict = {}   # schedule's signature -> posting plan (or the ScheduleError it raised)


def _layout(s: Schedule, stage: int, nccl: bool) -> list:
    """The NCCL-safe posting plan (labkit.pipeline.posting), on both backends so that they post
    the same batches. Gloo, which pairs messages by tag, also runs schedules that have none.
    Worked out once per schedule and process (ZB-V's takes about 50 ms, and every training step
    calls run_schedule with the same schedule)."""
    key = (s.P, s.K, s.v, s.placement, tuple(tuple(actions) for actions in s.stages))
    if key not in _PLANS:
        if len(_PLANS) >= 64:
            _PLANS.clear()
        try:  # NCCL ignores tags: the plan also posts each pair's receives in the order sent
            _PLANS[key] = posting.nccl_plan(s)
        except ScheduleError as e:
            _PLANS[key] = e
    got = _PLANS[key]
    if isinstance(got, ScheduleError):
        if nccl:
            raise got
        return posting.default_plan(s)[stage]
    return got[stage]


def _pad(pad, i: int, v: int, share: float = 1.0) -> None:
    """Stand-in compute (seconds per whole stage; a chunk takes 1/v; B and W of a split backward
    take `share` of the backward's each), before the result is sent."""
    if pad is not None:
        time.sleep(pad[i] * share / v)


def _backward_input(chunk, inp, out, grad_out):
    """B of a split backward: only the input's gradient (into inp.grad), keeping what W needs.
    PyTorch's own split (torch.distributed.pipelining._backward, used by its zero-bubble
    schedules): autograd stops at the input, hooks keep the gradients that reach the nodes
    where the weights' paths branch off, and W later resumes from those. The first chunk's
    input is token ids (no gradient): its whole backward is W's."""
    weights = list(chunk.parameters())
    if chunk.first:
        return (out, grad_out, None, weights)
    _, groups = stage_backward_input([out], [grad_out], [inp], iter(weights))
    return (None, None, groups, weights)


def _backward_weight(pending) -> None:
    """W of a split backward: the weight gradients, accumulated into .grad."""
    out, grad_out, groups, weights = pending
    if groups is None:
        torch.autograd.backward(out, grad_out)
    else:
        stage_backward_weight(iter(weights), groups)


def _sum_tied_embedding(s: Schedule, model: GPT, stage: int, group) -> None:
    """wte is used by chunk 0 (embedding) and by the last chunk (head): add the two gradients."""
    first, last = s.stage_of(0), s.stage_of(s.n_chunks - 1)
    if not model.config.tie_weights or first == last or stage not in (first, last):
        return
    mine = model.wte.weight.grad
    other = torch.empty_like(mine)                                       # (V, h)
    other_end = s.stage_of(s.n_chunks - 1 if stage == first else 0)
    for work in exchange([(dist.isend, mine.clone(), other_end, group, 1 << 20),
                          (dist.irecv, other, other_end, group, 1 << 20)], where="tied embedding"):
        work.wait()
    mine += other


# ----------------------------------------------------------------------------- jobs and reference
DEFAULT_CFG = GPTConfig(n_layer=8, n_embd=32, n_head=4, block_size=32)  # the labs' pipeline model


def make_batch(batch_size: int, cfg: GPTConfig, step: int = 0):
    return get_batch(tiny_corpus(), batch_size, cfg.block_size, step)


def train_step_job(s: Schedule, cfg: GPTConfig, batch_size: int, seed: int = 0, pad=None,
                   steps: int = 1) -> dict:
    """What each rank runs (use with labkit.launch.run): `steps` steps of schedule `s`, on
    labkit.launch.device()."""
    torch.set_num_threads(1)  # many ranks share few cores
    model = GPT(cfg, seed=seed).to(device())
    x, y = make_batch(batch_size, cfg)
    for _ in range(steps):
        dist.barrier()
        out = run_schedule(s, model, x, y, pad=pad)
    return out


def schedules_job(schedule_list, cfg: GPTConfig, batch_size: int, seed: int = 0, pad=None,
                  repeats: int = 1, keep_grads: bool = True) -> list:
    """Run several schedules (same P) in one launch, each `repeats` times; keep each one's last
    result. Launching costs seconds on a small machine, so labs and tests batch their runs."""
    torch.set_num_threads(1)
    model = GPT(cfg, seed=seed).to(device())
    x, y = make_batch(batch_size, cfg)
    results = []
    for s in schedule_list:
        for _ in range(repeats):
            dist.barrier()
            out = run_schedule(s, model, x, y, pad=pad)
        if not keep_grads:
            out["grads"] = {}
        results.append(out)
    return results


def reference_step(cfg: GPTConfig, batch_size: int, seed: int = 0) -> dict:
    """The one-process reference (labkit.reference.train, no optimizer step): loss and every
    gradient of make_batch's whole batch, no pipeline."""
    ref = train(cfg, TrainSpec(steps=1, batch=batch_size, optimizer=None, seed=seed, data_seed=0))
    return {"loss": ref.loss, "grads": ref.grads}


def merge(results: list) -> dict:
    """Combine the ranks' results: loss, all gradients by name, one timeline from t = 0."""
    loss = next(r["loss"] for r in results if r["loss"] is not None)
    grads = {}
    for r in results:
        grads.update(r["grads"])  # tied wte appears on two stages with the same (summed) value
    events = [e for r in results for e in r["timeline"]]
    t0 = min(e["start"] for e in events)
    timeline = [dict(e, start=e["start"] - t0, end=e["end"] - t0) for e in events]
    return {"loss": loss, "grads": grads, "timeline": timeline,
            "peak_in_flight": [r["peak_in_flight"] for r in results],
            "peak_activation_bytes": [r["peak_activation_bytes"] for r in results],
            "peak_live_bytes": [r.get("peak_live_bytes") for r in results]}


def compare_to_reference(merged: dict, ref: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Assert the pipeline's loss and every gradient equal the reference's (labkit.testing's
    comparator: a missing or unexpected name first, then the first that differs)."""
    tensors_close(merged["loss"].reshape(()), ref["loss"].reshape(()), rtol=rtol, atol=atol,
                  what="the loss")
    compare_dicts(merged["grads"], ref["grads"], rtol=rtol, atol=atol, what="the gradient of")
