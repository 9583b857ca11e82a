"""The book as a static website, from the notebooks as saved (their outputs are not re-run).

    labkit site build [--out build/site]      then open build/site/index.html (no server needed)
    labkit site serve [--dir build/site]      http://127.0.0.1:8000/, where the calculators run

Builder: nbconvert's HTMLExporter with a small template extending its `lab` template
(labkit/site_assets/book.html.j2): already installed, it renders notebooks as JupyterLab shows
them; Jupyter Book would add Sphinx and dozens of packages, and fonts and scripts from CDNs.

Everything is local: a page fetches nothing from outside the site (the build fetches one thing,
once: the pinned Pyodide tarball).
  * math: KaTeX 0.16.22 (npm; js, css, auto-render, woff2 fonts; MIT), in site_assets/katex/;
  * figures: each saved plotly figure (application/vnd.plotly.v1+json) becomes a div and its
    JSON, drawn by plotly.min.js from the installed `plotly` PyPI package;
  * calculators: a chapter's ipywidgets calculator becomes HTML controls over the same Python
    (labkit.widgets.web: the widget's text function, over labkit.costs), run in the reader's
    browser by Pyodide: the core runtime of the npm package pinned in scripts/pyodide-fetch.sh
    (version and sha256; fetched once into .cache/pyodide) is copied to _static/pyodide, and
    the pure-Python modules the calculators import to _static/labkit-calculators.zip. The page
    holds the defaults' text, computed at build time, so it reads the same with JavaScript off.
    Pyodide cannot load from file:// (browsers refuse fetch there): `labkit site serve` serves
    the site on 127.0.0.1; from file:// every page still renders, with the defaults' text.
  * chapter 01's ring explorer: its frames drawn at build time, switched by two sliders;
  * the lab template's CDN scripts (require.js, MathJax, mermaid, widgets manager) are left out.

Pages: index.html (site_assets/index.md: the book for a web reader, with the generated table of
contents), chapters/NN_x.html, exercises/NN_x.html, solutions/NN_x.html, and glossary.html from
GLOSSARY.md. A sidebar lists every chapter (a "Contents" menu under 900 px, CSS only); the
footer links chapter -> exercises -> solutions -> next chapter, then the previous and next page.
Links to x.ipynb, START_HERE and GLOSSARY.md become links to pages. A chapter's closing-links
cell (landing.nav_markdown) is left out of its page: the footer holds the same links.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat

from labkit import chapters, landing
from labkit.landing import NAV_MARK
from labkit.site_serve import server
from labkit.widgets import web

ASSETS = Path(__file__).resolve().parent / "site_assets"
KATEX_VERSION = "0.16.22"
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = ('<p class="book-widget-note">An interactive calculator is here in JupyterLab: '
               'open this notebook with <code>./book.sh</code> and run it.</p>')
LINK = re.compile(r'href="(?![a-z]+:|#)([^"#]*?)\.ipynb(#[^"]*)?"')
RING = re.compile(r"ring_explorer\((\d)\)")  # chapter 01's explorer: frames, not formulas
START_LINK = re.compile(r'href="((?:\.\./)*)START_HERE\.html(#[^"]*)?"')
REPO = Path(__file__).resolve().parents[1]
PYODIDE_FETCH = REPO / "scripts" / "pyodide-fetch.sh"
# The core runtime: what loadPyodide() fetches before it can run pure-Python code (no packages).
PYODIDE_FILES = ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip",
                 "pyodide-lock.json")
CALC_ZIP = "labkit-calculators.zip"
# Every calculator rendered (labkit.widgets.web) without what Pyodide's core runtime lacks: run to
# find the zip's contents (calculator_files: found, not listed), and by test_site on the zip alone.
BROWSER_RENDER = """
import sys
class Block:   # what Pyodide's core runtime does not have
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy", "plotly", "ipywidgets", "IPython"):
            raise ImportError("not in the browser: " + name)
sys.meta_path.insert(0, Block())
from labkit.widgets import web
for key in web.CALCULATORS:
    web.render(key, web.defaults(key))
"""
BROWSER_IMPORTS = BROWSER_RENDER + """
for m in sorted(sys.modules):
    if m.split(".")[0] == "labkit" and getattr(sys.modules[m], "__file__", None):
        print(sys.modules[m].__file__)
"""
GLOSSARY_LINK = re.compile(r'href="((?:\.\./)*)GLOSSARY\.md(#[^"]*)?"')
GLOSSARY_PAGE = "glossary.html"


def _figure_html(fig: dict, div_id: str) -> str:
    """A div and the figure's JSON (as a non-executed script), drawn by book.js."""
    data = json.dumps(fig).replace("</", "<\\/")  # a string in the JSON cannot close the tag
    height = (fig.get("layout") or {}).get("height") or 450
    return (f'<div class="book-plotly" id="{div_id}" style="height:{int(height)}px"></div>'
            f'<script type="application/json" id="{div_id}-json">{data}</script>')


