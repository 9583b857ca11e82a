"""Mixture of experts and expert parallelism, as arithmetic (pure math, no torch).

    from labkit.costs import moe
    moe.params(h=4096, n_layer=32, n_expert=8, ffn_mult=3.5)          # total vs active
    moe.alltoall_bytes_per_layer(tokens=4096, k=2, h=4096, ep=8, dtype_bytes=2)
    moe.dropped_fraction(n_expert=8, k=2, tokens=4096, factor=1.0)  # expected drops, random router
    moe.memory_per_gpu(...)                                          # bytes of weights+grads+Adam

Units: parameters are counts; bytes are bytes (GB = 1e9); FLOPs are multiply-adds x 2.

The facts (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021):
  each token visits k of E experts, so parameters grow with E and compute per token with k;
  an expert takes at most C = ceil(factor * tokens * k / E) assignments of its group;
  expert parallelism moves each rank's assignments to their experts' ranks and back with two
  all-to-alls forward (dispatch, combine) and two backward; with the ep ranks' experts equally
  likely, a rank sends (ep-1)/ep of its k * tokens rows of h elements in each of them.
"""
from __future__ import annotations

import math


def expert_params(h: int, ffn_mult: float, bias: bool = True) -> int:
    """One expert: an MLP h -> ffn_mult*h -> h (fc and proj), with biases if `bias`."""
    f = int(ffn_mult * h)
    return 2 * h * f + ((f + h) if bias else 0)


def params(h: int, n_layer: int, n_expert: int, k: int, ffn_mult: float, *, vocab: int = 0,
           positions: int = 0, shared_expert: bool = False, bias: bool = True) -> dict:
    """Parameters of a GPT whose every MLP is an MoE: {"total", "active", "experts",
    "non_expert"}. Attention is 4h^2 (+4h), layer norms 4h per block, the router h*E; "active" is
    what one token's forward touches: everything but the E - k experts it skips. Embeddings:
    vocab*h tokens (tied with the output layer) + positions*h learned positions."""
    e = expert_params(h, ffn_mult, bias)
    attn = 4 * h * h + (4 * h if bias else 0)
    per_layer_dense = attn + 4 * h + h * n_expert + (e if shared_expert else 0)
    non_expert = n_layer * per_layer_dense + (vocab + positions) * h + 2 * h
    experts = n_layer * n_expert * e
    return {"total": non_expert + experts, "active": non_expert + n_layer * k * e,
            "experts": experts, "non_expert": non_expert, "per_expert": e}


def flops_per_token(active_params: int) -> float:
    """Training FLOPs per token: 6 x the parameters the token touches (2 forward, 4 backward)."""
    return 6.0 * active_params


def capacity(tokens: int, k: int, n_expert: int, factor: float | None) -> int | None:
    """C = ceil(factor * tokens * k / E) assignments per expert per group; None: no limit."""
    if factor is None:
        return None
    return math.ceil(factor * tokens * k / n_expert)


def check(n_expert: int, k: int, ep: int = 1, factor: float | None = None) -> None:
    """Refuse what cannot run, saying what to change."""
    if n_expert < 1:
        raise ValueError(f"n_expert={n_expert}: a mixture needs at least one expert")
    if not 1 <= k <= n_expert:
        raise ValueError(f"top-k={k} must be between 1 and n_expert={n_expert}: a token cannot "
                         f"visit more experts than there are; lower k or add experts")
    if ep < 1 or n_expert % ep:
        raise ValueError(f"n_expert={n_expert} experts cannot be split evenly over ep={ep} ranks; "
                         f"use an ep that divides {n_expert}")
    if factor is not None and factor <= 0:
        raise ValueError(f"capacity factor {factor} would drop every token; use a factor > 0 "
                         f"(1.0-1.25 is usual) or None for no limit")


