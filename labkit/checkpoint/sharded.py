"""Sharded checkpoints: each rank writes only its own slices, plus one file describing the layout.

    layout = zero_layout(shapes_of(state), world)          # ZeRO: flat, uneven split per tensor
    layout = tp_layout(shapes_of(state), world, {"q.weight": 0, "o.weight": 1})  # Megatron TP
    mine = shard_state(state, layout, rank)                 # {piece key: tensor}
    save_sharded(root, step, mine, layout)                  # every rank, collectively
    got = load_sharded(root, new_layout, new_rank)          # any other world size: resharding

A layout is a list of Pieces: "rank r holds this box of tensor t". A box indexes either the
tensor's own n-d shape (tensor parallelism: a column block of a weight) or its flattened 1-d view
(ZeRO, FSDP: a contiguous run of the flat parameter). That is the whole trick of resharding
(torch.distributed.checkpoint stores the same kind of chunk metadata): the saved layout and the
wanted one are both descriptions of boxes, so any saved world size maps onto any other.

Loading here assembles each wanted tensor from the saved pieces that cover it (reading, with
mmap, only the shard files that hold some of it), then cuts the wanted box out. A production
loader reads only the overlapping byte ranges; the bookkeeping is the same.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from labkit.checkpoint import atomic
from labkit.checkpoint.errors import (
    CheckpointError,
    LayoutError,
    MissingShardError,
    WrongModelError,
    describe_mismatch,
)
from labkit.checkpoint.full import _barrier, _gather_objects, rank_world, resolve
from labkit.model import GPT, GPTConfig
from labkit.shard import even_bounds


@dataclass(frozen=True)
class Piece:
    """Rank `rank` holds the box offsets..offsets+lengths of tensor `name` (flat: of its 1-d
    view)."""
    name: str
    rank: int
    offsets: tuple
    lengths: tuple
    flat: bool = False

    @property
    def key(self) -> str:
        return f"{self.name}|{'flat' if self.flat else 'nd'}|{','.join(map(str, self.offsets))}"

    @property
    def numel(self) -> int:
        n = 1
        for v in self.lengths:
            n *= v
        return n


def shapes_of(state: dict) -> dict:
    """{name: (shape, dtype)} of a state dict: what a layout needs to know about each tensor."""
    return {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in state.items()}


def _split(n: int, world: int, rank: int) -> tuple[int, int]:
    """Offset and length of rank's share of n: the first n % world ranks get one extra."""
    lo, hi = even_bounds(n, world, rank)
    return lo, hi - lo


def zero_layout(shapes: dict, world: int) -> dict:
    """ZeRO / FSDP style: every tensor flattened and split in world contiguous runs (uneven ok)."""
    if world < 1:
        raise LayoutError(f"world={world}: need at least one rank")
    pieces = []
    for name, (shape, _) in shapes.items():
        numel = int(torch.Size(shape).numel())
        for r in range(world):
            off, length = _split(numel, world, r)
            pieces.append(Piece(name, r, (off,), (length,), flat=True))
    return {"world": world, "tensors": dict(shapes), "pieces": pieces}


def tp_layout(shapes: dict, world: int, split_dims: dict) -> dict:
    """Megatron-style tensor parallelism: tensors in `split_dims` are cut in `world` equal blocks
    along their dim (column-parallel: dim 0 of the weight, row-parallel: dim 1); all other
    tensors are replicated (every rank holds the whole, only the lowest rank writes it)."""
    pieces = []
    for name, (shape, _) in shapes.items():
        full = (0,) * len(shape), tuple(shape)
        if name not in split_dims:
            pieces += [Piece(name, r, *full) for r in range(world)]
            continue
        dim = split_dims[name]
        if shape[dim] % world:
            raise LayoutError(
                f"{name} has size {shape[dim]} along dim {dim}, which {world} tensor-parallel "
                f"ranks cannot split evenly (heads and columns are not cut in pieces). Use a "
                f"world size that divides {shape[dim]}, or load it with zero_layout.")
        size = shape[dim] // world
        for r in range(world):
            offs, lens = list(full[0]), list(full[1])
            offs[dim], lens[dim] = r * size, size
            pieces.append(Piece(name, r, tuple(offs), tuple(lens)))
    return {"world": world, "tensors": dict(shapes), "pieces": pieces}


