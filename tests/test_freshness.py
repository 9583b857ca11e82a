"""Saved outputs are current: every chapter and solution was executed (by `labkit book run`) after
the last change to the labkit code it runs, and its code cells were not edited since.

The stamp is in each notebook's metadata (labkit.book). LABKIT_FRESHNESS=off skips the check on
the real notebooks (while the book is being edited, before the one final re-run); the unit tests
of the check itself always run.
"""
import os
from pathlib import Path

import nbformat
import pytest

from labkit import book, chapters

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p for d in ("chapters", "solutions") for p in (ROOT / d).glob("*.ipynb"))
OFF = os.environ.get("LABKIT_FRESHNESS") == "off"
PYTHON3 = {"name": "python3", "display_name": "Python 3", "language": "python"}


@pytest.mark.skipif(OFF, reason="LABKIT_FRESHNESS=off: saved outputs not checked against "
                                "labkit's sources")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_saved_outputs_are_newer_than_the_code_they_ran(path):
    reasons = book.stale_reasons(nbformat.read(str(path), as_version=4))
    flag = " --solutions-only" if path.parent.name == "solutions" else ""
    assert not reasons, (f"{path.parent.name}/{path.name} shows outputs of older code: "
                         f"{'; '.join(reasons)}. Re-run it: labkit book run {path.name[:2]}{flag}")


# ---- the check itself, on a fake labkit package and tiny notebooks ----------------------


@pytest.fixture(autouse=True)
def _demo_chapters(monkeypatch):
    """The tiny books below hold chapters 42-44: `labkit book` runs the manifest's chapters."""
    demo = tuple(chapters.Chapter(n, slug, slug) for n, slug in
                 ((42, "demo"), (43, "broken"), (44, "x")))
    monkeypatch.setattr(chapters, "CHAPTERS", chapters.CHAPTERS + demo)


