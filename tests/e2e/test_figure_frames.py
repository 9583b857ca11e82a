"""Every plotly figure of every chapter page of the website, as Chromium draws it: do its axes frame
its data, and do its labels stay off the data?

Builds the site from the saved notebooks (labkit site build, without the Pyodide runtime: no
calculator is needed here), opens each chapter page from file:// in headless Chromium (Playwright)
and reads, for every figure, what plotly drew: `_fullLayout`'s axis ranges (a log axis's range is
in log10 units) against the traces' numbers, and the boxes of the annotations and of the legend
against the data points' pixels. A figure fails where

* an axis range does not contain its data, or the data span under MIN_SPREAD of the range (the
  crossover figures of chapters 02, 03, 04 and 07 once spanned 1e-6..1e113 on x, the data in a
  sliver: an add_vline's annotation on a log axis lands at 10**x);
* an annotation or the legend, drawn inside the plot area, covers a data point;
* at 390 px (a phone) the figure is wider than the screen or its plot area narrower than
  MIN_PHONE_PLOT px.

Needs Debian's chromium and PyPI's playwright (scripts/e2e-setup.sh); skips without them unless
LABKIT_E2E_REQUIRED=1.

Per commit (./test.sh) the browser part runs only when what it looks at changed since it last
passed: every chapter's saved figures and the code that lays them out (labkit/site.py,
labkit/site_assets/), as FIGURES_RECORD holds their digest, written by every passing run with
--record; ./test.sh --full always runs it.
"""
from __future__ import annotations

import hashlib
import json

import pytest
from e2e_common import ROOT, chromium

from labkit import site

FIGURES_RECORD = ROOT / "tests" / "e2e" / "figures-verified.json"
PLOTLY = "application/vnd.plotly.v1+json"

MIN_SPREAD = 0.2        # the data's share of an axis range, at least
MIN_PHONE_PLOT = 150    # px of plot area left at 390 px

# For every figure div: its title, axis frames (range vs data extent, in log10 units on a log
# axis), the data points' pixels, and the boxes of in-plot annotations and of the legend.
READ = """() => [...document.querySelectorAll('div.book-plotly')].map((gd) => {
  const fl = gd._fullLayout;
  if (!fl) return {id: gd.id, undrawn: true};
  const title = (fl.title && fl.title.text) || gd.id;
  const rect = gd.getBoundingClientRect();
  const axis = (id) => fl[id.replace(/^([xy])/, '$1axis')];
  const numeric = (ax) => ax && (ax.type === 'linear' || ax.type === 'log');
  const lin = (ax, v) => ax.type === 'log' ? (v > 0 ? Math.log10(v) : null) : v;
  const data = {};          // axis id -> values (log10 on a log axis)
  const points = [];        // page pixels of every plotted point
  const add = (id, ax, v) => {
    const l = lin(ax, v);
    if (l !== null && Number.isFinite(l)) (data[id] = data[id] || []).push(l);
  };
  gd._fullData.forEach((tr, k) => {
    if (tr.visible !== true || !['scatter', 'scattergl', 'bar'].includes(tr.type)) return;
    const xid = tr.xaxis || 'x', yid = tr.yaxis || 'y';
    const xa = axis(xid), ya = axis(yid);
    if (tr.type === 'bar') {   // a bar runs from s0 (its base) to s1 at position p
      const [sid, sa, pid, pa] = tr.orientation === 'h' ? [xid, xa, yid, ya] : [yid, ya, xid, xa];
      for (const cd of gd.calcdata[k] || []) {
        if (numeric(sa)) { add(sid, sa, cd.s0); add(sid, sa, cd.s1); }
        if (numeric(pa)) add(pid, pa, cd.p);
      }
      return;
    }
    const xs = tr.x || [], ys = tr.y || [];
    const n = Math.min(xs.length, ys.length);
    for (let i = 0; i < n; i++) {
      const x = Number(xs[i]), y = Number(ys[i]);
      if (numeric(xa) && xs[i] !== null && Number.isFinite(x)) add(xid, xa, x);
      if (numeric(ya) && ys[i] !== null && Number.isFinite(y)) add(yid, ya, y);
      if (numeric(xa) && numeric(ya) && Number.isFinite(x) && Number.isFinite(y)
          && (xa.type !== 'log' || x > 0) && (ya.type !== 'log' || y > 0)) {
        const px = rect.left + xa._offset + xa.c2p(x), py = rect.top + ya._offset + ya.c2p(y);
        const inside = px >= rect.left + xa._offset && px <= rect.left + xa._offset + xa._length
          && py >= rect.top + ya._offset && py <= rect.top + ya._offset + ya._length;
        if (inside) points.push([px, py]);
      }
    }
  });
  const frames = [];
  for (const [id, vals] of Object.entries(data)) {
    const ax = axis(id);
    if (!ax || !numeric(ax) || !vals.length) continue;
    frames.push({axis: id, type: ax.type, range: [Math.min(...ax.range), Math.max(...ax.range)],
                 lo: Math.min(...vals), hi: Math.max(...vals)});
  }
  const plot = {l: rect.left + fl._size.l, t: rect.top + fl._size.t,
                r: rect.left + fl._size.l + fl._size.w, b: rect.top + fl._size.t + fl._size.h};
  const boxes = [];
  gd.querySelectorAll('g.annotation').forEach((g) => {
    const b = (g.querySelector('rect.bg') || g).getBoundingClientRect();
    boxes.push({what: 'annotation ' + JSON.stringify(g.textContent.slice(0, 50)),
                l: b.left, t: b.top, r: b.right, b: b.bottom});
  });
  const legend = gd.querySelector('g.legend rect.bg');
  if (legend) {
    const b = legend.getBoundingClientRect();
    boxes.push({what: 'the legend', l: b.left, t: b.top, r: b.right, b: b.bottom});
  }
  const covers = boxes.map((b) => {
    const cx = (b.l + b.r) / 2, cy = (b.t + b.b) / 2;
    const inPlot = cx > plot.l && cx < plot.r && cy > plot.t && cy < plot.b;
    const n = inPlot ? points.filter(([x, y]) => x > b.l && x < b.r && y > b.t && y < b.b).length
                     : 0;
    return {what: b.what, points: n};
  }).filter((c) => c.points > 0);
  const svg = gd.querySelector('svg.main-svg');
  return {id: gd.id, title, frames, covers, plotWidth: fl._size.w,
          width: svg ? svg.getBoundingClientRect().width : 0, right: rect.right};
})"""


