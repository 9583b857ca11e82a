"""The reader's work in exercises/ is never overwritten: `labkit exercises` replaces only notebooks
nobody edited, and puts a fresh copy of an edited one in exercises/fresh/."""
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

from labkit import exercises
from labkit.profiling.folder import beside  # the trace folder chapter 02 uses

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ["00_why_distribute.ipynb", "08_mixture_of_experts.ipynb"]
NAMES = [exercises.exercise_name(name) for name in SOLUTIONS]   # the exercise notebooks' files


def _labkit(*args, cwd):
    return subprocess.run([sys.executable, "-m", "labkit", "exercises", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _tree(tmp_path):
    for d, names in (("solutions", SOLUTIONS), ("exercises", NAMES)):
        (tmp_path / d).mkdir()
        for name in names:
            shutil.copy(ROOT / d / name, tmp_path / d / name)
    return tmp_path


def test_an_edited_exercise_is_kept_and_a_fresh_copy_is_written(tmp_path):
    root = _tree(tmp_path)
    mine = root / "exercises" / NAMES[1]
    nb = nbformat.read(str(mine), as_version=4)
    stub = next(c for c in nb.cells if c.cell_type == "code" and "NotImplementedError" in c.source)
    stub.source = stub.source.replace('raise NotImplementedError(', 'answer = 42  # mine\n#(', 1)
    nbformat.write(nb, str(mine))
    before = mine.read_bytes()

    check = _labkit("--check", cwd=root)
    assert check.returncode == 1
    assert f"exercises/{NAMES[1]} has edits" in check.stdout and "exercises/fresh/" in check.stdout

    out = _labkit(cwd=root)
    assert out.returncode == 0, out.stderr
    assert mine.read_bytes() == before                       # the reader's work, byte for byte
    assert f"kept exercises/{NAMES[1]}: it has your edits" in out.stdout
    fresh = root / "exercises" / "fresh" / NAMES[1]
    assert not exercises.edited_by_reader(fresh)             # a clean, generated copy
    assert "answer = 42  # mine" not in fresh.read_text()
    # the untouched notebook is left as it was (it was already current)
    assert not exercises.edited_by_reader(root / "exercises" / NAMES[0])


def test_an_untouched_exercise_follows_its_solution(tmp_path):
    root = _tree(tmp_path)
    sol = root / "solutions" / SOLUTIONS[0]
    nb = nbformat.read(str(sol), as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("A new closing remark by the author."))
    nbformat.write(nb, str(sol))
    check = _labkit("--check", cwd=root)
    assert check.returncode == 1 and f"exercises/{NAMES[0]} is older than" in check.stdout

    out = _labkit(cwd=root)
    assert out.returncode == 0 and f"wrote exercises/{NAMES[0]}" in out.stdout, out.stdout
    assert "A new closing remark" in (root / "exercises" / NAMES[0]).read_text()
    assert not (root / "exercises" / "fresh").exists()
    assert _labkit("--check", cwd=root).returncode == 0


def test_a_notebook_run_and_saved_but_not_edited_is_not_the_readers_work(tmp_path):
    # running cells adds outputs and execution counts; that is not an edit of the exercise
    root = _tree(tmp_path)
    path = root / "exercises" / NAMES[0]
    nb = nbformat.read(str(path), as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.execution_count, code.outputs = 1, [nbformat.v4.new_output("stream", text="hi\n")]
    nbformat.write(nb, str(path))
    assert not exercises.edited_by_reader(path)


def test_an_edited_fresh_copy_is_kept_too_and_the_next_goes_to_a_dated_folder(tmp_path):
    root = _tree(tmp_path)
    for path in (root / "exercises" / NAMES[1],):
        nb = nbformat.read(str(path), as_version=4)
        nb.cells.append(nbformat.v4.new_code_cell("mine = 1"))
        nbformat.write(nb, str(path))
    exercises.generate(root / "solutions", root / "exercises", echo=lambda *a: None)
    fresh = root / "exercises" / "fresh" / NAMES[1]
    nb = nbformat.read(str(fresh), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("also mine = 2"))   # the reader works there too
    nbformat.write(nb, str(fresh))
    before = fresh.read_bytes()
    said = []
    written = exercises.generate(root / "solutions", root / "exercises", echo=said.append)
    assert fresh.read_bytes() == before                        # never overwritten
    dated = [p for p in written if p.parent.parent.name == "fresh"]
    assert len(dated) == 1 and dated[0].name == NAMES[1], written
    assert not exercises.edited_by_reader(dated[0]) and str(dated[0]) in said[0]


def test_from_the_wrong_folder_it_says_where_to_run_it(tmp_path):
    out = _labkit(cwd=tmp_path)
    assert out.returncode != 0
    assert "no notebooks in" in out.stderr and "--solutions PATH" in out.stderr, out.stderr


def test_traces_go_beside_the_notebook_by_default(tmp_path):
    assert beside("ch02", tmp_path) == tmp_path / "traces" / "ch02"
    assert (tmp_path / "traces" / "ch02").is_dir()
