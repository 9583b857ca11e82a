"""Lab 00: a first distributed program, an all-reduce measured against the alpha-beta model, and
the 16 bytes per parameter of training, measured.

    labkit run intro --nproc 4 [--sizes-kib 4 64 1024 16384 --repeats 5]
    torchrun --nproc-per-node 4 -m labkit run intro          # one rank per process

Three parts, as in chapter 00:
1. hello: every rank reports its rank, the world size, its backend and device.
2. `dist.all_reduce` timed over a range of sizes (one launch per size; medians over repeats,
   a repeat lasting as long as its slowest rank); alpha and the bandwidth are fitted to the ring
   model by least squares on relative errors (`fit_ring`), printed next to each measurement.
3. the tiny GPT after one AdamW step in fp32: the bytes of its weights, gradients and optimizer
   state, added up tensor by tensor on every rank (plain data parallelism: each rank holds them
   all), next to labkit.costs.memory.model_states(recipe="fp32"): 4 + 4 + 8 = 16 bytes/param.
"""
from __future__ import annotations

import math
import os
import statistics

import torch
import torch.distributed as dist

from labkit.cliargs import count, lab_parser, positive
from labkit.costs import comm, memory
from labkit.labs import ran_on
from labkit.launch import device, run
from labkit.model import GPT, GPTConfig, get_batch, num_parameters, tiny_corpus
from labkit.progress import Progress
from labkit.timing import now

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank
SIZES_KIB = (4, 16, 64, 256, 1024, 4096, 16384)  # float32 buffers, KiB: latency- to bandwidth-bound


def hello() -> dict:
    """Rank side: who am I?"""


    return {"rank": dist.get_rank(), "world": dist.get_world_size(),
            "backend": dist.get_backend(), "device": str(device()), "pid": os.getpid()}


def all_reduce_times(numels, repeats: int = 15, inner: int = 8) -> list:
    """Rank side: for each size, `repeats` timings (seconds) of one `dist.all_reduce` of that many
    float32 values on this rank. Each repeat starts at a barrier and averages `inner` calls back
    to back (a quarter of that from 1 MiB up), so one late wake-up of a process is diluted."""
    return collective_times(numels, "all_reduce", repeats, inner)


