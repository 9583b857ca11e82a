"""Chapter 06 fault tolerance: straggler detection and heartbeat health checks on real ranks."""
import pytest

from labkit import faults
from labkit.launch import run


def test_find_stragglers_pure():
    times = [[1.0, 1.1, 0.9], [1.0, 5.0, 1.0], [3.0, 3.1, 2.9]]  # rank 1: one hiccup only
    found = faults.find_stragglers(times, threshold=1.5)
    assert [r for r, _ in found] == [2]
    assert found[0][1] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="threshold"):
        faults.find_stragglers(times, threshold=1.0)


def test_straggler_is_reported_on_every_rank():
    out = run(faults.straggler_job, 3, args=(1, 4.0, 6, 0.01), echo=False)
    for medians, found in out:
        assert [r for r, _ in found] == [1], f"expected rank 1 to be flagged, got {found}"
        assert medians[1] > 2 * medians[0]


def test_frozen_rank_is_detected_within_the_bound(tmp_path):
    interval, timeout, every = 0.1, 0.5, 0.05
    silent, delay, bound = run(faults.health_job, 3, args=(str(tmp_path), 2, interval, timeout,
                                                           every), echo=False)[0]
    assert silent == [2], f"only the frozen rank should be reported, got {silent}"
    # the scheduler on a busy 2-core machine may add a little: allow 0.5 s of slack
    assert timeout - interval <= delay <= bound + 0.5
    with pytest.raises(ValueError, match="shorter than timeout"):
        faults.detection_bound(1.0, 0.5, 0.05)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_restarts_after_sigkill_and_matches_uninterrupted_run(tmp_path):
    """A rank SIGKILLs itself at step 7; torchrun restarts both; the end state is bitwise equal."""
    import os
    import subprocess
    import sys

    import torch

    from labkit.labs.checkpoint.resume import RunConfig, resume_jobs

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "params.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--nnodes", "1",
           "-m", "labkit.cli", "run", "train_ft", "--steps", "12", "--save-every", "3",
           "--kill-rank", "1", "--kill-step", "7", "--ckpt", str(tmp_path / "ckpt"),
           "--out", str(out)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=root)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr, "rank 1 should have been SIGKILLed"
    assert "resumed at step 6" in proc.stdout, proc.stdout[-1000:]
    straight = run(resume_jobs, 2, args=(RunConfig(), 12, None, str(tmp_path / "ref"),
                                         ("straight",)), echo=False)
    assert torch.equal(torch.load(out, weights_only=True), straight[0][0][0])
