"""Exercises: generated from solutions and in sync; checkers pass good code, fail bad code with a
hint, report a hang as a hang; grading scores solutions full and untouched exercises zero."""
from pathlib import Path

import pytest

from labkit import exercises
from labkit.check import ch01
from labkit.grade import exercises_of, grade_notebook

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def test_exercises_are_in_sync_with_solutions():
    assert exercises.out_of_sync(ROOT / "solutions", ROOT / "exercises") == []


def test_strip_source_replaces_regions_with_numbered_stubs():
    src = ("def f(x):\n    y = 1\n    ### BEGIN SOLUTION add one\n    y = x + 1\n"
           "    ### END SOLUTION\n    return y\n### BEGIN SOLUTION\nz = 2\n### END SOLUTION")
    out = exercises.strip_source(src, 3, [0])
    assert out == ('def f(x):\n    y = 1\n    raise NotImplementedError("Exercise 3.1: add one")\n'
                   '    return y\nraise NotImplementedError("Exercise 3.2: write your code here")')
    with pytest.raises(exercises.ExerciseError, match="without END"):
        exercises.strip_source("### BEGIN SOLUTION\nx = 1", 1, [0])


def _ring_without_adding(x):
    """A typical mistake: pass chunks around but never add them."""
    return x


def _deadlocking_all_reduce(x):
    """Every rank sends first with a blocking send of a large tensor: nobody receives."""
    import torch
    import torch.distributed as dist

    big = torch.zeros(4_000_000)
    dist.send(big, dst=(dist.get_rank() + 1) % dist.get_world_size())
    dist.recv(big, src=(dist.get_rank() - 1) % dist.get_world_size())
    return x


def test_every_stub_names_the_exercise_its_checker_grades():
    """A stub says "Exercise 6.2" only in exercise 6.2 (two regions of one exercise share it),
    and every exercise a chapter's checker grades has a stub."""
    import re

    for src in sorted((ROOT / "solutions").glob("*.ipynb")):
        nb = exercises.exercise_notebook(src)
        stubs = re.findall(r"Exercise (\d+\.\d+):", "\n".join(
            c.source for c in nb.cells if c.cell_type == "code"))
        graded = set(exercises_of(exercises.chapter_of(src)))
        assert set(stubs) == graded, (src.name, stubs, sorted(graded))


def test_checker_fails_wrong_code_with_a_hint():
    result = ch01.ring_all_reduce(_ring_without_adding)
    assert result.score == 0 and not result.passed
    assert "still this rank's own input" in result.cases[0]["message"]


def test_checker_reports_a_hang_with_each_rank_step(monkeypatch):
    monkeypatch.setattr(ch01, "HANG_TIMEOUT", 6.0)
    result = ch01.ring_all_reduce(_deadlocking_all_reduce)
    msg = result.cases[0]["message"]
    assert msg.startswith("HANG") and "dist.send(big" in msg and "rank 1 stuck" in msg
    assert "skipped after a hang" in result.cases[1]["message"]
    assert result.score == 0


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_scores_full_marks(path):
    row = grade_notebook(path)
    expected = exercises_of(exercises.chapter_of(path))
    assert expected, f"labkit.check has no EXERCISES table for {path.name}"
    assert row["error"] == ""
    for ex, (title, points) in expected.items():
        assert row["scores"][ex] == points, (ex, title, row["failures"].get(ex))


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_untouched_exercise_scores_zero(path):
    row = grade_notebook(ROOT / "exercises" / path.name)
    assert row["scores"] and all(score == 0 for score in row["scores"].values()), row["scores"]
