"""Checkers for chapter 01: ring reduce-scatter, ring all-gather, an all-reduce in O(log N)
rounds (recursive halving and doubling), and a prediction of an all-reduce's bytes and time,
measured.

The reader writes, with dist.send/recv (or isend/irecv) only:
    reduce_scatter(x) -> this rank's chunk of the sum (chunk r: the first numel % N chunks one
        element longer)
    all_gather(chunk, sizes) -> every rank's chunk concatenated in rank order
    halving_doubling_all_reduce(x) -> x, summed over ranks in place in O(log N) rounds, any N
        (its checker: labkit.check.ch01_halving)
    predict_all_reduce(algorithm, nbytes, n, alpha, bandwidth) -> {"bytes_sent", "seconds"}
The two ring functions run on real processes at 2 and 3 ranks and a hidden 4, with awkward sizes
(1 element, sizes that N does not divide, fewer elements than ranks) and one of 100,003 elements,
and are compared with torch.distributed's built-in on the same data. Watched from outside the
reader's code: the collectives called (a dispatch mode refuses any, labkit.check.guards; the
source is also read, so the hint comes before any launch), the bytes each rank sent (the kernel's
socket counters, labkit.netcount) against the ring's optimum plus a small slack, and the use of
labkit.collectives (the answer, already written). Each rank notes which call it is in
(labkit.launch.note), so a hang report names it beside the stack line each rank was stuck on.

1.4: the checker limits every rank's link to 100 MB/s each way (labkit.shaped), fits alpha and
the bandwidth to timed ring exchanges of four sizes, hands them to the reader's prediction, then
runs labkit's ring and parameter-server all-reduce: bytes by the kernel's counters (graded to
2%), time by the clock (graded against labkit.costs to 5%; the measured time is shown beside it
and only a prediction far from both fails).

Long because: the notebook imports one checker module per chapter; the two rings share their
rank job and byte bound, and 1.4's measurement fits alpha and beta in the same run.
"""
from __future__ import annotations

from labkit.check import Checker, fail, graded

EXERCISES = {
    "1.1": ("ring reduce-scatter", 3),
    "1.2": ("ring all-gather", 3),
    "1.3": ("all-reduce in O(log N) rounds: recursive halving, then doubling, any N", 6),
    "1.4": ("predict an all-reduce's bytes and time, then measure them", 3),
}

# (world size, element counts): one launch each; the 4-rank case is hidden
CASES = [(2, (8, 1, 100_003)), (3, (10, 37, 100_003)), (4, (1, 23, 65_537))]
SHOWN_WORLDS = (2, 3)
HANG_TIMEOUT = 20.0  # seconds; a correct ring finishes these cases in well under one
BYTES_SLACK = 0.05   # over the optimum: the few header bytes Gloo adds per message
HEADER_BYTES = 512   # per message, absolute (Gloo's header is under 200 bytes)
FORBIDDEN = ("labkit.collectives",)

COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
               "all_gather_into_tensor", "broadcast", "reduce", "gather", "scatter", "all_to_all",
               "all_to_all_single")


