"""Lab 07, sequence parallelism alone: the context lab without context parallelism.

    labkit run sequence [--nproc 2] [--seq 32 --batch 2]          (--nproc: the TP degree)
    torchrun --nproc-per-node 2 -m labkit run sequence

Activation bytes one block saves for backward, counted by saved-tensor hooks, for no
parallelism, TP, TP + SP, selective and full recomputation, beside labkit.costs.activations;
then Plan(tp=N, sp=True) trained through labkit.parallel against the one-process reference,
with its bytes per layer (comm log and the kernel's count) beside labkit.costs.parallel.
`labkit run context` adds the ring-attention runs.
"""
from __future__ import annotations

from labkit.labs.context import run_lab

BACKEND = "auto"  # as the context lab: its ranks put tensors on labkit.launch.device()


def main(argv=()):

    argv = list(argv)
    if any(a == "--cp" or a.startswith("--cp=") for a in argv):
        raise ValueError("labkit run sequence has no --cp (it is sequence parallelism alone): "
                         "use labkit run context --cp N")
    return run_lab(argv + ["--cp", "1"], "sequence")
