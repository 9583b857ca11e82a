"""One locked environment: what is installed is exactly requirements.lock, and the lock covers
every package the book asks for (requirements.txt and pyproject.toml)."""
import re
from importlib import metadata
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _name(s: str) -> str:
    return re.sub(r"[-_.]+", "-", s).lower()


def _lock() -> dict:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"requirements.lock: {line!r} is not pinned to one version"
            pins[_name(name)] = version
    return pins


def test_every_locked_package_is_installed_at_its_version():
    wrong = {}
    for name, version in _lock().items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have is None or have.split("+")[0] != version:   # torch's +cpu / +cu12x build label
            wrong[name] = (version, have)
    assert not wrong, f"installed != requirements.lock (locked, installed): {wrong}; " \
                      f"run scripts/env.sh (or ./test.sh), which installs the lock"


def test_the_lock_covers_every_requirement():
    wanted = re.findall(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*)", (ROOT / "requirements.txt").read_text(),
                        re.M)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for spec in project["dependencies"] + sum(project["optional-dependencies"].values(), []):
        wanted.append(re.match(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", spec).group())
    missing = sorted({_name(w) for w in wanted} - set(_lock()) - {"labkit"})
    assert not missing, f"not in requirements.lock: {missing}; run scripts/lock.sh"
