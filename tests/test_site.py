"""labkit.landing (START_HERE.ipynb) and labkit.site (the static website), without a browser."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

from labkit import chapters, exercises, landing, site
from labkit.widgets import web

ROOT = Path(__file__).resolve().parents[1]


def _chapter(root: Path, folder: str, name: str, title: str, cells=()) -> None:
    title_cell = nbformat.v4.new_markdown_cell(f"# Chapter {name[:2]} — {title}")
    nb = nbformat.v4.new_notebook(cells=[title_cell, *cells])
    (root / folder).mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, root / folder / name)


@pytest.fixture
def tiny_manifest(monkeypatch):
    """The manifest of the tiny books below (labkit.chapters): a chapter is listed where its
    chapters/ notebook exists."""
    monkeypatch.setattr(chapters, "CHAPTERS", (
        chapters.Chapter(0, "a", "First"), chapters.Chapter(1, "b", "Second"),
        chapters.Chapter(8, "mixture_of_experts", "Mixture of experts"),
        chapters.Chapter(9, "p", "P", calculators=("precision",))))


def test_landing_lists_every_chapter_with_its_exercises_and_solutions():
    text = "".join(c.source for c in landing.landing_notebook(ROOT).cells)
    for nb in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")):
        assert f"(chapters/{nb.name})" in text
        assert f"(solutions/{nb.name})" in text
        # the exercises' file says so: its JupyterLab tab reads differently from the chapter's
        assert f"(exercises/{exercises.exercise_name(nb.name)})" in text
        assert (ROOT / "exercises" / exercises.exercise_name(nb.name)).exists()
    assert "labkit grade" in text and "How grading works" in text


def test_a_chapter_added_to_the_manifest_appears_once_its_notebook_exists(tiny_manifest, tmp_path):
    _chapter(tmp_path, "chapters", "00_a.ipynb", "First")
    before = landing.write(tmp_path).read_text()
    assert "08_mixture_of_experts" not in before
    _chapter(tmp_path, "chapters", "08_mixture_of_experts.ipynb", "Mixture of experts")
    _chapter(tmp_path, "solutions", "08_mixture_of_experts.ipynb", "Mixture of experts")
    text = landing.write(tmp_path).read_text()
    assert "[Mixture of experts](chapters/08_mixture_of_experts.ipynb)" in text
    assert "[solutions](solutions/08_mixture_of_experts.ipynb)" in text
    assert "| 08 |" in text and "| — |" in text  # no exercises notebook yet: no link


def test_landing_file_is_rewritten_only_when_it_changes(tiny_manifest, tmp_path):
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
    fig = {"data": [{"type": "bar", "x": [1], "y": [2], "name": "</script>"}],
           "layout": {"height": 300}}
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("fig", outputs=[
        nbformat.v4.new_output("display_data", data={site.PLOTLY: fig, "text/plain": "Figure"}),
        nbformat.v4.new_output("display_data",
                               data={site.WIDGET: {"model_id": "x"}, "text/plain": "W"}),
    ])])
    nb.metadata["widgets"] = {"state": {}}
    out = site.prepare(nb)
    html0 = out.cells[0].outputs[0]["data"]
    assert list(html0) == ["text/html"]
    m = re.search(r'<script type="application/json" id="fig1-json">(.*)</script>',
                  html0["text/html"])
    assert json.loads(m.group(1)) == fig  # "</script>" inside the JSON is escaped, still equal
    assert 'height:300px' in html0["text/html"]
    assert out.cells[0].outputs[1]["data"] == {"text/html": site.WIDGET_NOTE}
    assert "widgets" not in out.metadata and "widgets" in nb.metadata  # the input is untouched


def test_build_writes_pages_with_local_assets_only(tiny_manifest, tmp_path):
    book = tmp_path / "book"
    md = nbformat.v4.new_markdown_cell(
        "Math $a^2$ and see [the solutions](../solutions/01_b.ipynb#top).")
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
            if url.startswith("data:"):  # the empty favicon: inside the page, fetches nothing
                continue
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


def test_glossary_is_linked_from_the_landing_page_and_built_as_a_page(tiny_manifest, tmp_path):
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


def _widget_cell(source, model_ids):
    outs = [nbformat.v4.new_output("display_data",
                                   data={site.WIDGET: {"model_id": m}, "text/plain": "W"})
            for m in model_ids]
    return nbformat.v4.new_code_cell(source, outputs=outs)


def test_a_chapter_calculator_becomes_live_controls_with_its_default_text():
    nb = nbformat.v4.new_notebook(cells=[
        _widget_cell("view.bytes_widget(7e9)", ["a", "a"]),       # saved twice: shown once
        _widget_cell("other_widget()", ["b"]),                     # no website calculator: a note
        nbformat.v4.new_markdown_cell(landing.NAV_MARK + "\n---\nlinks")])
    out = site.prepare(nb, "09")
    assert len(out.cells) == 2  # the closing-links cell: the page's footer has the same links
    calc = out.cells[0].outputs
    assert len(calc) == 1
    html0 = calc[0]["data"]["text/html"]
    assert 'data-calc="precision"' in html0 and "<noscript>" in html0
    assert "2 + 2 + 12 = 16 bytes/param; 7B params: 112 GB" in html0  # rendered at build time
    assert 'name="weights"' in html0 and 'name="master"' in html0
    assert out.cells[1].outputs[0]["data"] == {"text/html": site.WIDGET_NOTE}


def test_every_chapter_calculator_has_a_website_calculator():
    """Each widget a chapter saves stands for a web calculator, except the ring's step explorer
    (frames drawn at build time, tests/e2e/test_site_browser.py)."""
    missing = []
    for path in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if any(site.WIDGET in o.get("data", {}) for o in cell.get("outputs", [])):
                if (web.find(path.name[:2], cell.source) is None
                        and "ring_explorer" not in cell.source):
                    missing.append(f"{path.name}: {cell.source.strip()[:60]}")
    assert not missing, missing
    for key in web.CALCULATORS:
        assert "cannot compute" not in web.render(key), key


def test_calculators_import_no_torch_numpy_plotly_or_ipywidgets():
    """What Pyodide imports must be pure Python: blocked here, every calculator still renders."""
    code = ("import sys\n"
            "for m in ('torch', 'numpy', 'plotly', 'ipywidgets', 'IPython'):\n"
            "    sys.modules[m] = None\n"
            "from labkit.widgets import web\n"
            "print(sum(len(web.render(k)) > 0 for k in web.CALCULATORS))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout) == len(web.CALCULATORS)


def test_inputs_as_the_browser_sends_them():
    v = web.from_inputs("precision", '{"n_params": 2, "weights": "fp32", "master": true}')
    assert v == {"n_params": 100.0, "weights": "fp32", "master": True}  # a log range: 10 ** x
    assert web.from_inputs("intro", {"dp": 16.0})["dp"] == 16 and isinstance(
        web.from_inputs("intro", {"dp": 16.0})["dp"], int)
    # fp32 weights are their own master copy: the fp32 recipe's 16 B/param, not 18
    assert web.render("precision", {"weights": "fp32", "grads": "fp32"}).startswith(
        "4 + 4 + 8 = 16")


def test_chapter_pages_link_exercises_solutions_and_the_next_chapter(tiny_manifest, tmp_path):
    book = tmp_path / "book"
    for folder, name in (("chapters", "00_a.ipynb"), ("exercises", "00_a_exercises.ipynb"),
                         ("solutions", "00_a.ipynb")):
        _chapter(book, folder, name, "First")
    _chapter(book, "chapters", "01_b.ipynb", "Second")
    site.build(book, tmp_path / "site", runtime=None)
    for folder in ("chapters", "exercises", "solutions"):
        page = (tmp_path / "site" / folder / "00_a.html").read_text()
        footer = page[page.index('class="book-path"'):]
        order = [footer.index(f'href="../{f}/00_a.html"')
                 for f in ("chapters", "exercises", "solutions")]
        assert order == sorted(order), folder
        assert 'href="../chapters/01_b.html">next: 01' in footer
    index = (tmp_path / "site" / "index.html").read_text()
    assert "file browser on the left" not in index and "Run it yourself" in index
    assert 'href="chapters/00_a.html"' in index


def test_nav_markdown_is_the_cell_the_chapters_end_with():
    rows = landing.rows(ROOT)
    for i, row in enumerate(rows):
        text = landing.nav_markdown(rows, i)
        assert text.startswith(landing.NAV_MARK) and f"(../{row['exercises']})" in text
        if i + 1 < len(rows):
            assert f"({rows[i + 1]['stem']}.ipynb)" in text
    for stem in (r["stem"] for r in rows):
        nb = nbformat.read(ROOT / "chapters" / f"{stem}.ipynb", as_version=4)
        i = next(k for k, r in enumerate(rows) if r["stem"] == stem)
        assert nb.cells[-1].source == landing.nav_markdown(rows, i), stem


def test_runtime_and_labkit_are_copied_into_the_site(tiny_manifest, tmp_path):
    """With a (stand-in) Pyodide folder, its core files and labkit's calculator modules land in
    _static; nothing else of the npm package."""
    fake = tmp_path / "pyodide"
    fake.mkdir()
    for name in site.PYODIDE_FILES + ("console.html",):
        (fake / name).write_text(name)
    book = tmp_path / "book"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Chapter 09 — P"),
                                         _widget_cell("view.bytes_widget(7e9)", ["m"])])
    (book / "chapters").mkdir(parents=True)
    nbformat.write(nb, book / "chapters" / "09_p.ipynb")
    site.build(book, tmp_path / "site", runtime=fake)
    static = tmp_path / "site" / "_static"
    assert sorted(p.name for p in (static / "pyodide").iterdir()) == sorted(site.PYODIDE_FILES)
    names = zipfile.ZipFile(static / site.CALC_ZIP).namelist()
    assert "labkit/widgets/web.py" in names and "labkit/costs/memory.py" in names
    script = (ROOT / "scripts" / "pyodide-fetch.sh").read_text()
    assert re.search(r"^VERSION=\d+\.\d+\.\d+", script, re.M)
    assert re.search(r"^SHA256=[0-9a-f]{64}\b", script, re.M)


def _same_outputs(cell) -> list:
    """Outputs of one cell that repeat another's widget model or plotly figure."""
    seen, dup = set(), []
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if site.WIDGET in data:
            key = ("widget", data[site.WIDGET].get("model_id"))
        elif site.PLOTLY in data:
            key = ("figure", json.dumps(data[site.PLOTLY], sort_keys=True))
        else:
            continue
        if key in seen:
            dup.append(key[0])
        seen.add(key)
    return dup