def collectives_called(fn) -> list:
    """Names of torch.distributed collectives `fn`'s own source calls (read, not run: nothing in
    torch is patched). Empty when the source cannot be read."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return []
    return sorted({node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
                   and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES})


def _job(kind, fn, numels):
    from labkit.launch import note

    out = []
    for i, numel in enumerate(numels):
        note(f"your {kind.replace('_', '-')} of {numel} elements (call {i + 1} of {len(numels)})")
        out.append(_one(kind, fn, numel))
    return out


def _one(kind, fn, numel):
    """Rank side: the reader's function and the built-in on the same integer-valued data, on this
    rank's device (drawn on the CPU, the same numbers anywhere); results come back on the CPU.
    The reader's call runs inside the kernel's byte counter and a dispatch mode that refuses
    collectives."""
    import torch
    import torch.distributed as dist

    from labkit import netcount
    from labkit.check.guards import CollectiveLog
    from labkit.launch import device

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(17 * numel + rank)
    x = torch.randint(-9, 10, (numel,), generator=g, device="cpu").float().to(device())
    total = x.clone()
    dist.all_reduce(total)
    bounds = chunk_bounds(numel, n)
    lo, hi = bounds[rank]
    mine = x.clone()
    args = (total[lo:hi].clone(), [b - a for a, b in bounds]) if kind == "all_gather" else (mine,)
    dist.barrier()
    with netcount.socket_bytes() as net, \
            CollectiveLog(refuse=True, why="build the ring from isend/irecv (or send/recv) only"):
        got = fn(*args)
    want = total if kind != "reduce_scatter" else total[lo:hi]
    return {"got": got.cpu() if isinstance(got, torch.Tensor) else got, "want": want.cpu(),
            "input": x.cpu(), "rank": rank, "sent": net.sent}


def chunk_bounds(numel: int, n: int) -> list:
    """[(start, end)] of n chunks covering numel elements; the first numel % n one longer."""
    base, extra = divmod(numel, n)
    starts = [r * base + min(r, extra) for r in range(n + 1)]
    return list(zip(starts[:-1], starts[1:]))


def optimal_sent(kind: str, numel: int, n: int, itemsize: int = 4) -> float:
    """The most bytes a rank of a ring sends: N-1 steps of at most one (largest) chunk each."""
    biggest = -(-numel // n) * itemsize
    return (n - 1) * biggest


def _compare(kind, results, n, numel):
    import torch

    for r in results:
        got, want = r["got"], r["want"]
        if not isinstance(got, torch.Tensor):
            fail(f"rank {r['rank']} returned {type(got).__name__}; return a tensor")
        if got.numel() != want.numel():
            hint = {"reduce_scatter": f"rank r returns only its chunk r; with {numel} elements "
                                      f"over {n} ranks the chunks have "
                                      f"{[b - a for a, b in chunk_bounds(numel, n)]} elements",
                    "all_gather": "the result holds every rank's chunk, concatenated in rank "
                                  "order"}[kind]
            fail(f"rank {r['rank']}: got {got.numel()} elements, expected {want.numel()}. {hint}")
        got = got.reshape(-1).to(want.dtype)
        if not torch.equal(got, want):
            if kind != "all_gather" and torch.equal(got, r["input"].reshape(-1)[:got.numel()]):
                fail(f"rank {r['rank']}: the result is still this rank's own input: add each "
                     f"received chunk into your copy")
            bad = (got != want).nonzero().reshape(-1)
            fail(f"rank {r['rank']} of {n}: {len(bad)} of {want.numel()} values wrong (first at "
                 f"index {bad[0].item()}: got {got[bad[0]].item():g}, expected "
                 f"{want[bad[0]].item():g}). At step s, which chunk does rank r send, and which "
                 f"does it receive: is the one it receives the one its left neighbour just "
                 f"sent? With {numel} elements over {n} ranks, are your chunks "
                 f"{[b - a for a, b in chunk_bounds(numel, n)]} elements long?")
    for r in results:
        if r["sent"] is None:
            continue                                   # NCCL: no TCP counter sees it
        steps = n - 1
        best = optimal_sent(kind, numel, n)
        allowed = best * (1 + BYTES_SLACK) + HEADER_BYTES * steps
        if r["sent"] > allowed:
            fail(f"rank {r['rank']} of {n} sent {r['sent']:,} bytes (the kernel's count) for "
                 f"{numel} elements; a ring sends at most {best:,.0f} (+{BYTES_SLACK:.0%} and "
                 f"{HEADER_BYTES} B per message allowed: {allowed:,.0f}). Does every step send "
                 f"ONE chunk, never the whole tensor?")


def _check(exercise, kind, fn, cases=CASES, helpers=()):
    from labkit.check.guards import forbidden_used

    title, points = EXERCISES[exercise]
    c = Checker(exercise, title, points)
    used = collectives_called(fn)
    bad = forbidden_used([fn, *helpers], FORBIDDEN)
    for n, numels in cases:
        shown = n in SHOWN_WORLDS
        with c.case(f"{n} ranks, tensors of {', '.join(map(str, numels))} elements" if shown
                    else "hidden case"):
            if used:
                fail(f"your function calls {', '.join('dist.' + u for u in used)}: build the "
                     f"ring from point-to-point messages only (isend/irecv or send/recv)")
            if bad:
                fail(f"your code uses {', '.join(bad)}: that ring is already written; write "
                     f"yours from isend/irecv (your own chunk_bounds included)")
            per_rank = c.launch(_job, n, args=(kind, fn, numels), timeout=HANG_TIMEOUT)
            for i, numel in enumerate(numels):
                _compare(kind, [r[i] for r in per_rank], n, numel)
    return c.finish()


@graded("1.1")
def ring_reduce_scatter(fn, cases=CASES):
    """Exercise 1.1: fn(x) -> this rank's chunk of the sum over ranks."""
    return _check("1.1", "reduce_scatter", fn, cases)


