"""Style as a habit: ruff's rules from pyproject.toml ([tool.ruff]) hold over labkit, the tests
and the scripts. Installed from requirements.lock like everything else."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_is_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, f"ruff check . found problems (fix them, see pyproject.toml):\n" \
                                f"{out.stdout[-6000:]}{out.stderr[-2000:]}"
