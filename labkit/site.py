"""The book as a static website, from the notebooks as saved (their outputs are not re-run).

    labkit site build [--out build/site]      then open build/site/index.html (no server needed)

Builder: nbconvert's HTMLExporter with a small template extending its `lab` template
(labkit/site_assets/book.html.j2). Why: nbconvert is already installed (JupyterLab and the
grader need it), it renders notebooks exactly as JupyterLab shows them (same CSS, same output
renderers), and a 40-line template plus this module is all the site needs. Jupyter Book would
add Sphinx and dozens of packages to the book's requirements, and its theme loads fonts and
scripts that would have to be hunted down one by one to work offline.

Everything is local, so the site works from file:// with no network:
  * math: KaTeX 0.16.22 from the npm registry (`npm pack katex@0.16.22`; katex.min.js,
    katex.min.css, contrib/auto-render.min.js and the woff2 fonts, MIT licence), vendored in
    labkit/site_assets/katex/;
  * figures: the chapters save plotly figures as application/vnd.plotly.v1+json; each becomes a
    div plus its JSON, drawn by plotly.min.js copied from the installed `plotly` PyPI package
    (plotly/package_data/plotly.min.js; its version is written to _static/VERSIONS.txt);
  * the lab template's CDN scripts (require.js, MathJax, mermaid, the widgets manager) are left
    out; an ipywidgets calculator is replaced by a line saying to open the chapter in JupyterLab.

Pages: index.html (START_HERE, labkit.landing), chapters/NN_x.html, exercises/NN_x.html,
solutions/NN_x.html, and glossary.html from GLOSSARY.md (a markdown file, rendered through the
same template as a one-cell notebook) when the book has one; a sidebar lists every chapter (with
its exercises/solutions), and a pager links the previous and next page. Links between notebooks
(x.ipynb) become links to pages, and links to GLOSSARY.md become links to glossary.html.
"""
from __future__ import annotations

import argparse
import copy
import html
import json
import re
import shutil
import sys
from pathlib import Path

import nbformat

from labkit import landing

ASSETS = Path(__file__).resolve().parent / "site_assets"
KATEX_VERSION = "0.16.22"
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = ('<p class="book-widget-note">An interactive calculator is here in JupyterLab: '
               'open this notebook with <code>./book.sh</code> and run it.</p>')
LINK = re.compile(r'href="(?![a-z]+:|#)([^"#]*?)\.ipynb(#[^"]*)?"')
GLOSSARY_LINK = re.compile(r'href="((?:\.\./)*)GLOSSARY\.md(#[^"]*)?"')
GLOSSARY_PAGE = "glossary.html"


def _figure_html(fig: dict, div_id: str) -> str:
    """A div and the figure's JSON (as a non-executed script), drawn by book.js."""
    data = json.dumps(fig).replace("</", "<\\/")  # a string in the JSON cannot close the tag
    height = (fig.get("layout") or {}).get("height") or 450
    return (f'<div class="book-plotly" id="{div_id}" style="height:{int(height)}px"></div>'
            f'<script type="application/json" id="{div_id}-json">{data}</script>')


def prepare(nb):
    """A copy of nb whose plotly outputs are figure divs and whose widget views are a note."""
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)  # else the lab template loads a widget manager from a CDN
    n = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY in data:
                n += 1
                out["data"] = {"text/html": _figure_html(data[PLOTLY], f"fig{n}")}
            elif WIDGET in data:
                out["data"] = {"text/html": WIDGET_NOTE}
    return nb


def markdown_notebook(text: str):
    """A markdown file as a one-cell notebook, so that it renders with the book's template."""
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(text)])


def _pages(root: Path) -> list:
    """[(rel html path, notebook path, title, chapter row or None, folder)], in reading order."""
    pages = [("index.html", None, "Start here", None, None)]
    if (root / landing.GLOSSARY).exists():
        pages.append((GLOSSARY_PAGE, root / landing.GLOSSARY, "Glossary", None, "glossary"))
    for row in landing.chapters(root):
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
        return {"href": up + same[k][0], "title": same[k][2]} if i is not None and 0 <= k < len(same) else None

    return {"static": f"{up}_static", "home": f"{up}index.html", "toc": toc,
            "prev": link(i - 1) if i else None, "next": link(i + 1) if i is not None else None}


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


def build(root: Path, out: Path) -> list:
    """Write the site for the book at root into out; return the pages written (paths)."""
    from nbconvert import HTMLExporter

    root, out = Path(root), Path(out)
    exporter = HTMLExporter(template_name="lab", extra_template_paths=[str(ASSETS)])
    exporter.template_file = "book.html.j2"
    exporter.exclude_input_prompt = exporter.exclude_output_prompt = True
    rows = landing.chapters(root)
    order = _pages(root)
    out.mkdir(parents=True, exist_ok=True)
    _copy_assets(out)
    written = []
    for rel, path, title, row, folder in order:
        if path is None:
            nb = landing.landing_notebook(root)
        elif path.suffix == ".md":
            nb = markdown_notebook(path.read_text())
        else:
            nb = nbformat.read(path, as_version=4)
        nb.metadata["title"] = title
        resources = {"metadata": {"name": title}, "site": _nav(rel, row, folder, rows, order)}
        body, _ = exporter.from_notebook_node(prepare(nb), resources=resources)
        body = LINK.sub(lambda m: f'href="{m.group(1)}.html{m.group(2) or ""}"', body)
        body = GLOSSARY_LINK.sub(lambda m: f'href="{m.group(1)}{GLOSSARY_PAGE}{m.group(2) or ""}"', body)
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body)
        written.append(target)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="labkit site", description="build the book's website")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_build = sub.add_parser("build", help="write a static HTML site from the saved notebooks")
    p_build.add_argument("--out", default="build/site", help="folder to write (default build/site)")
    p_build.add_argument("--root", default=".", help="the book's repository (default .)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not (root / "chapters").is_dir():
        print(f"labkit site: no chapters/ folder in {root.resolve()}; pass --root REPO", file=sys.stderr)
        return 2
    pages = build(root, Path(args.out))
    print(f"wrote {len(pages)} pages to {args.out} (open {Path(args.out) / 'index.html'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
