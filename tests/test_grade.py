"""An instructor grades a folder: one row per student file, one column per exercise; a notebook
that crashes or hangs scores zero for what it had not reached, and the rest are still graded.
The notebooks are small fixtures (tests/fixtures/grading), not the chapter's."""
import csv
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.grade import chapter_of_submission, grade

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "grading"
HONEST = FIXTURES / "00_honest.ipynb"      # exercise 0.1 answered, the others never called
NAME = "00_why_distribute.ipynb"
ONLY_01 = {"0.1": 3, "0.2": 0, "0.3": 0, "0.4": 0}


def _with_cell_after_first_checker(code: str) -> nbformat.NotebookNode:
    """The honest fixture with `code` inserted right after the checker of exercise 0.1."""
    nb = nbformat.read(str(HONEST), as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "ch00.state_bytes(" in c.source)
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(code))
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    sub = tmp_path_factory.mktemp("submissions")
    (sub / "alice").mkdir()
    (sub / "bob").mkdir()
    nbformat.write(nbformat.read(str(HONEST), as_version=4), str(sub / "alice" / NAME))
    nbformat.write(_with_cell_after_first_checker("import os\nos._exit(1)  # the sandbox dies"),
                   str(sub / "bob" / NAME))
    nbformat.write(_with_cell_after_first_checker("import time\ntime.sleep(600)  # hangs"),
                   str(sub / f"carol_{NAME}"))
    (sub / f"dave_{NAME}").write_text("{ this is not json")
    nbformat.write(nbformat.read(str(FIXTURES / "00_partial.ipynb"), as_version=4),
                   str(sub / f"frank_{NAME}"))
    untouched = nbformat.read(str(FIXTURES / "00_untouched.ipynb"), as_version=4)
    nbformat.write(untouched, str(sub / "erin-homework.ipynb"))  # no chapter in the name
    lines = []
    rows = grade([sub], csv_path=sub / "scores.csv", cell_timeout=20,
                 echo=lambda *a, **k: lines.append(" ".join(map(str, a))))
    return {r["file"]: r for r in rows}, sub / "scores.csv", "\n".join(lines)


def test_every_file_gets_a_row_with_the_right_scores(graded):
    rows, _, _ = graded
    assert sorted(rows) == ["alice/00_why_distribute.ipynb", "bob/00_why_distribute.ipynb",
                            "carol_00_why_distribute.ipynb", "dave_00_why_distribute.ipynb",
                            "erin-homework.ipynb", "frank_00_why_distribute.ipynb"]
    frank = rows["frank_00_why_distribute.ipynb"]      # partial credit: 2 of 5 cases right
    assert frank["scores"]["0.1"] == 1.2 and "optimizer" in frank["failures"]["0.1"][0], frank
    assert rows["alice/00_why_distribute.ipynb"]["scores"] == ONLY_01
    assert "never called its checker" in rows["alice/00_why_distribute.ipynb"]["failures"]["0.2"][0]
    for crashed in ("bob/00_why_distribute.ipynb", "carol_00_why_distribute.ipynb"):
        assert rows[crashed]["scores"] == ONLY_01, rows[crashed]   # 0.1 was reached
    bob = rows["bob/00_why_distribute.ipynb"]["error"]
    assert "exited with status 1 (os._exit?)" in bob and "code cell 4 ('import os')" in bob, bob
    carol = rows["carol_00_why_distribute.ipynb"]["error"]
    assert "longer than 20 s" in carol and "code cell 4 ('import time')" in carol, carol
    assert rows["dave_00_why_distribute.ipynb"]["scores"] == {"0.1": 0, "0.2": 0, "0.3": 0,
                                                             "0.4": 0}
    assert "not a readable notebook" in rows["dave_00_why_distribute.ipynb"]["error"]
    erin = rows["erin-homework.ipynb"]  # chapter found from the checker it imports
    assert erin["chapter"] == 0 and erin["scores"] == {"0.1": 0, "0.2": 0, "0.3": 0, "0.4": 0}
    assert any("NotImplementedError" in f or "Exercise 0.1" in f for f in erin["failures"]["0.1"])


def test_csv_and_summary(graded):
    _, path, printed = graded
    with open(path) as f:
        table = list(csv.DictReader(f))
    assert [r["notebook"] for r in table][0] == "alice/00_why_distribute.ipynb"
    assert {r["notebook"]: float(r["total"]) for r in table}["alice/00_why_distribute.ipynb"] == 3
    assert all(set(r) >= {"0.1", "0.2", "0.3", "0.4", "total", "possible", "seconds", "failures",
                          "error"} for r in table)
    assert float(table[0]["seconds"]) > 0          # each notebook's grading time, in seconds
    assert "[6/6] grading" in printed and "stopped early" in printed
    assert "3/12" in printed


def test_no_process_left_behind(graded):
    import psutil

    def sandbox(p) -> str | None:
        """p's command line if it is a live sandbox (a zombie another test of this worker left
        unreaped, or one gone meanwhile, is neither live nor readable)."""
        try:
            cmd = " ".join(p.cmdline())
            return cmd if "labkit-sandbox" in cmd and p.status() != psutil.STATUS_ZOMBIE else None
        except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    mine = [c for c in map(sandbox, psutil.Process().children(recursive=True)) if c]
    assert not mine, mine


def test_chapter_from_name_or_content(tmp_path):
    assert chapter_of_submission(Path("submissions/03_zero_fsdp.ipynb")) == 3
    assert chapter_of_submission(Path("alice_05_pipeline_parallel.ipynb")) == 5
    p = tmp_path / "homework.ipynb"
    p.write_text('{"cells": [{"source": "from labkit.check import ch04"}]}')
    assert chapter_of_submission(p) == 4
    (tmp_path / "x.ipynb").write_text("{}")
    assert chapter_of_submission(tmp_path / "x.ipynb") is None


def test_cli_on_an_empty_folder_says_so(tmp_path):
    r = subprocess.run([sys.executable, "-m", "labkit", "grade", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no .ipynb files" in r.stderr