def dropped_fraction(n_expert: int, k: int, tokens: int, factor: float | None) -> float:
    """Expected share of the tokens*k assignments dropped by a router that has not learned
    anything yet (random logits). Top-k picks k *distinct* experts per token, so one expert's load
    is Binomial(tokens, k/E) (not Binomial(tokens*k, 1/E): same mean, larger variance, more drops),
    and it keeps min(load, C). Exact sum, no sampling: E * E[max(load - C, 0)] / (tokens * k)."""
    check(n_expert, k, 1, factor)
    cap = capacity(tokens, k, n_expert, factor)
    if cap is None or cap >= tokens:   # an expert gets each token at most once
        return 0.0
    p = k / n_expert
    if p >= 1.0:                       # k == E: every expert gets every token
        return max(tokens - cap, 0) / tokens
    # E[max(load - C, 0)] for load ~ Binomial(tokens, p), summed in log space for large counts
    over = 0.0
    for j in range(cap + 1, tokens + 1):
        logpmf = (math.lgamma(tokens + 1) - math.lgamma(j + 1) - math.lgamma(tokens - j + 1)
                  + j * math.log(p) + (tokens - j) * math.log1p(-p))
        over += (j - cap) * math.exp(logpmf)
    return n_expert * over / (tokens * k)


def alltoall_rows_per_rank(tokens: int, k: int, ep: int) -> float:
    """Rows one rank sends to other ranks in one all-to-all: (ep-1)/ep * k * tokens, its tokens'
    assignments whose experts live elsewhere (experts equally likely, nothing dropped)."""
    return (ep - 1) / ep * k * tokens


def alltoall_bytes_per_layer(tokens: int, k: int, h: int, ep: int, dtype_bytes: int = 2,
                             passes: str = "both") -> float:
    """Bytes one rank sends per MoE layer: 2 all-to-alls forward (dispatch, combine) and 2 in
    backward (their gradients), each (ep-1)/ep * k * tokens * h elements. `tokens` are this
    rank's tokens; passes: "forward", "backward" or "both"."""
    n = {"forward": 2, "backward": 2, "both": 4}[passes]
    return n * alltoall_rows_per_rank(tokens, k, ep) * h * dtype_bytes


def alltoall_seconds(nbytes: float, bandwidth: float, ep: int, latency: float = 0.0) -> float:
    """Time of the all-to-alls carrying `nbytes` sent per rank, at `bandwidth` bytes/s per rank
    (each rank's link in and out; alpha-beta with ep-1 messages each paying `latency`)."""
    return nbytes / bandwidth + (ep - 1) * latency


