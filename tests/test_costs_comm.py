"""labkit.costs.comm against values computed by hand."""
import math

import pytest

from labkit.costs import comm


def test_ring_steps_and_bytes():
    assert comm.ring_steps("all_reduce", 4) == 6
    assert comm.ring_steps("reduce_scatter", 4) == 3
    assert comm.ring_steps("all_reduce", 1) == 0
    # 4 ranks, 1 GB: each rank sends 2*3/4 GB = 1.5 GB
    assert comm.ring_bytes_sent_per_rank("all_reduce", 1e9, 4) == pytest.approx(1.5e9)
    assert comm.ring_bytes_sent_per_rank("all_gather", 1e9, 4) == pytest.approx(0.75e9)


def test_bandwidth_term_does_not_grow_with_n_but_latency_does():
    d, a, bw = 1e9, 5e-6, 100e9
    t8, t64 = comm.ring_allreduce_time(d, 8, a, bw), comm.ring_allreduce_time(d, 64, a, bw)
    assert t8 == pytest.approx(14 * a + 2 * 7 / 8 * d / bw)
    assert t64 == pytest.approx(126 * a + 2 * 63 / 64 * d / bw)
    assert t64 / t8 < 1.2  # nearly flat: the bandwidth term is bounded by 2D/bw
    # latency-dominated small message: the ring grows ~linearly, the tree ~log
    small = 1e3
    tree = comm.tree_allreduce_time(small, 64, a, bw)
    assert comm.ring_allreduce_time(small, 64, a, bw) > 5 * tree
    assert tree == pytest.approx(12 * a + 2 * 63 / 64 * small / bw)
    # N = 6: halving and doubling over P = 4, plus the fold's two whole-vector hops
    assert comm.tree_allreduce_time(small, 6, a, bw) == pytest.approx(
        4 * a + 1.5 * small / bw + 2 * (a + small / bw))
    for n in range(2, 70):   # 2 ceil(log2 N) latency terms, whether or not N is a power of two
        assert comm.tree_allreduce_time(0.0, n, a, bw) == pytest.approx(
            2 * math.ceil(math.log2(n)) * a)


def test_parameter_server_grows_linearly():
    d, a, bw = 1e8, 0.0, 1e10
    assert comm.parameter_server_time(d, 2, a, bw) == pytest.approx(2 * d / bw)
    assert comm.parameter_server_time(d, 8, a, bw) == pytest.approx(14 * d / bw)
    assert comm.parameter_server_bytes(d, 8)["root_received"] == 7 * d


def test_busbw_factors_as_nccl_tests():
    assert comm.busbw_factor("all_reduce", 8) == pytest.approx(1.75)
    assert comm.busbw_factor("reduce_scatter", 8) == pytest.approx(0.875)
    assert comm.busbw_factor("all_gather", 4) == pytest.approx(0.75)
    assert comm.busbw_factor("broadcast", 4) == 1.0
    # 1 GB all-reduce on 8 ranks in 10 ms: algbw 100 GB/s, busbw 175 GB/s
    assert comm.busbw("all_reduce", 1e9, 8, 0.01) == pytest.approx(175e9)
    # the model's predicted busbw tends to the link bandwidth for large messages
    assert comm.predicted_busbw("all_reduce", 1e12, 8, 5e-6, 50e9) == pytest.approx(50e9, rel=1e-3)


def test_fit_alpha_beta_recovers_parameters():
    alpha, bw = 2e-5, 3e9
    xs = [1e3, 1e5, 1e6, 1e7]
    a, b = comm.fit_alpha_beta(xs, [alpha + x / bw for x in xs])
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)
    with pytest.raises(ValueError):
        comm.fit_alpha_beta([1, 1], [1, 2])


def test_bad_input():
    with pytest.raises(ValueError, match="unknown collective"):
        comm.ring_steps("alltoall", 4)
    with pytest.raises(ValueError, match="positive integer"):
        comm.ring_steps("all_reduce", 0)
    assert math.isclose(comm.LINKS["NVLink 4 (H100 SXM)"].beta, 1 / 450e9)
