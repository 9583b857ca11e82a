"""Asynchronous checkpointing: training waits only for a copy to CPU memory, not for the disk.

    saver = AsyncSaver()
    saver.save(model.state_dict(), lambda snap: save_local(root, step, snap))  # returns quickly
    ...                                    # training goes on while a thread writes the files
    saver.wait()                           # before exit (or the next save waits by itself)

Two rules make it safe:
- snapshot first: the tensors are copied (GPU -> pinned CPU memory on a GPU) before save()
  returns, so the optimizer may change the weights right away without tearing the checkpoint;
- at most one save in flight: a save that finds the previous one still writing waits for it,
  so snapshots cannot pile up in memory and commits happen in step order.
The stall per save is then the copy (bytes / copy bandwidth) instead of bytes / disk bandwidth.
"""
from __future__ import annotations

import threading

import torch

from labkit.checkpoint import atomic
from labkit.timing import now


def _device_of(state):
    """The device of the first tensor in a (nested) state, or None: the clock waits for it."""
    if torch.is_tensor(state):
        return state.device
    values = state.values() if isinstance(state, dict) else \
        state if isinstance(state, (list, tuple)) else ()
    for v in values:
        d = _device_of(v)
        if d is not None:
            return d
    return None


def snapshot(state):
    """A private CPU copy of every tensor in a (nested) state: what the background thread writes."""
    if torch.is_tensor(state):
        if state.is_cuda:  # pinned memory makes the device-to-host copy fast (and async-capable)
            out = torch.empty(state.shape, dtype=state.dtype, pin_memory=True)
            return out.copy_(state.detach())
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    return state


def save_local(root, step: int, state) -> None:
    """One process's atomic checkpoint: `step_XXXXXXXX/state.pt` + meta.json, then `latest`."""
    name = atomic.step_name(step)
    tmp = atomic.begin(root, name)
    files = {"state.pt": atomic.save_file(state, tmp / "state.pt")}
    atomic.commit(root, name, {"kind": "local", "step": step, "world": 1, "files": files})


class AsyncSaver:
    """Copy to CPU in the caller, write in a background thread; at most one save in flight."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.stalls: list = []  # seconds each save() kept the caller waiting

    def save(self, state, write) -> float:
        """Snapshot `state`, start `write(snapshot)` in the background; return the stall (s)."""
        dev = _device_of(state)
        t0 = now(dev)  # on a GPU: after the queued kernels that write `state` have run
        self.wait()  # the previous save must be on disk before a new one starts
        snap = snapshot(state)
        self._thread = threading.Thread(target=self._run, args=(write, snap), daemon=True,
                                        name="labkit-async-save")
        self._thread.start()
        stall = now(dev) - t0
        self.stalls.append(stall)
        return stall

    def _run(self, write, snap):
        try:
            write(snap)
        except BaseException as err:  # noqa: BLE001 - reported by the next wait()
            self._error = err

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"the background checkpoint save failed: {err}") from err


def measure_stall(root, mbytes: float = 64, saves: int = 3, work_s: float = 0.05) -> dict:
    """Blocking vs async save of a `mbytes` MB state, between bursts of `work_s` of compute.

    Returns the median stall per save (s) of each and the time of the whole loop."""
    state = {"w": torch.randn(int(mbytes * 1e6 / 4))}  # cpu: a host-memory lesson; fp32, 4 B each
    a = torch.randn(256, 256)  # cpu: the "training" burst beside it
    out = {}
    for mode in ("blocking", "async"):
        saver, stalls = AsyncSaver(), []
        t_start = now()
        for i in range(saves):
            t_end = now() + work_s
            while now() < t_end:  # "training": compute that releases the GIL
                a = torch.tanh(a @ a)
            state["w"].add_(1.0)  # the weights change right after the save call returns
            t0 = now()
            if mode == "blocking":
                save_local(f"{root}/{mode}", i, state)
                stalls.append(now() - t0)
            else:
                def write(s, i=i, mode=mode):  # runs before this mode's saver.wait()
                    save_local(f"{root}/{mode}", i, s)

                stalls.append(saver.save(state, write))
        saver.wait()
        out[mode] = {"stall_s": sorted(stalls)[len(stalls) // 2],
                     "loop_s": now() - t_start}
    out["mbytes"] = mbytes
    return out
