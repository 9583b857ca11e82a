"""Kill a process in the middle of a save, for real, and look at what is left on disk.

    crash_during_save(root, atomic=True)   # -> what `latest` points to and whether it loads
    crash_during_save(root, atomic=False)  # the naive torch.save(obj, "ckpt.pt"): truncated

A child process saves step 1 completely, then starts saving step 2 and is SIGKILLed once it
has written part of it (the atomic saver has written one file of the new checkpoint; the naive
one has written half of the file under its final name).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import labkit

_ATOMIC = textwrap.dedent("""
    import sys, time, torch
    from labkit.checkpoint import atomic
    from labkit.checkpoint.full import save_full
    from labkit.labs.checkpoint.resume import RunConfig, build
    root = sys.argv[1]
    model, opt, data = build(RunConfig())
    save_full(root, 1, model, opt)
    print("saved 1", flush=True)
    real = atomic.save_file
    def slow(obj, path):  # write the file, then hang: the kill lands in the middle of a save
        info = real(obj, path)
        print("wrote", path.name, flush=True)
        time.sleep(60)
        return info
    atomic.save_file = slow
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_full(root, 2, model, opt)
""")

_NAIVE = textwrap.dedent("""
    import io, os, sys, time, torch
    from labkit.labs.checkpoint.resume import RunConfig, build
    path = os.path.join(sys.argv[1], "ckpt.pt")
    model, opt, data = build(RunConfig())
    torch.save({"model": model.state_dict()}, path)
    print("saved 1", flush=True)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    data = buf.getvalue()
    with open(path, "wb") as f:  # the naive way: overwrite the only copy in place
        f.write(data[: len(data) // 2])
        f.flush()
        print("wrote half", flush=True)
        time.sleep(60)
        f.write(data[len(data) // 2:])
""")


def crash_during_save(root, atomic: bool = True, timeout: float = 60.0) -> list:
    """Run the saver, SIGKILL it mid-save; return the lines it printed before dying."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    package_root = str(Path(labkit.__file__).resolve().parents[1])   # the folder holding labkit/
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in [package_root, os.environ.get("PYTHONPATH")] if p))
    proc = subprocess.Popen([sys.executable, "-c", _ATOMIC if atomic else _NAIVE, str(root)],
                            stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.startswith("wrote"):
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if not any(line.startswith("wrote") for line in lines):
        raise RuntimeError(f"the saver never reached the middle of its save: {lines}")
    return lines