def prepare(nb, chapter: str | None = None):
    """A copy of nb whose plotly outputs are figure divs and whose widget views are a live
    calculator (labkit.widgets.web, for a chapter's calculator cell) or a note; one widget per
    cell (a widget saved twice, displayed and returned, shows once) and no closing-links cell
    (the page's footer has the same links)."""
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)  # else the lab template loads a widget manager from a CDN
    nb.cells = [c for c in nb.cells if not (c.cell_type == "markdown"
                                            and c.source.startswith(NAV_MARK))]
    n = 0
    for cell in nb.cells:
        seen_widget = False
        kept = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY in data:
                n += 1
                out["data"] = {"text/html": _figure_html(data[PLOTLY], f"fig{n}")}
            elif WIDGET in data:
                if seen_widget:
                    continue
                seen_widget = True
                key = web.find(chapter, cell.source) if chapter else None
                ring = RING.fullmatch(cell.source.strip())
                if ring:  # frames drawn now; the page's sliders switch between them
                    from labkit.widgets.ring import frames  # imports torch: only for this page

                    n += 1
                    fr = frames()
                    start = int(ring.group(1))
                    fig = _figure_html(json.loads(fr[start][0]), f"fig{n}")
                    out["data"] = {"text/html": web.frames_html(fig, fr, start, WIDGET_NOTE)}
                else:
                    out["data"] = {"text/html": web.calculator_html(key, WIDGET_NOTE) if key
                                   else WIDGET_NOTE}
            kept.append(out)
        if "outputs" in cell:
            cell.outputs = kept
    return nb


def markdown_notebook(text: str):
    """A markdown file as a one-cell notebook, so that it renders with the book's template."""
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(text)])


def _pages(root: Path) -> list:
    """[(rel html path, notebook path, title, chapter row or None, folder)], in reading order."""
    pages = [("index.html", None, "The book", None, None)]
    if (root / landing.GLOSSARY).exists():
        pages.append((GLOSSARY_PAGE, root / landing.GLOSSARY, "Glossary", None, "glossary"))
    for row in landing.rows(root):
        for folder in landing.FOLDERS:
            if row[folder]:
                pages.append((f"{folder}/{row['stem']}.html", root / row[folder],
                              f"{row['number']} · {row['title']}" + ("" if folder == "chapters"
                                                                      else f" ({folder})"),
                              row, folder))
    return pages


def _nav(rel: str, row, folder, rows: list, order: list) -> dict:
    """The template's `resources.site` for the page at rel."""
    up = "../" * rel.count("/")
    toc = []
    for r in rows:
        current = row is not None and r["stem"] == row["stem"]
        toc.append({"number": r["number"], "title": r["title"], "current": current,
                    "href": f"{up}chapters/{r['stem']}.html",
                    "variants": [{"name": f, "href": f"{up}{f}/{r['stem']}.html",
                                  "current": current and f == folder}
                                 for f in landing.FOLDERS if r[f]]})
    same = [p for p in order if p[4] == folder]  # prev/next within chapters, exercises, ...
    i = next((k for k, p in enumerate(same) if p[0] == rel), None)

    def link(k):
        if i is None or not 0 <= k < len(same):
            return None
        return {"href": up + same[k][0], "title": same[k][2]}

    # chapter -> exercises -> solutions -> next chapter, on every chapter's three pages
    path = []
    if row is not None:
        j = next(k for k, r in enumerate(rows) if r["stem"] == row["stem"])
        path = [{"name": "chapter" if f == "chapters" else f, "href": f"{up}{f}/{row['stem']}.html",
                 "current": f == folder} for f in landing.FOLDERS if row[f]]
        if j + 1 < len(rows):
            nxt = rows[j + 1]
            path.append({"name": f"next: {nxt['number']} · {nxt['title']}",
                         "href": f"{up}chapters/{nxt['stem']}.html", "current": False})
    return {"static": f"{up}_static", "home": f"{up}index.html", "toc": toc, "path": path,
            "prev": link(i - 1) if i else None, "next": link(i + 1) if i is not None else None}


def pyodide_dir() -> Path | None:
    """The pinned Pyodide runtime, fetched by scripts/pyodide-fetch.sh into its cache (fetched
    now if missing and the script is there); None when it cannot be had (no network)."""
    if not PYODIDE_FETCH.exists():
        return None
    r = subprocess.run(["bash", str(PYODIDE_FETCH)], capture_output=True, text=True)
    ok = r.returncode == 0 and r.stdout.strip()
    path = Path(r.stdout.strip().splitlines()[-1]) if ok else None
    if path is None or not all((path / f).exists() for f in PYODIDE_FILES):
        print(f"labkit site: no Pyodide runtime ({r.stderr.strip()[-300:]}); calculators will show "
              "their default values only", file=sys.stderr)
        return None
    return path