def chapter_pages(out):
    return sorted((out / "chapters").glob("[0-9][0-9]_*.html"))


def problems_of(rel: str, fig: dict) -> list:
    """What is wrong with one figure READ describes: an axis range that does not hold its data or
    that the data fill under MIN_SPREAD of, a box (annotation, legend) inside the plot covering
    data points."""
    where = f"{rel} {fig['id']} ({fig.get('title', '')[:70]!r})"
    if fig.get("undrawn"):
        return [f"{where}: not drawn"]
    out = []
    for f in fig["frames"]:
        (a, b), lo, hi = f["range"], f["lo"], f["hi"]
        unit = " (log10)" if f["type"] == "log" else ""
        tol = 1e-6 * max(b - a, 1e-12)
        if lo < a - tol or hi > b + tol:
            out.append(f"{where}: {f['axis']} range {a:.3g}..{b:.3g}{unit} does not hold the "
                       f"data {lo:.3g}..{hi:.3g}")
        elif hi > lo and (hi - lo) / (b - a) < MIN_SPREAD:
            out.append(f"{where}: the data fill {(hi - lo) / (b - a):.0%} of {f['axis']}'s range "
                       f"{a:.3g}..{b:.3g}{unit} (data {lo:.3g}..{hi:.3g})")
    out += [f"{where}: {c['what']} covers {c['points']} data point(s)" for c in fig["covers"]]
    return out


def figures_digest() -> str:
    """What the browser checks vouch for: every chapter's plotly figures as saved, and the
    site's code that draws and lays them out (this file's checks included)."""
    h = hashlib.sha256()
    for nb in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        figs = [o["data"][PLOTLY] for c in cells for o in c.get("outputs", [])
                if PLOTLY in o.get("data", {})]
        h.update(nb.name.encode() + json.dumps(figs, sort_keys=True).encode())
    assets = sorted(p for p in (ROOT / "labkit" / "site_assets").rglob("*") if p.is_file())
    for code in [ROOT / "labkit" / "site.py", ROOT / "tests" / "e2e" / "test_figure_frames.py",
                 *assets]:
        h.update(code.relative_to(ROOT).as_posix().encode() + code.read_bytes())
    return h.hexdigest()[:16]


def _recorded() -> str | None:
    try:
        return json.loads(FIGURES_RECORD.read_text()).get("figures")
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module")
def pages(tmp_path_factory, request):
    digest = figures_digest()
    if not request.config.getoption("--full") and _recorded() == digest:
        pytest.skip("the figures and their layout code passed in the browser already "
                    "(tests/e2e/figures-verified.json); ./test.sh --full runs it again")
    failed = request.session.testsfailed
    out = tmp_path_factory.mktemp("site")
    site.build(ROOT, out, runtime=False)
    found = chapter_pages(out)
    assert found, "the site has no chapter page"
    yield out, found
    if request.config.getoption("--record") and request.session.testsfailed == failed:
        FIGURES_RECORD.write_text(json.dumps({"figures": digest}, indent=1) + "\n")


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


