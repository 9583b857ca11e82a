"""Where traces go: beside the notebook by default (traces/<name>/), --trace DIR checked before
any process starts, one file name per rank, and how to open the files. Imports no torch, so a
lab's options stay quick to check."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

HOW_TO_OPEN = ("open a file in https://ui.perfetto.dev (\"Open trace file\") or chrome://tracing; "
               "or `tensorboard --logdir DIR` with the torch-tb-profiler plugin")


DEFAULT = "traces"    # a notebook's traces go to traces/<name>/ beside it, never a hidden /tmp


def beside(name: str, where=None) -> Path:
    """traces/<name>/ in `where` (default: the working folder, which in a notebook is the
    notebook's own): where a chapter's traces are written unless it names a folder, so that the
    page can say where they are and they outlive the kernel. Made if missing."""
    path = Path(where if where is not None else os.getcwd()) / DEFAULT / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def trace_file(folder, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.pt.trace.json"


def check_folder(text: str) -> Path:
    """An argparse type for --trace DIR: a folder that exists or can be made, and is writable.
    Refused in one line before any process starts (labkit.cliargs)."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder; e.g. --trace traces")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {str(parent)!r}; e.g. --trace traces")
    return path


def announce(folder, n: int) -> str:
    """The lines a lab prints after writing n traces."""
    files = ", ".join(trace_file(folder, r).name for r in range(min(n, 3))) + \
        (", ..." if n > 3 else "")
    return f"profiler traces, one per rank, in {folder}/: {files}\n  to read them: {HOW_TO_OPEN}"
