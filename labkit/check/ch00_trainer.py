"""Exercise 0.3's checker: the reader's data-parallel trainer against one process.

    labkit.check.ch00.data_parallel(DataParallelTrainer)

One launch per world size (2 and 3 shown, 4 hidden) builds, on every rank, a small float64 MLP
from that rank's OWN seed, then runs two trainers one after the other: one without clipping, one
with a global-norm clip (SGD with momentum: Adam would hide a wrong scale). Batches change from
step to step and include sizes the world size does not divide and fewer rows than ranks (empty
shards and empty micro-batches); the model has a buffer, and two runs freeze a parameter
(requires_grad False); the hidden world also trains on a sub-group (ranks 1-3 of 4, whose group
rank 0 is global rank 1). Five cases per world, each one property:

  replicas: right after __init__ every rank holds group rank 0's initial parameters and buffers,
      and __init__ made exactly one collective, a broadcast of their flat elements;
  rows: a forward pre-hook records every row each forward saw: each rank sees exactly its own
      contiguous shard (the first B % N one row longer), cut into `accumulation` micro-batches
      the same way, and every row of the batch is seen once;
  communication: each step makes exactly ONE collective, an all-reduce of the trainable
      parameters' flat gradients (+ a few scalars: no frozen parameter's); and each rank sends,
      in __init__ and all steps together, at most one broadcast of the state plus the ring's
      2(N-1)/N of the gradients per step, plus 10% and Gloo's headers, counted by the kernel
      (labkit.netcount);
  global mean: the weights after the steps equal one process training group rank 0's initial
      model on the whole batches (to 1e-9), on every rank, and the losses are the whole batch's;
  clipping: the same with the gradient scaled by min(1, max_norm / (norm + 1e-6)) of the WHOLE
      gradient's norm (torch.nn.utils.clip_grad_norm_ on one process).

Known mistakes are named from their results: a mean of per-rank means, the per-rank means summed,
clipping each rank's part before the all-reduce, no clipping.
labkit.ddp, labkit.zero and torch's DDP are refused by reading the code.

Long because: five checks, each with the hints for every way it is known to go wrong, and the
one-process reference that also replays those mistakes to name them.
"""
from __future__ import annotations

from collections import Counter

import torch

from labkit.check import Checker, fail

DP_IN, DP_HIDDEN, DP_OUT = 8, 512, 4   # an MLP of 6,660 parameters (53 kB in float64)
# one launch per world: (world, label, [config, ...]); a config is one trainer's run
DP_WORLDS = [
    (2, "2 ranks, B = 6 then 5, accumulation 1 then 2", [
        dict(batches=(6, 6, 6), accumulation=1, max_norm=None, optimizer="momentum"),
        dict(batches=(5, 5, 5), accumulation=2, max_norm=20.0, optimizer="momentum")]),
    (3, "3 ranks, B = 7, accumulation 2 (and hidden batches)", [
        dict(batches=(7, 7, 7), accumulation=2, max_norm=None, optimizer="momentum"),
        dict(batches=(8, 2, 8), accumulation=1, max_norm=40.0, optimizer="momentum",
             frozen=("fc1.bias",))]),
    (4, "hidden case: 4 ranks", [
        dict(batches=(10, 3, 10), accumulation=3, max_norm=None, optimizer="adam",
             frozen=("fc2.weight",)),
        dict(batches=(5, 4, 5), accumulation=2, max_norm=30.0, optimizer="momentum",
             group=(1, 2, 3))]),
]
BYTES_SLACK = 0.10          # over the ring's 2(N-1)/N per step: Gloo's headers, a float or two
BYTES_HEADROOM = 8 * 2**10  # absolute: a few hundred bytes of header per message
EXTRA_ELEMENTS = 8          # a flat buffer may carry the loss (and a count or two) with the grads
DP_TIMEOUT = 60.0           # seconds: 4 ranks on 2 busy cores start slowly; a real hang waits this
FORBIDDEN = ("labkit.ddp", "torch.nn.parallel", "labkit.parallel", "labkit.zero")
NAMES = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "center")