def test_no_notebook_saves_a_widget_or_figure_twice():
    """A widget both displayed and returned by its cell is saved (and shown in JupyterLab) twice."""
    bad = []
    for folder in landing.FOLDERS:
        for path in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb")):
            for cell in nbformat.read(path, as_version=4).cells:
                if _same_outputs(cell):
                    bad.append(f"{folder}/{path.name}: {cell.source.strip()[:50]!r} "
                               f"shows a {_same_outputs(cell)[0]} twice")
    assert not bad, bad


def test_website_defaults_print_what_the_notebook_widgets_saved():
    """The text a calculator shows at its defaults is, character for character, what the chapter's
    widget printed when the chapter was run (chapter 07's two widgets draw figures only)."""
    for key in web.CALCULATORS:
        if web.chapter_of(key) == "07":
            continue
        chapter = ROOT / chapters.chapter(int(web.chapter_of(key))).notebooks[0]
        saved = json.dumps(json.loads(chapter.read_text()))
        assert json.dumps(web.render(key))[1:-1] in saved, key


# The zip alone on the path, then site's own description of the browser (site.BROWSER_RENDER:
# what Pyodide lacks is one fact, which a copy here would only repeat; the browser tests check it
# against the real Pyodide). What this checks is the zip: that nothing of labkit is missing from it.
ZIP_ONLY = """
import sys
sys.path = [p for p in sys.path if "site-packages" not in p and not p.startswith(sys.argv[2])]
sys.path.insert(0, sys.argv[1])
sys.meta_path = [f for f in sys.meta_path if "editable" not in type(f).__module__ + repr(f)]
""" + site.BROWSER_RENDER + """
print("rendered", len(web.CALCULATORS))
"""


def test_every_calculator_renders_from_the_zip_alone(tmp_path):
    """What the browser gets is the zip: every calculator renders from it with nothing else of
    labkit on the path and no torch, numpy, plotly or ipywidgets (a module site.calculator_files
    misses fails here, not in the reader's browser)."""
    zipped = site.calculators_zip(tmp_path / site.CALC_ZIP)
    out = subprocess.run([sys.executable, "-I", "-c", ZIP_ONLY, str(zipped), str(ROOT)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"rendered {len(web.CALCULATORS)}", out.stdout
