"""The CLI checks its arguments before anything runs: one line on stderr saying what to change,
exit status 2, and the lab's main (which may run a one-process reference, then start ranks) is
never called."""
from __future__ import annotations

import importlib
import re

import pytest

from labkit import cli


@pytest.fixture
def ring_main_never_runs(monkeypatch):
    ring = importlib.import_module("labkit.labs.ring")
    calls = []
    monkeypatch.setattr(ring, "main", lambda argv=(): calls.append(argv) or 0)
    yield calls
    assert calls == [], f"the lab ran with bad arguments: {calls}"


def _one_line_error(capsys, code, *words):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    return err


@pytest.mark.parametrize("args", [["--nproc", "0"], ["--nproc=-1"], ["--nproc", "two"], ["--nproc"],
                                  ["--sizes-mib", "1", "--nproc", "0"]])
def test_run_refuses_bad_nproc_before_the_lab_runs(args, capsys, ring_main_never_runs):
    _one_line_error(capsys, cli.main(["run", "ring", *args]), "--nproc", "1 or more")


def test_run_accepts_positive_nproc(capsys, monkeypatch):
    ring = importlib.import_module("labkit.labs.ring")
    calls = []
    monkeypatch.setattr(ring, "main", lambda argv=(): calls.append(list(argv)) or 0)
    assert cli.main(["run", "ring", "--nproc", "3", "--repeats", "1"]) == 0
    assert calls == [["--nproc", "3", "--repeats", "1"]]


def test_run_unknown_lab(capsys):
    _one_line_error(capsys, cli.main(["run", "no_such_lab", "--nproc", "2"]), "no lab named",
                    "labkit list")


def test_grade_missing_file_says_so(capsys, tmp_path):
    missing = tmp_path / "nonexistent.ipynb"
    _one_line_error(capsys, cli.main(["grade", str(missing)]), "no such file or folder",
                    str(missing))


def test_grade_missing_among_existing_runs_nothing(capsys, tmp_path, monkeypatch):
    import labkit.grade

    monkeypatch.setattr(labkit.grade, "grade", lambda *a, **k: pytest.fail("graded anyway"))
    real = tmp_path / "01_collectives.ipynb"
    real.write_text("{}")
    _one_line_error(capsys, cli.main(["grade", str(real), str(tmp_path / "gone")]), "gone")


def test_grade_refuses_nonpositive_cell_timeout(capsys, tmp_path):
    nb = tmp_path / "01_collectives.ipynb"
    nb.write_text("{}")
    _one_line_error(capsys, cli.main(["grade", str(nb), "--cell-timeout", "0"]), "--cell-timeout")


def test_site_without_a_book_folder(capsys, tmp_path):
    argv = ["site", "build", "--root", str(tmp_path), "--out", str(tmp_path / "o")]
    _one_line_error(capsys, cli.main(argv), "chapters/")


# ------------------------------------------------------------------------ every lab, bad options
# lab -> option sets that must be refused: exit 2, one line naming a flag, before any process
BAD = {
    "intro": [["--nproc", "1"], ["--repeats", "0"], ["--sizes-kib", "4", "4"], ["--nope"]],
    "ring": [["--sizes-mib", "0"], ["--bandwidth-mbs", "-1"], ["--repeats", "x"]],
    "ddp": [["--steps", "0"], ["--bucket-mb", "0"], ["--versions", "nope"],
            ["--trace", "/dev/null"]],
    "zero": [["--stages", "5"], ["--batch", "-1"], ["--steps", "0"], ["--trace", "/dev/null"],
             ["--stages", "1", "--trace", "traces"]],
    "tp": [["--nproc", "3"], ["--n-head", "0"]],
    "pipeline": [["--nproc", "1"], ["--K", "9", "--schedules", "interleaved"],
                 ["--nproc", "5", "--K", "5", "--batch", "5", "--schedules", "zb-v"],
                 ["--K", "4", "--batch", "2"], ["--v", "0"], ["--schedules", "zb-h9"],
                 ["--trace", "/dev/null"]],
    "checkpoint": [["--nosuch"], ["--folder", "/nonexistent/labkit"]],
    "train_ft": [["--kill-rank", "5"], ["--save-every", "0"], ["--kill-step", "-3"]],
    "hybrid": [["--zero", "4"], ["--nproc", "2", "--dp", "3", "--tp", "2"], ["--cp", "0"]],
    "context": [["--nproc", "3"], ["--seq", "33"], ["--seq", "30", "--nproc", "3"],
                ["--cp-layout", "ring"], ["--tp", "1", "--cp", "4", "--seq", "2",
                                          "--cp-layout", "plain"]],
    "sequence": [["--cp", "2"], ["--nproc", "3"]],
    "moe": [["--nproc", "3"], ["--top-k", "9"], ["--capacity-factor", "0"]],
    "precision": [["--steps", "0"], ["--nproc", "0"], ["--microscaling", "yes"]],
    "overlap": [["--nproc", "1"], ["--rows", "4"], ["--rows", "0", "2"], ["--n-embd", "60"],
                ["--rounds", "0"], ["--sizes-kib", "64"]],
    "overlap_tp": [["--nproc", "1"], ["--widths", "64"], ["--widths", "63", "128"],
                   ["--tokens", "0"]],
    "overlap_cp": [["--nproc", "1"], ["--chunks", "64"], ["--heads", "4", "--kv-heads", "3"]],
    "overlap_zero3": [["--nproc", "1"], ["--rows", "4"], ["--rows", "0", "2"],
                      ["--n-embd", "60"], ["--rounds", "0"], ["--sizes-kib", "64"]],
    "hsdp": [["--nproc", "4", "--replicate", "3"], ["--steps", "0"]],
    "zeropp": [["--nproc", "4", "--hpz", "3"], ["--nproc", "1"]],
    "moe_dispatch": [["--nproc", "1"], ["--skews", "-1"], ["--link-mb-s", "0"]],
}