def collective_times(numels, op: str = "all_reduce", repeats: int = 15, inner: int = 8) -> list:
    """all_reduce_times for op "all_reduce" or "all_gather" (numel: the gathered output, each
    rank contributing numel / N of it, as ZeRO-3's gathers and costs.comm count it)."""


    dev = device()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out = []
    for numel in numels:
        t = torch.ones(numel, device=dev)               # (numel,) float32
        world = dist.get_world_size()
        mine = torch.ones(numel // world, device=dev)   # (numel/N,) this rank's chunk

        def call(t=t, mine=mine, world=world):
            if op == "all_gather":
                gather(t[:mine.numel() * world], mine)   # (N*numel/N,)
            else:
                dist.all_reduce(t)
        call()                                          # warm-up: connections, allocations
        calls = inner if 4 * numel < 2**20 else max(1, inner // 4)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = now(dev)                            # waits for queued GPU work first
            for _ in range(calls):
                call()
            times.append((now(dev) - start) / calls)
        out.append(times)
    return out


def time_all_reduce(numel: int, repeats: int = 5) -> float:
    """Rank side: median seconds of one `dist.all_reduce` of `numel` float32 values."""

    return statistics.median(all_reduce_times([numel], repeats)[0])


def medians(per_rank, numels) -> list:
    """Per size: {bytes, median, q1, q3, repeats} over repeats, a repeat lasting as long as its
    slowest rank (per_rank: what every rank's all_reduce_times returned)."""

    rows = []
    for i, numel in enumerate(numels):
        reps = [max(r[i][j] for r in per_rank) for j in range(len(per_rank[0][i]))]
        q1, _, q3 = statistics.quantiles(reps, n=4) if len(reps) > 1 else (reps[0],) * 3
        rows.append({"bytes": 4 * numel, "median": statistics.median(reps), "q1": q1, "q3": q3,
                     "repeats": reps})
    return sorted(rows, key=lambda r: r["bytes"])


def fit_ring(nbytes, seconds, n: int, op: str = "all_reduce") -> dict:
    """Fit the ring model t = 2(n-1)·alpha + 2(n-1)/n·D/bandwidth to measured all-reduce times
    (op "all_gather": (n-1)·alpha + (n-1)/n·D/bandwidth, D the gathered output).

    Least squares on *relative* errors ((model - t)/t), so a 5 ms point and a 50 ms one weigh
    alike; otherwise the largest sizes alone would set alpha. No clamping: a fit that needs a
    negative alpha or bandwidth raises ValueError. Returns alpha, bandwidth, the model at each
    point, relative residuals, the largest one, and R² of log t (how much of the spread of log
    times the model explains)."""


    xs = [(comm.ring_steps(op, n), comm.ring_bytes_sent_per_rank(op, b, n)) for b in nbytes]
    ts = list(map(float, seconds))
    if len({x[1] for x in xs}) < 2 or len(xs) != len(ts):
        raise ValueError("need at least two different sizes, with one time each")
    # weighted normal equations for t ≈ a·steps + c·bytes, weights 1/t²
    w = [1 / t ** 2 for t in ts]
    s11 = sum(wi * x[0] ** 2 for wi, x in zip(w, xs))
    s12 = sum(wi * x[0] * x[1] for wi, x in zip(w, xs))
    s22 = sum(wi * x[1] ** 2 for wi, x in zip(w, xs))
    b1 = sum(wi * x[0] * t for wi, x, t in zip(w, xs, ts))
    b2 = sum(wi * x[1] * t for wi, x, t in zip(w, xs, ts))
    det = s11 * s22 - s12 ** 2
    alpha, inv_bw = (b1 * s22 - b2 * s12) / det, (s11 * b2 - s12 * b1) / det
    if alpha < 0 or inv_bw <= 0:
        raise ValueError(f"the best fit has alpha = {alpha:.3g} s and 1/bandwidth = {inv_bw:.3g} "
                         f"s/byte: these times are too noisy for the model (repeat on a quieter "
                         f"machine, or with more repeats)")
    model = [comm.ring_time(op, b, n, alpha, 1 / inv_bw) for b in nbytes]
    rel = [(m - t) / t for m, t in zip(model, ts)]
    logs = [math.log(t) for t in ts]
    mean = sum(logs) / len(logs)
    ss_tot = sum((v - mean) ** 2 for v in logs)
    ss_res = sum((math.log(m) - v) ** 2 for m, v in zip(model, logs))
    return {"alpha": alpha, "bandwidth": 1 / inv_bw, "model": model, "residuals": rel,
            "max_residual": max(abs(r) for r in rel),
            "r2_log": 1 - ss_res / ss_tot if ss_tot > 0 else float("nan")}


def model_state_bytes(n_layer: int = 2, n_embd: int = 32, n_head: int = 4) -> dict:
    """Rank side: the tiny GPT after one AdamW step in fp32; bytes of each kind of model state.

    Optimizer state counts every tensor with at least one dimension (momentum and variance);
    AdamW's one-element `step` counter per tensor is not per parameter and is left out."""


    dev = device()
    model = GPT(GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head), seed=0).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = get_batch(tiny_corpus(), batch_size=4, block_size=model.config.block_size, step=0)
    model(x.to(dev), y.to(dev))[1].backward()
    opt.step()

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    params = list(model.parameters())
    return {"numel": num_parameters(model), "weights": nbytes(params),
            "gradients": nbytes(p.grad for p in params),
            "optimizer": nbytes(v for st in opt.state.values() for v in st.values()
                                if torch.is_tensor(v) and v.dim() > 0)}


def main(argv=()) -> int:

    p = lab_parser("intro", nproc=4)
    p.add_argument("--sizes-kib", type=positive, nargs="+", default=list(SIZES_KIB),
                   help="all-reduce sizes in KiB of float32 (at least two different ones)")
    p.add_argument("--repeats", type=count, default=5, help="timed repeats per size (median)")
    a = p.parse_args(list(argv))
    n = a.nproc
    if n < 2:
        raise ValueError(f"--nproc {n}: an all-reduce needs at least 2 ranks; use --nproc 2 or "
                         f"more")
    numels = sorted({max(1, int(k * 1024) // 4) for k in a.sizes_kib})
    if len(numels) < 2 or a.repeats < 1:
        raise ValueError(f"--sizes-kib needs at least two different sizes to fit alpha and the "
                         f"bandwidth (got {' '.join(f'{k:g}' for k in a.sizes_kib)}); use "
                         f"--sizes-kib 4 256")
    prog = Progress("intro", total=2 + len(numels))

    ranks = run(hello, n, echo=False)
    prog.done(f"hello from {len(ranks)} ranks ({ranks[0]['backend']})")

    times = []
    for numel in numels:  # one launch per size: a line as each one is measured
        per_rank = run(all_reduce_times, n, args=([numel], a.repeats), echo=False)
        times.append(medians([[r[0]] for r in per_rank], [numel])[0]["median"])
        prog.done(f"all_reduce of {_size(4 * numel)}: {times[-1] * 1e3:.3f} ms (median)")
    nbytes = [4 * k for k in numels]
    try:
        fit = fit_ring(nbytes, times, n)
        alpha, bw = fit["alpha"], fit["bandwidth"]
    except ValueError as err:                              # noisy times on a busy machine
        alpha = bw = None
        prog.say(f"no alpha-beta fit: {err}")

    states = run(model_state_bytes, n, echo=False)
    prog.done(f"model states of the tiny GPT measured on {n} ranks")

    if os.environ.get("RANK", "0") != "0":
        return 0
    print(f"\n1. hello: {n} ranks; {ran_on(ranks[0]['backend'], ranks[0]['device'])} (rank 0)")
    print(f"{'rank':>4} {'world':>5} {'backend':>7} {'device':>7} {'pid':>8}")
    for r in ranks:
        print(f"{r['rank']:>4} {r['world']:>5} {r['backend']:>7} {r['device']:>7} {r['pid']:>8}")

    print(f"\n2. dist.all_reduce on {n} ranks vs the ring model 2(N-1)·alpha + 2(N-1)/N·D/bw")
    if alpha is not None:
        print(f"   fitted alpha = {alpha * 1e6:.1f} µs, bandwidth = {bw / comm.GB:.2f} GB/s "
              f"(relative least squares; largest residual {fit['max_residual']:.0%}, "
              f"R² of log t {fit['r2_log']:.3f})")
    print(f"{'size D':>10} {'median ms':>12} {'model ms':>9} {'measured/model':>15}")
    for b, t in zip(nbytes, times):
        if alpha is None:
            print(f"{_size(b):>10} {t * 1e3:>12.3f} {'-':>9} {'-':>15}")
            continue
        model = comm.ring_allreduce_time(b, n, alpha, bw)
        print(f"{_size(b):>10} {t * 1e3:>12.3f} {model * 1e3:>9.3f} {t / model:>15.2f}")

    s = states[0]
    psi = s["numel"]
    pred = memory.model_states(psi, recipe="fp32")
    same = all(st == s for st in states)
    print(f"\n3. model states of the tiny GPT, Ψ = {psi:,} parameters, AdamW, fp32 "
          f"(every rank holds all of them: equal on all ranks: {same})")
    print(f"{'part':>10} {'measured B':>11} {'predicted B':>12} {'B/param':>8}")
    for part, want in (("weights", pred.params), ("gradients", pred.grads),
                       ("optimizer", pred.optimizer)):
        print(f"{part:>10} {s[part]:>11,} {int(want):>12,} {s[part] / psi:>8g}")
    total = s["weights"] + s["gradients"] + s["optimizer"]
    print(f"{'total':>10} {total:>11,} {int(pred.total):>12,} {total / psi:>8g}")
    print(f"recipe: {memory.get_recipe('fp32')}")
    return 0


def _size(nbytes: float) -> str:
    for unit, div in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= div:
            return f"{nbytes / div:g} {unit}"
    return f"{nbytes:g} B"
