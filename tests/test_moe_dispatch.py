"""MoE dispatch as it runs: the skewed all-to-all model and DeepEP's hierarchical dispatch
(labkit.costs.moe), the Zipf routing of `labkit run moe_dispatch`,  (The lab
itself runs in tests/test_documented_commands.py; its timings are never asserted.)"""
import pytest

from labkit.costs import moe
from labkit.labs.moe_dispatch import K, expert_probs, route_counts


def test_uniform_traffic_is_the_chapters_model_and_a_hot_receiver_sets_the_time():
    ep, per_rank, alpha, bw = 4, 3e6, 1e-4, 1e9
    uniform = moe.alltoall_seconds_skewed(moe.uniform_matrix(per_rank, ep), alpha, bw)
    assert uniform == pytest.approx(moe.alltoall_seconds(per_rank, bw, ep, alpha))
    hot = [[0, 1e6, 1e6, 1e6], [3e6, 0, 0, 0], [3e6, 0, 0, 0], [3e6, 0, 0, 0]]
    # every rank sends 3 MB, as in the uniform case, but rank 0 receives 9 MB
    assert moe.alltoall_seconds_skewed(hot, alpha, bw) == pytest.approx(3 * alpha + 9e6 / bw)
    transposed = [list(col) for col in zip(*hot)]        # a hot sender costs the same
    assert moe.alltoall_seconds_skewed(transposed, alpha, bw) == \
        pytest.approx(moe.alltoall_seconds_skewed(hot, alpha, bw))


def test_deepep_sends_a_token_once_per_node_and_node_limited_routing_caps_it():
    # DeepSeek-V3-like: top-8 of experts over 16 nodes of 8 GPUs, 4,096 tokens, h = 7,168
    free = moe.deepep_dispatch(4096, 8, 7168, 16, 8)
    limited = moe.deepep_dispatch(4096, 8, 7168, 16, 8, max_nodes=4)
    assert free["rdma_bytes"] < free["flat_rdma_bytes"]          # copies to one node go once
    assert limited["rdma_bytes"] <= 4 * 15 / 16 * 4096 * 7168 * (1 + 4 / 128) + 1
    assert limited["dedup"] >= 2                                  # 8 copies, at most 4 nodes
    assert limited["seconds"] <= limited["flat_seconds"] / 2 * (1 + 1e-12)
    assert limited["sm_share"] == pytest.approx(24 / 132)
    one_node = moe.deepep_dispatch(4096, 8, 7168, 1, 8)           # NVLink only
    assert one_node["rdma_bytes"] == 0 and one_node["nvlink_bytes"] > 0


def test_zipf_routing_sends_k_distinct_experts_per_token_and_skews_the_load():
    assert expert_probs(4, 0.0) == pytest.approx([0.25] * 4)
    flat, skewed = route_counts(4000, 8, 0.0, seed=1), route_counts(4000, 8, 2.0, seed=1)
    assert sum(flat) == sum(skewed) == 4000 * K
    assert max(flat) / (sum(flat) / 8) < 1.1
    assert skewed[0] == max(skewed) and skewed[0] / (sum(skewed) / 8) > 2.5
    assert max(skewed) <= 4000                                  # distinct: once per token