@pytest.fixture
def no_process_starts(monkeypatch):
    """Starting a rank fails the test. The patch is on the launcher's first step inside
    labkit.launch.process, not on `run` itself: a module first imported during the test would
    otherwise bind the refusing `run` by `from labkit.launch import run` and keep it afterwards."""
    import labkit.launch.process

    def refuse(*a, **k):
        pytest.fail("a process was started before the options were checked")

    monkeypatch.setattr(labkit.launch.process, "sweep_orphans", refuse)


def test_every_lab_has_bad_option_cases():
    assert set(BAD) == set(cli._names("labkit.labs"))


@pytest.mark.parametrize("lab,args", [(lab, a) for lab, sets in BAD.items() for a in sets],
                         ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_bad_options_refused_before_any_process(lab, args, capsys, no_process_starts):
    err = _one_line_error(capsys, cli.main(["run", lab, *args]), f"labkit: {lab}:")
    assert "--" in err, err                                 # it names the flag to change
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [
    ["ddp", "--ranks", "0"], ["nosuch"], ["pipeline", "--K", "0"], ["context", "--seq", "x"],
    ["pipeline", "--stages", "1"], ["pipeline", "--pad-ms", "-1", "5"], ["tp", "--tps", "3"],
    ["tp", "--hidden", "100"], ["parallel", "--batch", "3"], ["checkpoint", "--mbytes", "0"],
    ["collectives", "--sizes-mib", "0"], ["moe", "--ranks", "0"], ["launch", "--repeats", "0"],
    ["zero", "--steps", "0"], ["zero", "--runs", "0"],
    # the bad value belongs to the second benchmark: refused before the first one starts
    ["ddp", "tp", "--tps", "3"], ["collectives", "context", "--cp", "1"],
    # an option no benchmark named takes
    ["ddp", "checkpoint", "--nosuch", "1"]],
    ids=" ".join)
def test_bench_bad_options_refused(args, capsys, no_process_starts, tmp_path):
    out = tmp_path / "r.json"
    _one_line_error(capsys, cli.main(["bench", *args, "--json", str(out)]), "labkit:")
    assert not out.exists()


def test_bench_help_lists_every_benchmark_and_each_shows_its_defaults(capsys, no_process_starts):
    assert cli.main(["bench", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--json FILE" in text
    for name in cli._names("labkit.bench"):
        assert re.search(rf"^  {name} +\S", text, re.M), name
        assert cli.main(["bench", name, "--help"]) == 0
        own = capsys.readouterr().out
        assert own.startswith(f"usage: labkit bench {name}"), own[:80]
        assert "(default:" in own, name


def test_messages_name_a_value_that_works(capsys, no_process_starts):
    cases = {("context", "--seq", "33"): "--seq 32",
             ("context", "--nproc", "3"): "--tp 1 or 2 or 4",
             ("moe", "--nproc", "3"): "--nproc 2 or 4 or 8",
             ("pipeline", "--K", "9", "--schedules", "interleaved"): "K that work",
             ("pipeline", "--nproc", "5", "--K", "5", "--batch", "5", "--schedules", "zb-v"):
                 "--nproc 4",
             ("hsdp", "--nproc", "4", "--replicate", "3"): "use --replicate 2",
             ("zeropp", "--nproc", "4", "--hpz", "3"): "use --hpz 2",
             ("zeropp", "--nproc", "1"): "use --nproc 4",
             ("moe_dispatch", "--skews", "-1"): "use --skews 0 1 2",
             ("moe_dispatch", "--link-mb-s", "0"): "use --link-mb-s 100",
             ("moe_dispatch", "--sizes-kib", "16"): "use --sizes-kib 16 256"}
    for argv, want in cases.items():
        err = _one_line_error(capsys, cli.main(["run", *argv]))
        assert want in err, (argv, err)


def test_every_lab_option_has_help_with_its_default(capsys):
    import contextlib

    for lab in cli._names("labkit.labs"):
        with contextlib.suppress(SystemExit):
            cli.main(["run", lab, "--help"])
        text = capsys.readouterr().out.split("options:", 1)[1]
        for entry in re.split(r"\n(?=  -)", text.strip("\n")):
            words = re.sub(r"\(default: [^)]*\)", "", entry).split()[1:]
            described = [w for w in words if re.search(r"[a-z]{2}", w)]
            assert described, f"{lab}: {entry.split()[0]} has no description"
        assert "(default:" in text, lab


def test_bench_json_form_of_the_readme(tmp_path, monkeypatch, capsys):
    import labkit.bench.launch as bl

    monkeypatch.setattr(bl, "main", lambda argv=(): {"rows": []})
    out = tmp_path / "results.json"
    assert cli.main(["bench", "launch", "--json", str(out)]) == 0
    assert out.exists()
    assert cli.main(["bench", "--json", str(out), "launch"]) == 0


def test_no_run_folder_when_a_lab_refuses(tmp_path):
    """As a user runs it: a subprocess, TMPDIR empty before, and no labkit-run-* after."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "labkit", "run", "context", "--seq", "30",
                          "--nproc", "3"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not list(tmp_path.glob("labkit-run-*"))
