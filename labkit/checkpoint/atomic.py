"""Atomic checkpoint writes: a crash at any instant leaves the previous checkpoint loadable.

The recipe (the same one databases use):
  1. write every file of the new checkpoint into a temporary folder (`.step_00000010.tmp`);
  2. flush and fsync each file, then write `meta.json` (sizes + SHA-256 of every file) last;
  3. rename the folder to its final name (`step_00000010`): one atomic rename on POSIX;
  4. only then rewrite the `latest` pointer (itself by write-temp-then-rename).
A process killed before step 3 leaves only a `.tmp` folder nobody reads; killed between 3 and 4
leaves `latest` on the previous, complete checkpoint. The naive `torch.save(obj, "ckpt.pt")`
killed half-way leaves a truncated file under the real name: the old checkpoint is gone.

Loading checks sizes and checksums before unpickling, and unpickles with
`torch.load(..., weights_only=True)`: tensors, numbers, strings, lists, dicts, never code.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import torch

from labkit.checkpoint.errors import CheckpointError, CorruptCheckpointError

META = "meta.json"
LATEST = "latest"
FORMAT = "labkit-checkpoint/1"


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (the directory entry itself is data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees the old file or the new one, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the name points at them
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save_file(obj, path: Path) -> dict:
    """torch.save `obj` to `path` (flushed and fsynced); return {"bytes", "sha256"} for
    meta.json."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def load_file(path: Path, expected: dict | None = None, *, mmap: bool = False):
    """Load one file written by `save_file`, checking size and checksum first when known."""
    path = Path(path)
    if not path.exists():
        raise CorruptCheckpointError(f"{path.name} is missing from {path.parent.name}/")
    if expected is not None:
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CorruptCheckpointError(
                f"{path.parent.name}/{path.name} is truncated or overwritten: {size} bytes on "
                f"disk, {expected['bytes']} when it was saved. Load an earlier step instead.")
        h = hashlib.sha256(path.read_bytes()).hexdigest()
        if h != expected["sha256"]:
            raise CorruptCheckpointError(
                f"{path.parent.name}/{path.name} is corrupted: its SHA-256 is {h[:12]}..., "
                f"it was {expected['sha256'][:12]}... when saved. Load an earlier step instead.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CorruptCheckpointError(
            f"{path.parent.name}/{path.name} cannot be read as a checkpoint "
            f"({type(err).__name__}: {str(err).splitlines()[0][:120]}). It is truncated, "
            f"corrupted, or not a weights-only torch file.") from err


def tmp_dir(root: Path, name: str) -> Path:
    return Path(root) / f".{name}.tmp"


def begin(root: Path, name: str) -> Path:
    """Create a fresh temporary folder for checkpoint `name` (a stale one from a crash is
    removed)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir(root, name)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def commit(root: Path, name: str, meta: dict) -> Path:
    """Write meta.json, rename the temporary folder to `name`, then point `latest` at it."""
    root = Path(root)
    tmp, final = tmp_dir(root, name), root / name
    meta = dict(meta, format=FORMAT)
    write_bytes_atomic(tmp / META, json.dumps(meta, indent=1).encode())
    fsync_dir(tmp)
    if final.exists():  # re-saving the same step: the old copy goes only once the new one is whole
        old = root / f".{name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    write_bytes_atomic(root / LATEST, name.encode())  # last: the pointer moves only to a whole one
    return final


def latest(root: Path) -> Path | None:
    """The folder `latest` points to, or None when nothing was committed yet."""
    root = Path(root)
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    return root / name


def read_meta(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint folder {path.name}/ in {path.parent.name}/ "
                              f"(was it committed? look for `latest` in the same folder)")
    try:
        meta = json.loads((path / META).read_text())
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path.name}/ has no {META}: it was never committed "
                                     f"(a save killed half-way). Load an earlier step.") from None
    except json.JSONDecodeError as err:
        raise CorruptCheckpointError(f"{path.name}/{META} is not valid JSON ({err})") from None
    if meta.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path.name}/ has format {meta.get('format')!r}, "
                                     f"expected {FORMAT!r}")
    return meta


def step_name(step: int) -> str:
    return f"step_{step:08d}"