class MLP(torch.nn.Module):
    """fc2(tanh(fc1(x - center))): `center` is a buffer (state that is not trained)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(DP_IN, DP_HIDDEN)
        self.fc2 = torch.nn.Linear(DP_HIDDEN, DP_OUT)
        self.register_buffer("center", torch.zeros(DP_IN))

    def forward(self, x):                                 # (B, d_in) -> (B, d_out)
        return self.fc2(torch.tanh(self.fc1(x - self.center)))


def mlp(seed: int, frozen=()) -> torch.nn.Module:
    """The model every rank builds, from its own seed (so ranks start different); the
    parameters named in `frozen` do not train (requires_grad False)."""
    g = torch.Generator().manual_seed(seed)
    model = MLP().double()
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64) * 0.3)  # cpu: seeded
            t.requires_grad_(t.requires_grad and name not in frozen)
    return model


def state(model) -> list:
    """Parameters, then buffers: what every replica must agree on."""
    return [t.detach().cpu().clone() for t in list(model.parameters()) + list(model.buffers())]


def trainable_numel(cfg: dict) -> int:
    return sum(p.numel() for p in mlp(0, cfg.get("frozen", ())).parameters() if p.requires_grad)


def seed_of(rank: int, config: int) -> int:
    return 1000 + 10 * config + rank          # every rank, every trainer: its own weights


def dp_batch(batch: int, step: int):
    g = torch.Generator().manual_seed(100 * step + batch)
    x = torch.randn(batch, DP_IN, generator=g, dtype=torch.float64)   # cpu: seeded; (B, d_in)
    y = torch.randn(batch, DP_OUT, generator=g, dtype=torch.float64)  # cpu: seeded; (B, d_out)
    return x, y


def make_optimizer(name: str, params):
    if name == "momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def rows(n: int, parts: int, i: int) -> tuple:
    """The i-th of `parts` contiguous pieces of n rows, the first n % parts one row longer."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


def members(cfg: dict, world: int) -> tuple:
    return tuple(cfg.get("group") or range(world))


