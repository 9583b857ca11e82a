"""Where every rank sits: the parallel dimensions, checked once, and the groups along each.

    from labkit.topology import Topology
    topo = Topology(world=8, dp=2, tp=2, pp=2, zero=1, gpus_per_node=4)
    topo.coords(5)                   # {'pp': 1, 'dp': 0, 'cp': 0, 'tp': 1}
    topo.groups("tp")                # [[0, 1], [2, 3], [4, 5], [6, 7]]
    print(topo.picture())            # which rank sits on which node, GPU and group
    # inside a launched rank (every rank calls it, together): labkit.parallel.mesh builds the
    mesh = build_mesh(topo)          # groups, the only place that does; mesh.group("tp")

The dimensions (the order of Megatron-LM and torchtitan, outermost first):
  pp  pipeline stages: consecutive blocks of layers; neighbours exchange activations
  dp  data-parallel replicas (the ZeRO stage 0-3 shards model states over this dimension)
  cp  context-parallel shards of the sequence (ring attention passes keys and values around)
  tp  tensor-parallel shards of every layer; the innermost dimension, so a TP group is made of
      consecutive ranks, which a launcher places on the same node (the fast links)

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

Their product must equal the world size: that is checked here, once, with an error that prints
every factor, so no later code has to wonder. Process groups are returned and passed as
arguments, never kept in a global.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import KW_ONLY, dataclass, field

from labkit.degrees import Degrees, factorizations  # noqa: F401  (factorizations: parallel.plan imports it from here)

DIMS = ("pp", "dp", "cp", "tp")  # outermost first: TP varies fastest, PP slowest


class TopologyError(ValueError):
    """The parallel dimensions do not fit the world (the message says what to change)."""


@dataclass(frozen=True)
class Topology:
    world: int
    _: KW_ONLY                       # the degrees, in labkit.degrees' order, by keyword only
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1                      # context parallelism
    zero: int = 0                    # ZeRO stage over the DP dimension: 0 (plain DP), 1, 2, 3
    gpus_per_node: int | None = None  # None: one node holds every rank
    sizes: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        w = self.world
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise TopologyError(f"world must be a positive integer, got {w!r}")
        self.degrees.check(world=w, error=TopologyError)
        g = self.gpus_per_node
        if g is not None:
            if isinstance(g, bool) or not isinstance(g, int) or g < 1:
                raise TopologyError(f"gpus_per_node must be a positive integer, got {g!r}")
            if self.world > g and self.world % g:
                raise TopologyError(f"world={self.world} ranks do not fill whole nodes of "
                                    f"gpus_per_node={g}: use a multiple of {g}.")
        object.__setattr__(self, "sizes", {"pp": self.pp, "dp": self.dp, "cp": self.cp,
                                           "tp": self.tp})

    @property
    def degrees(self) -> Degrees:
        """The degrees this grid holds (labkit.degrees: the one record and its checks)."""
        return Degrees(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, zero=self.zero)

    # -- the rank grid
    def coords(self, rank: int) -> dict:
        """{'pp': i, 'dp': j, 'cp': c, 'tp': k} of `rank`."""
        self._check_rank(rank)
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        pp, dp = divmod(rest, self.dp)
        return {"pp": pp, "dp": dp, "cp": cp, "tp": tp}

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        for name, v in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            if not 0 <= v < self.sizes[name]:
                raise TopologyError(f"{name} index {v} is outside 0..{self.sizes[name] - 1}")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def groups(self, dim: str) -> list:
        """The ranks of every group along `dim` (ranks that differ only in that coordinate)."""
        if dim not in DIMS:
            raise TopologyError(f"dimension must be one of {DIMS}, got {dim!r}")
        others = [d for d in DIMS if d != dim]
        out = []
        for fixed in itertools.product(*(range(self.sizes[d]) for d in others)):
            at = dict(zip(others, fixed))
            out.append([self.rank_of(**at, **{dim: i}) for i in range(self.sizes[dim])])
        return out

    def group_of(self, rank: int, dim: str) -> list:
        return next(g for g in self.groups(dim) if rank in g)

    # -- nodes
    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return 0 if self.gpus_per_node is None else rank // self.gpus_per_node

    def nodes_spanned(self, dim: str) -> int:
        """The most nodes any one group along `dim` spans (1: it stays inside a node)."""
        return max(len({self.node_of(r) for r in g}) for g in self.groups(dim))

    def advice(self) -> list:
        """Rules of thumb this layout breaks (empty when it follows them)."""
        out = []
        if self.tp > 1 and self.nodes_spanned("tp") > 1:
            out.append(f"TP={self.tp} spans {self.nodes_spanned('tp')} nodes: tensor parallelism "
                       f"all-reduces activations 4 times per layer and belongs inside a node "
                       f"(gpus_per_node={self.gpus_per_node}).")
        if self.tp == 1 and self.pp > 1 and self.gpus_per_node and self.nodes_spanned("pp") == 1:
            out.append("PP inside one node while TP=1: usually TP (or plain DP) uses the fast "
                       "links better; PP is the dimension to stretch across nodes.")
        return out

    def describe(self, rank: int) -> str:
        c = self.coords(rank)
        return (f"rank {rank}: node {self.node_of(rank)}, pp stage {c['pp']}, "
                f"dp replica {c['dp']}, "
                f"tp shard {c['tp']}")

    def picture(self) -> str:
        """A text map: one row per node, one cell per GPU (rank and its pp/dp/tp coordinates),
        then the groups along each dimension."""
        per_node = self.gpus_per_node or self.world
        lines = [f"world={self.world} = pp {self.pp} x dp {self.dp} x tp {self.tp}"
                 + (f" x cp {self.cp}" if self.cp > 1 else "")
                 + (f", ZeRO-{self.zero} over dp" if self.zero else "")
                 + (f"; {math.ceil(self.world / per_node)} node(s) of {per_node} GPUs")]
        for node in range(math.ceil(self.world / per_node)):
            cells = []
            for r in range(node * per_node, min((node + 1) * per_node, self.world)):
                c = self.coords(r)
                cp = f" c{c['cp']}" if self.cp > 1 else ""
                cells.append(f"r{r}(p{c['pp']} d{c['dp']}{cp} t{c['tp']})")
            lines.append(f"  node {node}: " + "  ".join(cells))
        for dim in DIMS:
            if self.sizes[dim] > 1:
                lines.append(f"  {dim} groups: " + " ".join(str(g) for g in self.groups(dim)))
        lines += ["  note: " + a for a in self.advice()]
        return "\n".join(lines)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise TopologyError(f"rank {rank} is outside 0..{self.world - 1}")