@graded("1.2")
def ring_all_gather(fn, cases=CASES):
    """Exercise 1.2: fn(chunk, sizes) -> every rank's chunk concatenated in rank order."""
    return _check("1.2", "all_gather", fn, cases)


@graded("1.3")
def halving_doubling_all_reduce(fn, **kwargs):
    """Exercise 1.3 (labkit.check.ch01_halving): fn(x) sums x over ranks in place in O(log N)
    rounds, for any N."""
    from labkit.check.ch01_halving import halving_doubling_all_reduce as check
    return check(fn, **kwargs)


# ----------------------------------------------------------------------------- 1.4
LINK_BANDWIDTH = 100e6                    # bytes/s each way per rank, emulated (labkit.shaped)
FIT_SIZES = (65_536, 262_144, 1_048_576, 4_194_304)  # bytes of the timed ring exchanges
# (world, [(algorithm, nbytes), ...]): one launch per world; the 4-rank case is hidden
PREDICT_CASES = [(3, [("ring", 2**20), ("parameter_server", 2**20)]),
                 (4, [("ring", 4_000_004), ("parameter_server", 2**20)])]
BYTES_TOLERANCE = 0.02
TIME_TOLERANCE = 0.05                     # against labkit.costs' alpha-beta formula
TIME_FACTOR = 3.0                         # a prediction this far from the measured time fails,
                                          # unless labkit.costs' own is too (a busy machine)


