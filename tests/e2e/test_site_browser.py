"""The website (labkit site build) in a real headless Chromium, with the network cut off.

Builds the site from the saved notebooks into a temporary folder, with the pinned Pyodide runtime
(scripts/pyodide-fetch.sh), then:

* opens every page from file:// with every request routed through a check: anything that is not
  a file inside the site is aborted and fails the test. Each page must load without a console
  error or page error; every plotly figure must be drawn (an SVG inside each figure div); where
  the markdown holds math, KaTeX must have typeset it; the sidebar's links must point at pages
  that exist;
* serves the site on 127.0.0.1 (Pyodide cannot load from file://), opens every page with a
  calculator, moves each control and reads the output: it must be the text that labkit computes
  for the values the page's controls now hold (and, for four calculators, contain the number
  labkit.costs gives directly), with every request that is not to this server failing the test;
* renders pages at 390 px (a phone) and 1400 px: no horizontal scroll of the page or of prose.

Needs Debian's chromium and PyPI's playwright (scripts/e2e-setup.sh); skips without them unless
LABKIT_E2E_REQUIRED=1.
"""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from e2e_common import ROOT, chromium, free_port, need

from labkit import site
from labkit.costs import memory, models
from labkit.costs import moe as mc
from labkit.costs import precision as cp
from labkit.costs import tensor_parallel as tpc
from labkit.widgets import ring, web

MATH = re.compile(r"\$\$|(?<![\\$\w])\$[^$\s][^$\n]*?\$|\\\(|\\\[")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    start = time.monotonic()
    pages = site.build(ROOT, out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    runtime = sum(f.stat().st_size for f in (out / "_static" / "pyodide").rglob("*")
                  if f.is_file())
    print(f"site build: {len(pages)} pages in {time.monotonic() - start:.1f} s; "
          f"{size / 1e6:.1f} MB, of which the Pyodide runtime {runtime / 1e6:.1f} MB")
    return out, pages


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


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
    page.on("console", lambda m: messages.append(f"console {m.type}: {m.text}")
            if m.type == "error" else None)
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
            title = page.locator(".katex-error").first.get_attribute("title")
            problems.append(f"{rel}: KaTeX error: {title}")
        for href in page.evaluate(
                "() => [...document.querySelectorAll('nav a, footer a')].map(a => a.href)"):
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


@pytest.fixture(scope="module")
def served(built):
    out, pages = built
    need((out / "_static" / "pyodide" / "pyodide.asm.wasm").exists(),
          "no Pyodide runtime in the site (scripts/pyodide-fetch.sh could not fetch it)")
    httpd = site.server(out, free_port())
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", out, pages
    httpd.shutdown()


def _local_only(context, origin: str) -> list:
    """Route every request: this server's and data:/blob: go through, anything else is aborted
    and listed (the test fails on any)."""
    outside = []

    def route(r):
        url = r.request.url
        if url.startswith(origin + "/") or urlparse(url).scheme in ("data", "blob", "about"):
            r.continue_()
        else:
            outside.append(url)
            r.abort()

    context.route("**/*", route)
    return outside


# A second opinion for four calculators: the number straight from labkit.costs, not through the
# widget's text function.
def _precision(v):
    master = v["master"] and v["weights"] != "fp32"  # fp32 weights are their own master copy
    r = cp.recipe(v["weights"], v["grads"], master, v["moments"])
    return f"{cp.model_bytes(10 ** v['n_params'] * 1e9, r) / 1e9:,.0f} GB"


def _intro(v):
    n = models.num_params(models.preset(v["model"]))
    s = memory.model_states(n, recipe=v["recipe"], zero=int(v["zero"]), dp=int(v["dp"]))
    return f"= {s.total / 1e9:.1f} GB per GPU"


def _moe(v):  # the widget's model: h 4096, 32 layers, experts of 3.5 h, vocabulary 32000
    r = mc.calculator(4096, 32, v["n_expert"], int(v["k"]), 3.5, v["ep"], v["tokens_per_gpu"],
                      v["factor"], v["bandwidth"], vocab=32000)
    return f"{r['total_params'] / 1e9:.2f} B total"


def _tp(v):
    nbytes = tpc.allreduce_bytes(int(v["b"]), int(v["s"]), int(v["h"]))
    return f"one all-reduce: {nbytes / 1e6:.1f} MB"


DIRECT = {"precision": _precision, "intro": _intro, "moe": _moe, "tp": _tp}

READ = """c => Object.fromEntries([...c.querySelectorAll('form input, form select')].map(el =>
    [el.name, el.type === 'checkbox' ? el.checked : el.tagName === 'SELECT' ? JSON.parse(el.value)
                                                   : Number(el.value)]))"""
# Move one control to another value the way a reader does, and fire the event the page listens to.
MOVE = """(c, name) => { const el = c.querySelector(`[name="${name}"]`);
    if (el.type === 'checkbox') el.checked = !el.checked;
    else if (el.tagName === 'SELECT') el.selectedIndex = (el.selectedIndex + 1) % el.options.length;
    else { const lo = Number(el.min), hi = Number(el.max), v = Number(el.value);
           el.value = String(Math.abs(v - hi) > Math.abs(v - lo) ? hi : lo); }
    el.dispatchEvent(new Event('input', {bubbles: true})); }"""


def test_calculators_compute_what_labkit_computes(served, browser):
    origin, out, pages = served
    context = browser.new_context(viewport={"width": 1300, "height": 900})
    outside = _local_only(context, origin)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}")
            if m.type in ("error", "warning") else None)
    with_calc = [p for p in pages if 'class="book-calc"' in p.read_text()]
    assert len(with_calc) >= 10, [p.name for p in with_calc]
    seen, problems, live_ms = set(), [], []
    for path in with_calc:
        rel = path.relative_to(out).as_posix()
        page.goto(f"{origin}/{rel}", wait_until="load")
        page.wait_for_function("() => [...document.querySelectorAll('div.book-calc')].every("
                               "c => c.classList.contains('live'))", timeout=240_000)
        live_ms.append(int(page.evaluate("document.body.dataset.calculatorsLiveMs")))
        for calc in page.locator("div.book-calc").all():
            key = calc.get_attribute("data-calc")
            seen.add(key)
            changed = 0
            for c in web.CALCULATORS[key].controls:
                before = calc.locator(".book-calc-out").text_content()
                calc.evaluate(MOVE, c["name"])
                raw = calc.evaluate(READ)
                got = calc.locator(".book-calc-out").text_content()
                want = web.render_inputs(key, raw)
                if got != want:
                    problems.append(f"{rel} {key}: after moving {c['name']} to {raw[c['name']]!r} "
                                    f"the page shows {got!r}, labkit computes {want!r}")
                if key in DIRECT and DIRECT[key](raw) not in got:
                    problems.append(f"{rel} {key}: {DIRECT[key](raw)!r} not in {got!r}")
                changed += got != before
            if not changed:
                problems.append(f"{rel} {key}: no control changed the output")
    context.close()
    assert not outside, f"requests leaving the site: {sorted(set(outside))[:10]}"
    assert not problems, "\n".join(problems[:20])
    assert not errors, "\n".join(errors[:20])
    assert seen == set(web.CALCULATORS), \
        f"calculators never seen on a page: {set(web.CALCULATORS) - seen}"
    print(f"{len(seen)} calculators on {len(with_calc)} pages; live {min(live_ms) / 1e3:.1f} to "
          f"{max(live_ms) / 1e3:.1f} s after navigation (first page {live_ms[0] / 1e3:.1f} s)")


