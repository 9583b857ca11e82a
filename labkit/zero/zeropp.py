"""ZeRO++ (Wang et al. 2023, arXiv:2306.10209): ZeRO-3 with three cuts to its communication, each
a flag of labkit's ZeRO3 subclass.

    zpp = ZeROpp(model, torch.optim.AdamW, qwz=True, hpz=2, qgz=True, lr=1e-3)  # in a rank

- qwZ, quantized weight communication: each rank quantizes its shard (symmetric int8 in blocks
  of `block` values, one fp32 scale per block) before the forward all-gather, and the gathered
  int8 values are dequantized into the unit's parameters: (1 + 4/block) bytes a value on the
  wire instead of 4 (fp32) or 2 (bf16).
- hpZ, hierarchical partitioning: after the forward gather every rank keeps a *secondary* shard
  of the unit's gathered values, 1/G of them, split over the G ranks of its node (`hpz=G`);
  backward gathers from those G neighbours only, so its all-gather never crosses nodes. The
  price: Ψ/G more values held per rank between forward and backward (in the compute dtype).
- qgZ, quantized gradient communication: the reduce-scatter becomes an all-to-all of int8
  blocks (each rank quantizes the chunk of its gradient bound for each peer, sends it, and sums
  the dequantized chunks it receives, in fp32): (1 + 4/block) bytes a value. The paper's qgZ uses
  int4 and two hops (all-to-all inside the node, then across nodes) so that quantization errors
  do not compound over a ring; this is the one-hop int8 version, which already never re-quantizes
  a partial sum.

What is exact and what is not: hpZ moves the same values (no error). qwZ and qgZ round each
value to the nearest of 255 levels of its block's largest magnitude: an error of at most
absmax/254 per value (labkit.zero.zeropp.quantize), which the lab measures as drift against
ZeRO-3. Not modelled: the paper's fused CUDA kernels and its int4 packing; prefetch (off).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.flat import all_gather_flat, padded_flat
from labkit.observe import commlog
from labkit.zero.zero3 import ZeRO3

BLOCK = 256   # values per quantization block (one fp32 scale each)


def quantize(x: torch.Tensor, block: int = BLOCK) -> tuple:
    """Symmetric int8 in blocks: (q (nb*block,) int8, scales (nb,) fp32); x flat, any length."""
    n = x.numel()
    nb = -(-n // block)
    xb = torch.nn.functional.pad(x.detach().float().reshape(-1), (0, nb * block - n))
    xb = xb.view(nb, block)                                               # (nb, block)
    scale = xb.abs().amax(dim=1).clamp_min(1e-30) / 127                   # (nb,)
    q = torch.round(xb / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # (nb, block)
    return q.reshape(-1), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, n: int, dtype=torch.float32) -> torch.Tensor:
    """The first n values of quantize's blocks, back in `dtype`.                     # (n,)"""
    block = q.numel() // scale.numel()
    return (q.view(-1, block).float() * scale[:, None]).reshape(-1)[:n].to(dtype)