# ----------------------------------------------------------------------------- one process
def reference(cfg: dict, index: int, world: int, rule: str = "mean"):
    """One process from group rank 0's initial model: (state, losses); see _reference."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # a tiny model: a thread pool on a busy machine only waits
    try:
        return _reference(cfg, index, world, rule)
    finally:
        torch.set_num_threads(threads)


def _reference(cfg: dict, index: int, world: int, rule: str = "mean"):
    """One process from group rank 0's initial model: (params, losses). `rule` other than
    "mean" gives the answer of a known mistake, to name it in a hint: "mean_of_means" (each
    rank's mean over its own rows, averaged over ranks), "sum_of_means" (the same, summed),
    "clip_per_rank" (each rank's part clipped before the sum), "no_clip"."""
    import torch.nn.functional as F

    group = members(cfg, world)
    model = mlp(seed_of(group[0], index), cfg.get("frozen", ()))
    params = [p for p in model.parameters() if p.requires_grad]
    opt, losses = make_optimizer(cfg["optimizer"], params), []
    for step, batch in enumerate(cfg["batches"]):
        x, y = dp_batch(batch, step)
        opt.zero_grad()
        with torch.no_grad():
            losses.append(F.mse_loss(model(x), y).item())
        if rule in ("mean", "no_clip"):
            F.mse_loss(model(x), y).backward()            # the whole batch, as one process
        else:
            total = [torch.zeros_like(p) for p in params]
            for r in range(len(group)):
                lo, hi = rows(batch, len(group), r)
                if hi == lo:
                    continue
                part = torch.autograd.grad(F.mse_loss(model(x[lo:hi]), y[lo:hi]), params)
                share = {"mean_of_means": 1 / len(group), "sum_of_means": 1.0,
                         "clip_per_rank": (hi - lo) / batch}[rule]
                part = [g * share for g in part]
                if rule == "clip_per_rank":
                    _clip(part, cfg["max_norm"])
                total = [t + g for t, g in zip(total, part)]
            for p, g in zip(params, total):
                p.grad = g
        if cfg["max_norm"] is not None and rule not in ("no_clip", "clip_per_rank"):
            torch.nn.utils.clip_grad_norm_(params, cfg["max_norm"])
        opt.step()
    return state(model), losses


def _clip(grads, max_norm):
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for g in grads:
        g.mul_(min(1.0, max_norm / (norm.item() + 1e-6)))


# ----------------------------------------------------------------------------- rank side
def _dp_job(cls, configs):
    """Rank side: the reader's trainer on this rank's own model, watched from outside."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from labkit import netcount
    from labkit.check.guards import CollectiveLog
    from labkit.launch import device, note

    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    groups = [dist.new_group(list(cfg["group"])) if cfg.get("group") else None
              for cfg in configs]                      # every rank creates every group, in order
    out = []
    for index, (cfg, group) in enumerate(zip(configs, groups)):
        if rank not in members(cfg, world):
            out.append(None)
            continue
        model = mlp(seed_of(rank, index), cfg.get("frozen", ())).to(dev)   # ranks differ
        seen = [[]]                                    # rows of each forward, per step
        model.register_forward_pre_hook(lambda m, args: seen[-1].append(args[0].detach().cpu()))
        opt = make_optimizer(cfg["optimizer"], model.parameters())
        kwargs = dict(accumulation=cfg["accumulation"], max_norm=cfg["max_norm"])
        if group is not None:
            kwargs["group"] = group                    # else the default: the whole world
        note(f"your DataParallelTrainer.__init__ ({len(members(cfg, world))} ranks)")
        batches = [[t.to(dev) for t in dp_batch(batch, step)]
                   for step, batch in enumerate(cfg["batches"])]
        # one byte count over __init__ and all steps: each count reads the kernel's tables
        with netcount.socket_bytes() as net:
            with CollectiveLog() as log:
                trainer = cls(model, opt, F.mse_loss, **kwargs)
            row = {"start": state(model), "init_calls": log.sized(), "steps": []}
            for step, (x, y) in enumerate(batches):
                seen.append([])
                note(f"your step() {step} of {len(batches)}, batch {x.shape[0]}")
                with CollectiveLog() as log:
                    loss = trainer.step(x.clone(), y.clone())
                if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                    loss = loss.item()
                row["steps"].append({"calls": log.sized(), "loss": loss if isinstance(
                    loss, (int, float)) else repr(loss)})
        row["sent"] = net.sent
        row["seen"] = seen[1:]
        row["params"] = state(model)
        out.append(row)
    dist.barrier()
    return out


# ----------------------------------------------------------------------------- the five checks
def _runs(res, cfg, index, world):
    """[(global rank, group rank, row)] of the config's members."""
    return [(r, g, res[r][index]) for g, r in enumerate(members(cfg, world))]


def _close(ps, ws):
    return all(a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=1e-12)
               for a, b in zip(ps, ws))


def check_replicas(res, configs, world):
    numel = len(torch.cat([t.reshape(-1) for t in state(mlp(0))]))
    n_params = len(list(mlp(0).parameters()))
    for index, cfg in enumerate(configs):
        runs = _runs(res, cfg, index, world)
        n = len(runs)
        root = runs[0][0]
        want = state(mlp(seed_of(root, index)))
        for rank, grank, row in runs:
            where = f"rank {rank} of {n}" + (f" (group {cfg['group']})" if cfg.get("group") else "")
            if not _close(row["start"], want):
                own = state(mlp(seed_of(rank, index)))
                if _close(row["start"][:n_params], want[:n_params]):
                    fail(f"{where}: after __init__ its parameters are group rank 0's but its "
                         f"buffers are not. What else does a model hold that every replica "
                         f"must agree on (model.buffers())?")
                if grank and _close(row["start"], own):
                    fail(f"{where}: after __init__ it still holds its OWN initial weights. The "
                         f"ranks were seeded differently: whose weights must every replica "
                         f"start from, and what must __init__ send?")
                src = "group rank 0 (global rank %d)" % root if root else "rank 0"
                fail(f"{where}: after __init__ its weights are not {src}'s initial weights. "
                     f"Which rank is the broadcast's src (a GLOBAL rank, even with a group), "
                     f"and are the received values copied back into the parameters?")
        for rank, grank, row in runs:                      # then how they got there
            where = f"rank {rank} of {n}" + (f" (group {cfg['group']})" if cfg.get("group") else "")
            calls = [(c, k) for c, k in row["init_calls"] if c != "barrier"]
            if [c for c, _ in calls] != ["broadcast"]:
                names = ", ".join(f"{c} x{m}" for c, m in Counter(c for c, _ in calls).items())
                fail(f"{where}: __init__ made {names or 'no collective'}; exactly one broadcast is "
                     f"asked. How can every parameter travel in ONE message, and from which rank?")
            if not numel <= calls[0][1] <= numel + EXTRA_ELEMENTS:
                fail(f"{where}: the broadcast carried {calls[0][1]:,} elements; the parameters "
                     f"and buffers have {numel:,}. Which tensors did you flatten into it?")


def check_rows(res, configs, world):
    for index, cfg in enumerate(configs):
        runs = _runs(res, cfg, index, world)
        n, k = len(runs), cfg["accumulation"]
        for step, batch in enumerate(cfg["batches"]):
            x, _ = dp_batch(batch, step)
            what = f"step {step + 1} (B = {batch}, {n} ranks, accumulation {k})"
            seen_by = [[] for _ in range(batch)]           # which ranks saw each row
            got = {}                                       # rank -> (rows in order, sizes)
            for rank, _, row in runs:
                forwards = [f for f in row["seen"][step] if f.shape[0]] \
                    if step < len(row["seen"]) else []
                got[rank] = ([], [f.shape[0] for f in forwards])
                for line in (ln for f in forwards for ln in f.reshape(f.shape[0], -1)):
                    hit = (x == line).all(dim=1).nonzero().flatten().tolist()
                    if not hit:
                        fail(f"{what}: rank {rank} ran forward on a row that is not in the "
                             f"batch. Does every forward take rows of x as they are?")
                    got[rank][0].append(hit[0])
                    seen_by[hit[0]].append(rank)
            lost = [i for i, s in enumerate(seen_by) if not s]
            twice = [i for i, s in enumerate(seen_by) if len(s) > 1]
            if lost:
                fail(f"{what}: rows {lost} were seen by no rank. Where do the B % N rows left "
                     f"over by B // N go?")
            if twice:
                fail(f"{what}: rows {twice} were seen more than once. Where does each shard "
                     f"start, and is a micro-batch run twice?")
            for rank, grank, _ in runs:
                lo, hi = rows(batch, n, grank)
                seen, sizes = got[rank]
                if seen != list(range(lo, hi)):
                    fail(f"{what}: rank {rank} ran forward on rows {_span(seen)}; its shard is "
                         f"rows {lo}:{hi}. Shards are contiguous, in group-rank order, their "
                         f"sizes differ by at most one, the first B % N one row longer.")
                want = [b - a for a, b in (rows(hi - lo, k, j) for j in range(k)) if b > a]
                if sizes != want:
                    fail(f"{what}: rank {rank}'s forwards saw {sizes} rows; its {hi - lo} rows "
                         f"in {k} micro-batches are {want}. Is each micro-batch its own forward "
                         f"and backward, cut by the same rule as the shards?")


def _span(got: list) -> str:
    if got and got == list(range(got[0], got[-1] + 1)):
        return f"{got[0]}:{got[-1] + 1}"
    return str(got) if got else "(none)"


def check_communication(res, configs, world):
    from labkit.costs.comm import ring_bytes_sent_per_rank

    state_numel = len(torch.cat([t.reshape(-1) for t in state(mlp(0))]))
    for index, cfg in enumerate(configs):
        runs = _runs(res, cfg, index, world)
        n, numel = len(runs), trainable_numel(cfg)
        for rank, _, row in runs:
            for step, s in enumerate(row["steps"]):
                where = f"rank {rank} of {n}, step {step + 1}"
                calls = [(c, k) for c, k in s["calls"] if c != "barrier"]
                if [c for c, _ in calls] != ["all_reduce"]:
                    names = ", ".join(f"{c} ({k:,} elements)" for c, k in calls[:6]) or "none"
                    more = f" and {len(calls) - 6} more" if len(calls) > 6 else ""
                    fail(f"{where}: step made {len(calls)} collectives ({names}{more}); exactly "
                         f"one all-reduce is asked. Could every gradient (and the loss) travel "
                         f"as ONE flat tensor?")
                k = calls[0][1]
                if not numel <= k <= numel + EXTRA_ELEMENTS:
                    fail(f"{where}: the all-reduce carried {k:,} elements; the gradients of the "
                         f"trainable parameters have {numel:,} (a few scalars more are fine). "
                         f"Which tensors are in it, and does a frozen parameter need one?")
            if row["sent"] is None:
                continue                                   # NCCL: the kernel cannot count
            steps = len(row["steps"])
            ring = ring_bytes_sent_per_rank("all_reduce", 8 * (numel + EXTRA_ELEMENTS), n)
            # a broadcast's root (or a tree's inner node) sends the buffer to up to N - 1 ranks
            start = (n - 1) * 8 * (state_numel + EXTRA_ELEMENTS)
            budget = (start + steps * ring) * (1 + BYTES_SLACK) + (steps + 1) * BYTES_HEADROOM
            if row["sent"] > budget:
                fail(f"rank {rank} of {n} sent {row['sent']:,} bytes in __init__ and {steps} "
                     f"steps (kernel count); one broadcast of the {state_numel * 8:,} bytes of "
                     f"parameters and buffers, then a ring all-reduce of the {numel * 8:,} "
                     f"gradient bytes per step (2(N-1)/N of them per rank), with 10% slack and "
                     f"headers, allow {budget:,.0f}. What else travelled?")


def _check_training(res, configs, world, clipped: bool):
    for index, cfg in enumerate(configs):
        if (cfg["max_norm"] is not None) != clipped:
            continue
        runs = _runs(res, cfg, index, world)
        n, steps = len(runs), len(cfg["batches"])
        what = (f"{n} ranks, batches {list(cfg['batches'])}, accumulation {cfg['accumulation']}"
                + (f", max_norm {cfg['max_norm']}" if clipped else ""))
        want, want_losses = reference(cfg, index, world)
        first = runs[0][2]["params"]
        for rank, _, row in runs[1:]:
            if not _close(row["params"], first):
                fail(f"{what}: after {steps} steps rank {rank}'s weights differ from group rank "
                     f"0's. Did they start equal, and does every rank apply the same gradient?")
        if not _close(first, want):
            for rule, hint in _MISTAKES:
                if (rule in ("no_clip", "clip_per_rank")) <= clipped and \
                        _close(first, reference(cfg, index, world, rule)[0]):
                    fail(f"{what}: the weights equal {hint}")
            worst = max(range(len(want)), key=lambda i: (first[i] - want[i]).abs().max())
            fail(f"{what}: after {steps} steps {NAMES[worst]} is off by up to "
                 f"{(first[worst] - want[worst]).abs().max():.3g} from one process on the whole "
                 f"batches. Is the gradient the optimizer sees the whole batch's mean"
                 + (", clipped by the norm of the whole gradient" if clipped else "") + "?")
        for rank, _, row in runs:
            got = [s["loss"] for s in row["steps"]]
            if not all(isinstance(a, (int, float)) and abs(a - b) <= 1e-9 * max(1.0, abs(b))
                       for a, b in zip(got, want_losses)):
                fail(f"{what}: rank {rank}'s step() returned {[_round(a) for a in got]}; the "
                     f"whole batch's loss before each step is {[_round(b) for b in want_losses]},"
                     f" on every rank. Is it the whole batch's mean, weighted by rows, and a "
                     f"number on a rank with no rows?")


_MISTAKES = [
    ("mean_of_means", "averaging each rank's mean over its own rows. The shards differ in size: "
                      "what weight should a rank with fewer rows have in the whole batch's mean?"),
    ("sum_of_means", "training with each rank's mean SUMMED over ranks. What does an all-reduce "
                     "with op SUM give you, and what is still to be divided?"),
    ("clip_per_rank", "clipping each rank's part of the gradient before the all-reduce. Whose "
                      "norm must be at most max_norm: a rank's part, or the whole gradient?"),
    ("no_clip", "training WITHOUT clipping. Is max_norm applied, after the all-reduce?"),
]


def _round(v):
    return round(v, 6) if isinstance(v, (int, float)) else v


def check_mean(res, configs, world):
    _check_training(res, configs, world, clipped=False)


def check_clip(res, configs, world):
    _check_training(res, configs, world, clipped=True)


CHECKS = [("replicas start as group rank 0's, one broadcast", check_replicas),
          ("every row once, in its rank's shard and micro-batches", check_rows),
          ("one flat all-reduce per step, bytes within the ring's", check_communication),
          ("the whole batch's mean gradient: weights and losses equal one process", check_mean),
          ("clipping by the whole gradient's norm", check_clip)]


def data_parallel(cls, worlds=None, exercise=("0.3", "data-parallel training by hand", 5)):
    """Exercise 0.3: cls(model, optimizer, loss_fn, group=None, accumulation=1, max_norm=None)
    with .step(x, y) -> loss, on real ranks."""
    from labkit.check.guards import forbidden_used

    c = Checker(*exercise)
    bad = forbidden_used([cls], FORBIDDEN, ("DistributedDataParallel", "BucketedDDP"))
    refuse = (f"your code uses {', '.join(bad)}: that is the exercise done for you. Write the "
              f"trainer with torch.distributed calls yourself.") if bad else ""
    for world, label, configs in (DP_WORLDS if worlds is None else worlds):
        clipped = {cfg["max_norm"] is not None for cfg in configs}
        checks = [(name, check) for name, check in CHECKS          # a case only where it is run
                  if check not in (check_mean, check_clip) or (check is check_clip) in clipped]
        c.cases_on_one_launch(
            label, [(name, lambda res, check=check, cf=configs, w=world: check(res, cf, w))
                    for name, check in checks],
            lambda w=world, cf=configs: c.launch(_dp_job, w, args=(cls, cf), timeout=DP_TIMEOUT),
            refuse=refuse)
    return c.finish()
