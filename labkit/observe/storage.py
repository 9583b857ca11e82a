"""Bytes a tensor holds: the one way labkit counts them.

    nbytes(t)                    # t's own elements: t.numel() * t.element_size(), as torch says
    storage_bytes(tensors)       # the storages behind them, each once (views are not new memory)

`Tensor.nbytes` is what a message or a payload carries; a storage is what memory holds: a view,
or a shard that is a view of a flat buffer, shares its base's storage and adds nothing.
"""
from __future__ import annotations

import torch


def nbytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s elements (torch's Tensor.nbytes)."""
    return t.nbytes


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors` (None skipped), each storage counted once."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.nbytes():
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total
