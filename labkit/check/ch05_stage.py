"""Chapter 05's exercise 5.3, a pipeline stage on real processes: the cases, the observer the
checker puts inside the reader's stage (order of F, B and W; saved bytes alive at once), the
expected order and peak for a schedule, and the checker `pipeline_stage` (re-exported by
labkit.check.ch05, where the notebook calls it). See labkit.check.ch05's docstring for 5.3.

Long because: the observer inside the reader's stage, the order and peak a schedule implies, and
the checker that compares them are one idea (a correct stage, watched from outside).
"""
from __future__ import annotations

from labkit.check import Checker, fail, graded

STAGE_CASES = {  # P: [(schedule, K)]; one launch per P, a batch of STAGE_BATCH rows (K need not divide it)
    2: [("1f1b", 3), ("zb-h2", 4)],
    3: [("zb-h1", 5), ("gpipe", 2)],
}
STAGE_BATCH = 7
MEMORY_SLACK = 0.05     # the peak may exceed what the schedule holds by 5% of one micro-batch's bytes
FORBIDDEN_MODULES = ("labkit.pipeline", "torch.distributed.pipelining.schedules",
                     "torch.distributed.pipelining.stage")
FORBIDDEN_NAMES = {"run_schedule", "PipelineStage", "ScheduleGPipe", "Schedule1F1B",
                   "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
                   "ScheduleZBVZeroBubble", "schedules_job", "train_step_job"}


def stage_config():
    """The GPT the stages are cut from: untied embeddings, so every weight lives on one stage."""
    from labkit.model import GPTConfig

    return GPTConfig(n_layer=3, n_embd=16, n_head=2, block_size=8, tie_weights=False)


class _Held:
    """What the pack hook hands autograd instead of the tensor: freed when autograd frees it."""
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class StageObserver:
    """The checker's eyes inside the reader's stage: what happened, in order ("F" forward, "B"
    input gradient, "W" weight gradient), and the bytes saved for backward that are alive.

    Bytes: torch.autograd.graph.saved_tensors_hooks. Each saved storage counts once while any
    packed reference to it is alive (the packed object dies when autograd frees the node or the
    graph), parameters, buffers and the caller's token ids not at all. Order: a forward is the
    module's call; B is a hook on the stage's input tensor (it fires when the input's gradient
    is computed); W is a hook on one weight (it fires when that weight's gradient is)."""

    def __init__(self, exclude_ptrs):
        self.exclude = set(exclude_ptrs)
        self.events, self.per_mb = [], []
        self.live, self.live_bytes, self.peak = {}, 0, 0

    def pack(self, t):
        import weakref

        st = t.untyped_storage()
        ptr, n = st.data_ptr(), st.nbytes()
        if n == 0 or ptr in self.exclude:
            return t
        if ptr in self.live:
            self.live[ptr][1] += 1
        else:
            self.live[ptr] = [n, 1]
            self.live_bytes += n
            self.per_mb[-1] += n
            self.peak = max(self.peak, self.live_bytes)
        held = _Held(t.detach())  # detached: a saved output would otherwise hold its own node
        weakref.finalize(held, self._release, ptr)    # (a cycle through autograd, never freed)
        return held

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held

    def _release(self, ptr):
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[ptr]
            self.live_bytes -= entry[0]


class ObservedStage:
    """The stage module the reader's run_stage gets: one contiguous slice of the GPT
    (labkit.pipeline.executor.PipelineChunk), watched by a StageObserver.

    first: takes token ids (B_k, T); else activations (B_k, T, h), h = hidden. last: called as
    stage(x, y) it returns the micro-batch's loss, its token-sum over all the batch's tokens (the
    K losses add up to the batch mean); else stage(x) returns activations (B_k, T, h)."""

    def __init__(self, model, s, stage, n_tokens, exclude=()):
        import torch.nn as nn

        from labkit.pipeline.executor import build_chunks

        self.chunk = build_chunks(model, s, stage)[0]
        self.first, self.last = self.chunk.first, self.chunk.last
        self.hidden, self.n_tokens = model.config.n_embd, n_tokens
        ptrs = [t.untyped_storage().data_ptr() for t in
                list(self.chunk.parameters()) + list(self.chunk.buffers()) + list(exclude)]
        self.observer = StageObserver(ptrs)
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
        import torch
        import torch.nn.functional as F

        obs = self.observer
        obs.events.append("F")
        obs.per_mb.append(0)
        if x.requires_grad:
            x.register_hook(self._input_grad)
        with torch.autograd.graph.saved_tensors_hooks(obs.pack, obs.unpack):
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