def _read(browser, out, paths, width: int):
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    figs = {}
    for path in paths:
        page.goto(path.resolve().as_uri(), wait_until="load")
        if page.locator("div.book-plotly").count():
            page.wait_for_function("() => [...document.querySelectorAll('div.book-plotly')].every("
                                   "d => d.querySelector('svg.main-svg'))", timeout=30_000)
        figs[path.relative_to(out).as_posix()] = page.evaluate(READ)
    context.close()
    return figs


def test_every_figure_frames_its_data_and_keeps_labels_off_it(pages, browser):
    out, paths = pages
    figs = _read(browser, out, paths, 1300)
    n = sum(len(v) for v in figs.values())
    problems = [p for rel, fs in figs.items() for f in fs for p in problems_of(rel, f)]
    assert n > 0, "no plotly figure on any chapter page"
    assert not problems, f"{len(problems)} problem(s) in {n} figures:\n" + "\n".join(problems)
    print(f"{n} figures on {len(paths)} chapter pages: every axis frames its data")


def _phone_problems(figs: dict, keep) -> list:
    return [f"{rel} {f['id']} ({f.get('title', '')[:60]!r}): {why}"
            for rel, fs in figs.items() for f in fs if keep(f.get("title", ""))
            for why in ([f"{f['width']:.0f} px wide on a 390 px screen"]
                        if f.get("width", 0) > 390 else [])
            + ([f"plot area {f['plotWidth']:.0f} px"] if f.get("plotWidth", 0) < MIN_PHONE_PLOT
               else [])]


# the crossover labs' figures (labkit.labs._crossover, chapters 02, 03, 04, 07), by their titles
CROSSOVER = ("stops hiding", "stop hiding", "below the crossover")


def test_crossover_figures_fit_a_phone(pages, browser):
    out, paths = pages
    figs = _read(browser, out, paths, 390)
    n = sum(any(c in f.get("title", "") for c in CROSSOVER) for fs in figs.values() for f in fs)
    problems = _phone_problems(figs, lambda t: any(c in t for c in CROSSOVER))
    assert n >= 4, f"found {n} crossover figures, expected those of chapters 02, 03, 04, 07"
    assert not problems, "\n".join(problems)


def test_every_figure_fits_a_phone(pages, browser):
    out, paths = pages
    figs = _read(browser, out, paths, 390)
    problems = _phone_problems(figs, lambda t: True)
    assert sum(len(v) for v in figs.values()) > 0, "no plotly figure on any chapter page"
    assert not problems, f"{len(problems)} figure(s) do not fit a phone:\n" + "\n".join(problems)


def test_the_overlap_check_sees_a_label_on_the_data(pages, browser):
    """READ on a page of two figures drawn by the site's own plotly: a label placed on the data
    points must be reported, one in a corner without data must not."""
    out, _ = pages
    x, y = list(range(1, 11)), [v * v for v in range(1, 11)]

    def fig(ax, ay):
        return {"data": [{"type": "scatter", "mode": "markers", "x": x, "y": y}],
                "layout": {"annotations": [{"x": ax, "y": ay, "text": "a long label over here",
                                            "showarrow": False, "bgcolor": "white"}],
                           "height": 400}}
    html = "".join(site._figure_html(f, f"fig{i}") for i, f in enumerate((fig(5, 25), fig(8, 90))))
    probe = out / "chapters" / "zz_probe.html"
    probe.write_text('<html><body style="width:900px">' + html
                     + '<script src="../_static/plotly.min.js"></script>'
                     + "<script>document.querySelectorAll('div.book-plotly').forEach((d) => {"
                     + "const f = JSON.parse(document.getElementById(d.id + '-json').textContent);"
                     + "Plotly.newPlot(d, f.data, f.layout); });</script></body></html>")
    try:
        figs = _read(browser, out, [probe], 1000)
    finally:
        probe.unlink()
    (over, corner), = figs.values()
    assert [p for p in problems_of("probe", over) if "covers" in p], over
    assert problems_of("probe", corner) == [], corner


def test_the_frame_check_catches_a_sliver():
    """problems_of on the figure the crossover plots once drew (x: -6..113 in log10, data 0.9..2.4)
    and on a framed one."""
    bad = {"id": "fig1", "title": "t", "covers": [],
           "frames": [{"axis": "x", "type": "log", "range": [-6, 113], "lo": 0.9, "hi": 2.4}]}
    good = dict(bad, frames=[dict(bad["frames"][0], range=[0.8, 2.5])])
    assert problems_of("p", bad) and "fill 1%" in problems_of("p", bad)[0]
    assert problems_of("p", good) == []
