"""Notebooks open as a reader opens them: a fresh kernel finds the installed labkit (no sys.path
edits, no os.chdir), and plotly uses the renderer JupyterLab draws without embedding plotly.js."""
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p for d in ("chapters", "solutions", "exercises")
                   for p in (ROOT / d).glob("*.ipynb"))


def _code(path):
    nb = json.loads(path.read_text())
    return nb, ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_path_hacks_and_a_plain_python3_kernel(path):
    nb, code = _code(path)
    for src in code:
        for hack in ("sys.path", "os.chdir", "PYTHONPATH", "%cd ", "site.addsitedir"):
            assert hack not in src, f"{path.name}: `{hack}` in a cell; labkit must be installed"
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert any("labkit" in src for src in code[:2]), f"{path.name}: labkit not imported up front"


@pytest.mark.parametrize("path", sorted((ROOT / "chapters").glob("*.ipynb")), ids=lambda p: p.name)
def test_plotly_renderer_is_the_jupyterlab_mimetype(path):
    nb, code = _code(path)
    assert 'pio.renderers.default = "plotly_mimetype"' in code[0], path.name
    text = path.read_text()
    assert "cdn.plot.ly" not in text and "plotly.min.js" not in text  # no plotly.js per output


@pytest.mark.parametrize("path", sorted((ROOT / "chapters").glob("*.ipynb")), ids=lambda p: p.name)
def test_chapter_names_its_labs_as_scripts(path):
    from labkit import chapters

    labs = chapters.chapter(int(path.name[:2])).lab_names
    text = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
    for lab in labs:
        assert f"labkit run {lab}" in text, f"{path.name} does not show `labkit run {lab}`"
