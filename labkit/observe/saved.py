"""Bytes autograd saves for backward, seen by PyTorch's saved-tensor hooks: the one meter.

    with SavedTensors(exclude=model.parameters()) as saved:     # a block of code
        loss = model(x, y)[1]
    saved.bytes, saved.tensors            # distinct storages: int, [(shape, dtype, bytes)]

    meter = SavedTensors(exclude=params, live=True)             # a pipeline stage
    with meter.saving(("F", mb)):                               # book what this forward saves
        out = chunk(inp)
    meter.bytes_of(("F", mb))             # bytes booked under that key (and forgotten)
    meter.fresh_bytes_of(("F", mb))       # bytes of the storages first held under it
    meter.live_bytes, meter.peak_live     # saved storages autograd still holds, now and at most

    with SavedTensors(exclude=params, live=True) as meter:       # a whole step, no keys
        ...; meter.live_bytes             # read it whenever (labkit.profiling.memory samples it)

The hook (torch.autograd.graph.saved_tensors_hooks) sees every tensor an operation keeps for its
backward, whoever runs it: a counter the code under test does not write. Three views of it:
- storages (`bytes`, `tensors`): each storage once (a view and its base are one allocation; a
  tensor saved by two operations is held once), the storages of `exclude` not at all;
- booked (`bytes_of(key)`): per key, the bytes of each tensor saved while that key was open
  (Tensor.nbytes, a tensor saved twice once): what a schedule believes a micro-batch holds;
- live (live=True): each saved storage from the forward that saves it until autograd frees its
  last reference (a weakref finalizer on what the hook hands autograd), at the size its storage
  has when read: what stays allocated.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch


class _Saved:
    """What the meter hands autograd in live mode: a detached alias (holding the tensor itself
    would tie a saved output to its own node, a cycle autograd never frees)."""
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class SavedTensors:
    """Count what autograd saves inside `with meter:` or `with meter.saving(key):`.

    A storage is known by its identity (the StorageImpl behind it), not by its address: ZeRO-3
    frees a saved weight's storage after forward (resize to 0 bytes) and gathers it back before
    backward, and meanwhile the allocator may hand the same address to another tensor. Keyed by
    address, the two were one entry and the meter's sum drifted (a leftover of one weight's
    bytes after the step, depending on where the allocator put things)."""

    def __init__(self, exclude=(), live: bool = False):
        self._skip = {t.untyped_storage()._cdata for t in exclude}
        self._storages: dict = {}              # storage identity -> (shape, dtype, bytes)
        self._booked: dict = {}                # key -> {tensor data_ptr: bytes}
        self._fresh: dict = {}                 # key -> bytes of storages first held under it
        self.current = None
        self.live = live
        self._live: dict = {}                  # storage identity -> [storage, references]
        self.peak_live = 0

    # -- the hooks
    def pack(self, t):
        if t.layout != torch.strided:
            return t
        st = t.untyped_storage()
        sid, n = st._cdata, st.nbytes()
        if sid in self._skip:
            return t
        if sid not in self._storages:
            self._storages[sid] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), n)
        if self.current is not None:
            self._booked.setdefault(self.current, {})[t.data_ptr()] = t.nbytes
        if not self.live or n == 0:
            return t
        if sid in self._live:
            self._live[sid][1] += 1
        else:
            self._live[sid] = [st, 1]          # the storage itself: its size now, when read
            if self.current is not None:
                self._fresh[self.current] = self._fresh.get(self.current, 0) + n
            self.peak_live = max(self.peak_live, self.live_bytes)
        held = _Saved(t.detach())
        weakref.finalize(held, self._release, sid)
        return held

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Saved) else held

    def _release(self, sid):
        entry = self._live[sid]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[sid]

    # -- blocks
    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    @contextmanager
    def saving(self, key):
        """Book what is saved inside under `key` (a micro-batch, a chunk)."""
        self.current = key
        try:
            with self:
                yield self
        finally:
            self.current = None

    # -- readings
    @property
    def bytes(self) -> int:
        return sum(v[2] for v in self._storages.values())

    @property
    def tensors(self) -> list:
        return list(self._storages.values())

    @property
    def live_bytes(self) -> int:
        """Bytes of the saved storages autograd still holds, at their size now (a ZeRO-3 weight
        freed between its forward and backward counts 0 meanwhile)."""
        return sum(st.nbytes() for st, _ in self._live.values())

    def bytes_of(self, key) -> int:
        """Bytes booked under `key`, forgotten afterwards (its backward frees them)."""
        return sum(self._booked.pop(key, {}).values())

    def fresh_bytes_of(self, key) -> int:
        """Live mode: bytes of the storages first held while `key` was open (a storage already
        held by an earlier key is not counted again), forgotten afterwards."""
        return self._fresh.pop(key, 0)


def saved_bytes(model, x, y, *, train: bool | None = True) -> tuple[int, list]:
    """(bytes, [(shape, dtype, bytes)]) of the distinct storages autograd saves in one forward
    of `model(x, y)`, parameters excluded (train=None: the model's mode as it is). The graph is
    freed by a backward afterwards."""
    if train is not None:
        model.train(train)
    with SavedTensors(exclude=model.parameters()) as saved:
        _, loss = model(x, y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return saved.bytes, saved.tensors
