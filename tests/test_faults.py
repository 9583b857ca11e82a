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