def _box(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The view of `t` (the whole tensor) that `piece` describes."""
    if piece.flat:
        return t.reshape(-1)[piece.offsets[0]:piece.offsets[0] + piece.lengths[0]]
    return t[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.lengths))]


def pieces_of(layout: dict, rank: int) -> list:
    return [p for p in layout["pieces"] if p.rank == rank]


def shard_state(state: dict, layout: dict, rank: int) -> dict:
    """Cut this rank's pieces out of a whole state dict: {piece key: tensor (a copy)}."""
    return {p.key: _box(state[p.name], p).clone() for p in pieces_of(layout, rank)}


def _writers(layout: dict) -> dict:
    """key -> the lowest rank holding it: a replicated piece is written once."""
    owner = {}
    for p in sorted(layout["pieces"], key=lambda p: p.rank):
        owner.setdefault(p.key, p.rank)
    return owner


def layout_to_json(layout: dict) -> dict:
    return {"world": layout["world"],
            "tensors": {k: [list(s), d] for k, (s, d) in layout["tensors"].items()},
            "pieces": [asdict(p) for p in layout["pieces"]]}


def layout_from_json(j: dict) -> dict:
    return {"world": j["world"],
            "tensors": {k: (tuple(s), d) for k, (s, d) in j["tensors"].items()},
            "pieces": [Piece(p["name"], p["rank"], tuple(p["offsets"]), tuple(p["lengths"]),
                             p["flat"]) for p in j["pieces"]]}


def save_sharded(root, step: int, local: dict, layout: dict, *, group=None, extra=None) -> Path:
    """Every rank writes `shard_rank{r}.pt` with its pieces; rank 0 writes the layout; commit."""
    rank, world = rank_world(group)
    if layout["world"] != world:
        raise LayoutError(f"the layout is for {layout['world']} ranks; this group has {world}")
    name = atomic.step_name(step)
    if rank == 0:
        atomic.begin(root, name)
    _barrier(group)
    owner = _writers(layout)
    mine = {k: v.detach().cpu() for k, v in local.items() if owner.get(k) == rank}
    fname = f"shard_rank{rank}.pt"
    files = {fname: atomic.save_file(mine, atomic.tmp_dir(root, name) / fname)}
    everyone = _gather_objects(files, group)
    if rank == 0:
        meta = {"kind": "sharded", "step": step, "world": world, "extra": extra,
                "layout": layout_to_json(layout), "owner": owner,
                "files": {k: v for f in everyone for k, v in f.items()}}
        atomic.commit(root, name, meta)
    _barrier(group)
    return Path(root) / name


def load_sharded(path, layout: dict, rank: int) -> dict:
    """This rank's pieces of `layout` ({piece key: tensor}), from a checkpoint saved with any
    layout."""
    ckpt = resolve(path)
    meta = atomic.read_meta(ckpt)
    if meta.get("kind") != "sharded":
        raise CheckpointError(f"{ckpt.name}/ is a {meta.get('kind')!r} checkpoint, not sharded")
    saved = layout_from_json(meta["layout"])
    want = {p.name for p in pieces_of(layout, rank)}
    s_fp = {k: [*s, d] for k, (s, d) in saved["tensors"].items()}
    w_fp = {k: [*s, d] for k, (s, d) in layout["tensors"].items()}
    if any(s_fp.get(n) != w_fp[n] for n in want):
        raise WrongModelError(f"{ckpt.name}/ was saved from another model:\n"
                              + describe_mismatch({k: s_fp[k] for k in s_fp if k in w_fp}, w_fp))
    files, out, wholes = {}, {}, {}
    for p in pieces_of(layout, rank):
        shape, dtype = layout["tensors"][p.name]
        if any(o < 0 or o + n > lim for o, n, lim in zip(
                p.offsets, p.lengths, (int(torch.Size(shape).numel()),) if p.flat else shape)):
            raise LayoutError(f"piece {p.key} of rank {rank} lies outside {p.name} {shape}")
        if p.name not in wholes:
            wholes[p.name] = _assemble(ckpt, meta, saved, p.name, files)
        out[p.key] = _box(wholes[p.name], p).clone()
    return out


def _assemble(ckpt: Path, meta: dict, saved: dict, name: str, files: dict) -> torch.Tensor:
    shape, dtype = saved["tensors"][name]
    whole = torch.empty(shape, dtype=getattr(torch, dtype))
    covered = torch.zeros(shape, dtype=torch.bool)
    for key, r in meta["owner"].items():
        if not key.startswith(name + "|"):
            continue
        fname = f"shard_rank{r}.pt"
        if fname not in files:
            if fname not in meta["files"] or not (ckpt / fname).exists():
                raise MissingShardError(
                    f"{ckpt.name}/{fname} (rank {r} of {meta['world']}) is missing; it holds "
                    f"part of {name}. Restore the file or load an earlier step.")
            files[fname] = atomic.load_file(ckpt / fname, meta["files"][fname], mmap=True)
        piece = next(p for p in saved["pieces"] if p.key == key and p.rank == r)
        _box(whole, piece).copy_(files[fname][key].reshape(piece.lengths))
        _box(covered, piece).fill_(True)
    if not bool(covered.all()):
        raise MissingShardError(f"the saved shards cover {int(covered.sum())} of "
                                f"{covered.numel()} elements of {name}: the layout is incomplete")
    return whole


def assemble_local(pieces_by_rank: list, layout: dict) -> dict:
    """Whole tensors from every rank's {key: tensor} (for tests and for the one-process view)."""
    out = {n: torch.empty(s, dtype=getattr(torch, d)) for n, (s, d) in layout["tensors"].items()}
    for p in layout["pieces"]:
        _box(out[p.name], p).copy_(pieces_by_rank[p.rank][p.key].reshape(p.lengths))
    return out


# ----------------------------------------------------------------------------- a demo state
TP_SPLIT = {"attn.q_proj.weight": 0, "attn.k_proj.weight": 0, "attn.v_proj.weight": 0,
            "mlp.fc.weight": 0, "attn.o_proj.weight": 1, "mlp.proj.weight": 1}


def demo_state(n_embd: int = 16, n_layer: int = 1, n_head: int = 4, seed: int = 0) -> dict:
    """A GPT's weights plus Adam-like moments for each (`exp_avg/...`, `exp_avg_sq/...`):
    what a ZeRO rank shards. The same on every rank (built from seed)."""
    model = GPT(GPTConfig(n_embd=n_embd, n_layer=n_layer, n_head=n_head), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    state = {}
    for k, v in model.named_parameters():
        state[k] = v.detach().clone()
        state["exp_avg/" + k] = torch.randn(v.shape, generator=g) * 1e-3
        state["exp_avg_sq/" + k] = torch.rand(v.shape, generator=g) * 1e-6
    return state


def tp_split_of(state: dict) -> dict:
    """Which dim each tensor-parallel weight (and its moments) is split along (Megatron)."""
    return {k: d for k in state for suffix, d in TP_SPLIT.items() if k.endswith(suffix)}
