"""One locked environment: what is installed is exactly the lock scripts/env.sh chose, the locks
cover every package the book asks for (requirements.txt and pyproject.toml) and everything those
pull in, and the CPU variant is the full lock with torch's CPU build and no CUDA packages.
(That the full lock resolves from the public index alone to itself, nothing more, is checked
with the network by `bash scripts/lock.sh --verify`; docs/testing.md.)"""
import re
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
FULL, CPU = ROOT / "requirements.lock", ROOT / "requirements-cpu.lock"


def _name(s: str) -> str:
    return re.sub(r"[-_.]+", "-", s).lower()


def _lock(path: Path = FULL) -> dict:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            spec = str(req.specifier)
            assert spec.startswith("==") and "," not in spec, \
                f"{path.name}: {line!r} is not pinned to one version"
            pins[_name(req.name)] = (spec[2:], req.marker)
    return pins


def _active() -> Path:
    """The lock scripts/env.sh installed into this environment (.venv/.labkit-lock)."""
    chosen = ROOT / ".venv" / ".labkit-lock"
    return ROOT / (chosen.read_text().strip() if chosen.exists() else FULL.name)


def test_every_locked_package_is_installed_at_its_version():
    env = default_environment()
    wrong = {}
    for name, (version, marker) in _lock(_active()).items():
        if marker is not None and not marker.evaluate(env):
            continue
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have != version and (have or "").split("+")[0] != version:
            wrong[name] = (version, have)
    assert not wrong, f"installed != {_active().name} (locked, installed): {wrong}; " \
                      f"run scripts/env.sh (or ./test.sh), which installs the lock"


def test_everything_the_installed_packages_require_is_locked():
    """The lock is closed: no installed package asks for one the lock does not pin."""
    pins, env = _lock(_active()), default_environment()
    missing = set()
    for name in pins:
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue   # a package for another platform (its marker is false here)
        for spec in requires:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            if _name(req.name) not in pins:
                missing.add(f"{req.name} (asked for by {name})")
    assert not missing, f"not in {_active().name}: {sorted(missing)}; run scripts/lock.sh"


def test_the_lock_covers_every_requirement():
    wanted = re.findall(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*)", (ROOT / "requirements.txt").read_text(),
                        re.M)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for spec in project["dependencies"] + sum(project["optional-dependencies"].values(), []):
        wanted.append(re.match(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", spec).group())
    for path in (FULL, CPU):
        missing = sorted({_name(w) for w in wanted} - set(_lock(path)) - {"labkit"})
        assert not missing, f"not in {path.name}: {missing}; run scripts/lock.sh"


def test_the_full_lock_pins_torchs_cuda_packages_and_the_cpu_lock_is_the_rest():
    full, cpu = _lock(FULL), _lock(CPU)
    cuda = set(full) - set(cpu)
    assert {"triton", "nvidia-nccl-cu13", "nvidia-cudnn-cu13", "cuda-toolkit"} <= cuda, sorted(cuda)
    for name in cuda:   # torch's CUDA build exists for Linux only: never asked for elsewhere
        assert 'platform_system == "Linux"' in str(full[name][1]), (name, full[name][1])
    assert set(cpu) <= set(full), sorted(set(cpu) - set(full))
    assert cpu["torch"][0] == full["torch"][0] + "+cpu", (cpu["torch"], full["torch"])
    differ = {n: (full[n][0], cpu[n][0]) for n in cpu if n != "torch" and cpu[n][0] != full[n][0]}
    assert not differ, f"the two locks disagree (full, cpu): {differ}; run scripts/lock.sh"
