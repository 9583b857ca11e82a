"""Checkers for chapter 00: predict a model's training-state bytes, a first send/recv, and a
data-parallel training loop by hand.

    labkit.check.ch00.state_bytes(predict_state_bytes)          # 0.1 predict, then measure
    labkit.check.ch00.shift_right(shift_right)                  # 0.2
    labkit.check.ch00.data_parallel(train_data_parallel)        # 0.3

0.1: YOUR prediction of the bytes of weights, gradients and optimizer states (master copy
included) for a dtype/optimizer combination is compared with labkit.costs.memory and with the
storage bytes (untyped_storage().nbytes(), deduplicated) of a real GPT after one real optimizer
step in that combination, within 1%.

0.2: YOUR shift_right runs on 2, 3 and 4 real ranks, with a 4 MB tensor among the shapes (a
blocking send first on every rank hangs there); collectives are refused while it runs.

0.3: YOUR training loop runs on 2, 3 and 4 real ranks whose models start from different weights,
on batches that the world size does not divide (a hidden case leaves a rank with no rows), under
SGD with momentum and Adam. Its weights and losses must equal one process training rank 0's
initial model on the whole batch. Watched without the reader's help: the rows each forward sees
(a forward pre-hook), the collectives called (a dispatch mode, labkit.check.guards) and the bytes
each rank sent (the kernel's socket counters, labkit.netcount).

Long because: the notebook imports one checker module per chapter; each of its three exercises
brings its rank jobs, its hidden cases and the hints for each way it can go wrong.
"""
from __future__ import annotations

import torch

from labkit.check import Checker, fail, tensors_close

EXERCISES = {
    "0.1": ("predict a model's training-state bytes, then measure them", 3),
    "0.2": ("a first send/recv: shift right around a ring", 2),
    "0.3": ("data-parallel training by hand", 5),
}

# ----------------------------------------------------------------------------- 0.1
STATE_MODEL = dict(n_layer=2, n_embd=64, n_head=4, block_size=32)    # about 0.13 M parameters
# (weights dtype, gradients dtype, fp32 master copy, optimizer); the last two are hidden
STATE_CASES = [(torch.bfloat16, torch.bfloat16, True, "adam"),
               (torch.float32, torch.float32, False, "adam"),
               (torch.bfloat16, torch.float32, True, "adam"),
               (torch.float16, torch.float16, True, "momentum"),
               (torch.float32, torch.float32, False, "sgd")]
STATE_TOLERANCE = 0.01   # Adam's per-tensor `step` counters add 4 bytes per tensor
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}    # fp32 tensors per parameter


def costs_prediction(n_params: int, weights, grads, master: bool, optimizer: str) -> dict:
    """labkit.costs' answer: a Precision with the bytes per parameter of this combination."""
    from labkit.costs import memory

    opt = 4 * master + 4 * OPTIMIZER_STATES[optimizer]
    r = memory.Precision("case", weights.itemsize, grads.itemsize, opt)
    s = memory.model_states(n_params, recipe=r)
    return {"weights": s.params, "grads": s.grads, "optimizer": s.optimizer, "total": s.total}


