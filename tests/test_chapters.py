"""The chapter manifest (labkit.chapters) is the one list of chapters: it agrees with the notebooks
on disk, imports nothing, and every registry that lists chapters, labs or calculators follows it,
so a new chapter is its notebooks, its implementation, its checker package and one entry."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit import book, chapter_stats, chapters, cli, landing, site
from labkit.widgets import controls, web

ROOT = Path(__file__).resolve().parents[1]


def test_the_manifest_and_the_notebooks_agree():
    on_disk = sorted(p.stem for p in (ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
    assert on_disk == [c.stem for c in chapters.CHAPTERS], \
        "chapters/ and labkit.chapters.CHAPTERS list different chapters"
    assert [c.number for c in chapters.CHAPTERS] == list(range(len(chapters.CHAPTERS)))
    for c in chapters.CHAPTERS:
        for rel in c.notebooks:
            assert (ROOT / rel).exists(), f"chapter {c.nn}: no {rel}"
        heading = landing.chapter_title(ROOT / c.notebooks[0])
        assert heading == c.title, f"chapter {c.nn}: the notebook says {heading!r}"
        package = ROOT / Path(*c.checker.split(".")) / "__init__.py"
        assert package.exists(), f"chapter {c.nn}: no checker package {c.checker}"
    names = [x.name for x in chapters.labs()]
    assert len(names) == len(set(names)), "a lab listed in two chapters"


def test_every_web_calculator_is_in_one_chapter_and_every_listed_one_exists():
    listed = [k for c in chapters.CHAPTERS for k in c.calculators]
    assert sorted(listed) == sorted(web.CALCULATORS), \
        "labkit.chapters' calculators and labkit.widgets.web.CALCULATORS differ"
    assert len(listed) == len(set(listed)), "a calculator listed in two chapters"


def test_the_manifest_imports_nothing_of_labkit_or_torch():
    code = ("import sys, labkit.chapters\n"
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('labkit', 'torch', 'numpy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["labkit", "labkit.chapters"]


def test_an_unknown_chapter_or_lab_names_the_ones_that_exist():
    with pytest.raises(KeyError, match="chapters: 00, 01"):
        chapters.chapter(99)
    with pytest.raises(KeyError, match="labs: intro, ring"):
        chapters.lab("nope")


# ---- a throw-away chapter (11 today): three notebooks and one manifest entry, nothing else ----

SOURCE = "view.inference_calculator()"


def _notebook(path: Path, title: str, cells=()) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(f"# {title}"), *cells])
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


@pytest.fixture
def new_chapter(monkeypatch, tmp_path):
    """A book of the last chapter and a new one after it (11 today) in tmp_path, the new one
    added to the manifest with a lab and a calculator (its web entry stands in for the one the
    chapter's widget module adds)."""
    last = chapters.CHAPTERS[-1]
    new = chapters.Chapter(last.number + 1, "inference", "Inference parallelism",
                           labs=(chapters.Lab("inference", ("--steps", "1"), "tokens/s"),),
                           calculators=("inference",))
    monkeypatch.setattr(chapters, "CHAPTERS", chapters.CHAPTERS + (new,))
    monkeypatch.setitem(web.CALCULATORS, "inference", web.Calculator(
        SOURCE, [controls.rng("batch", "batch", 1, 8, 1, 2)], lambda v: f"batch {v['batch']}"))
    widget = nbformat.v4.new_code_cell(SOURCE, outputs=[nbformat.v4.new_output(
        "display_data", data={site.WIDGET: {"model_id": "m", "version_major": 2,
                                            "version_minor": 0}})])
    for c in (last, new):
        for rel in c.notebooks:
            _notebook(tmp_path / rel, f"Chapter {c.nn} — {c.title}",
                      [widget] if c is new and rel.startswith("chapters/") else [])
    return last, new, tmp_path


def test_a_new_chapter_reaches_every_registry_from_its_manifest_entry(new_chapter, capsys):
    last, new, root = new_chapter
    rows = landing.rows(root)
    assert [r["number"] for r in rows] == [last.nn, new.nn]
    assert rows[1]["exercises"] == new.notebooks[1] == f"exercises/{new.stem}_exercises.ipynb"
    assert f"[Inference parallelism](chapters/{new.stem}.ipynb)" in "".join(
        c.source for c in landing.landing_notebook(root).cells)
    # the last chapter's closing links now lead to the new one: `labkit book nav` writes them
    assert landing.write_nav(root, check=True) == [root / last.notebooks[0],
                                                   root / new.notebooks[0]]
    assert book.main(["nav", "--root", str(root)]) == 0
    closing = nbformat.read(root / last.notebooks[0], as_version=4).cells[-1]
    assert closing.source == landing.nav_markdown(rows, 0)
    assert f"({new.stem}.ipynb)" in closing.source
    assert landing.write_nav(root, check=True) == []
    # labkit book, the README's numbers, the website's pages and calculators
    assert book.chapter_number(str(new.number)) == new.nn
    assert book.select(root, {new.nn}, ["chapters", "solutions"]) == [
        root / new.notebooks[0], root / new.notebooks[2]]
    assert [r["number"] for r in chapter_stats.all_stats(root)] == [last.nn, new.nn]
    assert web.chapter_of("inference") == new.nn and web.find(new.nn, SOURCE) == "inference"
    page = site.prepare(nbformat.read(root / new.notebooks[0], as_version=4), new.nn)
    assert 'data-calc="inference"' in page.cells[1].outputs[0]["data"]["text/html"]
    assert f"chapters/{new.stem}.html" in [p[0] for p in site._pages(root)]
    # labkit list (tests/test_labs.py and test_documented_commands.py read chapters.labs())
    assert cli.main(["list"]) == 0
    assert any(line.split()[:1] == [new.nn] and line.rstrip().endswith("inference")
               for line in capsys.readouterr().out.splitlines())
