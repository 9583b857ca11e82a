"""Lab 00: a first distributed program, an all-reduce measured against the alpha-beta model, and
the 16 bytes per parameter of training, measured.

    labkit run intro --nproc 4 [--sizes-kib 4 64 1024 16384 --repeats 5]
    torchrun --nproc-per-node 4 -m labkit run intro          # one rank per process

Three parts, as in chapter 00:
1. hello: every rank reports its rank, the world size, its backend and device.
2. `dist.all_reduce` timed over a range of sizes (one launch per size); alpha and the bandwidth
   are fitted with labkit.costs.comm.fit_alpha_beta (per ring step: 2(N-1) steps of D/N bytes)
   and the ring model's time is printed next to each measurement.
3. the tiny GPT after one AdamW step in fp32: the bytes of its weights, gradients and optimizer
   state, added up tensor by tensor on every rank (plain data parallelism: each rank holds them
   all), next to labkit.costs.memory.model_states(recipe="fp32"): 4 + 4 + 8 = 16 bytes/param.
"""
from __future__ import annotations

import argparse
import os

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank
SIZES_KIB = (4, 16, 64, 256, 1024, 4096, 16384)  # float32 buffers, KiB: latency- to bandwidth-bound


def hello() -> dict:
    """Rank side: who am I?"""
    import torch.distributed as dist

    from labkit.launch import device

    return {"rank": dist.get_rank(), "world": dist.get_world_size(),
            "backend": dist.get_backend(), "device": str(device()), "pid": os.getpid()}


def time_all_reduce(numel: int, repeats: int = 5) -> float:
    """Rank side: mean seconds of one `dist.all_reduce` of `numel` float32 values on this rank."""
    import torch
    import torch.distributed as dist

    from labkit.launch import device
    from labkit.timing import now

    t = torch.ones(numel, device=device())
    dist.all_reduce(t)                                   # warm-up: connections, allocations
    dist.barrier()
    start = now(t.device)                                # waits for queued GPU work first
    for _ in range(repeats):
        dist.all_reduce(t)
    return (now(t.device) - start) / repeats


def model_state_bytes(n_layer: int = 2, n_embd: int = 32, n_head: int = 4) -> dict:
    """Rank side: the tiny GPT after one AdamW step in fp32; bytes of each kind of model state.

    Optimizer state counts every tensor with at least one dimension (momentum and variance);
    AdamW's one-element `step` counter per tensor is not per parameter and is left out."""
    import torch

    from labkit.model import GPT, GPTConfig, get_batch, num_parameters, tiny_corpus

    model = GPT(GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = get_batch(tiny_corpus(), batch_size=4, block_size=model.config.block_size, step=0)
    model(x, y)[1].backward()
    opt.step()

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    params = list(model.parameters())
    return {"numel": num_parameters(model), "weights": nbytes(params),
            "gradients": nbytes(p.grad for p in params),
            "optimizer": nbytes(v for st in opt.state.values() for v in st.values()
                                if torch.is_tensor(v) and v.dim() > 0)}


def fit_ring(nbytes, seconds, n: int) -> tuple:
    """(alpha, bandwidth) of the ring model from measured all-reduce times of D = nbytes on n
    ranks: each of the 2(n-1) ring steps moves D/n bytes (labkit.costs.comm.ring_steps)."""
    from labkit.costs import comm

    steps = comm.ring_steps("all_reduce", n)
    return comm.fit_alpha_beta([b / n for b in nbytes], [t / steps for t in seconds])


def main(argv=()) -> int:
    from labkit.costs import comm, memory
    from labkit.launch import run
    from labkit.progress import Progress

    p = argparse.ArgumentParser(prog="labkit run intro")
    p.add_argument("--nproc", type=int, default=int(os.environ.get("WORLD_SIZE", 4)))
    p.add_argument("--sizes-kib", type=float, nargs="+", default=list(SIZES_KIB),
                   help="all-reduce sizes in KiB of float32 (at least two different ones)")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(list(argv))
    n = a.nproc
    if n < 2:
        raise ValueError(f"--nproc {n}: an all-reduce needs at least 2 ranks; use --nproc 2 or "
                         f"more")
    numels = sorted({max(1, int(k * 1024) // 4) for k in a.sizes_kib})
    if len(numels) < 2 or a.repeats < 1:
        raise ValueError(f"--sizes-kib needs at least two different sizes to fit alpha and the "
                         f"bandwidth (got {a.sizes_kib}) and --repeats >= 1 (got {a.repeats})")
    prog = Progress("intro", total=2 + len(numels))

    ranks = run(hello, n, echo=False)
    prog.done(f"hello from {len(ranks)} ranks ({ranks[0]['backend']})")

    times = []
    for numel in numels:  # one launch per size: a line as each one is measured
        per_rank = run(time_all_reduce, n, args=(numel, a.repeats), echo=False)
        times.append(max(per_rank))                       # the slowest rank sets the pace
        prog.done(f"all_reduce of {_size(4 * numel)}: {times[-1] * 1e3:.3f} ms")
    nbytes = [4 * k for k in numels]
    try:
        alpha, bw = fit_ring(nbytes, times, n)
    except ValueError as err:                              # noisy times on a busy machine
        alpha = bw = None
        prog.say(f"no alpha-beta fit: {err}")

    states = run(model_state_bytes, n, echo=False)
    prog.done(f"model states of the tiny GPT measured on {n} ranks")

    if os.environ.get("RANK", "0") != "0":
        return 0
    print(f"\n1. hello: {n} ranks")
    print(f"{'rank':>4} {'world':>5} {'backend':>7} {'device':>7} {'pid':>8}")
    for r in ranks:
        print(f"{r['rank']:>4} {r['world']:>5} {r['backend']:>7} {r['device']:>7} {r['pid']:>8}")

    print(f"\n2. dist.all_reduce on {n} ranks vs the ring model 2(N-1)·alpha + 2(N-1)/N·D/bw")
    if alpha is not None:
        print(f"   fitted alpha = {alpha * 1e6:.1f} µs, bandwidth = {bw / comm.GB:.2f} GB/s")
    print(f"{'size D':>10} {'measured ms':>12} {'model ms':>9} {'measured/model':>15}")
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
