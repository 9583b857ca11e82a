"""labkit.launch: results, errors, hangs, cleanup, isolation, notebook-defined functions."""
import os
import time
from pathlib import Path

import psutil
import pytest
import torch

from labkit.launch import HangError, LaunchError, RankError, resolve_backend, run


def _children():
    """This process's live descendants, less the warm zygote (a helper kept between runs, which
    no run leaves behind: it has no rank of its own)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            zygote = "labkit/launch/zygote.py" in " ".join(p.cmdline())
            if p.status() != psutil.STATUS_ZOMBIE and not zygote:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def _rank_and_sum(offset):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank() + offset, dist.get_world_size(), t.item()


def test_results_in_rank_order_and_args():
    out = run(_rank_and_sum, 3, args=(10,))
    assert out == [(10, 3, 3.0), (11, 3, 3.0), (12, 3, 3.0)]
    assert not _children()


def test_closure_and_lambda_sent_by_value():
    factor = 7  # captured: the function is pickled by value, as a notebook's would be
    out = run(lambda: __import__("torch.distributed").distributed.get_rank() * factor, 2)
    assert out == [0, 7]


def _raise_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("bad value on purpose")
    dist.barrier()  # the others wait here until they are stopped


def test_rank_error_reports_rank_and_traceback_and_stops_others():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run(_raise_on_rank_one, 3, timeout=60)
    assert time.monotonic() - start < 20  # the others were stopped, not waited out
    err = info.value
    assert err.rank == 1
    assert "ValueError: bad value on purpose" in str(err)
    assert "_raise_on_rank_one" in err.remote_traceback
    assert not _children()


def _unmatched_recv():
    import torch
    import torch.distributed as dist

    from labkit.launch import note

    note(f"rank {dist.get_rank()} waiting")
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)  # nobody sends
    return "done"


def test_hang_reports_each_rank_stack_and_cleans_up():
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        run(_unmatched_recv, 2, timeout=4)
    assert time.monotonic() - start < 15
    err = info.value
    assert "_unmatched_recv" in err.stacks[0] and "dist.recv" in err.stacks[0]
    assert err.stacks[1] == "(finished)"
    assert err.notes[0] == "rank 0 waiting"
    assert "rank 0: stuck" in str(err)
    assert not _children()


def test_rank_killed_by_signal_is_reported():
    def die():
        import os
        import signal

        import torch.distributed as dist

        if dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()

    with pytest.raises(RankError) as info:
        run(die, 2, timeout=30)
    assert info.value.rank == 0 and "SIGKILL" in str(info.value)
    assert not _children()


def test_back_to_back_runs_do_not_collide():
    for _ in range(2):
        assert [r[0] for r in run(_rank_and_sum, 2, args=(0,))] == [0, 1]


def test_bad_input_errors_name_the_numbers():
    with pytest.raises(LaunchError, match="positive integer"):
        run(_rank_and_sum, 0)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(LaunchError, match=rf"{gpus + 1} ranks asked for, {gpus} GPU"):
        resolve_backend("nccl", gpus + 1)   # one rank more than GPUs, on any machine
    with pytest.raises(LaunchError, match="unknown backend"):
        run(_rank_and_sum, 2, backend="mpi")
    assert resolve_backend("auto", 2) in ("gloo", "nccl")


def _listening_ports():
    import psutil

    me = psutil.Process()
    found = []
    for p in [me] + me.children(recursive=True):
        try:
            found += [c.laddr for c in p.net_connections(kind="inet") if c.status == "LISTEN"]
        except psutil.Error:
            pass
    return found


def _report_listeners():
    import torch
    import torch.distributed as dist

    dist.barrier()
    t = torch.ones(4)
    dist.all_reduce(t)
    import psutil

    return [(c.laddr.ip, c.status) for c in psutil.Process().net_connections(kind="inet")
            if c.status == "LISTEN"]


def test_nothing_listens_beyond_loopback():
    for listeners in run(_report_listeners, 2):
        for ip, _ in listeners:
            assert ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1"), f"a rank listens on {ip}"


def test_rank_prints_are_echoed_with_rank(capsys):
    run(lambda: print("hello from a rank"), 2)
    out = capsys.readouterr().out
    assert "[rank 0] hello from a rank" in out and "[rank 1] hello from a rank" in out


def test_keyboard_interrupt_ends_children(monkeypatch):
    """Interrupting the kernel raises KeyboardInterrupt inside run(): every child must go."""
    import labkit.launch.process as process

    calls = {"n": 0}
    real_sleep = time.sleep

    def interrupting_sleep(s):
        calls["n"] += 1
        if calls["n"] == 50:  # the ranks are up and waiting
            raise KeyboardInterrupt
        real_sleep(s)

    monkeypatch.setattr(process.time, "sleep", interrupting_sleep)
    with pytest.raises(KeyboardInterrupt):
        run(_unmatched_recv, 2, timeout=60)
    monkeypatch.undo()
    assert not _children()


def test_two_runs_at_once_do_not_collide():
    """Two notebooks launching at the same moment: separate rendezvous, no shared port."""
    import threading

    results = {}

    def go(key):
        results[key] = run(_rank_and_sum, 2, args=(key,))

    threads = [threading.Thread(target=go, args=(k,)) for k in (100, 200)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert [r[0] for r in results[100]] == [100, 101]
    assert [r[0] for r in results[200]] == [200, 201]


def test_function_defined_in_a_notebook_cell(tmp_path):
    """A function defined in a kernel's cell (module __main__) runs on the ranks."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "from labkit.launch import run\n"
        "def double_rank():\n"
        "    import torch.distributed as dist\n"
        "    return 2 * dist.get_rank()\n"
        "print(run(double_rank, 3))")]
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert "[0, 2, 4]" in nb.cells[0].outputs[-1]["text"]


