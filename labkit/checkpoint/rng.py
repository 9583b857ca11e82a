"""Every random generator a training step may draw from, captured and restored.

Four generators are in play on every rank: Python's `random` (e.g. data augmentation), NumPy's
global generator (shuffling in many data loaders), torch's CPU generator (dropout, randperm) and
one CUDA generator per GPU (dropout on the GPU). A resumed run that restores the weights but not
these draws different dropout masks and a different data order from the step it resumes at:
its loss curve looks fine and its weights are not the ones the uninterrupted run would have.

The captured state is plain tensors, ints and floats, so it survives
`torch.load(weights_only=True)` (no NumPy arrays or tuples of unknown types are unpickled).
"""
from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """Capture Python, NumPy, torch CPU and every CUDA device's generator state."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "mt": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]  # one per device
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` captured (the inverse, generator by generator)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["mt"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda"):
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(state["cuda"]):
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise RuntimeError(f"the checkpoint holds RNG state for {len(state['cuda'])} CUDA "
                               f"device(s); this process sees {have}")
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    """Seed all four generators (what a run does once, at step 0; never on resume)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
