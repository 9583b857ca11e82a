"""What the browser tests share: skip (or, where CI requires the browser, fail) when Chromium or
Playwright is missing; a headless Chromium; a Jupyter server of their own (JupyterLab itself or
./book.sh in a copy of the book) on a free loopback port with a random token, and its REST API."""
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("LABKIT_CHROMIUM", "/usr/bin/chromium")
# Chromium on a machine with a closed network: no background traffic, no sandbox when root.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--disable-dev-shm-usage"]


def need(ok: bool, why: str) -> None:
    if ok:
        return
    if os.environ.get("LABKIT_E2E_REQUIRED") == "1":
        pytest.fail(f"{why} (LABKIT_E2E_REQUIRED=1)")
    pytest.skip(f"{why}: run scripts/e2e-setup.sh to install Chromium and Playwright")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def chromium():
    """A headless Chromium driven by Playwright (see need() when either is missing)."""
    need(Path(CHROMIUM).exists(), f"no Chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright  # optional: the test skips without it
    except ImportError:
        need(False, "the Python package playwright is not installed")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


def api(server: dict, path: str, method: str = "GET"):
    """One call to the server's REST API with its token: the JSON answer, None when empty."""
    req = urllib.request.Request(f"{server['url']}{path}", method=method,
                                 headers={"Authorization": f"token {server['token']}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read()
    return json.loads(body) if body else None


@contextlib.contextmanager
def serve_jupyter(cmd: list, jupyter_dirs: Path, log_path: Path, start_s: float, cwd=None,
                  what: str = "JupyterLab", extra_env: dict | None = None):
    """Runs `cmd` (a Jupyter server; this adds a free port and a random token) in a process group
    of its own, with Jupyter's config, runtime and data folders under `jupyter_dirs` and without
    PYTHONPATH (the kernels must import the installed labkit). Yields {url, token, log} once the
    REST API answers; afterwards stops the group: the server, its kernels and their ranks."""
    port, token = free_port(), secrets.token_hex(16)
    cmd = [*cmd, f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra_env or {})
    env.update(JUPYTER_CONFIG_DIR=str(jupyter_dirs / ".cfg"),
               JUPYTER_RUNTIME_DIR=str(jupyter_dirs / ".run"),
               JUPYTER_DATA_DIR=str(jupyter_dirs / ".data"))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        srv = {"url": f"http://127.0.0.1:{port}", "token": token, "log": log_path}
        deadline = time.monotonic() + start_s
        while True:
            try:
                api(srv, "/api/status")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    pytest.fail(f"{what} did not start:\n" + log_path.read_text()[-3000:])
                time.sleep(0.5)
        try:
            yield srv
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def serve_book(repo: Path, *args: str):
    """./book.sh itself, run in `repo`, a copy of the book (so that JupyterLab's autosave and
    settings writes never touch the repository), with the repository's .venv as it is
    (LABKIT_SKIP_INSTALL: an install from the copy would repoint the editable labkit at the copy).
    Yields the server, as serve_jupyter() does."""
    (repo / ".venv").symlink_to(ROOT / ".venv")
    cmd = ["bash", str(repo / "book.sh"), "--no-browser", *args]
    with serve_jupyter(cmd, repo, repo.parent / "book-sh.log", start_s=120,
                       what="./book.sh (JupyterLab)",
                       extra_env={"LABKIT_SKIP_INSTALL": "1"}) as srv:
        yield srv


# A JupyterLab dialog that reports a real error: the kernel died or restarted, the server failed.
DIALOG_ERROR = re.compile(r"died|restarting|kernel restart|server connection error|"
                          r"server error|error", re.I)


class Dialogs:
    """Answers every JupyterLab dialog that appears over `page`, whenever it appears, and keeps
    its text. Playwright runs the handler before any action (a click, a fill) that the dialog
    would intercept; `answer()` does the same between actions that have no target (key presses,
    polling). Non-error dialogs (a save conflict, a kernel choice) are answered with their
    default button; `errors()` are the ones whose text reports a real error, which the test
    fails with (CI once saw an unanswered dialog intercept a click under load)."""

    SELECTOR = ".jp-Dialog"

    def __init__(self, page):
        self.page, self.seen = page, []
        page.add_locator_handler(page.locator(self.SELECTOR), self._handle)

    def _handle(self, dialog) -> None:
        try:
            text = " ".join(dialog.first.inner_text(timeout=5_000).split())[:300]
        except Exception:   # noqa: BLE001  gone before it could be read
            return
        self.seen.append(text)
        accept = dialog.first.locator(".jp-Dialog-button.jp-mod-accept")
        if accept.count():
            accept.first.click(timeout=10_000)
        else:
            self.page.keyboard.press("Escape")
        self.page.wait_for_timeout(300)

    def answer(self) -> None:
        for _ in range(3):
            dialogs = self.page.locator(self.SELECTOR)
            if not dialogs.count():
                return
            self._handle(dialogs)

    def errors(self) -> list[str]:
        return [t for t in self.seen if DIALOG_ERROR.search(t)]

    def check(self) -> None:
        """Fail with the text of every dialog that reported a real error."""
        bad = self.errors()
        assert not bad, f"JupyterLab reported an error in a dialog: {bad}"