def test_ring_explorer_switches_frames_from_file(built, browser):
    """Chapter 01's explorer needs no Python in the browser: from file://, its sliders show the
    frame ring_figure draws for that N and step."""
    out, _ = built
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    page.goto((out / "chapters" / "01_collectives.html").resolve().as_uri(), wait_until="load")
    box = page.locator("div.book-frames")
    box.locator("svg.main-svg").first.wait_for(timeout=60_000)
    moves = (("step", 3, 4, 3), ("n", 8, 8, 3), ("step", 14, 8, 14), ("n", 2, 2, 2))
    for name, value, n, step in moves:
        box.evaluate("(c, [name, v]) => { const el = c.querySelector(`[name=${name}]`);"
                     " el.value = String(v); el.dispatchEvent(new Event('input')); }",
                     [name, value])
        want = f"{n} ranks — {ring.step_label(n, step)}"
        try:  # Plotly.react may finish drawing after the event returns
            page.wait_for_function("w => document.querySelector('div.book-frames .gtitle')"
                                   ".textContent.endsWith(w)", arg=want, timeout=10_000)
        except Exception:
            pass
        title = box.locator(".gtitle").text_content()
        assert title.endswith(want), f"after {name} = {value}: {title!r}, want {want!r}"
    page.close()


PROSE = (".jp-RenderedMarkdown p, .jp-RenderedMarkdown li, .jp-RenderedMarkdown h1, "
         ".jp-RenderedMarkdown h2, .jp-RenderedMarkdown h3, footer")
OVERFLOW = """(sel) => {
    const w = document.documentElement.clientWidth;
    const bad = [];
    const sw = document.documentElement.scrollWidth;
    if (sw > w + 1) bad.push(`page scrolls sideways: ${sw} > ${w}`);
    for (const el of document.querySelectorAll(sel)) {
        const r = el.getBoundingClientRect();
        if (r.width === 0) continue;
        if (el.scrollWidth > el.clientWidth + 1 || r.right > w + 1)
            bad.push(`${el.tagName} "${el.textContent.trim().slice(0, 50)}" `
                     + `${Math.round(r.right)} > ${w}`);
    }
    return bad; }"""


@pytest.mark.parametrize("width", [390, 1400])
def test_no_horizontal_scroll_on_prose(built, browser, width):
    out, pages = built
    context = browser.new_context(viewport={"width": width, "height": 850})
    page = context.new_page()
    problems = []
    for path in pages:
        rel = path.relative_to(out).as_posix()
        page.goto(path.resolve().as_uri(), wait_until="load")
        if page.locator("div.book-plotly").count():
            page.wait_for_function("() => [...document.querySelectorAll('div.book-plotly')].every("
                                   "d => d.querySelector('svg.main-svg'))", timeout=30_000)
        problems += [f"{rel} at {width} px: {b}" for b in page.evaluate(OVERFLOW, PROSE)]
        nav_shown = page.locator("nav.book-nav").is_visible()
        if nav_shown != (width > 900):
            problems.append(f"{rel} at {width} px: sidebar {'shown' if nav_shown else 'hidden'}")
    if width < 900:  # the menu opens the contents
        page.click("label.book-menu-label")
        if not page.locator("nav.book-nav").is_visible():
            problems.append("the Contents menu does not open the sidebar")
    (ROOT / "build" / "e2e").mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ROOT / "build" / "e2e" / f"site-{width}px.png"), full_page=False)
    context.close()
    assert not problems, "\n".join(problems[:30])
