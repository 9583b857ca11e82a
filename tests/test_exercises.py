"""Exercises: generated from solutions and in sync; grading scores solutions full and untouched
exercises zero. Each chapter's wrong answers (and hang reports) are in
tests/test_chNN_exercises.py."""
from pathlib import Path

import pytest

from labkit import exercises
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
    row = grade_notebook(ROOT / "exercises" / exercises.exercise_name(path.name))
    assert row["scores"] and all(score == 0 for score in row["scores"].values()), row["scores"]


def test_an_exercise_notebooks_file_says_exercises(tmp_path):
    """JupyterLab names a tab after its file: a chapter and its exercises must not share one. A
    notebook under the old name is pointed to the new one."""
    assert exercises.exercise_name("01_collectives.ipynb") == "01_collectives_exercises.ipynb"
    assert exercises.solution_name("01_collectives_exercises.ipynb") == "01_collectives.ipynb"
    for sol in SOLUTIONS:
        assert (ROOT / "exercises" / exercises.exercise_name(sol.name)).exists(), sol.name
        assert not (ROOT / "exercises" / sol.name).exists(), sol.name
    (tmp_path / "solutions").mkdir()
    (tmp_path / "exercises").mkdir()
    (tmp_path / "solutions" / SOLUTIONS[0].name).write_bytes(SOLUTIONS[0].read_bytes())
    (tmp_path / "exercises" / SOLUTIONS[0].name).write_text("{}")
    said = exercises.out_of_sync(tmp_path / "solutions", tmp_path / "exercises")
    assert any("named " + exercises.exercise_name(SOLUTIONS[0].name) in s for s in said), said
