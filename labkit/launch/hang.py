"""The hang report: where each rank was when a run stopped making progress.

Two things make it: `note(text)`, which a rank calls to say what it is doing (a slot of a
shared-memory file, cheap enough for every step), and the Python stack of every rank, dumped by
faulthandler on SIGUSR1 when the parent declares a hang. The parent formats both into a
HangError that reads like a traceback per rank.
"""
from __future__ import annotations

import faulthandler
import linecache
import mmap
import os
import re
import signal
import time
from pathlib import Path

from labkit.launch import source
from labkit.launch.errors import HangError

NOTE_BYTES = 512
_note_slot = None  # this rank's slice of the shared notes file (set in the rank by attach)


def note(text: str) -> None:
    """Record what this rank is doing now; a HangError shows each rank's latest note.

    Cheap enough to call every step (it writes into shared memory). A no-op outside `run`."""
    if _note_slot is not None:
        data = text.encode("utf-8", "replace")[: NOTE_BYTES - 1] + b"\0"
        _note_slot[: len(data)] = data


def create_notes(rundir: Path, n: int) -> None:
    """In the parent, before the ranks start: one empty slot per rank."""
    (rundir / "notes.bin").write_bytes(bytes(n * NOTE_BYTES))


def attach(rundir: Path, rank: int) -> None:
    """In a rank: dump the stack to stack<rank>.txt on SIGUSR1, and write notes to our slot."""
    global _note_slot
    stack_file = open(rundir / f"stack{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    with open(rundir / "notes.bin", "r+b") as f:
        _note_slot = memoryview(mmap.mmap(f.fileno(), 0))[rank * NOTE_BYTES:(rank + 1) * NOTE_BYTES]


_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def format_stack(raw: str, names: dict | None = None) -> str:
    """faulthandler's dump (innermost first) -> a Python-style traceback with source lines.
    names: {file: "Cell In[5]"}, the reader's names for notebook cells (labkit.launch.source)."""
    frames = []
    for line in raw.splitlines():
        m = _FRAME.match(line)
        if not m:
            continue
        file, lineno, func = m["file"], int(m["line"]), m["func"]
        if source.hidden(file):
            continue
        frames.append((file, lineno, func))
    out = []
    for file, lineno, func in reversed(frames):
        out.append(source.frame_line(file, lineno, func, names or {}))
        src = linecache.getline(file, lineno).strip()
        if src:
            out.append(f"    {src}")
    return "\n".join(out) if out else "  (no Python frame: the rank was starting or exiting)"


def hang_error(procs, rundir: Path, timeout: float, done, names: dict | None = None,
               starting=False) -> HangError:
    """Ask every live rank for its stack, then build the report (notes, stacks, finished ranks)."""
    notes_raw = (rundir / "notes.bin").read_bytes()
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(0.3)
    stacks, notes, parts = {}, {}, []
    for r in range(len(procs)):
        note = notes_raw[r * NOTE_BYTES:(r + 1) * NOTE_BYTES].split(b"\0", 1)[0]
        notes[r] = note.decode("utf-8", "replace")
        if done[r]:
            stacks[r] = "(finished)"
        else:
            stack_file = rundir / f"stack{r}.txt"
            raw = stack_file.read_text() if stack_file.exists() else ""
            stacks[r] = format_stack(raw, names)
        head = f"rank {r}: " + ("finished" if done[r] else "stuck")
        if notes[r]:
            head += f" (last note: {notes[r]})"
        parts.append(head + ("" if done[r] else "\n" + stacks[r]))
    if starting:
        msg = (f"the ranks did not all start within {timeout:g}s (a very busy machine, or an "
               f"import that blocks). Where each rank was:\n\n" + "\n\n".join(parts))
    else:
        msg = (f"the run did not finish within timeout={timeout:g}s: a hang. Most often a send "
               f"without its matching recv, or a collective some rank never called. Where each "
               f"rank was:\n\n" + "\n\n".join(parts))
    return HangError(msg, stacks, notes)
