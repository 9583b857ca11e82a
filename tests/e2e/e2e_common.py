"""What the browser tests share: skip (or, where CI requires the browser, fail) when Chromium or
Playwright is missing, and a free loopback port for a server of their own."""
import os
import socket

import pytest


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
