"""Opening is not editing: a reader who opens every notebook of the book in JupyterLab, and lets
autosave run, changes no file that git tracks.

./book.sh runs, in a copy of every tracked file (so that the test never writes into the working
tree), with one change to the copy's JupyterLab settings: autosave every few seconds instead of
every two minutes, so that the test sees it happen. One Chromium tab opens START_HERE.ipynb, as
./book.sh does, then every notebook of chapters/, solutions/ and exercises/ in turn, each shown
until its plotly figures are drawn (the plotly extension writes a PNG into a figure's output
when it draws it, which marks the notebook changed), each with its own kernel, as a reader's
would be. When every kernel is idle and autosave has had its turns, no tab may be left unsaved,
and every tracked file must hold the bytes it had. What keeps them: notebooks written in
JupyterLab's own format (labkit.nbfile) and the save hook ./book.sh installs (labkit.labsave).

Needs Chromium and Playwright (scripts/e2e-setup.sh); skips without them unless
LABKIT_E2E_REQUIRED=1.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from e2e_common import CHROMIUM, ROOT, Dialogs, api, chromium, need, serve_book

PLOTLY = "application/vnd.plotly.v1+json"
DOCMANAGER = Path("jupyterlab/user-settings/@jupyterlab/docmanager-extension/"
                  "plugin.jupyterlab-settings")
AUTOSAVE_S = 3  # the test's copy only; the book keeps JupyterLab's default (on, every 120 s)


def _json5(path: Path) -> dict:
    """A JupyterLab settings file: JSON with // comments."""
    if not path.exists():
        return {}
    return json.loads(re.sub(r"^\s*//.*$", "", path.read_text(), flags=re.M))


def _notebooks(repo: Path) -> list[str]:
    rest = sorted(p.relative_to(repo).as_posix() for d in ("chapters", "solutions", "exercises")
                  for p in (repo / d).glob("*.ipynb"))
    return ["START_HERE.ipynb"] + rest


def _plots(path: Path) -> int:
    nb = json.loads(path.read_text())
    return sum(PLOTLY in out.get("data", {}) for c in nb["cells"] for out in c.get("outputs", []))


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    """./book.sh in a copy of every tracked file; yields the server and the copy's bytes."""
    need(Path(CHROMIUM).exists(), f"no Chromium at {CHROMIUM}")
    repo = tmp_path_factory.mktemp("open") / "book"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    before = {}
    for rel in filter(None, tracked):
        src = ROOT / rel
        if src.is_file():  # a tracked file someone is deleting right now is no file to check
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / rel)
            before[rel] = (repo / rel).read_bytes()
    settings = _json5(repo / DOCMANAGER)
    settings.update(autosave=True, autosaveInterval=AUTOSAVE_S)
    (repo / DOCMANAGER).parent.mkdir(parents=True, exist_ok=True)
    (repo / DOCMANAGER).write_text(json.dumps(settings))
    before.pop(DOCMANAGER.as_posix(), None)  # the one file the test changes itself
    # expose_app_in_browser: the test opens notebooks with JupyterLab's own "open" command
    with serve_book(repo, "--LabApp.expose_app_in_browser=True") as srv:
        srv.update(repo=repo, before=before)
        yield srv


def test_the_books_own_settings_keep_autosave_on():
    """Readers need autosave; only the test's copy shortens its interval."""
    assert _json5(ROOT / DOCMANAGER).get("autosave", True) is True


def test_opening_every_notebook_and_autosaving_changes_no_tracked_file(book):
    repo, names = book["repo"], _notebooks(book["repo"])
    with chromium() as browser:
        page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        dialogs = Dialogs(page)
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{book['url']}/lab/tree/START_HERE.ipynb?token={book['token']}")
        page.wait_for_function("() => window.jupyterapp", timeout=120_000)
        page.evaluate("async () => { await window.jupyterapp.started;"
                      " await window.jupyterapp.restored; }")
        shown = ".jp-NotebookPanel:not(.lm-mod-hidden)"
        for name in names:
            if name != "START_HERE.ipynb":
                page.evaluate("async (path) => { const w = await window.jupyterapp.commands"
                              ".execute('docmanager:open', {path}); await w.context.ready; }", name)
            page.wait_for_function(
                """(name) => {
                    const t = document.querySelector('.lm-DockPanel-tabBar .lm-mod-current');
                    return t && t.title.includes(name.split('/').pop()); }""",
                arg=name, timeout=60_000)
            page.locator(f"{shown} .jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
            want = _plots(repo / name)  # shown until drawn: drawing is what writes the PNG
            page.wait_for_function(
                "([sel, n]) => document.querySelectorAll(sel + ' .js-plotly-plot').length >= n",
                arg=[shown, want], timeout=60_000)
        # Every notebook has its kernel (whose info JupyterLab writes into the metadata), idle.
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            sessions = api(book, "/api/sessions")
            if len(sessions) == len(names) and all(
                    s["kernel"]["execution_state"] == "idle" for s in sessions):
                break
            time.sleep(1)
        else:
            pytest.fail(f"{len(sessions)} kernels for {len(names)} notebooks, not all idle")
        # Autosave's turns: until no tab shows unsaved changes, then one turn more.
        unsaved = page.locator(".lm-DockPanel-tabBar .jp-mod-dirty")
        deadline = time.monotonic() + 120
        while unsaved.count() and time.monotonic() < deadline:
            time.sleep(1)
        dirty = unsaved.all_inner_texts()
        time.sleep(AUTOSAVE_S + 2)
        tabs = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab").count()
    assert tabs == len(names), f"{tabs} tabs open for {len(names)} notebooks"
    assert not dirty, f"autosave left these unsaved: {dirty}"
    log = book["log"].read_text()
    kept = set(re.findall(r"labsave: (\S+) unchanged by the reader", log))
    saved = set(re.findall(r"labsave: (\S+?):? ", log))
    # a chapter gains the plotly PNGs when drawn, so autosave runs on it (START_HERE carries its
    # kernel's language_info already, labkit.landing, and may not be saved at all)
    assert any(k.startswith("chapters/") for k in kept), "no autosave seen:\n" + log[-2000:]
    assert saved == kept, f"saved as edited, though nobody edited them: {sorted(saved - kept)}"
    changed = sorted(rel for rel, data in book["before"].items()
                     if not (repo / rel).is_file() or (repo / rel).read_bytes() != data)
    assert not changed, f"opening the book changed tracked files: {changed}"
    assert not errors, errors[:5]
    dialogs.check()
