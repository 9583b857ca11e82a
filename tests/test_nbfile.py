"""Notebook files as JupyterLab saves them (labkit.nbfile), and the book server's save hook
(labkit.labsave). No browser: tests/e2e/test_open_is_not_edit.py opens every notebook in one."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import nbformat
import pytest
from jupyter_server.services.contents.filemanager import FileContentsManager

from labkit import labsave, nbfile

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted([ROOT / "START_HERE.ipynb"] + [p for d in ("chapters", "solutions", "exercises")
                                                  for p in (ROOT / d).glob("*.ipynb")])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_committed_notebook_is_saved_as_jupyterlab_saves_it(path):
    """A notebook written with plain nbformat (0.0 where JupyterLab writes 0, "Python 3" where it
    writes "Python 3 (ipykernel)") would be rewritten by the first autosave of a reader who only
    opened it. labkit writes notebooks with labkit.nbfile.write; to fix one written otherwise:
    python -c "import sys, nbformat; from labkit import nbfile; p = sys.argv[1];
               nbfile.write(nbformat.read(p, as_version=nbformat.NO_CONVERT), p)" NOTEBOOK"""
    data = path.read_bytes()
    nb = nbformat.reads(data.decode("utf-8"), as_version=nbformat.NO_CONVERT)
    assert nbfile.dumps(nb) == data.decode("utf-8"), f"{path.name} is not in JupyterLab's format"


@pytest.mark.parametrize("value, saved", [
    (0.0, 0), (1.0, 1), (-5.0, -5), (-0.0, 0), (0.5, 0.5), (1e-7, 1e-7), (3, 3), (True, True),
    (1e20, 100000000000000000000), (1e21, 1e21), (2.5e300, 2.5e300),
    (12345678901234567891, 12345678901234567000),   # beyond 2**53: what a double holds
    (float("nan"), None), (float("inf"), None), (None, None)])
def test_numbers_come_back_as_javascript_writes_them(value, saved):
    got = nbfile.js_number(value)
    assert got == saved and type(got) is type(saved)


def _nb(cells, **metadata):
    kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nbformat.from_dict({"nbformat": 4, "nbformat_minor": 5, "cells": cells,
                               "metadata": {"kernelspec": kernelspec, **metadata}})


def _code(id_, metadata=None, outputs=()):
    return {"cell_type": "code", "id": id_, "metadata": metadata or {}, "source": "x = 1\ny = 2",
            "outputs": list(outputs), "execution_count": None}


def test_collapsed_and_outputs_hidden_are_kept_equal_collapsed_first():
    nb = nbfile.as_jupyterlab(_nb([
        _code("a", {"jupyter": {"outputs_hidden": True}}),
        _code("b", {"collapsed": False}),
        _code("c", {"collapsed": True,
                    "jupyter": {"source_hidden": True, "outputs_hidden": False}}),
        _code("d", {"jupyter": {"source_hidden": True}}),
        {"cell_type": "markdown", "id": "e", "metadata": {"collapsed": True}, "source": "# x"}]))
    got = [c.metadata for c in nb.cells]
    assert got[0] == {"jupyter": {"outputs_hidden": True}, "collapsed": True}
    assert got[1] == {"collapsed": False, "jupyter": {"outputs_hidden": False}}
    assert got[2] == {"collapsed": True, "jupyter": {"source_hidden": True, "outputs_hidden": True}}
    assert got[3] == {"jupyter": {"source_hidden": True}}
    assert got[4] == {"collapsed": True, "jupyter": {"outputs_hidden": True}}


def test_the_kernelspec_is_the_installed_kernels_and_lines_are_split_at_line_ends():
    nb = _nb([_code("a", outputs=[{"output_type": "stream", "name": "stdout",
                                   "text": ["one\ntw", "o\n"]}])])
    text = nbfile.dumps(nb)
    saved = json.loads(text)
    assert saved["metadata"]["kernelspec"] == nbfile.kernelspec("python3")
    assert saved["metadata"]["kernelspec"]["display_name"] == "Python 3 (ipykernel)"
    assert saved["cells"][0]["source"] == ["x = 1\n", "y = 2"]
    assert saved["cells"][0]["outputs"][0]["text"] == ["one\n", "two\n"]
    assert text.endswith("}\n") and "\r" not in text


