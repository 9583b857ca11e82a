"""JupyterLab's terminal, as ./book.sh starts it, runs `labkit list` (START_HERE says to).

A real server (./book.sh), a real terminal (the server's terminals API and its websocket, which is
what File > New > Terminal uses), a real shell. Before the fix the terminal's login shell reset
PATH and said `bash: labkit: command not found`.
"""
import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

websocket = pytest.importorskip("websocket")   # websocket-client, a jupyter_server dependency

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port, token = _free_port(), secrets.token_hex(8)
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path_factory.mktemp("runtime")))
    # a PATH without the book's .venv, as a fresh desktop session would have
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if ".venv" not in p)
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    proc = subprocess.Popen(
        ["bash", str(ROOT / "book.sh"), "--no-browser", f"--port={port}",
         f"--IdentityProvider.token={token}", "--ServerApp.port_retries=0"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                assert proc.poll() is None, "./book.sh exited:\n" + _read(log)
                time.sleep(0.5)
        else:
            pytest.fail("JupyterLab did not start in 120 s:\n" + _read(log))
        yield base, token, port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _read(log) -> str:
    log.seek(0)
    return log.read()[-3000:]


def _terminal_output(base, token, port, command: str, until: str, seconds: float = 60) -> str:
    req = urllib.request.Request(f"{base}/api/terminals?token={token}", method="POST", data=b"")
    name = json.load(urllib.request.urlopen(req, timeout=10))["name"]
    ws = websocket.create_connection(
        f"ws://127.0.0.1:{port}/terminals/websocket/{name}?token={token}", timeout=5)
    out = ""
    try:
        ws.send(json.dumps(["stdin", command + "\r"]))
        end = time.monotonic() + seconds
        while until not in out and time.monotonic() < end:
            try:
                kind, *data = json.loads(ws.recv())
            except websocket.WebSocketTimeoutException:
                continue
            if kind == "stdout":
                out += data[0]
    finally:
        ws.close()
        urllib.request.urlopen(urllib.request.Request(
            f"{base}/api/terminals/{name}?token={token}", method="DELETE"), timeout=10)
    return out


def test_labkit_list_runs_in_jupyterlabs_terminal(server):
    out = _terminal_output(*server, "labkit list; echo DONE-$((6*7))", until="DONE-42")
    assert "command not found" not in out, out
    assert "DONE-42" in out, out
    # what `labkit list` prints: the labs, by name
    listed = subprocess.run([str(ROOT / ".venv" / "bin" / "labkit"), "list"], capture_output=True,
                            text=True, timeout=60).stdout.split()
    assert listed and all(word in out for word in listed[:6]), (listed[:6], out)


def test_the_terminal_starts_in_the_book_with_its_python(server):
    out = _terminal_output(*server, 'echo "PWD=$PWD"; python -c "import labkit, sys; '
                           'print(\'PY=\' + sys.prefix)"; echo END-$((2+3))', until="END-5")
    assert f"PWD={ROOT}" in out, out
    assert f"PY={ROOT / '.venv'}" in out, out