def _fused_pairs(events) -> list:
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


def _stage_job(fn, specs, batch_size):
    import sys

    import torch
    import torch.distributed as dist

    from labkit.check.guards import CollectiveLog
    from labkit.launch import device, note
    from labkit.model import GPT, shard_rows
    from labkit.pipeline import schedules
    from labkit.pipeline.executor import make_batch, owned_parameters

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
        log = CollectiveLog(refuse=True, why="pipeline stages send to their neighbours only")
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
                                          if m.startswith(FORBIDDEN_MODULES))})
        dist.barrier()   # nobody starts the next schedule while a neighbour still sends
    return {"runs": out}


def _reference(batch_size):
    """The one-process GPT: loss and every gradient of the whole batch."""
    from labkit.model import GPT
    from labkit.pipeline.executor import make_batch

    cfg = stage_config()
    model = GPT(cfg, seed=0)
    x, y = make_batch(batch_size, cfg)
    _, loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_stage_numerics(runs, s, ref) -> None:
    from labkit.testing import tensors_close

    P = s.P
    last = runs[P - 1]["loss"]
    if not isinstance(last, (int, float)):
        fail(f"the last stage returned {last!r}: return the sum of the K micro-batch losses "
             f"(a float) there")
    if abs(last - ref[0]) > 1e-4 * max(1.0, abs(ref[0])):
        fail(f"the last stage's loss is {last:.6f}, the one-process model's {ref[0]:.6f}: does "
             f"every micro-batch's loss enter once, and does the last stage see the right "
             f"activations for each micro-batch?")
    for p, r in enumerate(runs):
        for n, g in sorted(r["grads"].items()):
            try:
                tensors_close(g, ref[1][n], rtol=1e-4, atol=1e-6, what=f"stage {p}'s gradient of {n}")
            except AssertionError as err:
                where = ("the last stage" if p == P - 1 else
                         f"stage {p} (the stages after it are right)" if all(
                             _grads_ok(q, ref) for q in runs[p + 1:]) else f"stage {p}")
                fail(f"{err}\nfirst wrong gradient on {where}: is the gradient you receive "
                     f"for each micro-batch the one sent for it (waited for before it is "
                     f"used), and does each W use that micro-batch's output and gradient?")
    missing = sorted(set(ref[1]) - {n for r in runs for n in r["grads"]})
    if missing:
        fail(f"no stage left a gradient in .grad for {missing[0]} ({len(missing)} missing): "
             f"every stage must run its weights' backward for every micro-batch")


def _grads_ok(run, ref) -> bool:
    import torch

    return all(torch.allclose(g, ref[1][n], rtol=1e-4, atol=1e-6) for n, g in run["grads"].items())


def _assert_stage_order_and_memory(runs, s) -> None:
    for p, r in enumerate(runs):
        actions = s.stages[p]
        want = expected_order(actions, first=p == 0)
        got = list(r["events"]) if s.split else _fused_pairs(r["events"])
        if got != want:
            i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            names = {"F": "a forward", "B": "an input gradient (B)", "W": "a weight gradient (W)"}
            fail(f"stage {p} of {s.P}: event #{i} was {names.get(got[i], 'nothing') if i < len(got) else 'nothing'}"
                 f", the schedule's order wants {names[want[i]] if i < len(want) else 'nothing more'} "
                 f"there (observed {''.join(got[:i + 1])}..., scheduled {''.join(want[:i + 1])}...)"
                 + (". In a split schedule B computes only the input's gradient and W only the "
                    "weights': which tensors does each of your backward calls differentiate?"
                    if s.split else ""))
        limit = expected_peak(actions, r["per_mb"])
        slack = MEMORY_SLACK * max(r["per_mb"] or [0])
        if r["peak"] > limit + slack:
            fail(f"stage {p} of {s.P}: {r['peak'] / 1024:.1f} KiB saved for backward were alive "
                 f"at once; running this order holds at most {limit / 1024:.1f} KiB (a "
                 f"micro-batch's activations from its F to its "
                 f"{'W' if s.split else 'B'}). What still refers to a micro-batch's output or "
                 f"graph after its last backward action: a list, a dict, or a local name that "
                 f"keeps it until a later action rebinds it?")


