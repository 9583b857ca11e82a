"""Every chapter's lab as a script: `labkit run NAME --nproc N` and the same under torchrun.

Each lab runs as a reader would run it (a subprocess), with tiny options, and must exit 0, print
a progress line per phase and end with its table; under torchrun rank 0 prints them once. Bad
input exits 2 with one line and no traceback.
"""
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import chapters

ROOT = Path(__file__).resolve().parent.parent

# lab -> (quick options, a line of its final table that must appear): the manifest's
LABS = {x.name: (list(x.quick), x.table) for x in chapters.labs()}
# RNG bit-equality, files, a killed rank, emulated per-rank links: CPU lessons
CPU_ONLY = ("checkpoint", "train_ft", "moe_dispatch")
# "backend B, device D" in their table
GPU_READY = ("ring", "tp", "pipeline", "hybrid", "overlap", "overlap_tp", "overlap_cp",
             "overlap_zero3", "hsdp", "zeropp", "ddp", "zero", "precision", "intro", "sequence",
             "context")
PROGRESS = re.compile(r"^\[(\w+)\] .*\((\d+/\d+, )?\d+\.\d s\)$", re.M)


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p))


def _labkit(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "labkit", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _torchrun(*args, timeout=240):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    return subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "labkit",
                           *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _progress_lines(name, stdout):
    return [m.group(0) for m in PROGRESS.finditer(stdout) if m.group(1) == name]


def test_every_chapter_has_a_lab_and_every_lab_exists():
    missing = [c.nn for c in chapters.CHAPTERS if not c.labs]
    assert not missing, f"chapters without a lab in labkit.chapters: {missing}"
    for x in chapters.labs():
        mod = importlib.import_module(f"labkit.labs.{x.name}")
        assert callable(getattr(mod, "main", None)), f"labkit.labs.{x.name} has no main()"
        # "gloo": its lesson is on the CPU, so `labkit run` hides the GPUs from it
        assert getattr(mod, "BACKEND", None) == ("gloo" if x.name in CPU_ONLY else "auto"), x.name
        assert x.table, f"lab {x.name}: no `table` line in labkit.chapters"
    out = _labkit("list", timeout=60)
    assert out.returncode == 0, out.stderr
    for c in chapters.CHAPTERS:
        assert re.search(rf"^\s+{c.nn} .*{', '.join(c.lab_names)}$", out.stdout, re.M), out.stdout
    assert "(no chapter)" not in out.stdout, "a module in labkit/labs/ that no chapter lists"
    assert re.search(rf"^backend: NCCL where .*always Gloo .*: {', '.join(sorted(CPU_ONLY))}$",
                     out.stdout, re.M), out.stdout


# The two-process runs are the README's own lines now: tests/test_documented_commands.py runs
# every documented `labkit run` as written and checks what these did (marker, progress before the
# table, the backend line, train_ft's temporary folder and bit-for-bit resume).


@pytest.mark.parametrize("name,opts", [
    ("ring", ["--sizes-mib", "0.0625", "--repeats", "1"]),
    ("hybrid", ["--steps", "1", "--batch", "4"]),               # defaults: dp 3 x tp 1
    ("tp", ["--steps", "1", "--batch", "2", "--n-layer", "1", "--n-head", "3", "--n-embd", "24",
            "--block-size", "8"]),
])
def test_lab_runs_on_three_local_processes(name, opts):
    out = _labkit("run", name, "--nproc", "3", *opts)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert LABS[name][1] in out.stdout, out.stdout[-2000:]
    assert _progress_lines(name, out.stdout)
    if name == "hybrid":
        assert "dp 3 x tp 1" in out.stdout and "r2(p0 d2 t0)" in out.stdout


# Under torchrun per commit (tests/conftest.py): the labs with a torchrun branch of their own
# (checkpoint, train_ft, hybrid's WORLD_SIZE), one crossover lab (labs/_crossover.py) and ring
# for the rank-0-prints pattern the others share; every lab under torchrun: ./test.sh --full.
TORCHRUN_PER_COMMIT = ("checkpoint", "hybrid", "overlap", "ring", "train_ft")


@pytest.mark.parametrize("name", sorted(LABS))
def test_lab_runs_under_torchrun(name):
    opts, marker = LABS[name]
    if name == "train_ft":
        opts = ["--steps", "4", "--save-every", "2", "--kill-step", "-1"]  # restarts: test_faults
    if name == "hsdp":      # torchrun's 2 ranks: one replica of a 2-rank shard group
        opts = [*opts, "--replicate", "1"]
    out = _torchrun("run", name, *opts)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count(marker) == 1, out.stdout[-3000:]        # rank 0 only
    lines = _progress_lines(name, out.stdout)
    assert lines and len(lines) == len(set(lines)), out.stdout[-2000:]


def test_bad_topology_exits_2_with_one_clear_line():
    out = _labkit("run", "hybrid", "--nproc", "2", "--dp", "3", "--tp", "2", timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in out.stderr, out.stderr
    assert err[0].startswith("labkit: ") and "3 x 2" in err[0] and "2 ranks" in err[0], err[0]
    assert out.stdout == ""


def test_other_bad_input_exits_2_without_traceback():
    for args in (["tp", "--nproc", "3"],                      # 4 heads over 3 ranks
                 ["intro", "--nproc", "1"],
                 ["pipeline", "--nproc", "2", "--K", "8", "--batch", "4"]):
        out = _labkit("run", *args, timeout=60)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr and out.stderr.startswith("labkit: "), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def _fails_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 trips on purpose")
    return 0


def test_a_failing_rank_still_shows_its_report(capsys):
    """A ValueError inside a rank is a RankError, not bad input: exit 1 with the rank's report."""
    from labkit import cli
    from labkit.launch import run

    code = cli.run_lab_main("demo", lambda argv: run(_fails_on_rank_1, 2, echo=False), [])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "rank 1 failed" in err and "rank 1 trips on purpose" in err
    assert "--- traceback from rank 1 ---" in err


def test_hybrid_defaults_fit_any_world_and_keep_what_was_given():
    from labkit.labs.hybrid import default_dims
    from labkit.topology import Topology, TopologyError

    for n in range(1, 9):
        dp, tp, pp = default_dims(n)
        Topology(n, dp=dp, tp=tp, pp=pp)                     # fits: no error
        assert tp == (2 if n % 2 == 0 else 1) and pp == 1
    assert default_dims(4, dp=4) == (4, 1, 1)
    assert default_dims(8, tp=4) == (2, 4, 1)
    assert default_dims(6, pp=2) == (3, 1, 2)
    assert default_dims(2, dp=3, tp=2) == (3, 2, 1)          # kept: check_plan reports it
    assert default_dims(4, tp=2, pp=2) == (1, 2, 2)          # TP x PP composes now
    with pytest.raises(TopologyError, match="positive integer"):
        default_dims(0)


def test_gpus_are_hidden_only_from_the_cpu_lessons(monkeypatch):
    """`labkit run` hides the GPUs (CUDA_VISIBLE_DEVICES="") from checkpoint and train_ft only;
    the other labs choose NCCL themselves where there is a GPU per rank."""
    from labkit import cli

    hidden = []
    monkeypatch.setattr(cli, "_hide_gpus", lambda: hidden.append(True))
    monkeypatch.setattr(cli, "run_lab_main", lambda name, main, rest: 0)
    for name in sorted(LABS):
        hidden.clear()
        assert cli._run_lab(name, []) == 0
        assert bool(hidden) == (name in CPU_ONLY), name
