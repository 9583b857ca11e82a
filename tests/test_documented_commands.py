"""Every command line the README and docs/ show, parsed from the files, keeps its promise (#29).

- `labkit run LAB ...` in the README and docs/ (except the GPU page): run as written, in a
  subprocess as a reader runs it; exit 0, the lab's progress lines, its final table, and what
  the line's comment says it shows (EXPECT below). These replace the labs' tiny two-process runs
  (tests/test_labs.py keeps the three-process and torchrun runs and the bad input).
- docs/gpu-and-cluster.md's lines (NCCL on GPUs, `torchrun --nnodes 2` on a cluster) and lab
  names written inline in the prose: each runs as written up to the moment it would start its
  first process (every check labkit makes passes); GPUs and two nodes are not here.
- `labkit bench NAME ...`: its options are checked the same way (each full benchmark is a
  minutes-long timing tool, run by hand for docs/benchmarks.md; tests/test_bench_*.py run small
  real benchmarks).
- Everything else (`./book.sh`, `./test.sh`, `labkit grade`, `scripts/gpu-smoke.sh`, ...) names
  the test that runs it in COVERED_BY; a new documented command without an entry fails here.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_labs import GPU_READY, LABS, _progress_lines

from labkit import chapters, cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
START = re.compile(r"^(?:\$ )?(?:[A-Z_]+=\S+ )*"
                   r"(labkit |torchrun |\./book\.sh|\./test\.sh|bash scripts/)")

# what each lab's documented line says it shows, beyond its final table's marker (the manifest,
# labkit.chapters; tp's marker names the tiny run's layer count, so its own line here stands for it)
EXPECT = {x.name: list(x.shows) for x in chapters.labs()}

# documented command (its start) -> the test that runs it
COVERED_BY = {
    "./book.sh": "tests/e2e/test_jupyterlab_browser.py::"
                 "test_book_sh_opens_the_landing_page_which_leads_to_every_notebook",
    "./test.sh": ".ci/run (CI runs it on a clean clone)",
    "labkit grade": "tests/test_grade.py::test_every_file_gets_a_row_with_the_right_scores",
    "bash scripts/gpu-smoke.sh": "scripts/gpu-smoke.sh on a GPU machine (exit 2 without one); "
                                 "docs/gpu-and-cluster.md",
    "labkit exercises": "tests/test_exercises_kept.py",
    "labkit book": "tests/test_freshness.py",
    "labkit site": "tests/test_site.py",
    "labkit list": "tests/test_labs.py::test_every_chapter_has_a_lab_and_every_lab_exists",
    "labkit calibrate": "tests/test_calibrate.py::test_calibrate_quick_end_to_end_writes_a_profile",
}


def documented() -> list[tuple[str, str, bool]]:
    """(file, command, fenced): each command line in a fenced block (fenced), and each
    `labkit run|bench ...` written inline in the prose (not fenced: checked, not run)."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if START.match(line.strip()):
                    found.append((path.name, " ".join(line.split(" #")[0].split()), True))
        for span in re.findall(r"`(labkit (?:run|bench) [^`]+)`", text):
            if not re.search(r"\b[A-Z]{2,}\b|\bN\b|\.\.\.|\[|\|", span):   # a template
                found.append((path.name, " ".join(span.split()), False))
    return found


def _argv(command: str) -> list[str]:
    words = shlex.split(command.removeprefix("$ "))
    while words and re.fullmatch(r"[A-Z_]+=\S+", words[0]):
        words = words[1:]
    return words


def _labkit_part(words: list[str]) -> list[str]:
    """The arguments after `labkit` (or after torchrun's `-m labkit`)."""
    if words[0] == "torchrun":
        return words[words.index("-m") + 2:]
    return words[1:]


FOUND = documented()
COMMANDS = sorted({(f, c) for f, c, _ in FOUND}, key=lambda fc: (fc[1], fc[0]))
# docs/gpu-and-cluster.md's lines are for a machine with GPUs (NCCL, real GPU compute): here they
# are checked up to the first process, like the two-node lines; the same labs run above
RUNS = sorted({c for f, c, fenced in FOUND if fenced and _argv(c)[0] in ("labkit", "torchrun")
               and _labkit_part(_argv(c))[0] == "run" and f != "gpu-and-cluster.md"})
CHECKED = sorted({c for _, c, _ in FOUND if _argv(c)[0] in ("labkit", "torchrun")
                  and _labkit_part(_argv(c))[0] == "run" and c not in RUNS})


def test_the_docs_show_commands_of_every_kind():
    kinds = {tuple(_labkit_part(_argv(c))[:1]) for _, c in COMMANDS if _argv(c)[0] != "bash"}
    assert {("run",), ("bench",), ("grade",)} <= kinds, kinds
    assert len(RUNS) >= len(LABS), RUNS      # a documented line for every lab at least
    assert {_labkit_part(_argv(c))[1] for c in RUNS} == set(LABS)


