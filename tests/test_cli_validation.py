"""The CLI checks its arguments before anything runs: one line on stderr saying what to change,
exit status 2, and the lab's main (which may run a one-process reference, then start ranks) is
never called."""
from __future__ import annotations

import importlib

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
    _one_line_error(capsys, cli.main(["run", "no_such_lab", "--nproc", "2"]), "no lab named", "labkit list")


def test_grade_missing_file_says_so(capsys, tmp_path):
    missing = tmp_path / "nonexistent.ipynb"
    _one_line_error(capsys, cli.main(["grade", str(missing)]), "no such file or folder", str(missing))


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
    _one_line_error(capsys, cli.main(["site", "build", "--root", str(tmp_path), "--out", str(tmp_path / "o")]),
                    "chapters/")