def test_same_lab_runs_from_cli_and_under_torchrun():
    """`labkit run ring` on local processes, and the same lab with one rank per torchrun process."""
    import shutil
    import subprocess
    import sys

    local = subprocess.run([sys.executable, "-m", "labkit", "run", "ring", "--nproc", "2",
                            "--sizes-mib", "0.0625", "--repeats", "1"],
                           capture_output=True, text=True, timeout=180)
    assert local.returncode == 0, local.stderr[-2000:]
    assert "parameter_server" in local.stdout and "65,536" in local.stdout
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    tr = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "labkit", "run",
                         "ring", "--sizes-mib", "0.0625", "--repeats", "1"],
                        capture_output=True, text=True, timeout=180)
    assert tr.returncode == 0, tr.stderr[-2000:]
    assert tr.stdout.count("parameter_server") == 1  # only rank 0 prints the table


def test_reaped_rank_waits_for_its_status_before_the_folder_goes(tmp_path):
    # The zygote reaps a rank, then writes exit<rank>. A poll between the two used to report the
    # rank dead at once; the parent then deleted the run folder while the zygote wrote into it,
    # leaving /tmp/labkit-run-* folders behind. Now the status gets a grace period.
    import subprocess
    import sys

    from labkit.launch import warm

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid is gone, and no status file exists
    rank = warm.ForkedRank(child.pid, tmp_path, 0)
    assert rank.poll() is None  # not yet: the zygote may still be writing
    (tmp_path / "exit0").write_text("0")
    assert rank.poll() == 0  # the written status wins
    (tmp_path / "exit0").unlink()
    time.sleep(warm._STATUS_GRACE + 0.1)
    assert rank.poll() == -9  # no status after the grace period: the zygote died


def test_run_folders_of_a_killed_launcher_are_swept(tmp_path):
    # A kernel killed mid-cleanup (a grader's cell timeout) leaves its run folder behind; the
    # next launch removes folders whose owner is gone, and only those.
    import subprocess
    import sys
    import tempfile

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = Path(tempfile.mkdtemp(prefix="labkit-run-"))
    (orphan / "owner").write_text(str(dead.pid))
    mine = Path(tempfile.mkdtemp(prefix="labkit-run-"))
    (mine / "owner").write_text(str(os.getpid()))
    try:
        assert run(lambda: 1, 1, echo=False) == [1]
        assert not orphan.exists()
        assert mine.exists()
    finally:
        import shutil

        shutil.rmtree(mine, ignore_errors=True)
        shutil.rmtree(orphan, ignore_errors=True)