class ZeROpp(ZeRO3):
    """ZeRO-3 with ZeRO++'s qwZ (quantized weight gathers), hpZ (secondary shards inside groups
    of `hpz` ranks) and qgZ (quantized gradient all-to-all). Every other ZeRO3 option works but
    prefetch and find_unused_parameters (refused: the gathers here are synchronous, and the
    has-grad flags would be quantized)."""

    def __init__(self, model, optimizer_class, group=None, *, qwz: bool = False,
                 hpz: int | None = None, qgz: bool = False, block: int = BLOCK,
                 **zero3_kw):
        if zero3_kw.get("prefetch") or zero3_kw.get("find_unused_parameters"):
            raise ValueError("ZeROpp supports neither prefetch nor find_unused_parameters")
        world = dist.get_world_size(group)
        if hpz is not None and (hpz < 1 or world % hpz):
            raise ValueError(f"hpz={hpz} must divide the {world} ranks into equal groups")
        super().__init__(model, optimizer_class, group, **zero3_kw)
        self.qwz, self.qgz, self.block = bool(qwz), bool(qgz), int(block)
        self.hpz = hpz if hpz and hpz < world else None
        self.node_group, self._secondary = None, {}
        if self.hpz:
            self.node_group = _node_group(group, self.hpz)
        self.secondary_peak = 0          # values held in secondary shards, most at once

    # ---- weights: forward from every rank (qwZ: int8), backward from the node (hpZ) ---------
    def gather(self, unit, phase: str, mine: torch.Tensor) -> torch.Tensor:
        secondary = self._secondary.pop(id(unit), None) if phase == "backward" else None
        if secondary is not None:                          # hpZ: only the node's G ranks
            part, n = secondary
            flat = all_gather_flat(part, self.node_group, where="ZeRO++ hpZ gather")
            return flat[:n]                                                 # (N * sum c_i,)
        if self.qwz:
            flat = self._quantized_gather(mine)
        else:
            flat = all_gather_flat(mine, self.group, where="ZeRO-3 gather")
        if self.hpz and phase == "forward":
            g = dist.get_world_size(self.node_group)
            r = dist.get_rank(self.node_group)
            c = -(-flat.numel() // g)
            self._secondary[id(unit)] = (padded_flat(flat, g)[r * c:(r + 1) * c].clone(),
                                         flat.numel())
            self.secondary_peak = max(self.secondary_peak, self.secondary_values())
        return flat

    def secondary_values(self) -> int:
        return sum(part.numel() for part, _ in self._secondary.values())

    def _quantized_gather(self, mine: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size(self.group)
        q, scale = quantize(mine, self.block)
        qs = all_gather_flat(q, self.group, where="ZeRO++ qwZ gather (int8)")      # (N*nb*B,)
        ss = all_gather_flat(scale, self.group, where="ZeRO++ qwZ scales")         # (N*nb,)
        rows = [dequantize(qr, sr, mine.numel(), mine.dtype)
                for qr, sr in zip(qs.view(world, -1), ss.view(world, -1))]
        return torch.cat(rows)                                                # (N * sum c_i,)

    # ---- gradients: qgZ's quantized all-to-all ---------------------------------------------
    def reduce_scatter(self, fulls: list) -> list:
        if not self.qgz:
            return super().reduce_scatter(fulls)
        world = dist.get_world_size(self.group)
        cols = [padded_flat(t, world).view(world, -1) for t in fulls]        # (N, c_i) each
        sizes = [c.shape[1] for c in cols]
        rows = torch.cat(cols, dim=1)                        # (N, C): row j is rank j's chunk
        pieces = [quantize(row, self.block) for row in rows]
        q = torch.cat([p[0] for p in pieces])                                # (N * nb*B,) int8
        s = torch.cat([p[1] for p in pieces])                                # (N * nb,)
        q_in, s_in = torch.empty_like(q), torch.empty_like(s)
        commlog.all_to_all_single(q_in, q, group=self.group, where="ZeRO++ qgZ (int8)")
        commlog.all_to_all_single(s_in, s, group=self.group, where="ZeRO++ qgZ scales")
        mean = sum(dequantize(qr, sr, rows.shape[1])                        # (C,) fp32
                   for qr, sr in zip(q_in.view(world, -1), s_in.view(world, -1))) / world
        return [m.to(f.dtype) for m, f in zip(mean.split(sizes), fulls)]

    def _settle(self) -> None:
        self._secondary = {}             # a unit whose backward never ran: drop its secondary
        super()._settle()


def _node_group(group, size: int):
    """This rank's group of `size` consecutive ranks (a node); every rank creates every group,
    in the same order, as torch.distributed.new_group requires."""
    ranks = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    mine = None
    for start in range(0, len(ranks), size):
        g = dist.new_group(ranks[start:start + size])
        if dist.get_rank() in ranks[start:start + size]:
            mine = g
    commlog.name_group(mine, "node")
    return mine
