"""End every process that still carries LABKIT_TEST_RUN=<run> in its environment (test.sh, on
exit, interrupted or not): a JupyterLab, a kernel, Chromium, a rank that double-forked into a
session of its own. Linux (/proc); elsewhere it does nothing.

    python scripts/reap.py RUN_ID [PID_TO_SPARE ...]
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def carriers(run: str, spare: set[int]) -> dict[int, str]:
    """pid -> command name of every process whose environment holds LABKIT_TEST_RUN=run."""
    want, found = f"LABKIT_TEST_RUN={run}".encode(), {}
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if pid in spare:
            continue
        try:
            if want in (entry / "environ").read_bytes().split(b"\0"):
                found[pid] = (entry / "comm").read_text().strip()
        except OSError:   # gone meanwhile, or not ours to read
            continue
    return found


def main(argv: list[str]) -> int:
    if len(argv) < 1 or not Path("/proc/self/environ").exists():
        return 0
    run, spare = argv[0], {os.getpid(), os.getppid(), *map(int, argv[1:])}
    left = carriers(run, spare)
    if not left:
        return 0
    names = ", ".join(f"{name} ({pid})" for pid, name in sorted(left.items())[:8])
    print(f"test.sh: ending {len(left)} process(es) the tests left running: {names}",
          file=sys.stderr)
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and (left := carriers(run, spare)):
            time.sleep(0.1)
        if not left:
            return 0
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
