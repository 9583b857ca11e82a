"""Checkpoint benchmark: blocking vs async stall; sharded save at N = 1, 2, 4; labkit vs DCP.

    labkit bench checkpoint [--mbytes 64] [--folder DIR]

Every time is measured in this run; the columns to compare are the ratios (async / blocking,
labkit / DCP), which travel between machines better than seconds do. The "load" rows read the
checkpoint saved at N = 4 (so N = 2 and 1 reshard, both for labkit and for DCP).
"""
from __future__ import annotations

import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from labkit.checkpoint import sharded as sh
from labkit.checkpoint.async_save import measure_stall
from labkit.cliargs import bench_parser, positive
from labkit.labs.checkpoint.dcp_compare import to_dtensors
from labkit.launch import run
from labkit.table import table


def _state(mbytes: float, n: int = 8) -> dict:

    g = torch.Generator().manual_seed(0)
    per = int(mbytes * 1e6 / 4 / n)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def _job(root: str, mbytes: float, load_from: str | None):
    """Sharded save (labkit, DCP) of the state at this world size, then loads of the N=4 save."""


    rank, world = dist.get_rank(), dist.get_world_size()
    state = _state(mbytes)
    layout = sh.zero_layout(sh.shapes_of(state), world)
    local = sh.shard_state(state, layout, rank)
    mesh = init_device_mesh("cpu", (world,))  # 1-D over the world, as dcp_compare uses
    dstate = to_dtensors(state, mesh)  # DTensors made outside the timed part, like `local`
    target = to_dtensors({k: torch.zeros_like(v) for k, v in state.items()}, mesh)
    dcp.save(to_dtensors({"warm": torch.zeros(8)}, mesh), checkpoint_id=f"{root}/warm{world}")
    out = {}

    def timed(key, fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()  # a checkpoint is saved when the slowest rank is done
        out[key] = time.perf_counter() - t0

    timed("labkit_save", lambda: sh.save_sharded(f"{root}/labkit{world}", 1, local, layout))
    timed("dcp_save", lambda: dcp.save(dstate, checkpoint_id=f"{root}/dcp{world}"))
    src = load_from or str(world)
    timed("labkit_load", lambda: sh.load_sharded(f"{root}/labkit{src}", layout, rank))
    timed("dcp_load", lambda: dcp.load(target, checkpoint_id=f"{root}/dcp{src}"))
    return out


def options(argv=()):
    """(options, the arguments not taken), checked before any benchmark runs (labkit.bench)."""
    p = bench_parser("checkpoint")
    p.add_argument("--mbytes", type=positive, default=64.0, help="state size in MB (1e6 bytes)")
    p.add_argument("--folder", default=None,
                   help="folder to write in (None: the system temp folder)")
    return p.parse_known_args(list(argv or ()))


def main(argv=None) -> dict:

    a, _ = options(argv)
    root = tempfile.mkdtemp(prefix="labkit-bench-ckpt-", dir=a.folder)
    rows = []
    try:
        st = measure_stall(f"{root}/stall", a.mbytes, saves=3, work_s=0.5)
        rows.append({"what": "stall per save", "N": 1, "a": "async", "a_s": st["async"]["stall_s"],
                     "b": "blocking", "b_s": st["blocking"]["stall_s"]})
        for world in (4, 2, 1):
            r = run(_job, world, args=(root, a.mbytes, None if world == 4 else "4"), echo=False,
                    timeout=300)[0]
            rows.append({"what": "sharded save", "N": world, "a": "labkit", "a_s": r["labkit_save"],
                         "b": "DCP", "b_s": r["dcp_save"]})
            rows.append({"what": "load (saved at N=4)", "N": world, "a": "labkit",
                         "a_s": r["labkit_load"], "b": "DCP", "b_s": r["dcp_load"]})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in rows:
        r["ratio"] = r["a_s"] / r["b_s"]
    print(table(rows, [("what", "what"), ("N", "N"), ("a", "a"), ("a (s)", "a_s", ".3f"),
                       ("b", "b"), ("b (s)", "b_s", ".3f"), ("a/b", "ratio", ".2f")],
                title=f"checkpoint benchmark, state {a.mbytes:g} MB"))
    return {"mbytes": a.mbytes, "rows": rows}
