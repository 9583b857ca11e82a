"""The collective matmul (async TP): the all-gather before a column-parallel matmul, cut into
ring passes that each overlap a chunk of the matmul.

Wang et al., "Overlap Communication with Dependent Computation via Decomposition in Large Deep
Learning Models" (ASPLOS 2023): with sequence-parallel activations, rank r holds rows X_r of the
input and columns W_r of the weight, and needs all_gather(X) @ W_r. Plain: gather everything, then
multiply. Decomposed: in N steps, multiply the chunk in hand while the ring passes it on to the
next rank and receives the one after, so step j's transfer hides behind step j's matmul. PyTorch
ships the same idea as async TP (torch.distributed._symmetric_memory; "Introducing Async Tensor
Parallelism in PyTorch", PyTorch dev-discuss, 2024).

    from labkit.tp.collective_matmul import allgather_matmul, collective_matmul
    y = allgather_matmul(x_r, w_r, group)      # (N*m, n_r): gather, then one matmul
    y = collective_matmul(x_r, w_r, group)     # the same rows, the gather hidden step by step

Equal row chunks on every rank (what sequence parallelism gives a divisible sequence). Both
timed on real ranks: labkit.labs.tp.collective_matmul.time_job.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.collectives import exchange
from labkit.observe import commlog


def allgather_matmul(x: torch.Tensor, w: torch.Tensor, group=None) -> torch.Tensor:
    """all_gather(x) @ w, the plain way: x (m, k) this rank's rows, w (k, n_r) -> (N*m, n_r)."""
    full = x.new_empty(dist.get_world_size(group) * x.shape[0], x.shape[1])    # (N*m, k)
    commlog.all_gather_into(full.view(-1), x.contiguous().view(-1), group=group,
                            where="allgather_matmul")
    return full @ w                                              # (N*m, k) @ (k, n_r)


def collective_matmul(x: torch.Tensor, w: torch.Tensor, group=None) -> torch.Tensor:
    """all_gather(x) @ w in N steps: step j multiplies the rows of rank (r - j) mod N while the
    ring sends them to rank r + 1 and receives rank (r - j - 1)'s from rank r - 1."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    m = x.shape[0]
    out = x.new_empty(n * m, w.shape[1])                         # (N*m, n_r)
    held, incoming = x.contiguous().clone(), torch.empty_like(x)
    for step in range(n):
        owner = (rank - step) % n                                # whose rows `held` are
        works = [] if step == n - 1 else exchange(
            [(dist.isend, held, (rank + 1) % n, group),
             (dist.irecv, incoming, (rank - 1) % n, group)],
            where="collective_matmul")
        torch.mm(held, w, out=out[owner * m:(owner + 1) * m])    # (m, k) @ (k, n_r), overlapped
        for work in works:
            work.wait()
        held, incoming = incoming, held                          # the send finished: reuse it
    return out