def _timed(fn, repeats: int) -> float:
    """The fastest of `repeats` runs: the one least disturbed by other programs (what the
    alpha-beta model describes), both for the fit and for the measurement."""
    import time

    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _predict_job(cases, bandwidth):
    """Rank side: fit alpha and bandwidth to ring exchanges through a limited link, then time
    and count labkit's all-reduces (time through the link, bytes by the kernel, unshaped)."""
    import torch
    import torch.distributed as dist

    from labkit import netcount
    from labkit.collectives import exchange, parameter_server_all_reduce, ring_all_reduce
    from labkit.launch import device
    from labkit.shaped import Shaper

    rank, n, dev = dist.get_rank(), dist.get_world_size(), device()
    # labkit.shaped paces Gloo's sends; NCCL's real links need no emulated limit
    shaped = "gloo" in str(dist.get_backend()).lower()
    link = (lambda: Shaper(bandwidth).exchange) if shaped else (lambda: None)
    right, left = (rank + 1) % n, (rank - 1) % n
    fit = []
    for m in FIT_SIZES:
        a, b = torch.ones(m // 4, device=dev), torch.empty(m // 4, device=dev)   # (m/4,) fp32

        def step():
            p2p = link() or exchange
            for w in p2p([(dist.isend, a, right, None), (dist.irecv, b, left, None)]):
                w.wait()
        fit.append((m, _timed(step, 4)))
    algorithms = {"ring": lambda x, p: ring_all_reduce(x, pieces=1, p2p=p),
                  "parameter_server": lambda x, p: parameter_server_all_reduce(x, p2p=p)}
    out = {"fit": fit, "runs": []}
    for algorithm, nbytes in cases:
        x = torch.ones(nbytes // 4, device=dev)                 # (D/4,) float32
        run = algorithms[algorithm]
        seconds = _timed(lambda: run(x, link()), 3)
        dist.barrier()
        with netcount.socket_bytes() as net:
            run(x, None)
        out["runs"].append({"seconds": seconds, "sent": net.sent})
    return out


def costs_prediction(algorithm, nbytes, n, alpha, bandwidth) -> dict:
    """labkit.costs' answer: the busiest rank's bytes sent, and the alpha-beta time."""
    from labkit.costs import comm

    busiest = (comm.ring_bytes_sent_per_rank("all_reduce", nbytes, n) if algorithm == "ring"
               else comm.parameter_server_bytes(nbytes, n)["root_sent"])
    return {"bytes_sent": busiest, "seconds": comm.time_of(algorithm, nbytes, n, alpha,
                                                           bandwidth)}


def _predict_hint(key, got, want, algorithm, n) -> str:
    ratio = got / want if want else float("inf")
    said = f"{key}: predicted {got:.4g}, expected {want:.4g} (ratio {ratio:.2f}). "
    if key == "bytes_sent":
        if algorithm == "ring":
            return said + ("How many steps does each phase of the ring take, how many phases "
                           "are there, and what fraction of the buffer moves per step?")
        return said + ("Which rank sends the most in a parameter server, and how many full "
                       "buffers does it send back?")
    return said + ("How many messages does the slowest rank wait for one after the other "
                   "(each costs alpha), and how many bytes cross its link (each costs "
                   "1/bandwidth)? Bytes, not elements; seconds, not milliseconds.")


@graded("1.4")
def predict_all_reduce(fn, cases=PREDICT_CASES):
    """Exercise 1.4: fn(algorithm, nbytes, n, alpha, bandwidth) -> {"bytes_sent", "seconds"}."""
    from labkit.costs.comm import fit_alpha_beta

    c = Checker("1.4", *EXERCISES["1.4"])
    for world, runs in cases:
        res, tried = None, False
        for i, (algorithm, nbytes) in enumerate(runs):
            hidden = world not in (3,)
            with c.case(f"hidden case {i + 1}" if hidden else
                        f"{algorithm}, {nbytes:,} bytes, {world} ranks"):
                if not tried:
                    tried = True
                    res = c.launch(_predict_job, world, args=(runs, LINK_BANDWIDTH), timeout=60)
                if res is None:
                    fail("did not run (see the first case of this world size)")
                try:
                    alpha, bandwidth = fit_alpha_beta(*zip(*[
                        (m, max(r["fit"][j][1] for r in res)) for j, m in enumerate(FIT_SIZES)]))
                except ValueError as err:
                    fail(f"the machine was too busy to fit alpha and bandwidth ({err}): run the "
                         f"cell again")
                measured = {"bytes_sent": max(r["runs"][i]["sent"] or 0 for r in res),
                            "seconds": max(r["runs"][i]["seconds"] for r in res)}
                got = fn(algorithm, nbytes, world, alpha, bandwidth)
                if not (isinstance(got, dict) and all(isinstance(got.get(k), (int, float))
                                                      for k in ("bytes_sent", "seconds"))):
                    fail('return {"bytes_sent": bytes, "seconds": seconds}, numbers')
                want = costs_prediction(algorithm, nbytes, world, alpha, bandwidth)
                if not hidden:
                    c.cases[-1]["name"] += (
                        f" (fitted alpha {alpha * 1e6:.0f} us, bandwidth {bandwidth / 1e6:.0f} MB/s)"
                        f"\n      bytes sent, busiest rank: predicted {got['bytes_sent']:,.0f}, "
                        f"measured {measured['bytes_sent']:,}"
                        f"\n      seconds: predicted {got['seconds'] * 1e3:.1f} ms, measured "
                        f"{measured['seconds'] * 1e3:.1f} ms")
                _assert_prediction(got, want, measured, algorithm, world)
    return c.finish()


def _assert_prediction(got, want, measured, algorithm, n) -> None:
    if measured["bytes_sent"] and abs(want["bytes_sent"] / measured["bytes_sent"] - 1) > \
            BYTES_TOLERANCE:
        fail(f"labkit.costs says {want['bytes_sent']:.0f} B, the kernel counted "
             f"{measured['bytes_sent']} B: the checker disagrees with itself (please report)")
    if measured["bytes_sent"] and abs(got["bytes_sent"] / measured["bytes_sent"] - 1) > \
            BYTES_TOLERANCE:
        fail(_predict_hint("bytes_sent", got["bytes_sent"], measured["bytes_sent"], algorithm, n))
    if not measured["bytes_sent"] and abs(got["bytes_sent"] / want["bytes_sent"] - 1) > \
            BYTES_TOLERANCE:                      # NCCL: no kernel count, labkit.costs decides
        fail(_predict_hint("bytes_sent", got["bytes_sent"], want["bytes_sent"], algorithm, n))
    if abs(got["seconds"] / want["seconds"] - 1) > TIME_TOLERANCE:
        fail(_predict_hint("seconds", got["seconds"], want["seconds"], algorithm, n))
    far = lambda t: not 1 / TIME_FACTOR <= t / measured["seconds"] <= TIME_FACTOR  # noqa: E731
    if far(got["seconds"]) and not far(want["seconds"]):
        fail(f"seconds: predicted {got['seconds']:.4g}, measured {measured['seconds']:.4g}")
