"""The website (labkit site build) in a real headless Chromium, with the network cut off.

Builds the site from the saved notebooks into a temporary folder, then opens every page from
file:// with every request routed through a check: anything that is not a file inside the site
is aborted and fails the test. Each page must load without a console error or page error; every
plotly figure must be drawn (an SVG inside each figure div); where the markdown holds math, KaTeX
must have typeset it (KaTeX elements present, no `$$` left in the rendered text, no KaTeX
error); and the sidebar's links must point at pages that exist.

Needs Debian's chromium and PyPI's playwright (scripts/e2e-setup.sh); skips without them unless
LABKIT_E2E_REQUIRED=1.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from labkit import site

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("LABKIT_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage"]
MATH = re.compile(r"\$\$|(?<![\\$\w])\$[^$\s][^$\n]*?\$|\\\(|\\\[")


def _need(ok: bool, why: str) -> None:
    if ok:
        return
    if os.environ.get("LABKIT_E2E_REQUIRED") == "1":
        pytest.fail(f"{why} (LABKIT_E2E_REQUIRED=1)")
    pytest.skip(f"{why}: run scripts/e2e-setup.sh to install Chromium and Playwright")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    start = time.monotonic()
    pages = site.build(ROOT, out)
    print(f"site build: {len(pages)} pages in {time.monotonic() - start:.1f} s")
    return out, pages


@pytest.fixture(scope="module")
def browser():
    _need(Path(CHROMIUM).exists(), f"no Chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need(False, "the Python package playwright is not installed")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


def test_every_page_renders_offline(built, browser):
    out, pages = built
    out = out.resolve()
    context = browser.new_context(viewport={"width": 1300, "height": 900})
    outside = []

    def route(r):
        url = r.request.url
        parsed = urlparse(url)
        local = parsed.scheme == "file" and Path(unquote(parsed.path)).resolve().is_relative_to(out)
        if local or parsed.scheme in ("data", "blob", "about"):
            r.continue_()
        else:
            outside.append(url)
            r.abort()

    context.route("**/*", route)
    page = context.new_page()
    problems = []
    messages = []
    page.on("console", lambda m: messages.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: messages.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: messages.append(f"request failed: {r.url}"))
    figures = math_pages = 0
    for path in pages:
        messages.clear()
        rel = path.relative_to(out)
        page.goto(path.resolve().as_uri(), wait_until="load")
        page.wait_for_function("() => document.readyState === 'complete'")
        n_fig = page.locator("div.book-plotly").count()
        if n_fig:  # drawn: each figure div holds plotly's SVG
            page.wait_for_function(
                "() => [...document.querySelectorAll('div.book-plotly')].every("
                "d => d.querySelector('svg.main-svg'))", timeout=30_000)
        figures += n_fig
        md_text = page.evaluate("""() => [...document.querySelectorAll('.jp-RenderedMarkdown')]
            .map(e => { const c = e.cloneNode(true);
                        c.querySelectorAll('code, pre, .katex').forEach(x => x.remove());
                        return c.textContent; }).join('\\n')""")
        n_katex = page.locator(".katex").count()
        if MATH.search(md_text):
            problems.append(f"{rel}: math left untypeset: {MATH.search(md_text).group(0)[:80]!r}")
        if n_katex:
            math_pages += 1
        if page.locator(".katex-error").count():
            problems.append(f"{rel}: KaTeX error: {page.locator('.katex-error').first.get_attribute('title')}")
        for href in page.evaluate("() => [...document.querySelectorAll('nav a, footer a')].map(a => a.href)"):
            target = Path(unquote(urlparse(href).path))
            if not target.exists():
                problems.append(f"{rel}: navigation link to a missing page: {href}")
        problems += [f"{rel}: {m}" for m in messages]
    context.close()
    assert not outside, f"requests leaving the site: {sorted(set(outside))[:10]}"
    assert not problems, "\n".join(problems[:40])
    assert figures > 0, "no plotly figure on any page"
    assert math_pages > 0, "KaTeX typeset nothing on any page"
    print(f"{len(pages)} pages, {figures} figures drawn, math typeset on {math_pages} pages")


def test_landing_page_links_every_chapter(built):
    out, _ = built
    index = (out / "index.html").read_text()
    for nb in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")):
        assert f'href="chapters/{nb.stem}.html"' in index, nb.name
        assert (out / "chapters" / f"{nb.stem}.html").exists()
