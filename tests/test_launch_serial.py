"""labkit.launch.serial: where LABKIT_RUN_LOCK is set (./test.sh), runs of 4 ranks or more take
turns; smaller runs, and runs started inside a run that holds the turn, never wait."""
import subprocess
import sys
import time

from labkit.launch import serial

HOLDER = """
import sys, time
from labkit.launch import serial
with serial.turn(4):
    open(sys.argv[1] + ".start", "w").close()
    while not __import__("os").path.exists(sys.argv[1] + ".go"):
        time.sleep(0.01)
    open(sys.argv[1] + ".end", "w").close()
"""


def _holder(tmp_path, monkeypatch):
    lock = tmp_path / "lock"
    monkeypatch.setenv("LABKIT_RUN_LOCK", str(lock))
    monkeypatch.delenv(serial.HELD, raising=False)
    mark = str(tmp_path / "holder")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, mark])
    deadline = time.monotonic() + 120
    while not (tmp_path / "holder.start").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the holder never took its turn"
        time.sleep(0.01)
    return proc, tmp_path / "holder"


def test_a_run_of_four_ranks_waits_for_the_one_holding_the_turn(tmp_path, monkeypatch):
    proc, mark = _holder(tmp_path, monkeypatch)
    # let the holder finish only once this process is waiting; it enters only after that
    subprocess.Popen([sys.executable, "-c", "import time, pathlib; time.sleep(0.5); "
                      f"pathlib.Path({str(mark)!r} + '.go').touch()"])
    with serial.turn(4):
        assert (tmp_path / "holder.end").exists(), "entered while another run of 4 held the turn"
    assert proc.wait(60) == 0


def test_small_runs_and_runs_inside_a_held_turn_never_wait(tmp_path, monkeypatch):
    proc, mark = _holder(tmp_path, monkeypatch)
    with serial.turn(3):
        assert not (tmp_path / "holder.end").exists()
    monkeypatch.setenv(serial.HELD, "1")       # the ranks of a run that holds the turn
    with serial.turn(8):
        assert not (tmp_path / "holder.end").exists()
    (tmp_path / "holder.go").touch()
    assert proc.wait(60) == 0


def test_without_the_variable_nothing_waits(tmp_path, monkeypatch):
    monkeypatch.delenv("LABKIT_RUN_LOCK", raising=False)
    with serial.turn(64):
        pass