def _package(tmp_path):
    pkg = tmp_path / "labkit"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""fake"""\n')
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from labkit.sub import b  # a rank imports inside\n"
                              "    return b.g()\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n\ndef g():\n    return c.h()\n")
    (pkg / "sub" / "c.py").write_text(
        "from importlib import resources\n\ndef h():\n"
        "    return resources.files('labkit').joinpath('data/x.txt')\n")
    (pkg / "data").mkdir()
    (pkg / "data" / "x.txt").write_text("a file the code reads by name\n")
    (pkg / "unused.py").write_text("X = 1\n")
    (pkg / "book.py").write_text("# excluded: running the book does not depend on the runner\n")
    return pkg


def _notebook(*sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


def test_dependencies_follow_function_level_and_relative_imports(tmp_path):
    pkg = _package(tmp_path)
    nb = _notebook("import torch\nfrom labkit import a\n%time a.f()")
    deps = book.dependencies(nb, book.Sources(pkg))
    assert sorted(deps) == ["labkit/__init__.py", "labkit/a.py", "labkit/data/x.txt",
                            "labkit/sub/__init__.py", "labkit/sub/b.py", "labkit/sub/c.py"]
    dotted = _notebook("import labkit\nlabkit.sub.c.h()")  # a module named by attribute only
    assert "labkit/sub/c.py" in book.dependencies(dotted, book.Sources(pkg))


def test_staleness_fires_when_a_source_it_runs_changes(tmp_path):
    pkg = _package(tmp_path)
    nb = _notebook("from labkit import a\na.f()")
    assert book.stale_reasons(nb, book.Sources(pkg)) == [
        "no labkit stamp: its outputs predate `labkit book run`"]
    book.stamp(nb, book.dependencies(nb, book.Sources(pkg)), seconds=1.0)
    assert book.stale_reasons(nb, book.Sources(pkg)) == []

    (pkg / "unused.py").write_text("X = 2\n")  # not run by the notebook: still current
    assert book.stale_reasons(nb, book.Sources(pkg)) == []

    (pkg / "data" / "x.txt").write_text("changed data\n")  # a file the code reads by name
    assert book.stale_reasons(nb, book.Sources(pkg)) == ["changed since the run: labkit/data/x.txt"]

    book.stamp(nb, book.dependencies(nb, book.Sources(pkg)), seconds=1.0)
    (pkg / "sub" / "c.py").write_text("def h():\n    return 2\n")  # reached only through f's import
    reasons = book.stale_reasons(nb, book.Sources(pkg))
    assert reasons == ["changed since the run: labkit/sub/c.py"]

    book.stamp(nb, book.dependencies(nb, book.Sources(pkg)), seconds=1.0)
    (pkg / "sub" / "b.py").write_text("from . import c\nfrom labkit import unused\n")
    assert book.stale_reasons(nb, book.Sources(pkg)) == [
        "changed since the run: labkit/sub/b.py", "now also runs: labkit/unused.py"]

    book.stamp(nb, book.dependencies(nb, book.Sources(pkg)), seconds=1.0)
    (pkg / "unused.py").unlink()
    assert "ran files that no longer exist: labkit/unused.py" in book.stale_reasons(
        nb, book.Sources(pkg))


def test_editing_a_code_cell_after_the_run_is_stale(tmp_path):
    pkg = _package(tmp_path)
    nb = _notebook("from labkit import a\na.f()")
    book.stamp(nb, book.dependencies(nb, book.Sources(pkg)), seconds=1.0)
    nb.cells.append(nbformat.v4.new_markdown_cell("prose may change freely"))
    assert book.stale_reasons(nb, book.Sources(pkg)) == []
    nb.cells[0].source += "\nprint(a.f())"
    assert book.stale_reasons(nb, book.Sources(pkg)) == ["its code cells were edited after the run"]


def test_check_command_names_the_stale_notebook_and_the_command(tmp_path, capsys):
    (tmp_path / "chapters").mkdir()
    nb = _notebook("from labkit.costs import comm\nprint(comm.ring_steps('all_reduce', 4))")
    book.stamp(nb, book.dependencies(nb), seconds=0.0)
    path = tmp_path / "chapters" / "42_demo.ipynb"
    nbformat.write(nb, str(path))
    assert book.main(["run", "--check", "--root", str(tmp_path)]) == 0

    nb.metadata["labkit"]["sources"]["labkit/costs/comm.py"] = "0" * 16  # as if comm.py changed
    nbformat.write(nb, str(path))
    assert book.main(["run", "42", "--check", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "STALE chapters/42_demo.ipynb: changed since the run: labkit/costs/comm.py" in out
    assert "labkit book run 42" in out


def test_run_executes_in_a_fresh_kernel_with_the_installed_labkit_and_stamps(tmp_path, capsys):
    (tmp_path / "chapters").mkdir()
    path = tmp_path / "chapters" / "42_demo.ipynb"
    nb = _notebook("import os, labkit\nfrom labkit.costs import comm",
                   "print(os.getcwd() == os.path.dirname(os.path.abspath('42_demo.ipynb')),"
                   " os.path.exists('42_demo.ipynb'), os.path.dirname(labkit.__file__))",
                   "print(comm.ring_steps('all_reduce', 4))")
    nb.metadata["kernelspec"] = dict(PYTHON3)
    nbformat.write(nb, str(path))
    assert book.main(["run", "42", "--root", str(tmp_path)]) == 0
    # one line per notebook, with seconds
    assert "chapters/42_demo.ipynb" in capsys.readouterr().out
    saved = nbformat.read(str(path), as_version=4)
    cwd_ok, exists, pkg = saved.cells[1].outputs[0].text.split()
    assert (cwd_ok, exists) == ("True", "True")  # the kernel runs in the notebook's folder
    assert Path(pkg).resolve() == book.Sources().pkg  # the labkit whose files were hashed
    assert saved.cells[2].outputs[0].text.strip() == "6"
    assert [c.execution_count for c in saved.cells] == [1, 2, 3]
    stamp = saved.metadata["labkit"]
    assert "labkit/costs/comm.py" in stamp["sources"] and stamp["torch"]
    assert book.stale_reasons(nbformat.read(str(path), as_version=4)) == []


def test_a_failing_notebook_is_left_as_it_was_and_the_run_exits_1(tmp_path, capsys):
    (tmp_path / "chapters").mkdir()
    path = tmp_path / "chapters" / "43_broken.ipynb"
    nb = _notebook("import labkit", "1 / 0")
    nb.metadata["kernelspec"] = dict(PYTHON3)
    nbformat.write(nb, str(path))
    before = path.read_bytes()
    assert book.main(["run", "43", "--root", str(tmp_path)]) == 1
    assert "FAILED (left as it was)" in capsys.readouterr().out
    assert path.read_bytes() == before


def test_a_cell_timeout_gets_one_more_try_then_fails(tmp_path, monkeypatch, capsys):
    # nbclient sometimes never sees a widget cell's reply (jupyter/nbclient#312): one retry from a
    # fresh kernel, then the notebook counts as failed. execute() is stubbed: no kernel needed.
    from nbclient.exceptions import CellTimeoutError

    (tmp_path / "chapters").mkdir()
    nbformat.write(_notebook("1"), str(tmp_path / "chapters" / "44_x.ipynb"))
    calls = []

    def flaky(path, timeout, sources):
        calls.append(path.name)
        if len(calls) == 1:
            raise CellTimeoutError("a cell passed the timeout")
        return 0.5
    monkeypatch.setattr(book, "execute", flaky)
    assert book.main(["run", "44", "--root", str(tmp_path)]) == 0
    assert calls == ["44_x.ipynb"] * 2 and "trying once more" in capsys.readouterr().out

    def stuck(path, timeout, sources):
        calls.append(path.name)
        raise CellTimeoutError("a cell passed the timeout")
    monkeypatch.setattr(book, "execute", stuck)
    calls.clear()
    assert book.main(["run", "44", "--root", str(tmp_path)]) == 1
    assert len(calls) == 2 and "FAILED" in capsys.readouterr().out
