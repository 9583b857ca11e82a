"""What comes back from the ranks, through files in the run's folder: each rank's return value
(`result<rank>.pkl`, cloudpickle, tensors moved to the CPU), its traceback if it raised
(`error<rank>.txt`, stamped with the time, so the first failure is told from its effects), and
what it printed (`out<rank>.txt`, relayed to the notebook marked with the rank).

Every file is written whole or not at all (write, then rename), so the parent never reads half.
"""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from labkit.launch.errors import RankError


def to_cpu(obj):
    """Tensors (also inside lists, tuples and dicts) detached and moved to the CPU."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if type(obj) in (list, tuple):
        return type(obj)(to_cpu(o) for o in obj)
    if type(obj) is dict:
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- rank side
def send_result(rundir: Path, rank: int, result) -> None:
    import cloudpickle

    write_atomic(rundir / f"result{rank}.pkl", cloudpickle.dumps(to_cpu(result)))


def send_error(rundir: Path, rank: int, text: str) -> None:
    write_atomic(rundir / f"error{rank}.txt", f"{time.time()!r}\n{text}".encode())


# ----------------------------------------------------------------------------- parent side
def has_error(rundir: Path, rank: int) -> bool:
    return (rundir / f"error{rank}.txt").exists()


def has_result(rundir: Path, rank: int) -> bool:
    return (rundir / f"result{rank}.pkl").exists()


def receive_results(rundir: Path, n: int) -> list:
    import cloudpickle

    return [cloudpickle.loads((rundir / f"result{r}.pkl").read_bytes()) for r in range(n)]


def rank_error(procs, rundir: Path) -> RankError:
    """The first failure (by time; a rank killed by a signal first), with its traceback."""
    failures = []  # (time, rank, text)
    for r, p in enumerate(procs):
        f = rundir / f"error{r}.txt"
        if f.exists():
            stamp, _, text = f.read_text().partition("\n")
            failures.append((float(stamp), r, text))
        elif p.poll() not in (None, 0):
            code = p.poll()
            why = (f"killed by signal {signal.Signals(-code).name}" if code < 0
                   else f"exit code {code}")
            # A rank killed by a signal is almost always the cause: its peers' errors
            # ("connection reset") are the effect, so it sorts first.
            failures.append((float("-inf") if code < 0 else float("inf"), r,
                             f"rank {r} died ({why}) without a Python traceback"))
    failures.sort()
    _, rank, text = failures[0]
    last = text.strip().splitlines()[-1] if text.strip() else "died"
    others = [r for _, r, _ in failures[1:]]
    tail = (f"\n(ranks {others} failed after it, most likely because rank {rank} stopped)"
            if others else "")
    msg = f"rank {rank} failed: {last}\n\n--- traceback from rank {rank} ---\n{text.rstrip()}{tail}"
    return RankError(rank, msg, text, others)


_NOISE = re.compile(r"^\s*$|^\[Gloo\] Rank \d+ is connected to|ProcessGroupGloo")


class Echo:
    """Relay what each rank prints to this process's stdout (the notebook), marked by rank."""

    def __init__(self, rundir: Path, n: int):
        self.files = [rundir / f"out{r}.txt" for r in range(n)]
        self.offsets = [0] * n
        self.partial = [b""] * n

    def pump(self, final: bool = False) -> None:
        for r, path in enumerate(self.files):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[r])
                    data = f.read()
            except OSError:
                continue
            self.offsets[r] += len(data)
            lines = (self.partial[r] + data).split(b"\n")
            self.partial[r] = b"" if final else lines.pop()
            for line in lines:
                text = line.decode("utf-8", "replace")
                if not _NOISE.search(text):
                    print(f"[rank {r}] {text}", flush=True)
