"""labkit.collectives against torch.distributed's built-ins, world sizes 1 to 5, uneven sizes."""
import pytest

from labkit.collectives import (
    Traffic,
    chunk_bounds,
    parameter_server_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    ring_schedule,
)
from labkit.costs import comm
from labkit.launch import run

SIZES = (1, 7, 64, 1001)  # 1 and 7 are smaller than / not a multiple of most world sizes


def _compare_all(sizes, dtype_name, op):
    """On every rank: each labkit collective vs the built-in on the same integer-valued data."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    report = []
    for numel in sizes:
        g = torch.Generator().manual_seed(1000 * numel + rank)
        x = torch.randint(-8, 9, (numel,), generator=g).to(dtype)  # exact in bf16 and fp32
        ref = x.clone()
        dist.all_reduce(ref)
        if op == "avg":
            ref = ref / n
        lo, hi = chunk_bounds(numel, n)[rank]
        t = Traffic()
        ring = ring_all_reduce(x.clone(), op=op, traffic=t)
        ps = parameter_server_all_reduce(x.clone(), op=op)
        rs = ring_reduce_scatter(x.clone(), op=op)
        sizes_ = [b - a for a, b in chunk_bounds(numel, n)]
        ag = ring_all_gather(ref[lo:hi].clone(), sizes=sizes_)
        # the built-in all-gather on equal chunks, as a cross-check of the gather itself
        chunk = x[: max(numel // n, 1)].clone()
        outs = [torch.empty_like(chunk) for _ in range(n)]
        dist.all_gather(outs, chunk)
        ag_equal = ring_all_gather(chunk)
        close = (lambda a, b: torch.allclose(a.double(), b.double(), rtol=1e-2, atol=1e-2)) \
            if op == "avg" else torch.equal
        report.append({"numel": numel, "ring": close(ring, ref), "ps": close(ps, ref),
                       "rs": close(rs, ref[lo:hi]), "ag": torch.equal(ag, ref),
                       "ag_builtin": torch.equal(ag_equal, torch.cat(outs)),
                       "dtype_kept": ring.dtype == dtype and rs.dtype == dtype,
                       "sent": t.sent, "received": t.received,
                       "elt": x.element_size()})
    return report


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_ring_and_parameter_server_match_builtins_float32(n):
    for rank_report in run(_compare_all, n, args=(SIZES, "float32", "sum")):
        for row in rank_report:
            assert row["ring"] and row["ps"] and row["rs"] and row["ag"] and row["ag_builtin"], row
            assert row["dtype_kept"]


def test_pipelined_pieces_on_large_uneven_tensors():
    """Chunks large enough to travel as several pieces, with sizes N does not divide."""
    for rank_report in run(_compare_all, 3, args=((6_000_001,), "float32", "sum")):
        for row in rank_report:
            assert row["ring"] and row["rs"] and row["ag"], row
    for rank_report in run(_compare_all, 4, args=((9_000_003,), "float32", "avg")):
        for row in rank_report:
            assert row["ring"] and row["rs"], row


@pytest.mark.parametrize("n,dtype,op", [(3, "bfloat16", "sum"), (4, "float32", "avg"),
                                        (3, "bfloat16", "avg")])
def test_dtypes_and_average(n, dtype, op):
    for rank_report in run(_compare_all, n, args=((7, 64), dtype, op)):
        for row in rank_report:
            assert row["ring"] and row["ps"] and row["rs"] and row["ag"] and row["dtype_kept"], row


def test_ring_traffic_matches_the_formula():
    """Each ring rank sends exactly its 2(N-1) chunk transfers: 2(N-1)/N * D when N divides D."""
    n, numel = 4, 1000
    for rank_report in run(_compare_all, n, args=((numel,), "float32", "sum")):
        row = rank_report[0]
        d = numel * row["elt"]
        assert row["sent"] == comm.ring_bytes_sent_per_rank("all_reduce", d, n) == 1500 * 4
        assert row["received"] == row["sent"]


def _ps_traffic():
    import torch
    import torch.distributed as dist

    t = Traffic()
    parameter_server_all_reduce(torch.ones(100), traffic=t)
    return dist.get_rank(), t.sent, t.received


def test_parameter_server_root_receives_n_minus_one_buffers():
    n, d = 4, 400
    for rank, sent, received in run(_ps_traffic, n):
        expect = comm.parameter_server_bytes(d, n)
        if rank == 0:
            assert received == expect["root_received"] == 3 * d and sent == expect["root_sent"]
        else:
            assert sent == expect["other_sent"] == d and received == d


def test_ring_schedule_ends_with_rank_owning_its_chunk():
    for n in range(2, 7):
        owned = {r: {r} for r in range(n)}  # which ranks' contributions chunk c holds, per rank
        holds = [[{r} for _ in range(n)] for r in range(n)]  # holds[rank][chunk]
        for plan in ring_schedule(n, "reduce_scatter"):
            sent = [holds[r][plan[r][0]] for r in range(n)]
            for r in range(n):
                left = (r - 1) % n
                assert plan[left][0] == plan[r][1]  # I receive the chunk my left neighbour sends
                holds[r][plan[r][1]] = holds[r][plan[r][1]] | sent[left]
        for r in range(n):
            assert holds[r][r] == set(range(n))
        del owned


def test_chunk_bounds_cover_uneven_sizes():
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_bad_input():
    import torch

    with pytest.raises(ValueError, match="op must be"):
        ring_all_reduce(torch.ones(4), op="max")
    with pytest.raises(ValueError, match="contiguous"):
        ring_all_reduce(torch.ones(4, 4).t(), op="sum")


# ----------------------------------------------------------------------------- GPU-readiness
def _on_the_input_device(sizes, dtype_name):
    """Every collective with torch's default device set to "meta" (tests/devicecheck.py): a
    buffer made without device= would be a meta tensor and break the result."""
    import torch
    import torch.distributed as dist
    from devicecheck import default_device

    rank, n = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    rows = []
    with default_device("meta"):
        for numel in sizes:
            x = (torch.arange(numel, device="cpu") % 7 + rank).to(dtype)       # exact in bf16
            ref = x.clone()
            dist.all_reduce(ref)
            lo, hi = chunk_bounds(numel, n)[rank]
            sizes_ = [b - a for a, b in chunk_bounds(numel, n)]
            outs = {"ring": (ring_all_reduce(x.clone()), ref),
                    "ps": (parameter_server_all_reduce(x.clone()), ref),
                    "rs": (ring_reduce_scatter(x.clone()), ref[lo:hi]),
                    "ag uneven": (ring_all_gather(ref[lo:hi].clone(), sizes=sizes_), ref)}
            for name, (got, want) in outs.items():
                rows.append((numel, name, str(got.device), got.dtype == dtype,
                             torch.equal(got, want)))
    return rows


@pytest.mark.parametrize("n,dtype", [(2, "float32"), (3, "bfloat16")])
def test_collectives_make_every_buffer_on_the_input_device(n, dtype):
    # 2_100_001 floats on 2 ranks: chunks of 4 MiB, sent as several pipelined pieces
    sizes = (1, 7, 1001) + ((2_100_001,) if dtype == "float32" else ())
    for rows in run(_on_the_input_device, n, args=(sizes, dtype), echo=False):
        for numel, name, device, dtype_kept, equal in rows:
            assert device == "cpu" and dtype_kept and equal, (numel, name, device, dtype_kept)


def test_ring_and_pipeline_messages_go_through_exchange():
    """NCCL-safety, checked in the source: the ring and the pipeline executor post their
    point-to-point messages as batches (labkit.collectives.exchange), never a bare
    isend/irecv/send/recv (under NCCL a receive posted before the matching send deadlocks a
    ring of 2). The parameter server posts through exchange too."""
    import ast
    import inspect
    import textwrap

    import labkit.collectives as C
    import labkit.pipeline.executor as E

    def bare_p2p(fn):
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("send", "recv", "isend", "irecv")]

    for fn in (C._ring_steps, C._ring_gather_layout, C.ring_all_reduce, C.ring_all_gather,
               C.ring_reduce_scatter, C.parameter_server_all_reduce, E.run_schedule,
               E._sum_tied_embedding):
        assert bare_p2p(fn) == [], f"{fn.__name__} calls send/recv directly"

    def direct(dist, x):
        dist.send(x, 1)

    assert bare_p2p(direct), "the detector finds direct calls"


def _bench_rank_side():
    from devicecheck import RANK_SIDE, ImplicitDevice

    from labkit.bench.collectives import _time_on_ranks

    with ImplicitDevice(RANK_SIDE) as mode:
        rows = _time_on_ranks([4096], ("builtin", "ring", "parameter_server"), 1)
    return mode.calls, rows


def test_benchmark_names_its_device_and_backend():
    for calls, rows in run(_bench_rank_side, 2, echo=False):
        assert calls == [], f"tensors made without device=: {calls}"
        assert {(r["backend"], r["device"]) for r in rows} == {("gloo", "cpu")}


# ----------------------------------------------------------------------------- shaped links
def _shaped(sizes, bandwidth):
    """On every rank: the ring and the parameter server over labkit.shaped links vs the built-in,
    and how far each direction of this rank's link was kept busy."""
    import time

    import torch
    import torch.distributed as dist

    from labkit.launch import device
    from labkit.shaped import Shaper

    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for numel in sizes:
        g = torch.Generator().manual_seed(7 * numel + rank)
        x = torch.randint(-8, 9, (numel,), generator=g, device="cpu").float().to(device())
        ref = x.clone()
        dist.all_reduce(ref)
        lo, hi = chunk_bounds(numel, n)[rank]
        links = {k: Shaper(bandwidth) for k in ("ring", "ps")}
        t0 = time.perf_counter()
        ring = ring_all_reduce(x.clone(), p2p=links["ring"].exchange)
        rs = ring_reduce_scatter(x.clone(), p2p=Shaper(bandwidth).exchange)
        ag = ring_all_gather(ref[lo:hi].clone(), sizes=[b - a for a, b in chunk_bounds(numel, n)],
                             p2p=Shaper(bandwidth).exchange)
        t1 = time.perf_counter()
        ps = parameter_server_all_reduce(x.clone(), p2p=links["ps"].exchange)
        out.append({"ok": torch.equal(ring, ref) and torch.equal(ps, ref)
                    and torch.equal(rs, ref[lo:hi]) and torch.equal(ag, ref),
                    "ring_out": links["ring"].out_free - t0, "ps_out": links["ps"].out_free - t1,
                    "ps_in": links["ps"].in_free - t1, "nbytes": 4 * numel})
    return out