def memory_per_gpu(h: int, n_layer: int, n_expert: int, k: int, ffn_mult: float, ep: int,
                   dp: int | None = None, *, vocab: int = 0, shared_expert: bool = False,
                   bytes_per_param: int = 16, zero1: bool = False) -> dict:
    """Bytes of model state per GPU (mixed-precision Adam: 16 per parameter by default) with the
    experts sharded over ep (E/ep on each GPU) and the rest replicated; zero1 shards the 12 bytes
    of optimizer state of the non-expert parameters over dp (default dp = ep), and of the
    experts over dp/ep (the ranks holding the same experts)."""
    check(n_expert, k, ep)
    dp = dp or ep
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}: expert parallelism splits "
                         f"data-parallel ranks")
    p = params(h, n_layer, n_expert, k, ffn_mult, vocab=vocab, shared_expert=shared_expert)
    local_experts = p["experts"] / ep
    if zero1:
        opt = bytes_per_param - 4
        dense = p["non_expert"] * (4 + opt / dp)
        expert = local_experts * (4 + opt / (dp // ep))
    else:
        dense, expert = p["non_expert"] * bytes_per_param, local_experts * bytes_per_param
    return {"total": dense + expert, "non_expert": dense, "experts": expert,
            "params_on_gpu": p["non_expert"] + local_experts}


def calculator(h: int, n_layer: int, n_expert: int, k: int, ffn_mult: float, ep: int,
               tokens_per_gpu: int, factor: float | None, bandwidth: float, *,
               dtype_bytes: int = 2, vocab: int = 0) -> dict:
    """Everything the MoE calculator shows, in one dict (the widget and worked problems use it)."""
    check(n_expert, k, ep, factor)
    p = params(h, n_layer, n_expert, k, ffn_mult, vocab=vocab)
    mem = memory_per_gpu(h, n_layer, n_expert, k, ffn_mult, ep, vocab=vocab)
    a2a = n_layer * alltoall_bytes_per_layer(tokens_per_gpu, k, h, ep, dtype_bytes)
    return {"total_params": p["total"], "active_params": p["active"],
            "memory_bytes": mem["total"], "alltoall_bytes": a2a,
            "alltoall_s": alltoall_seconds(a2a, bandwidth, ep),
            "dropped": dropped_fraction(n_expert, k, tokens_per_gpu, factor),
            "capacity": capacity(tokens_per_gpu, k, n_expert, factor),
            "flops_per_token": flops_per_token(p["active"]),
            "dense_flops_per_token": flops_per_token(p["total"])}


# ---------------------------------------------------------------------- dispatch as it runs
def uniform_matrix(bytes_per_rank: float, ep: int) -> list:
    """The chapter's assumption as a traffic matrix: every rank sends bytes_per_rank, split
    evenly over its ep-1 peers (bytes[src][dst], 0 on the diagonal)."""
    share = bytes_per_rank / (ep - 1) if ep > 1 else 0.0
    return [[0.0 if s == d else share for d in range(ep)] for s in range(ep)]


def alltoall_seconds_skewed(matrix, latency: float, bandwidth: float) -> float:
    """An all-to-all's time when the traffic is not uniform: every rank pays ep-1 message
    latencies, and the rank that sends or receives the most bytes sets the finish (each rank's
    link carries its own bytes out and in at `bandwidth`). With uniform_matrix it is
    alltoall_seconds; under skewed routing the hottest experts' rank is the straggler."""
    ep = len(matrix)
    out = [sum(row) for row in matrix]
    into = [sum(matrix[s][d] for s in range(ep)) for d in range(ep)]
    return (ep - 1) * latency + max(max(out), max(into)) / bandwidth


def deepep_dispatch(tokens: int, k: int, h: int, nodes: int, gpus_per_node: int, *,
                    max_nodes: int | None = None, bytes_per_value: float = 1 + 4 / 128,
                    rdma_bw: float = 50e9, nvlink_bw: float = 160e9, sms: int = 24,
                    total_sms: int = 132) -> dict:
    """DeepEP's hierarchical dispatch (its normal kernels, github.com/deepseek-ai/DeepEP), per
    GPU and per MoE layer's dispatch, against a flat all-to-all over the network.

    A token's copy crosses the network once per destination *node* (forwarded from NVLink to
    RDMA), then fans out to the experts' GPUs over NVLink inside that node. With k experts drawn
    uniformly, a token reaches nodes·(1-(1-1/nodes)^k) nodes on average; DeepSeek-V3 limits it
    to max_nodes = 4 (node-limited routing, arXiv:2412.19437 §2.1.2), which caps the RDMA bytes.
    A flat all-to-all sends each of the k copies over the network when its expert is elsewhere.
    Defaults: FP8 dispatch (1 byte and a 4-byte scale per 128 values, §3.3), DeepEP's V1 test
    machine (H800: ~160 GB/s NVLink, a 400 Gb/s CX7 NIC, ~50 GB/s) and its 24 SMs of 132 set
    aside for communication (docs/legacy.md; V2's README: 4 to 6 SMs for a V3-like setting).
    Returns bytes and seconds of each path and the SM share lost to communication."""
    hit = nodes * (1 - (1 - 1 / nodes) ** k)              # distinct nodes per token (expected)
    if max_nodes is not None:
        hit = min(hit, max_nodes)
    remote = hit * (nodes - 1) / nodes                     # of them, not this GPU's node
    row = h * bytes_per_value
    rdma = tokens * remote * row
    nvlink = tokens * k * (gpus_per_node - 1) / gpus_per_node * row
    flat = tokens * k * (nodes - 1) / nodes * row          # every remote copy on the NIC
    return {"rdma_bytes": rdma, "nvlink_bytes": nvlink, "flat_rdma_bytes": flat,
            "seconds": max(rdma / rdma_bw, nvlink / nvlink_bw),   # the two links pipelined
            "flat_seconds": flat / rdma_bw, "dedup": flat / rdma if rdma else float("inf"),
            "sm_share": sms / total_sms}
