"""Record a torch.profiler trace on each rank: one Chrome/Perfetto JSON file per rank.

    from labkit.profiling.record import traced, label
    with traced("traces") as where:           # inside a rank (labkit.launch.run)
        with label("forward"):
            loss = model(x, y)[1]
    where.path                                 # traces/rank0.pt.trace.json

The files open in ui.perfetto.dev ("Open trace file"), in chrome://tracing, and in TensorBoard's
profiler plugin (which looks for *.pt.trace.json). labkit labels its own work with
record_function: forward, backward, optimizer here; "all_reduce bucket i" in labkit.ddp; every
collective labkit.observe.commlog makes as "<op> <where>" (e.g. "all_gather ZeRO-3 gather"); the
pipeline's actions as F<mb>, B<mb>, W<mb> (labkit.pipeline.executor).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from labkit.profiling.folder import beside, trace_file

label = record_function      # the one way labkit names a span in a trace


@dataclass
class Where:
    path: Path | None = None


def activities() -> list:
    """The CPU always; CUDA kernels (NCCL's among them) where a GPU is used."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


@contextlib.contextmanager
def traced(folder=None, rank: int | None = None):
    """Profile the block on this rank and write its trace to `folder`/rank<r>.pt.trace.json;
    without a folder, to traces/run/ in the working folder (a notebook's own: folder.beside)."""
    import torch.distributed as dist

    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    where = Where()
    folder = beside("run") if folder is None else folder
    Path(folder).mkdir(parents=True, exist_ok=True)
    with profile(activities=activities()) as prof:
        yield where
    where.path = trace_file(folder, rank)
    prof.export_chrome_trace(str(where.path))