def state_model_params() -> int:
    from labkit.model import GPT, GPTConfig

    return sum(p.numel() for p in GPT(GPTConfig(**STATE_MODEL), seed=0).parameters())


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`: what the allocator really holds."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def measure_state(weights, grads, master: bool, optimizer: str) -> tuple:
    """(parameters, {"weights", "grads", "optimizer", "total"} measured in storage bytes) of a
    real GPT after one real step: forward and backward in the weights' dtype; gradients kept in
    `grads` (an fp32 copy, as Megatron's main_grad, when it differs); the optimizer updating an
    fp32 master copy when `master`, else the weights themselves."""
    from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus

    model = GPT(GPTConfig(**STATE_MODEL), seed=0).to(weights)
    params = list(model.parameters())                           # tied weights listed once
    x, y = get_batch(tiny_corpus(), 2, STATE_MODEL["block_size"], 0)       # (2, T)
    model(x, y)[1].float().backward()
    grad = [p.grad if p.grad.dtype == grads else p.grad.to(grads) for p in params]
    for p in params:
        if p.grad.dtype != grads:
            p.grad = None                                       # only the kept copy remains
    updated = [p.detach().float().clone().requires_grad_() for p in params] if master else params
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
            "momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
            "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3)}[optimizer]
    opt = make(updated)
    if master:
        for m, g in zip(updated, grad):
            m.grad = g.float()                                  # transient: dropped after step
    opt.step()
    if master:
        for m in updated:
            m.grad = None
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    got = {"weights": _storage_bytes(params), "grads": _storage_bytes(grad),
           "optimizer": _storage_bytes((updated if master else []) + states)}
    got["total"] = got["weights"] + got["grads"] + got["optimizer"]
    return sum(p.numel() for p in params), got


def _state_hint(key, got, measured, n, weights, grads, master, optimizer) -> str:
    per = got / n
    said = (f"{key}: predicted {got:,.0f} B ({per:g} B/param), measured {measured:,} B "
            f"({measured / n:.3g} B/param). ")
    if key == "weights":
        return said + f"How many bytes does one {weights} element take (dtype.itemsize)?"
    if key == "grads":
        return said + f"Gradients are kept in {grads} here: how many bytes per element is that?"
    if key == "optimizer":
        return said + (f"What does {optimizer!r} keep per parameter besides the weights "
                       f"(momentum? variance?), in which dtype, and does the fp32 master copy "
                       f"(master={master}) belong to the optimizer's bytes?")
    return said + "total = weights + grads + optimizer"


def state_bytes(fn, cases=None):
    """Exercise 0.1: fn(n_params, weights, grads, master, optimizer) -> {"weights", "grads",
    "optimizer", "total"} in bytes."""
    c = Checker("0.1", *EXERCISES["0.1"])
    cases = STATE_CASES if cases is None else cases
    for i, (w, g, master, optimizer) in enumerate(cases):
        hidden = i >= 3
        name = (f"hidden case {i - 2}" if hidden else
                f"{str(w)[6:]} weights, {str(g)[6:]} grads, master={master}, {optimizer}")
        with c.case(name):
            got = fn(state_model_params(), w, g, master, optimizer)   # a stub stops here
            n, measured = measure_state(w, g, master, optimizer)
            keys = ("weights", "grads", "optimizer", "total")
            if not (isinstance(got, dict) and all(isinstance(got.get(k), (int, float))
                                                  for k in keys)):
                fail(f"return a dict of numbers with keys {list(keys)}, got {got!r:.80}")
            if not hidden:                    # predicted beside measured, in the table
                c.cases[-1]["name"] += "".join(
                    f"\n      {k}: predicted {got[k]:>10,.0f} B, measured {measured[k]:>10,} B"
                    for k in keys)
            want = costs_prediction(n, w, g, master, optimizer)
            for key in keys:
                if abs(want[key] - measured[key]) > STATE_TOLERANCE * max(measured[key], 1):
                    fail(f"labkit.costs says {want[key]:.4g} B for {key}, the storages "
                         f"{measured[key]} B: the checker disagrees with itself (please report)")
                if abs(got[key] - measured[key]) > STATE_TOLERANCE * measured["total"] or \
                        abs(got[key] - measured[key]) > STATE_TOLERANCE * measured[key] > 0:
                    fail(_state_hint(key, got[key], measured[key], n, w, g, master, optimizer))
    return c.finish()


# ----------------------------------------------------------------------------- 0.2
SHIFT_WORLDS = (2, 3, 4)            # 4: hidden
SHIFT_SHAPES = [(7,), (1, 4), (1_000_000,)]   # 4 MB: a blocking send waits for its receiver
SHIFT_TIMEOUT = 30.0


def _shift_job(fn, shapes):
    """Rank side: the reader's function on rank-dependent data, collectives refused."""
    import torch.distributed as dist

    from labkit.check.guards import CollectiveLog
    from labkit.launch import device, note

    rank, n, dev = dist.get_rank(), dist.get_world_size(), device()
    out = []
    for shape in shapes:
        def data(r):
            g = torch.Generator().manual_seed(1000 * r + len(shape))
            return torch.randn(shape, generator=g, device="cpu").to(dev)  # cpu: same anywhere
        x = data(rank)
        before = x.clone()
        note(f"your shift_right of a tensor of shape {shape}")
        with CollectiveLog(refuse=True, why="pass the tensor with send/recv (or isend/irecv)"):
            got = fn(x)
        out.append({"got": got.cpu() if isinstance(got, torch.Tensor) else got,
                    "want": data((rank - 1) % n).cpu(), "unchanged": torch.equal(x, before),
                    "wrong_way": data((rank + 1) % n).cpu()})
    return out


def shift_right(fn, worlds=SHIFT_WORLDS):
    """Exercise 0.2: fn(x) -> the tensor of rank (rank - 1) mod N, by point-to-point messages."""
    c = Checker("0.2", *EXERCISES["0.2"])
    for world in worlds:
        name = f"{world} ranks, shapes {SHIFT_SHAPES}" if world < 4 else "hidden case"
        with c.case(name):
            rows = c.launch(_shift_job, world, args=(fn, SHIFT_SHAPES), timeout=SHIFT_TIMEOUT)
            for rank, per_shape in enumerate(rows):
                for shape, row in zip(SHIFT_SHAPES, per_shape):
                    what = f"rank {rank} of {world}, shape {shape}"
                    got = row["got"]
                    if not isinstance(got, torch.Tensor) or got.shape != row["want"].shape:
                        fail(f"{what}: return a tensor of the input's shape, got "
                             f"{getattr(got, 'shape', type(got).__name__)}")
                    if world > 2 and torch.equal(got, row["wrong_way"]):
                        fail(f"{what}: you returned the RIGHT neighbour's tensor; whose tensor "
                             f"should rank r hold after a shift to the right?")
                    if not row["unchanged"]:
                        fail(f"{what}: the input x was overwritten; where should the incoming "
                             f"tensor land so that the caller keeps its data?")
                    tensors_close(got, row["want"], rtol=0, atol=0,
                                  what=f"{what} (did you wait for the receive to complete?)")
    return c.finish()


# ----------------------------------------------------------------------------- 0.3
DP_IN, DP_HIDDEN, DP_OUT = 8, 512, 4   # an MLP of 6,660 parameters (53 kB in float64)
# (world, [(global batch, optimizer, steps), ...]) one launch per world; 4 and batch 2 hidden
DP_CASES = [(2, [(6, "momentum", 3)]),
            (3, [(7, "momentum", 3), (2, "momentum", 2)]),
            (4, [(10, "adam", 2)])]
DP_SHOWN = {(2, 6), (3, 7)}
BYTES_SLACK = 0.10          # over the ring's 2(N-1)/N per step: Gloo's headers, a float or two
BYTES_HEADROOM = 8 * 2**10  # absolute: a few hundred bytes of header per message
DP_TIMEOUT = 60.0          # seconds: 4 ranks on 2 busy cores start slowly; a real hang waits this
FORBIDDEN = ("labkit.ddp", "torch.nn.parallel", "labkit.parallel", "labkit.zero")


def mlp(seed: int) -> torch.nn.Module:
    """The model every rank builds, from its own seed (so ranks start different)."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(DP_IN, DP_HIDDEN), torch.nn.Tanh(),
                                torch.nn.Linear(DP_HIDDEN, DP_OUT)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)  # cpu: seeded
    return model


def dp_batch(batch: int):
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, DP_IN, generator=g, dtype=torch.float64)   # cpu: seeded; (B, d_in)
    y = torch.randn(batch, DP_OUT, generator=g, dtype=torch.float64)  # cpu: seeded; (B, d_out)
    return x, y


def make_optimizer(name: str, params):
    if name == "momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def shard_bounds(batch: int, world: int, rank: int) -> tuple:
    base, extra = divmod(batch, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def reference(batch: int, optimizer: str, steps: int, grads: str = "mean", world: int = 1):
    """One process on the whole batch from rank 0's initial model: (params, losses). Other
    `grads` rules give the answers of known mistakes, to name them in a hint: "sum" (the
    gradients summed over ranks, not averaged), "mean_of_means" (each rank's mean over its own
    rows, averaged over ranks: wrong when shards differ in size)."""
    import torch.nn.functional as F

    model, (x, y) = mlp(1000), dp_batch(batch)
    opt, losses = make_optimizer(optimizer, model.parameters()), []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(F.mse_loss(model(x), y).item())
        if grads == "mean":
            F.mse_loss(model(x), y).backward()
        else:
            for r in range(world):
                lo, hi = shard_bounds(batch, world, r)
                if hi == lo:
                    continue
                part = F.mse_loss(model(x[lo:hi]), y[lo:hi], reduction="sum") / y[0].numel()
                part = part / (hi - lo) / world if grads == "mean_of_means" else part / batch
                (part * (world if grads == "sum" else 1)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], losses


def _dp_job(fn, configs):
    """Rank side: the reader's loop on this rank's own model, watched from outside."""
    import torch.distributed as dist

    from labkit import netcount
    from labkit.check.guards import CollectiveLog
    from labkit.launch import device, note

    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    out = []
    for batch, optimizer, steps in configs:
        model = mlp(1000 + rank).to(dev)                        # ranks start from different weights
        rows = []
        model.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
        opt = make_optimizer(optimizer, model.parameters())
        x, y = (t.to(dev) for t in dp_batch(batch))
        note(f"your train_data_parallel: batch {batch}, {optimizer}, {steps} steps")
        dist.barrier()
        with netcount.socket_bytes() as net, CollectiveLog() as log:
            losses = fn(model, opt, x.clone(), y.clone(), steps)
        out.append({"rank": rank, "params": [p.detach().cpu() for p in model.parameters()],
                    "losses": list(losses) if isinstance(losses, (list, tuple)) else losses,
                    "rows": rows, "calls": log.calls, "sent": net.sent})
        dist.barrier()
    return out


def _assert_trained(res, batch, optimizer, steps, world):
    want, want_losses = reference(batch, optimizer, steps)
    for r in res:
        where = f"rank {r['rank']} of {world} (batch {batch}, {optimizer})"
        lo, hi = shard_bounds(batch, world, r["rank"])
        if sum(r["rows"]) != steps * (hi - lo) or any(b > hi - lo for b in r["rows"]):
            fail(f"{where}: its forwards saw {r['rows']} rows; its shard has {hi - lo} rows "
                 f"(rows {lo}:{hi}) and there are {steps} steps. Does each rank run forward on "
                 f"its own contiguous shard only, with the first B % N shards one row longer?")
    first = res[0]["params"]
    for r in res[1:]:
        if not all(torch.equal(a, b) for a, b in zip(first, r["params"])):
            fail(f"after training, rank {r['rank']}'s weights differ from rank 0's. The ranks "
                 f"start from different random weights: what must happen before the first step "
                 f"so that they all start from rank 0's?")
    same = lambda ps, ws: all(torch.allclose(a, b, rtol=1e-9, atol=1e-12)  # noqa: E731
                              for a, b in zip(ps, ws))
    if not same(first, want):
        if same(first, reference(batch, optimizer, steps, "sum", world)[0]):
            fail(f"batch {batch} at {world} ranks: the weights equal training with the gradients "
                 f"SUMMED over ranks. Each rank's gradient should be its share of the global "
                 f"batch's mean: what does an all-reduce with op SUM give you then?")
        if same(first, reference(batch, optimizer, steps, "mean_of_means", world)[0]):
            fail(f"batch {batch} at {world} ranks: the weights equal averaging each rank's mean "
                 f"over its own rows. The shards differ in size: what weight should a rank with "
                 f"fewer rows have in the global mean?")
        for a, b, name in zip(first, want, ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")):
            tensors_close(a, b, rtol=1e-9, atol=1e-12,
                          what=f"batch {batch} at {world} ranks: {name} after {steps} steps")
    for r in res:
        got = r["losses"]
        if not (isinstance(got, list) and len(got) == steps):
            fail(f"rank {r['rank']}: return a list of {steps} losses (one per step), got "
                 f"{got!r:.60}")
        if not all(abs(float(a) - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(got, want_losses)):
            fail(f"rank {r['rank']}: losses {[round(float(a), 6) for a in got]}, expected the "
                 f"whole batch's mean-squared error before each step "
                 f"{[round(b, 6) for b in want_losses]} on every rank. Is it the same on every "
                 f"rank, weighted by rows, not by rank, and a number on a rank with no rows?")


def _assert_communication(res, batch, steps, world):
    from labkit.costs.comm import ring_bytes_sent_per_rank

    numel = sum(p.numel() for p in mlp(0).parameters())
    grads = numel * 8                                            # float64 gradients
    for r in res:
        where = f"rank {r['rank']} of {world} (batch {batch})"
        other = [c for c in r["calls"] if c not in ("send", "recv", "broadcast", "barrier")]
        if len(other) != steps:
            fail(f"{where}: {len(other)} collectives other than broadcast in {steps} steps "
                 f"({', '.join(sorted(set(other))) or 'none'}); exactly one per step is asked. "
                 f"How many tensors does your step send, and could the gradients (and the loss) "
                 f"travel as ONE flat tensor?")
        if r["sent"] is None:
            continue                                             # NCCL: the kernel cannot count
        budget = steps * ring_bytes_sent_per_rank("all_reduce", grads, world) * (1 + BYTES_SLACK)
        budget += (world - 1) * grads + BYTES_HEADROOM   # the start: a root (or a tree node)

        if r["sent"] > budget:
            fail(f"{where} sent {r['sent']:,} bytes (kernel count); {steps} ring all-reduces of "
                 f"the {grads:,} gradient bytes plus the first broadcast allow {budget:,.0f}. "
                 f"Which collective moves each rank's gradients at 2(N-1)/N bytes per byte?")


def data_parallel(fn, cases=None):
    """Exercise 0.3: fn(model, optimizer, x, y, steps) -> losses, on real ranks."""
    from labkit.check.guards import forbidden_used

    c = Checker("0.3", *EXERCISES["0.3"])
    bad = forbidden_used([fn], FORBIDDEN, ("DistributedDataParallel", "BucketedDDP"))
    for world, configs in (DP_CASES if cases is None else cases):
        res, tried = None, False
        for i, (batch, optimizer, steps) in enumerate(configs):
            shown = (world, batch) in DP_SHOWN
            label = (f"{world} ranks, batch {batch} ({optimizer})" if shown
                     else f"hidden case: {world} ranks")
            with c.case(label + ": weights and losses equal one process on the whole batch"):
                if bad:
                    fail(f"your code uses {', '.join(bad)}: that is the exercise done for you. "
                         f"Write the step with torch.distributed calls yourself.")
                if not tried:
                    tried = True
                    res = c.launch(_dp_job, world, args=(fn, configs), timeout=DP_TIMEOUT)
                if res is None:
                    fail("did not run (see the first case of this world size)")
                _assert_trained([r[i] for r in res], batch, optimizer, steps, world)
            with c.case(label + ": one collective per step, bytes within the ring's"):
                if bad or res is None:
                    fail("did not run (see the case above)")
                _assert_communication([r[i] for r in res], batch, steps, world)
    return c.finish()
