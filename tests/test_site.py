"""labkit.landing (START_HERE.ipynb) and labkit.site (the static website), without a browser."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from labkit import landing, site

ROOT = Path(__file__).resolve().parents[1]


def _chapter(root: Path, folder: str, name: str, title: str, cells=()) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(f"# Chapter {name[:2]} — {title}"),
                                         *cells])
    (root / folder).mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, root / folder / name)


def test_landing_lists_every_chapter_with_its_exercises_and_solutions():
    text = "".join(c.source for c in landing.landing_notebook(ROOT).cells)
    for nb in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")):
        assert f"(chapters/{nb.name})" in text
        for folder in ("exercises", "solutions"):
            if (ROOT / folder / nb.name).exists():
                assert f"({folder}/{nb.name})" in text
    assert "labkit grade" in text and "How grading works" in text


def test_a_chapter_added_later_appears_without_editing(tmp_path):
    _chapter(tmp_path, "chapters", "00_a.ipynb", "First")
    before = landing.write(tmp_path).read_text()
    assert "08_mixture_of_experts" not in before
    _chapter(tmp_path, "chapters", "08_mixture_of_experts.ipynb", "Mixture of experts")
    _chapter(tmp_path, "solutions", "08_mixture_of_experts.ipynb", "Mixture of experts")
    text = landing.write(tmp_path).read_text()
    assert "[Mixture of experts](chapters/08_mixture_of_experts.ipynb)" in text
    assert "[solutions](solutions/08_mixture_of_experts.ipynb)" in text
    assert "| 08 |" in text and "| — |" in text  # no exercises notebook yet: no link


def test_landing_file_is_rewritten_only_when_it_changes(tmp_path):
    _chapter(tmp_path, "chapters", "00_a.ipynb", "First")
    path = landing.write(tmp_path)
    mtime = path.stat().st_mtime_ns
    assert landing.write(tmp_path).stat().st_mtime_ns == mtime


def test_committed_landing_is_valid_and_lists_the_book():
    nb = nbformat.read(ROOT / landing.NAME, as_version=4)
    nbformat.validate(nb)
    text = "".join(c.source for c in nb.cells)
    assert "(chapters/00_why_distribute.ipynb)" in text


def test_prepare_turns_plotly_json_into_a_figure_div_and_widgets_into_a_note():
    fig = {"data": [{"type": "bar", "x": [1], "y": [2], "name": "</script>"}], "layout": {"height": 300}}
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("fig", outputs=[
        nbformat.v4.new_output("display_data", data={site.PLOTLY: fig, "text/plain": "Figure"}),
        nbformat.v4.new_output("display_data", data={site.WIDGET: {"model_id": "x"}, "text/plain": "W"}),
    ])])
    nb.metadata["widgets"] = {"state": {}}
    out = site.prepare(nb)
    html0 = out.cells[0].outputs[0]["data"]
    assert list(html0) == ["text/html"]
    m = re.search(r'<script type="application/json" id="fig1-json">(.*)</script>', html0["text/html"])
    assert json.loads(m.group(1)) == fig  # "</script>" inside the JSON is escaped, still equal
    assert 'height:300px' in html0["text/html"]
    assert out.cells[0].outputs[1]["data"] == {"text/html": site.WIDGET_NOTE}
    assert "widgets" not in out.metadata and "widgets" in nb.metadata  # the input is untouched


def test_build_writes_pages_with_local_assets_only(tmp_path):
    book = tmp_path / "book"
    md = nbformat.v4.new_markdown_cell("Math $a^2$ and see [the solutions](../solutions/01_b.ipynb#top).")
    _chapter(book, "chapters", "00_a.ipynb", "First")
    _chapter(book, "chapters", "01_b.ipynb", "Second", [md])
    _chapter(book, "solutions", "01_b.ipynb", "Second")
    pages = site.build(book, tmp_path / "site")
    rels = sorted(str(p.relative_to(tmp_path / "site")) for p in pages)
    assert rels == ["chapters/00_a.html", "chapters/01_b.html", "index.html", "solutions/01_b.html"]
    for p in pages:
        text = p.read_text()
        # every script and stylesheet the page loads is a relative path inside the site
        for url in re.findall(r'<(?:script|link)[^>]+(?:src|href)="([^"]+)"', text):
            assert not re.match(r"[a-z]+:|//", url), f"{p.name} loads {url}"
            assert (p.parent / url).resolve().exists(), f"{p.name}: {url} missing"
    b = (tmp_path / "site" / "chapters" / "01_b.html").read_text()
    assert 'href="../solutions/01_b.html#top"' in b
    assert re.search(r'<a [^>]*href="../chapters/00_a.html"[^>]*rel="prev"', b)
    assert "$a^2$" in b  # typeset in the browser by KaTeX (tests/e2e/test_site.py checks that)
    assert (tmp_path / "site" / "_static" / "katex" / "fonts" / "KaTeX_Main-Regular.woff2").exists()
    assert "plotly" in (tmp_path / "site" / "_static" / "VERSIONS.txt").read_text()


def test_site_command_refuses_a_folder_without_chapters(tmp_path, capsys):
    assert site.main(["build", "--root", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "chapters/" in capsys.readouterr().err


def test_glossary_is_linked_from_the_landing_page_and_built_as_a_page(tmp_path):
    book = tmp_path / "book"
    _chapter(book, "chapters", "00_a.ipynb", "First")
    assert "GLOSSARY" not in landing.write(book).read_text()  # no glossary, no dangling link
    (book / "GLOSSARY.md").write_text("# Glossary\n\n- **Rank.** A process's index. "
                                      "Chapters: [00](chapters/00_a.ipynb#rank).\n")
    assert "[GLOSSARY.md](GLOSSARY.md)" in landing.write(book).read_text()
    pages = site.build(book, tmp_path / "site")
    assert tmp_path / "site" / "glossary.html" in pages
    g = (tmp_path / "site" / "glossary.html").read_text()
    assert "A process" in g and 'href="chapters/00_a.html#rank"' in g
    assert 'href="glossary.html"' in (tmp_path / "site" / "index.html").read_text()


def test_committed_glossary_links_only_chapters_that_exist():
    text = (ROOT / landing.GLOSSARY).read_text()
    links = re.findall(r"\]\((chapters/[^)#]+)", text)
    assert links, "the glossary links no chapter"
    missing = sorted({rel for rel in links if not (ROOT / rel).exists()})
    assert not missing, missing
    assert "(GLOSSARY.md)" in (ROOT / landing.NAME).read_text()
