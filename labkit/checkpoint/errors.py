"""Errors a checkpoint can raise, each saying what is wrong and what to change.

A failed load never deletes or rewrites anything on disk: the reader can fix the cause (point at
another step, restore the missing shard, change the world size) and try again.
"""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class: something about a checkpoint on disk cannot be used as asked."""


class CorruptCheckpointError(CheckpointError):
    """A file is truncated, corrupted (checksum mismatch) or not a checkpoint at all."""


class WrongModelError(CheckpointError):
    """The checkpoint holds tensors of another model (names or shapes differ)."""


class MissingShardError(CheckpointError):
    """A rank's shard file is missing, or the saved shards do not cover a tensor."""


class LayoutError(CheckpointError):
    """The saved layout cannot be mapped onto the ranks asked for."""


def describe_mismatch(saved: dict, wanted: dict, limit: int = 4) -> str:
    """Name the first differences between two {name: (shape, dtype)} fingerprints."""
    lines = []
    for name in sorted(set(saved) | set(wanted)):
        if name not in saved:
            lines.append(f"  {name}: in the model, not in the checkpoint")
        elif name not in wanted:
            lines.append(f"  {name}: in the checkpoint, not in the model")
        elif tuple(saved[name]) != tuple(wanted[name]):
            lines.append(f"  {name}: checkpoint has {saved[name]}, model has {wanted[name]}")
    more = f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else ""
    return "\n".join(lines[:limit]) + more