@pytest.mark.parametrize("n", [2, 3, 5])
def test_shaped_links_keep_results_exact(n):
    for rank_report in run(_shaped, n, args=((1, 7, 1001), 1e9)):
        for row in rank_report:
            assert row["ok"], row


def test_shaped_links_pace_the_parameter_server_root():
    """The emulated links' own accounting: the root's outgoing link is busy (N-1)·D/B after it
    starts the broadcast, its incoming one (N-1)·D/B; a ring rank's only 2(N-1)/N·D/B."""
    n, numel, bw = 4, 25_000, 50e6                        # D = 100 kB: 2 ms per buffer
    for rank, rows in enumerate(run(_shaped, n, args=((numel,), bw))):
        row = rows[0]
        d = row["nbytes"] / bw
        if rank == 0:
            assert row["ps_in"] >= (n - 1) * d and row["ps_out"] >= 2 * (n - 1) * d
        else:
            assert row["ps_out"] >= d
        assert row["ring_out"] >= comm.ring_bytes_sent_per_rank("all_reduce", row["nbytes"], n) / bw


def _counted(numel):
    """Kernel-counted bytes (observe.netcount) of one ring and one parameter-server all-reduce."""
    import torch
    import torch.distributed as dist

    from labkit.launch import device
    from labkit.observe import netcount

    x = torch.ones(numel, device=device())  # (numel,)
    ring_all_reduce(x)
    parameter_server_all_reduce(x)                        # warm-up: connections
    out = {}
    for name, fn in (("ring", ring_all_reduce), ("ps", parameter_server_all_reduce)):
        dist.barrier()
        with netcount.socket_bytes() as c:
            fn(x)
        out[name] = (c.sent, c.received)
    return dist.get_rank(), out


