"""Collectives built only from point-to-point send/recv: the naive one and the ring.

    from labkit.collectives import ring_all_reduce, Traffic
    t = Traffic()
    ring_all_reduce(x, op="sum", traffic=t)   # in place, like dist.all_reduce(x)
    t.sent, t.received                         # bytes this rank moved

- `parameter_server_all_reduce`: every rank sends its whole tensor to a root, the root adds
  them and sends the sum back (reduce-to-root + broadcast; the "master GPU" pattern). The root
  receives (N-1)*D bytes, so it is the bottleneck as N grows.
- `ring_reduce_scatter`, `ring_all_gather`, `ring_all_reduce`: the ring (Patarasuk & Yuan,
  "Bandwidth optimal all-reduce algorithms for clusters of workstations", 2009). The tensor is cut
  into N chunks (any size: the first numel % N chunks are one element longer); in N-1 steps each
  rank sends one chunk right and receives one from the left. All-reduce = reduce-scatter then
  all-gather: 2(N-1) steps, 2(N-1)/N * D bytes sent per rank.

The ring is pipelined: each chunk travels as `pieces` sub-chunks, and the reduction of one piece
overlaps the transfer of the next, which is what lifts a Python ring to the built-in's speed.
`p2p` (optional, every function): a callable with `exchange`'s signature through which the
messages are posted instead; labkit.shaped.Shaper.exchange limits each rank's link to a bandwidth.
Every function takes a process `group` (default: the whole world) and is written for CPU (Gloo)
and GPU (NCCL) tensors: buffers follow the input's device and dtype, and the ring's messages go
as batches (`exchange`) that NCCL's rules cannot deadlock; float32 and bfloat16; op "sum" or
"avg". (The tests run on Gloo; scripts/gpu-smoke.sh runs the labs on a GPU.)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labkit.observe import commlog
from labkit.shard import even_ranges

OPS = ("sum", "avg")
MIN_PIECE_BYTES = 2 * 2**20  # below this a piece is latency-bound: do not cut further (measured)


@dataclass
class Traffic:
    """Bytes this rank sent and received, step by step: the code's own ledger, a picture of its
    steps. Counts that prove what moved come from the kernel (labkit.observe.netcount)."""
    steps: list = field(default_factory=list)  # dicts: phase, step, sent, received

    def record(self, phase: str, step: int, sent: int, received: int) -> None:
        self.steps.append({"phase": phase, "step": step, "sent": sent, "received": received})

    @property
    def sent(self) -> int:
        return sum(s["sent"] for s in self.steps)

    @property
    def received(self) -> int:
        return sum(s["received"] for s in self.steps)


# ----------------------------------------------------------------------------- the ring's plan
def chunk_bounds(numel: int, n: int) -> list:
    """[(start, end)] of n chunks covering numel elements; the first numel % n are one longer."""
    return even_ranges(numel, n)


def ring_schedule(n: int, phase: str) -> list:
    """For each step, for each rank r: (chunk r sends right, chunk r receives from the left).

    reduce_scatter: at step s rank r sends chunk (r-s-1) mod n and receives (r-s-2) mod n, adding
    it to its own copy; after n-1 steps rank r holds the complete chunk r (as reduce_scatter does).
    all_gather: rank r starts with chunk r; at step s it sends (r-s) and receives (r-s-1)."""
    if phase == "reduce_scatter":
        return [[((r - s - 1) % n, (r - s - 2) % n) for r in range(n)] for s in range(n - 1)]
    if phase == "all_gather":
        return [[((r - s) % n, (r - s - 1) % n) for r in range(n)] for s in range(n - 1)]
    raise ValueError(f"phase must be 'reduce_scatter' or 'all_gather', got {phase!r}")


def _setup(tensor: torch.Tensor, op: str, group):
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if not tensor.is_contiguous():
        raise ValueError("the tensor must be contiguous (call .contiguous() first): the ring sends "
                         "slices of its flat view")
    group = group or dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _pieces(start: int, end: int, pieces: int) -> list:
    return [(start + a, start + b) for a, b in chunk_bounds(end - start, pieces) if b > a]


_SCRATCH: dict = {}


def _scratch(numel: int, dtype, device) -> torch.Tensor:
    """A receive buffer kept between calls: fresh memory every call costs page faults, which
    on a CPU is a large share of the time of a big all-reduce."""
    key = (dtype, str(device))
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


class _AllOf:
    """One handle for several works: NCCL may answer a batch with a single work for all."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()