def test_consecutive_streams_of_one_name_are_written_as_one():
    """JupyterLab's output area shows them as one; a figure after them, redrawn by view index,
    overwrote the second (chapter 02's trace cell, tests/e2e/test_open_is_not_edit.py)."""
    err = {"output_type": "stream", "name": "stderr", "text": "warn\n"}
    nb = _nb([_code("a", outputs=[
        {"output_type": "stream", "name": "stdout", "text": ["one\n"]},
        {"output_type": "stream", "name": "stdout", "text": "tw"},
        {"output_type": "stream", "name": "stdout", "text": "o\n"}, err, PLOT,
        {"output_type": "stream", "name": "stdout", "text": "three\n"}])])
    outs = json.loads(nbfile.dumps(nb))["cells"][0]["outputs"]
    assert [(o["output_type"], o.get("name")) for o in outs] == [
        ("stream", "stdout"), ("stream", "stderr"), ("display_data", None), ("stream", "stdout")]
    assert outs[0]["text"] == ["one\n", "two\n"] and outs[3]["text"] == ["three\n"]


def test_write_is_atomic_and_round_trips(tmp_path):
    nb = _nb([_code("a")], widgets={"state": {"max": 3.0}})
    path = tmp_path / "n.ipynb"
    nbfile.write(nb, path)
    assert nbfile.is_canonical(path)
    assert json.loads(path.read_text())["metadata"]["widgets"] == {"state": {"max": 3}}
    assert [p.name for p in tmp_path.iterdir()] == ["n.ipynb"]  # no temporary file left


# ---- the save hook, through jupyter_server's own contents manager ------------------------------

PLOT = {"output_type": "display_data", "metadata": {},
        "data": {labsave.PLOTLY: {"data": [{"y": [0.0, 1.5]}], "layout": {}},
                 "text/plain": "Figure"}}


@pytest.fixture
def book(tmp_path):
    """A notebook on disk as labkit writes it, and the contents manager ./book.sh configures."""
    nb = _nb([_code("a", outputs=[PLOT])],
             language_info={"name": "python", "version": "3.11.7"})
    nbfile.write(nb, tmp_path / "ch.ipynb")
    cm = FileContentsManager(root_dir=str(tmp_path), pre_save_hook="labkit.labsave.pre_save_hook")
    return tmp_path / "ch.ipynb", cm


def _as_browser_sends(path: Path) -> dict:
    """What JupyterLab sends when saving the unedited notebook on a reader's machine: numbers
    through JavaScript, its own kernel's language_info, a PNG drawn by the plotly extension."""
    nb = json.loads(json.dumps(nbfile.as_jupyterlab(nbformat.read(str(path), as_version=4))))
    nb["metadata"]["language_info"]["version"] = "3.13.1"
    nb["metadata"]["kernelspec"]["display_name"] = "Python 3 (my env)"
    nb["cells"][0]["outputs"][0]["data"]["image/png"] = "iVBORw0KGgo="
    nb["cells"][0]["metadata"]["trusted"] = True  # never written by nbformat
    return nb


def test_saving_an_unedited_notebook_keeps_its_bytes(book, caplog):
    path, cm = book
    before = path.read_bytes()
    cm.log = logging.getLogger("test-labsave")
    with caplog.at_level(logging.INFO, logger="test-labsave"):
        cm.save({"type": "notebook", "format": "json", "content": _as_browser_sends(path)},
                "ch.ipynb")
    assert path.read_bytes() == before
    assert "unchanged by the reader" in caplog.text  # kept because equal, not by luck


def test_a_real_edit_is_saved_without_the_plotly_png(book):
    path, cm = book
    nb = _as_browser_sends(path)
    nb["cells"][0]["source"] = "x = 2"
    cm.save({"type": "notebook", "format": "json", "content": nb}, "ch.ipynb")
    saved = json.loads(path.read_text())
    assert saved["cells"][0]["source"] == ["x = 2"]
    assert "image/png" not in saved["cells"][0]["outputs"][0]["data"]
    assert saved["metadata"]["language_info"]["version"] == "3.13.1"  # an edit saves it all


def test_book_sh_leaves_start_here_as_committed():
    """./book.sh regenerates START_HERE.ipynb (labkit.landing) before JupyterLab starts: the
    committed file must be what it writes, or starting the book edits it."""
    from labkit import landing

    want = (ROOT / "START_HERE.ipynb").read_text()
    assert nbfile.dumps(landing.landing_notebook(ROOT)) == want, \
        "START_HERE.ipynb is out of date: run python -m labkit.landing ."