@pytest.mark.parametrize("n", [3, 4])
def test_kernel_counted_bytes_match_the_formulas(n):
    """Counted by the kernel, not by labkit: within 1% (Gloo adds small per-message headers)."""
    numel = 300_000 + 1                                   # N does not divide it
    d = 4 * numel
    for rank, got in run(_counted, n, args=(numel,)):
        ring = comm.ring_bytes_sent_per_rank("all_reduce", d, n)
        ps = comm.parameter_server_bytes(d, n)
        want_ps = ps["root_sent"] if rank == 0 else ps["other_sent"]
        for (sent, received), want in ((got["ring"], ring), (got["ps"], want_ps)):
            assert sent is not None, "netcount cannot count here"
            assert abs(sent / want - 1) < 0.01 and abs(received / want - 1) < 0.01, (rank, got)


def test_ch01_checker_refuses_a_collective_without_patching_torch():
    """The exercise checker reads the reader's source for collectives; torch stays untouched."""
    import torch.distributed as dist

    from labkit.check import ch01

    def cheat(x):
        dist.all_reduce(x)
        return x

    before = {name: getattr(dist, name) for name in ("send", "recv", "isend", "irecv")}
    assert ch01.collectives_called(cheat) == ["all_reduce"]
    result = ch01.halving_doubling_all_reduce(cheat)
    assert result.score == 0 and "point-to-point messages only" in result.cases[0]["message"]
    assert {name: getattr(dist, name) for name in before} == before