@pytest.mark.parametrize("command", RUNS)
def test_documented_lab_line_runs_as_written(command):
    words = _argv(command)
    if words[0] == "labkit":
        words = [sys.executable, "-m", *words]
    else:
        words[0] = str(Path(sys.executable).parent / "torchrun")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p))
    out = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lab = _labkit_part(_argv(command))[1]
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    marker = LABS[lab][1] if lab != "tp" else EXPECT["tp"][0]
    assert out.stdout.count(marker) == 1, out.stdout[-3000:]      # once, also under torchrun
    assert _progress_lines(lab, out.stdout), out.stdout[-2000:]
    low = out.stdout.lower()
    missing = [w for w in EXPECT[lab] if w.lower() not in low]
    assert not missing, f"{command}: the output never mentions {missing}\n{out.stdout[-3000:]}"
    if lab in GPU_READY:   # no GPU here: Gloo on the CPU, and the table says so
        assert "backend gloo, device cpu" in out.stdout, out.stdout[-2000:]
    if lab == "train_ft":  # no --ckpt: a fresh temporary folder, named, then removed
        m = re.search(r"checkpoints in (\S+) \(temporary", out.stdout)
        assert m and not Path(m.group(1)).exists(), out.stdout[-2000:]
        assert "equal an uninterrupted run (same seed, same steps), bit for bit, on every " \
               "rank: True" in out.stdout, out.stdout[-2000:]


def _small(command: str) -> list[str]:
    """A documented line's lab and rank count with test_labs.LABS's tiny options instead of its
    own sizes: the same `main`, progress lines and final table, in seconds."""
    words = [w for part in _argv(command) for w in part.split("=", 1)]
    lab = _labkit_part(_argv(command))[1]
    flag = next((f for f in ("--nproc", "--nproc-per-node") if f in words), None)
    nproc = words[words.index(flag) + 1] if flag else None
    return ["run", lab, *(["--nproc", nproc] if nproc else []), *LABS[lab][0]]


# one documented line per lab (the first), run small per commit; every line at full size: --full
SMALL = sorted({_labkit_part(_argv(c))[1]: c for c in reversed(RUNS)}.values())


@pytest.mark.parametrize("command", SMALL)
def test_documented_lab_line_runs_small(command):
    """Per commit (tests/conftest.py): each lab's documented line with tiny options. The line as
    written, every word its comment promises (EXPECT) included, runs in the full lane."""
    lab = _labkit_part(_argv(command))[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p))
    words = [sys.executable, "-m", "labkit", *_small(command)]
    out = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, " ".join(words[2:]) + "\n" + out.stdout[-2000:] \
        + out.stderr[-3000:]
    assert out.stdout.count(LABS[lab][1]) == 1, out.stdout[-3000:]
    assert _progress_lines(lab, out.stdout), out.stdout[-2000:]
    if lab in GPU_READY:   # no GPU here: Gloo on the CPU, and the table says so
        assert "backend gloo, device cpu" in out.stdout, out.stdout[-2000:]


class _Started(Exception):
    """Raised where the lab would start its first process: every check before it passed."""


@pytest.mark.parametrize("command", CHECKED)
def test_other_lab_lines_pass_every_check_before_a_process_starts(command, monkeypatch, capsys):
    """GPU and two-node lines (neither is here) and lab names written in the prose: the lab runs
    as written up to the moment it would start a process; nothing refuses it first."""
    import labkit.launch.process

    def started():
        raise _Started

    monkeypatch.setattr(labkit.launch.process, "sweep_orphans", started)
    args = _labkit_part(_argv(command))
    if "--ckpt" in args:            # a folder every node sees; here, one this test may write
        args[args.index("--ckpt") + 1] = str(Path(os.environ.get("TMPDIR", "/tmp")) / "ft-doc")
    with pytest.raises(_Started):
        code = cli.main(args)
        pytest.fail(f"{command}: exit {code} before any process: {capsys.readouterr().err}")


@pytest.mark.parametrize("command", sorted({c for _, c in COMMANDS
                                            if _labkit_part(_argv(c))[:1] == ["bench"]}))
def test_documented_bench_line_passes_its_checks(command):
    args = _labkit_part(_argv(command))[1:]
    names = [a for a in args if not a.startswith("-") and a in cli._names("labkit.bench")]
    rest = [a for a in args if a not in names and a != "--json"]
    for name in names or cli._names("labkit.bench"):
        _, left = cli._load("labkit.bench", name).options(rest)
        assert not left or not names, (command, left)


def test_every_other_command_names_the_test_that_runs_it():
    others = {c for _, c in COMMANDS if c not in RUNS and c not in CHECKED
              and _labkit_part(_argv(c))[:1] != ["bench"]}
    uncovered = [c for c in others
                 if not any(" ".join(_argv(c)).startswith(k) for k in COVERED_BY)]
    assert not uncovered, f"documented commands no test runs: {uncovered}"
    for where in COVERED_BY.values():
        path = where.split("::")[0].split(" ")[0]
        assert (ROOT / path).exists(), where
        if "::" in where:
            assert f"def {where.split('::')[1]}" in (ROOT / path).read_text(), where
