"""The measured pieces of the TP and CP crossover labs (labkit.labs.tp.crossover,
labkit.labs.context.crossover, labs overlap_tp and overlap_cp) count what they claim: FLOPs against
torch's FlopCounterMode, bytes against commlog, and the labs' tables against their own inputs
and costs.hiding. No timing is asserted. Three 2-rank launches at tiny sizes: about 15 s once
the launcher is warm, 40 s cold on a loaded 2-core machine."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit import roofline
from labkit.context.tiled import attend
from labkit.costs import comm, hiding
from labkit.labs.context import crossover as cpx
from labkit.labs.tp import crossover as tpx


@pytest.mark.parametrize("h,tp", [(64, 2), (96, 4)])
def test_tp_layer_flops_are_what_the_matmuls_do(h, tp):
    xs, ws, flops = roofline.matmul_operands(tpx.layer_shapes(h, tp), 8)
    with FlopCounterMode(display=False) as counter:
        times = roofline.time_matmuls(xs, ws, repeats=1, warmup=0)
    assert len(times) == 1 and times[0] > 0
    assert counter.get_total_flops() == flops == tpx.matmul_flops(h, tp, 8)
    assert flops == 2 * 12 * h * h * 8 // tp                # costs.hiding.tp's 2 * 12 h^2 t / tp
    with pytest.raises(ValueError, match="multiple of 4"):
        tpx.layer_shapes(66, 4)


def test_cp_block_is_unmasked_and_its_flops_are_counted():
    q, k, v = cpx._qkv(40, 2, 8, 1, seed=0)                # grouped-query: 1 K/V head for 2
    c = q.shape[2]
    with FlopCounterMode(display=False) as counter:
        out, _ = attend(q, k, v, torch.arange(c, 2 * c), torch.arange(c))
    assert counter.get_total_flops() == cpx.block_flops(c, 2, 8)
    torch.testing.assert_close(out, attend(q, k, v)[0])  # every key visible: no mask at all
    assert cpx.block_seconds(q, k, v) > 0
    assert cpx.hop_bytes(c, 1, 8) == k.nbytes + v.nbytes


def _cp_job(c):
    import torch.distributed as dist

    from labkit.observe import commlog

    q, k, v = cpx._qkv(c, 2, 8, 2, seed=dist.get_rank())
    with commlog.record() as log:
        cpx._hop(k, v, None, calls=3)
    _, wait = cpx._ring_wait(q, k, v, None)
    return {"sent": log.bytes(op="send") / 3, "sends": log.count(op="send"), "wait": wait}


def test_cp_hop_moves_the_kv_chunk_and_the_ring_wait_is_read():
    rows = _run2(_cp_job, 8)
    for r in rows:
        assert r["sent"] == cpx.hop_bytes(8, 2, 8) and r["sends"] == 2 * 3   # K and V, 3 hops
        assert r["wait"] >= 0


def _run2(fn, *args):
    from labkit.launch import run

    return run(fn, 2, args=args, echo=False, timeout=120)


def test_overlap_tp_lab_table_follows_its_measurements():
    from labkit.labs import overlap_tp

    res = overlap_tp.measure(2, widths=(16, 32), tokens=16, rounds=1, sizes_kib=(4096,))
    ar = {r["bytes"]: r["median"] for r in res["all_reduce"]}
    assert sorted(ar) == [16 * 16 * 4, 16 * 32 * 4, 2**22]
    for r in res["rows"]:
        assert r["comm"] == 2 * ar[4 * 16 * r["width"]]   # two g all-reduces of (tokens, h)
        assert r["ratio"] == pytest.approx(r["comm"] / r["compute"])
        model = 2 * comm.ring_allreduce_time(4 * 16 * r["width"], 2, res["alpha"],
                                             res["bandwidth"])
        assert r["comm_model"] == pytest.approx(model)
    want = hiding.tp(2, res["flops_per_s"], res["bandwidth"], res["alpha"], tokens=16,
                     act_bytes=4)
    assert res["predicted_width"] == pytest.approx(want.value)
    assert "TP group" in overlap_tp.report(res)


def test_overlap_cp_lab_table_follows_its_measurements():
    from labkit.labs import overlap_cp

    res = overlap_cp.measure(2, chunks=(8, 16), heads=2, head_dim=8, kv_heads=1, rounds=1,
                             sizes_kib=(4096,))
    assert [h["bytes"] for h in res["hops"]] == [8 * 8 * 4 * 2, 16 * 8 * 4 * 2, 2**22]
    for r in res["rows"]:
        assert r["hop_bytes"] == 2 * r["chunk"] * 8 * 4
        assert r["ratio"] == pytest.approx(r["hop"] / r["block"])
        assert r["flops_per_s"] == pytest.approx(4 * r["chunk"] ** 2 * 16 / r["block"])
    want = hiding.cp(2, 16, 8, res["flops_per_s"], res["bandwidth"], res["alpha"], act_bytes=4)
    assert res["predicted_chunk"] == pytest.approx(want.value)
    assert "CP ring" in overlap_cp.report(res)


def test_first_crossing_interpolates_around_the_crossing():
    from labkit.labs._crossover import first_crossing, measured_crossover

    xs, compute = [1, 2, 4, 8], [1.0, 1.0, 1.0, 1.0]
    # ratio 4, 2, 0.5, 0.25: falls through 1 between 2 and 4 as x^-2 there -> 2 * sqrt(2)
    assert first_crossing(xs, [4.0, 2.0, 0.5, 0.25], compute) == pytest.approx(2 * 2 ** 0.5)
    # never below 1: the power law through every point, extrapolated
    never = [8.0, 6.0, 4.0, 2.0]
    assert first_crossing(xs, never, compute) == measured_crossover(xs, never, compute) > 8