def calculator_files() -> list:
    """labkit's files the website's calculators import: those a fresh interpreter loads to render
    every calculator with torch, numpy, plotly and ipywidgets blocked (as in Pyodide), so a
    calculator added to the manifest brings its modules without a list to edit."""
    r = subprocess.run([sys.executable, "-c", BROWSER_IMPORTS], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    if r.returncode != 0:
        raise RuntimeError("the calculators do not import without torch, numpy, plotly and "
                           f"ipywidgets (Pyodide has none of them): {r.stderr.strip()[-1500:]}")
    return sorted(Path(f) for f in r.stdout.split())


def calculators_zip(dest: Path) -> Path:
    """labkit's pure-Python modules the calculators import, as a zip Pyodide unpacks."""
    package = REPO / "labkit"
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as z:
        for f in calculator_files():
            z.write(f, (Path("labkit") / f.resolve().relative_to(package.resolve())).as_posix())
    return dest


def _copy_runtime(static: Path, runtime: Path) -> None:
    (static / "pyodide").mkdir(parents=True, exist_ok=True)
    for name in PYODIDE_FILES:
        shutil.copy2(runtime / name, static / "pyodide" / name)
    calculators_zip(static / CALC_ZIP)


def _copy_assets(out: Path) -> None:
    import plotly

    static = out / "_static"
    shutil.copytree(ASSETS / "katex", static / "katex", dirs_exist_ok=True)
    for name in ("book.js", "book.css"):
        shutil.copy2(ASSETS / name, static / name)
    shutil.copy2(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", static)
    (static / "VERSIONS.txt").write_text(
        f"katex {KATEX_VERSION} (npm registry, vendored in labkit/site_assets/katex)\n"
        f"plotly.min.js from the plotly {plotly.__version__} PyPI package\n")


def index_notebook(root: Path):
    """The website's front page: site_assets/index.md (what the book is, the path through it, how
    to run it locally), then the table of contents with .html links and the glossary line."""
    text = (ASSETS / "index.md").read_text()
    table = landing.table_markdown(landing.rows(root), ".ipynb") + landing.glossary_line(root)
    return markdown_notebook(text.replace("{{contents}}", table))


def build(root: Path, out: Path, runtime: Path | None | bool = True) -> list:
    """Write the site for the book at root into out; return the pages written (paths).
    runtime: the Pyodide folder for live calculators (True: pyodide_dir(); None/False: none)."""
    from nbconvert import HTMLExporter

    root, out = Path(root), Path(out)
    exporter = HTMLExporter(template_name="lab", extra_template_paths=[str(ASSETS)])
    exporter.template_file = "book.html.j2"
    exporter.exclude_input_prompt = exporter.exclude_output_prompt = True
    rows = landing.rows(root)
    order = _pages(root)
    out.mkdir(parents=True, exist_ok=True)
    _copy_assets(out)
    written = []
    live = False
    for rel, path, title, row, folder in order:
        if path is None:
            nb = index_notebook(root)
        elif path.suffix == ".md":
            nb = markdown_notebook(path.read_text())
        else:
            nb = nbformat.read(path, as_version=4)
        nb.metadata["title"] = title
        resources = {"metadata": {"name": title}, "site": _nav(rel, row, folder, rows, order)}
        page = prepare(nb, row["number"] if row and folder == "chapters" else None)
        body, _ = exporter.from_notebook_node(page, resources=resources)
        live = live or 'class="book-calc"' in body
        body = LINK.sub(lambda m: f'href="{m.group(1)}.html{m.group(2) or ""}"', body)
        body = START_LINK.sub(lambda m: f'href="{m.group(1)}index.html{m.group(2) or ""}"', body)
        body = GLOSSARY_LINK.sub(
            lambda m: f'href="{m.group(1)}{GLOSSARY_PAGE}{m.group(2) or ""}"', body)
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body)
        written.append(target)
    runtime = pyodide_dir() if live and runtime is True else runtime
    if live and runtime:
        _copy_runtime(out / "_static", Path(runtime))
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="labkit site", description="build the book's website")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_build = sub.add_parser("build", help="write a static HTML site from the saved notebooks")
    p_build.add_argument("--out", default="build/site", help="folder to write (default build/site)")
    p_build.add_argument("--root", default=".", help="the book's repository (default .)")
    p_serve = sub.add_parser("serve", help="serve a built site on http://127.0.0.1:PORT/")
    p_serve.add_argument("--dir", default="build/site", help="the built site (default build/site)")
    p_serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        if not (Path(args.dir) / "index.html").exists():
            print(f"labkit site serve: no index.html in {args.dir}; run `labkit site build` first",
                  file=sys.stderr)
            return 2
        httpd = server(Path(args.dir), args.port)
        print(f"serving {args.dir} on http://127.0.0.1:{args.port}/ (Ctrl+C stops)")
        try:
            httpd.serve_forever()
        except KeyboardInterrupt:
            pass
        return 0
    root = Path(args.root)
    if not (root / "chapters").is_dir() or not landing.rows(root):
        print(f"labkit site: no chapters/ folder with a chapter of labkit.chapters in "
              f"{root.resolve()} (e.g. chapters/{chapters.CHAPTERS[0].stem}.ipynb); pass --root "
              f"REPO", file=sys.stderr)
        return 2
    pages = build(root, Path(args.out))
    print(f"wrote {len(pages)} pages to {args.out} (open {Path(args.out) / 'index.html'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