def exchange(ops, where: str = "") -> list:
    """Post point-to-point ops [(dist.isend | dist.irecv, tensor, peer's group rank, group[,
    tag])] as one batch; return one waitable per op.

    Why a batch and not isend + irecv: under NCCL a receive occupies the GPU's stream until its
    message arrives, and NCCL ignores tags and matches messages in order. Two ranks that each
    post "receive from you, then send to you" (a ring of 2) would both wait forever; in one
    batch (batch_isend_irecv: ncclGroupStart/End) NCCL runs both directions together. On Gloo a
    batch is the same isend/irecv calls, one by one."""
    if not ops:
        return []
    works = dist.batch_isend_irecv([dist.P2POp(op, t, group=group, group_peer=peer,
                                               tag=rest[0] if rest else 0)
                                    for op, t, peer, group, *rest in ops])
    if len(works) != len(ops):
        works = [_AllOf(list(works))] * len(ops)  # coalesced (NCCL): one work stands for all
    return commlog.p2p_posted(ops, list(works), where)


def _ring_steps(flat, n, rank, group, phases, pieces, traffic, divide_by: int = 1, p2p=None):
    """Run ring phases on the flat buffer, in place, as one stream of pieces.

    The chunk a rank sends at step t+1 is the chunk it received at step t (true across the
    switch from reduce-scatter to all-gather too), so piece j is forwarded the moment it has
    arrived and been added: the reduction of one piece overlaps the transfer of the next, and no
    step waits for the whole previous one. Each (step, piece) is one batch of its send to the
    right and its receive from the left (`exchange`), posted in the same order on every rank."""
    right, left = (rank + 1) % n, (rank - 1) % n
    bounds = chunk_bounds(flat.numel(), n)
    longest = bounds[0][1] - bounds[0][0]
    # Small chunks are latency-bound: cutting them further only adds messages.
    pieces = max(1, min(pieces, longest * flat.element_size() // MIN_PIECE_BYTES))
    steps = [(phase, plan[rank]) for phase in phases for plan in ring_schedule(n, phase)]
    scratch = _scratch(2 * longest, flat.dtype, flat.device)  # double buffer: steps t and t+1

    def parts(chunk):
        return _pieces(*bounds[chunk], pieces)

    def post(t, j):
        """Step t, piece j: its receive (if chunk has piece j) and its send, as one batch.
        Returns (receive buffer or None, receive work or None, send work or None)."""
        phase, (send_chunk, recv_chunk) = steps[t]
        ops, buf = [], None
        if j < len(parts(recv_chunk)):
            a, b = parts(recv_chunk)[j]
            if phase == "reduce_scatter":  # into scratch, to be added
                off = (t % 2) * longest + a - bounds[recv_chunk][0]
                buf = scratch[off:off + b - a]
            else:                          # straight into place
                buf = flat[a:b]
            ops.append((dist.irecv, buf, left, group))
        if j < len(parts(send_chunk)):
            a, b = parts(send_chunk)[j]
            ops.append((dist.isend, flat[a:b], right, group))
        works = (p2p or exchange)(ops)
        recv_work = works[0] if buf is not None else None
        send_work = works[-1] if j < len(parts(send_chunk)) else None
        return buf, recv_work, send_work

    def width(t):  # pieces of step t: the larger of its send and receive chunk's
        return max(len(parts(steps[t][1][0])), len(parts(steps[t][1][1])))

    posted = [[post(0, j) for j in range(width(0))]]
    for t, (phase, (send_chunk, recv_chunk)) in enumerate(steps):
        last_reduce = phase == "reduce_scatter" and (t + 1 == len(steps)
                                                     or steps[t + 1][0] != phase)
        if t + 1 < len(steps):
            posted.append([])
        for j, (buf, work, _) in enumerate(posted[t]):
            if work is None:
                continue
            work.wait()
            a, b = parts(recv_chunk)[j]
            if phase == "reduce_scatter":
                flat[a:b].add_(buf)
                if last_reduce and divide_by != 1:
                    flat[a:b].div_(divide_by)  # 'avg': divide only the chunk this rank owns
            if t + 1 < len(steps):  # forward this piece now, and listen for the next step's
                posted[t + 1].append(post(t + 1, j))
        if t + 1 < len(steps):  # chunks of 0 and 1 elements can have different piece counts
            for j in range(len(posted[t + 1]), width(t + 1)):
                posted[t + 1].append(post(t + 1, j))
        for _, _, send in posted[t]:
            if send is not None:
                send.wait()  # before any later step may write into what it sent
        if traffic is not None:
            esize = flat.element_size()
            traffic.record(phase, t if phase == phases[0] else t - (n - 1),
                           (bounds[send_chunk][1] - bounds[send_chunk][0]) * esize,
                           (bounds[recv_chunk][1] - bounds[recv_chunk][0]) * esize)


def ring_reduce_scatter(tensor: torch.Tensor, op: str = "sum", group=None, *, pieces: int = 4,
                        traffic: Traffic | None = None, p2p=None) -> torch.Tensor:
    """Reduce over ranks; return this rank's chunk of the result (a new tensor, flat).

    `tensor` is used as scratch space and holds partial sums afterwards (pass a clone to keep it).
    Chunk r of the flattened tensor ends on rank r, as `chunk_bounds(numel, N)` cuts it."""
    group, rank, n = _setup(tensor, op, group)
    flat = tensor.view(-1)
    if n > 1:
        _ring_steps(flat, n, rank, group, ("reduce_scatter",), pieces, traffic, p2p=p2p)
    a, b = chunk_bounds(flat.numel(), n)[rank]
    out = flat[a:b].clone()
    return out.div_(n) if op == "avg" else out


def ring_all_gather(chunk: torch.Tensor, group=None, *, sizes=None, pieces: int = 4,
                    traffic: Traffic | None = None, p2p=None) -> torch.Tensor:
    """Concatenate every rank's chunk, in rank order; return the flat result on every rank.

    `sizes`: the number of elements of each rank's chunk (default: all equal to this one's)."""
    group, rank, n = _setup(chunk, "sum", group)
    sizes = list(sizes) if sizes is not None else [chunk.numel()] * n
    if len(sizes) != n or sizes[rank] != chunk.numel():
        raise ValueError(f"sizes={sizes} must list {n} chunk sizes with this rank's ({rank}) "
                         f"equal to its chunk's {chunk.numel()} elements")
    flat = torch.empty(sum(sizes), dtype=chunk.dtype, device=chunk.device)
    offsets = [sum(sizes[:i]) for i in range(n)]
    flat[offsets[rank]:offsets[rank] + sizes[rank]] = chunk.view(-1)
    if n > 1:
        bounds = chunk_bounds(flat.numel(), n)
        if [b - a for a, b in bounds] != sizes:  # arbitrary sizes: gather on the caller's layout
            _ring_gather_layout(flat, n, rank, group, sizes, offsets, traffic, p2p)
        else:
            _ring_steps(flat, n, rank, group, ("all_gather",), pieces, traffic, p2p=p2p)
    return flat


def _ring_gather_layout(flat, n, rank, group, sizes, offsets, traffic, p2p=None):
    right, left = (rank + 1) % n, (rank - 1) % n
    for step, plan in enumerate(ring_schedule(n, "all_gather")):
        s, r = plan[rank]
        post = p2p or exchange
        works = post([(dist.irecv, flat[offsets[r]:offsets[r] + sizes[r]], left, group),
                      (dist.isend, flat[offsets[s]:offsets[s] + sizes[s]], right, group)])
        for work in works:
            work.wait()
        if traffic is not None:
            traffic.record("all_gather", step, sizes[s] * flat.element_size(),
                           sizes[r] * flat.element_size())


def ring_all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, *, pieces: int = 4,
                    traffic: Traffic | None = None, p2p=None) -> torch.Tensor:
    """In place, like dist.all_reduce: reduce-scatter, then all-gather, on the same buffer."""
    group, rank, n = _setup(tensor, op, group)
    if n == 1:
        return tensor
    flat = tensor.view(-1)
    _ring_steps(flat, n, rank, group, ("reduce_scatter", "all_gather"), pieces, traffic,
                divide_by=n if op == "avg" else 1, p2p=p2p)
    return tensor


def parameter_server_all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, *,
                                root: int = 0, traffic: Traffic | None = None,
                                p2p=None) -> torch.Tensor:
    """In place: everyone sends to `root`, the root adds and sends the result back to everyone.
    Messages go through `p2p` (default `exchange`), one receive at a time at the root."""
    group, rank, n = _setup(tensor, op, group)
    if not 0 <= root < n:
        raise ValueError(f"root={root} is not a rank of this group of {n}")
    nbytes = tensor.nbytes
    post = p2p or exchange
    if rank == root:
        buf = _scratch(tensor.numel(), tensor.dtype, tensor.device).view_as(tensor)
        for step, src in enumerate(r for r in range(n) if r != root):  # reduce: N-1 receives
            post([(dist.irecv, buf, src, group)])[0].wait()
            tensor.add_(buf)
            if traffic is not None:
                traffic.record("reduce", step, 0, nbytes)
        if op == "avg":
            tensor.div_(n)
        sends = post([(dist.isend, tensor, dst, group) for dst in range(n) if dst != root])
        for step, work in enumerate(sends):                          # broadcast: N-1 sends
            work.wait()
            if traffic is not None:
                traffic.record("broadcast", step, nbytes, 0)
    else:
        post([(dist.isend, tensor, root, group)])[0].wait()
        post([(dist.irecv, tensor, root, group)])[0].wait()
        if traffic is not None:
            traffic.record("reduce", 0, nbytes, 0)
            traffic.record("broadcast", 0, 0, nbytes)
    return tensor