def test_alpha_beta_fit_recovers_a_known_model_and_refuses_a_negative_alpha():
    """labkit.labs.intro.fit_ring: relative least squares; exact data give back alpha and B."""
    from labkit.labs.intro import fit_ring

    sizes = [4096 * 4 ** k for k in range(7)]
    times = [comm.ring_allreduce_time(d, 4, 50e-6, 2e9) for d in sizes]
    fit = fit_ring(sizes, times, 4)
    assert abs(fit["alpha"] / 50e-6 - 1) < 1e-9 and abs(fit["bandwidth"] / 2e9 - 1) < 1e-9
    assert fit["max_residual"] < 1e-9 and abs(fit["r2_log"] - 1) < 1e-9
    # noisy data: the largest residual is what the data say, not hidden
    noisy = [t * (1.2 if i == 3 else 1.0) for i, t in enumerate(times)]
    assert fit_ring(sizes, noisy, 4)["max_residual"] > 0.05
    with pytest.raises(ValueError, match="too noisy"):
        fit_ring([1e3, 1e6, 1e7], [1e-3, 1e-3 + 1e-6, 1e-3 + 1e-5 - 2e-3], 4)


def _labs_rank_side():
    from devicecheck import ImplicitDevice

    from labkit.labs import intro, ring

    files = ("labkit/labs/ring.py", "labkit/labs/intro.py", "labkit/shaped.py",
             "labkit/collectives.py")
    with ImplicitDevice(files) as mode:
        ring.time_and_count(1001, repeats=1, bandwidth=1e9)
        ring.time_and_count(1001, ("builtin", "ring", "parameter_server"), repeats=1)
        intro.all_reduce_times([7, 1024], repeats=2)
        intro.model_state_bytes()
    return mode.calls


def test_chapter_00_and_01_labs_make_tensors_on_the_rank_device():
    """What the ring and intro labs run on a rank (shaped links included) names its device."""
    for calls in run(_labs_rank_side, 2, echo=False):
        assert calls == [], f"tensors made without device=: {calls}"
