"""Scores a submission cannot forge: each attack on the grader, as a motivated student wrote it, in
a small fixture notebook (tests/fixtures/grading/make.py writes them), scores 0 with its reason
in the CSV. The judge runs no student code: the notebook runs again in a sandbox, the checker's
comparisons and case records stay in the judge, and what comes back is plain data."""
import csv
import json
import socket
import socketserver
import subprocess
import threading
from pathlib import Path

import pytest

from labkit.grade import grade, sandbox

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "grading"
CHECK_INIT = ROOT / "labkit" / "check" / "__init__.py"
ZERO = {"0.1": 0, "0.2": 0, "0.3": 0, "0.4": 0}
SILENT = dict(cell_timeout=60, echo=lambda *a, **k: None)


def _grade(tmp_path, *names):
    """Grade the fixtures `names` as one folder; {name: (row, csv row)}."""
    for name in names:
        (tmp_path / f"{name}.ipynb").write_bytes((FIXTURES / f"{name}.ipynb").read_bytes())
    rows = grade([tmp_path], csv_path=tmp_path / "scores.csv", **SILENT)
    with open(tmp_path / "scores.csv") as f:
        table = {r["notebook"]: r for r in csv.DictReader(f)}
    return {r["file"][:-len(".ipynb")]: (r, table[r["file"]]) for r in rows}


def _said(csv_row) -> str:
    return csv_row["failures"] + " " + csv_row["error"]


def test_a_reduce_payload_in_an_untouched_notebook_runs_nowhere_near_the_judge(tmp_path):
    graded = _grade(tmp_path, "00_honest", "00_reduce")
    honest, _ = graded["00_honest"]
    assert honest["scores"] == {"0.1": 3, "0.2": 0, "0.3": 0, "0.4": 0}, honest
    row, line = graded["00_reduce"]
    assert row["scores"] == ZERO and float(line["total"]) == 0, row
    assert "0.1: " in line["failures"] and "not implemented yet" in line["failures"], _said(line)


@pytest.mark.full
def test_threads_and_forged_replies_on_the_socket_count_for_nothing(tmp_path):
    graded = _grade(tmp_path, "00_thread", "00_socket")
    row, line = graded["00_thread"]
    assert row["scores"] == ZERO, row
    # the real reply (a stub) or a forged frame, whichever arrives first: a forged frame can only
    # say what the answer returned, a wrong answer; a garbled stream breaks the channel
    assert any(why in _said(line) for why in ("not implemented yet", "return a dict of numbers",
                                                "channel broke")), _said(line)
    row, line = graded["00_socket"]
    assert row["scores"] == ZERO, row
    assert ("exited with status 0 before it replied" in _said(line)
            or "the sandbox's channel broke" in _said(line)), _said(line)


@pytest.mark.full
def test_an_edit_of_the_graders_files_is_undone_and_scores_nothing(tmp_path):
    before = CHECK_INIT.read_bytes()
    try:
        graded = _grade(tmp_path, "00_disk", "00_untouched")   # graded in this order
    finally:
        if CHECK_INIT.read_bytes() != before:   # never leave the tree edited, whatever failed
            CHECK_INIT.write_bytes(before)
            pytest.fail("the grader left labkit/check/__init__.py edited")
    row, line = graded["00_disk"]
    assert row["scores"] == ZERO, row
    assert "changed the grader's own files on disk (labkit/check/__init__.py)" in line["error"]
    row, line = graded["00_untouched"]
    assert row["scores"] == ZERO and "not implemented yet" in line["failures"], _said(line)


@pytest.mark.full
def test_forbidden_means_forbidden_at_run_time(tmp_path):
    """The reference reached by an alias, a partial, importlib with a string, a default argument,
    or handed in as the answer itself, with the checker's source reader blinded in the notebook:
    each refused while it runs. The honest answer still scores."""
    names = ["02_honest", "02_alias", "02_partial", "02_importlib", "02_default", "02_itself"]
    graded = _grade(tmp_path, *names)
    assert graded["02_honest"][0]["scores"]["2.1"] == 2, graded["02_honest"][0]
    for name in names[1:]:
        row, line = graded[name]
        assert row["scores"]["2.1"] == 0, (name, row)
        assert "forbids it" in line["failures"], (name, _said(line))


@pytest.mark.full
def test_numbers_that_lie_oracles_and_eq_count_for_nothing(tmp_path):
    graded = _grade(tmp_path, "00_lies", "00_oracle", "00_costs", "00_eq", "00_swallow")
    for name, why in [("00_lies", "LyingFloat"), ("00_oracle", "ModuleNotFoundError"),
                      ("00_costs", "was called from your code"),
                      ("00_eq", "return a dict of numbers"), ("00_swallow", "predicted 0 B")]:
        row, line = graded[name]
        assert row["scores"] == ZERO, (name, row)
        assert why in _said(line), (name, _said(line))


@pytest.mark.full
def test_patches_env_vars_and_exits_are_named(tmp_path):
    graded = _grade(tmp_path, "00_patch", "00_exit", "00_daemon")
    row, line = graded["00_patch"]
    assert row["scores"] == ZERO, row          # its answer is wrong; the patches gain nothing
    assert "never called its checker" in line["failures"], _said(line)
    row, line = graded["00_exit"]
    assert row["scores"] == ZERO, row
    assert "the answer called sys.exit(3)" in _said(line), _said(line)
    assert "exited with status 5 (os._exit?)" in line["error"], line["error"]
    assert not Path("/tmp/labkit-forged-grade.json").exists()
    row, line = graded["00_daemon"]
    assert row["scores"]["0.1"] == 3, row     # an honest answer, and a process left behind
    assert "the notebook left 1 process behind, killed: pid" in line["error"], line["error"]


class _Oracle(socketserver.StreamRequestHandler):
    """A service on the grading machine's localhost that tells the right numbers."""

    def handle(self):
        n, w, g, master, optimizer = json.loads(self.rfile.readline())
        states = {"sgd": 0, "momentum": 1, "adam": 2}[optimizer] + (1 if master else 0)
        out = {"weights": n * w, "grads": n * g, "optimizer": n * 4 * states}
        out["total"] = sum(out.values())
        self.wfile.write(json.dumps(out).encode() + b"\n")


@pytest.mark.parametrize("network", ["namespace", "audit"])
def test_a_service_on_localhost_is_out_of_reach(tmp_path, monkeypatch, network):
    """An answer that asks a service on the grader's 127.0.0.1 for the right numbers scores 0,
    whether the sandbox has a network namespace of its own or (where Linux refuses one) Python's
    audit hooks refuse its sockets; the same service answers the test's own process."""
    if network == "namespace" and subprocess.run(["unshare", "-rn", "true"]).returncode != 0:
        pytest.skip("this kernel refuses unprivileged network namespaces (unshare -rn true)")
    monkeypatch.setattr(sandbox, "_NETWORK", [] if network == "namespace" else ["audit"])
    with socketserver.TCPServer(("127.0.0.1", 0), _Oracle) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:   # reachable here
            s.sendall(b'[10, 4, 4, true, "adam"]\n')
            assert json.loads(s.makefile().readline())["total"] == 10 * 4 * 5
        (tmp_path / "port.txt").write_text(str(port))
        graded = _grade(tmp_path, "00_network")
        server.shutdown()
    row, line = graded["00_network"]
    assert row["scores"] == ZERO, row
    why = {"namespace": "ConnectionRefusedError", "audit": "the grader's sandbox has no network"}
    assert why[network] in _said(line), _said(line)
