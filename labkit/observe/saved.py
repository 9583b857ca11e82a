"""Bytes autograd saves for backward, seen by PyTorch's saved-tensor hooks: the one meter.

    with SavedTensors(exclude=model.parameters()) as saved:     # a block of code
        loss = model(x, y)[1]
    saved.bytes, saved.tensors            # distinct storages: int, [(shape, dtype, bytes)]

    meter = SavedTensors(exclude=params, live=True)             # a pipeline stage
    with meter.saving(("F", mb)):                               # book what this forward saves
        out = chunk(inp)
    meter.bytes_of(("F", mb))             # bytes booked under that key (and forgotten)
    meter.live_bytes, meter.peak_live     # saved storages autograd still holds, now and at most

The hook (torch.autograd.graph.saved_tensors_hooks) sees every tensor an operation keeps for its
backward, whoever runs it: a counter the code under test does not write. Three views of it:
- storages (`bytes`, `tensors`): each storage once (a view and its base are one allocation; a
  tensor saved by two operations is held once), the storages of `exclude` not at all;
- booked (`bytes_of(key)`): per key, the bytes of each tensor saved while that key was open
  (Tensor.nbytes, a tensor saved twice once): what a schedule believes a micro-batch holds;
- live (live=True): each saved storage from the forward that saves it until autograd frees its
  last reference (a weakref finalizer on what the hook hands autograd): what stays allocated.
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
    """Count what autograd saves inside `with meter:` or `with meter.saving(key):`."""

    def __init__(self, exclude=(), live: bool = False):
        exclude = list(exclude)
        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        self._skip_ptrs = {t.data_ptr() for t in exclude}
        self._storages: dict = {}              # storage data_ptr -> (shape, dtype, bytes)
        self._booked: dict = {}                # key -> {tensor data_ptr: bytes}
        self.current = None
        self.live = live
        self._live: dict = {}                  # storage data_ptr -> [bytes, references]
        self.live_bytes = self.peak_live = 0

    # -- the hooks
    def pack(self, t):
        if t.layout != torch.strided:
            return t
        st = t.untyped_storage()
        sptr, n = st.data_ptr(), st.nbytes()
        if sptr not in self._skip and sptr not in self._storages:
            self._storages[sptr] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), n)
        if self.current is None or t.data_ptr() in self._skip_ptrs:
            return t
        self._booked.setdefault(self.current, {})[t.data_ptr()] = t.nbytes
        if not self.live or n == 0 or sptr in self._skip:
            return t
        if sptr in self._live:
            self._live[sptr][1] += 1
        else:
            self._live[sptr] = [n, 1]
            self.live_bytes += n
            self.peak_live = max(self.peak_live, self.live_bytes)
        held = _Saved(t.detach())
        weakref.finalize(held, self._release, sptr)
        return held

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Saved) else held

    def _release(self, sptr):
        entry = self._live[sptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[sptr]
            self.live_bytes -= entry[0]

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

    def bytes_of(self, key) -> int:
        """Bytes booked under `key`, forgotten afterwards (its backward frees them)."""
        return sum(self._booked.pop(key, {}).values())


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