def forbidden_used(fn, modules=FORBIDDEN_MODULES, names=FORBIDDEN_NAMES) -> list:
    """What of `modules` and `names` the reader's function (and the helpers it calls from its
    own namespace) imports, names or reaches through its globals (labkit.check.guards)."""
    import ast
    import inspect
    import textwrap

    from labkit.check.guards import forbidden_used as used

    found = set(used([fn], tuple(modules), set(names)))
    try:  # `from labkit import costs` names the module only in the imported name
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        tree = None
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{a.name}" for a in node.names
                      if f"{node.module}.{a.name}".startswith(tuple(modules))}
    return sorted(found)


def collectives_in_source(fn) -> list:
    """torch.distributed collectives the function's own source calls (read, not run; the
    dispatch-mode observer catches the rest while it runs)."""
    import ast
    import inspect
    import textwrap

    from labkit.check.guards import _PUBLIC

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return []
    public = set(_PUBLIC.values())
    return sorted({n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call)
                   and isinstance(n.func, ast.Attribute) and n.func.attr in public})


@graded("5.3")
def pipeline_stage(fn, Ps=None):
    """Exercise 5.3: the reader's run_stage on real processes. Ps: the world sizes to run
    (default all of STAGE_CASES; the tests pick one to stay quick)."""
    from labkit.check.ch05 import EXERCISES, RUN_TIMEOUT
    from labkit.pipeline import schedules

    c = Checker("5.3", EXERCISES["5.3"][0], EXERCISES["5.3"][1])
    banned, called = forbidden_used(fn), collectives_in_source(fn)

    def refuse_code():  # every case: an untouched stub or a borrowed executor earns nothing
        if banned:
            fail(f"run_stage uses {', '.join(banned)}: the exercise is to write the stage "
                 f"yourself (torch.autograd and torch.distributed's point-to-point calls)")
        if called:
            fail(f"run_stage calls dist.{', dist.'.join(called)}: a pipeline's stages talk to "
                 f"their neighbours only, with send/recv (or isend/irecv)")

    ref = _reference(STAGE_BATCH)
    for P, specs in sorted(STAGE_CASES.items()):
        if Ps is not None and P not in Ps:
            continue
        got = {}
        for i, (name, K) in enumerate(specs):
            s = schedules.make(name, P, K)
            label = f"P={P}, {name}, K={K} ({STAGE_BATCH} rows: micro-batches of {STAGE_BATCH // K}-{-(-STAGE_BATCH // K)})"
            with c.case(label + ": loss and every gradient = one-process reference (P2P only, "
                        "no pipeline implementation)"):
                refuse_code()
                if "runs" not in got:
                    try:
                        got["runs"] = c.launch(_stage_job, P, args=(fn, specs, STAGE_BATCH), timeout=RUN_TIMEOUT)
                    except Exception as err:
                        got["error"] = err
                        raise
                if "error" in got:
                    fail(f"see the first case of P={P}")
                used = sorted({u for r in got["runs"] for u in r.get("collectives", [])})
                if used:
                    fail(f"dist.{', dist.'.join(used)} called while run_stage ran: send "
                         f"activations and gradients point to point")
                runs = [r["runs"][i] for r in got["runs"]]
                _assert_stage_numerics(runs, s, ref)
            with c.case(label + ": forwards, B's and W's in the schedule's order; bytes held "
                        f"<= the schedule's (+{MEMORY_SLACK:.0%} of a micro-batch)"):
                refuse_code()
                if "runs" not in got or any("collectives" in r for r in got["runs"]):
                    fail(f"the run of P={P} failed (see above)")
                _assert_stage_order_and_memory([r["runs"][i] for r in got["runs"]], s)
    return c.finish()


