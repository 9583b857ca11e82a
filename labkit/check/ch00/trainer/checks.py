"""Exercise 0.3's five checks, each on one launch's results, with the hints for every way it is
known to go wrong (a mistake's answer is replayed by the reference to name it).
"""
from __future__ import annotations

from collections import Counter

import torch

from labkit.check import fail
from labkit.check.ch00.trainer.runs import (
    BYTES_HEADROOM,
    BYTES_SLACK,
    EXTRA_ELEMENTS,
    NAMES,
    dp_batch,
    members,
    mlp,
    reference,
    rows,
    seed_of,
    state,
    trainable_numel,
)
from labkit.costs.comm import ring_bytes_sent_per_rank


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
        for rank, _grank, row in runs:                     # then how they got there
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
