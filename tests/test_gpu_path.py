"""The GPU path on the CPU: every lab runs at --nproc 1 and says where it ran; the launcher says
when it fell back to Gloo; scripts/gpu-smoke.sh exits with its "no GPU" code here.

The labs run in this process on a one-rank Gloo group (`one_rank`: labkit.launch.run replaced by
a direct call), so each costs a second, not a launch: what is checked is the lab's own output
(its header line, its ratios where the formula predicts 0 bytes), not the launcher."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import labkit.launch
from labkit.launch import rendezvous

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A one-rank Gloo group in this process; labkit.launch.run calls the function here."""
    monkeypatch.setenv("RANK", "0")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=60))

    def run(fn, nprocs, args=(), kwargs=None, **_):
        assert nprocs == 1
        return [fn(*args, **(kwargs or {}))]

    monkeypatch.setattr(labkit.launch, "run", run)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ring_at_one_rank_prints_na_not_a_zero_division(one_rank, capsys):
    from labkit.labs import ring

    assert ring.main(["--nproc", "1", "--sizes-mib", "0.0625", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "backend gloo, device cpu" in out
    assert "n.a." in out and "one rank has no peer" in out


def test_ring_ratio_text():
    from labkit.labs.ring import ratio

    assert ratio(0, 0) == "n.a." and ratio(None, 5) == "-" and ratio(10, 4) == "2.500"


def test_tp_at_one_rank_prints_na_not_a_zero_division(one_rank, capsys):
    from labkit.labs import tp

    assert tp.main(["--nproc", "1", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "backend gloo, device cpu" in out
    assert "formula: 0, TP=1 has no shards to sum" in out
    assert "ratio n.a." in out or "not counted" in out


@pytest.mark.parametrize("lab, argv", [
    ("ddp", ["--steps", "1", "--versions", "bucketed"]),
    ("precision", ["--steps", "2"]),
])
def test_lab_header_says_backend_and_device(one_rank, capsys, lab, argv):
    import importlib

    mod = importlib.import_module(f"labkit.labs.{lab}")
    assert mod.main(["--nproc", "1", *argv]) == 0
    out = capsys.readouterr().out
    assert "backend gloo, device cpu (rank 0" in out


def test_zero_rank_side_reports_where_it_ran(one_rank):
    from labkit.labs import zero

    res = zero._lab(0, 1, 2)
    assert res["ran_on"] == ("gloo", "cpu")


def test_zero_at_one_rank(one_rank, capsys):
    from labkit.labs import zero

    assert zero.main(["--nproc", "1", "--stages", "0", "--steps", "1"]) == 0
    assert "backend gloo, device cpu (rank 0)" in capsys.readouterr().out


def test_auto_backend_says_once_that_it_fell_back_to_gloo(monkeypatch, capsys):
    monkeypatch.setattr(rendezvous, "gpu_count", lambda: 1)
    monkeypatch.setattr(rendezvous, "_FELL_BACK", set())
    monkeypatch.setenv("RANK", "0")
    assert rendezvous.resolve_backend("auto", 1) == "nccl"
    assert capsys.readouterr().out == ""
    assert rendezvous.resolve_backend("auto", 2) == "gloo"
    assert rendezvous.resolve_backend("auto", 2) == "gloo"
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out                       # once per process
    assert "2 ranks asked for, 1 GPU(s)" in out and "Gloo on the CPU" in out
    assert "Duplicate GPU detected" in out and "--nproc 1" in out
    monkeypatch.setattr(rendezvous, "gpu_count", lambda: 0)  # no GPU: nothing to say
    assert rendezvous.resolve_backend("auto", 3) == "gloo"
    assert capsys.readouterr().out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the labs")
def test_gpu_smoke_script_exits_with_its_no_gpu_code_on_the_cpu():
    env = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-smoke.sh")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no GPU visible" in r.stderr and "Traceback" not in r.stderr
    assert "0 GPU(s)" in r.stdout


def test_gpu_smoke_script_runs_every_gpu_lab_and_calibrate():
    text = (ROOT / "scripts" / "gpu-smoke.sh").read_text()
    labs = text.split('LABS="', 1)[1].split('"', 1)[0].split()
    assert set(labs) == {"ring", "tp", "hybrid", "ddp", "zero", "precision"}
    assert "labkit calibrate --quick" in text
