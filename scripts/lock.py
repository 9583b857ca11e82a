"""Write requirements.lock and requirements-cpu.lock: every package an install of the book gets,
each at one exact version. Run through scripts/lock.sh (read its header).

Two resolutions of requirements.txt (plus the browser test's Playwright), both by pip's own
resolver in `--dry-run --report` mode (nothing is installed, only metadata is read):

- requirements.lock: what a plain package index gives (pip with no extra index and no wheel
  folder). On Linux x86-64 that is torch's CUDA build, with everything it pulls in
  (`nvidia-*`, `cuda-*`, `triton`): each of those is pinned here too, with the marker torch puts
  on it, so resolving this file installs nothing it does not name.
- requirements-cpu.lock: the same pins with torch's CPU build (`torch==X+cpu`, 200 MB instead
  of several GB, found on PyTorch's CPU wheel index or a local wheel folder) and without the CUDA
  packages. scripts/env.sh chooses it where there is no NVIDIA GPU and that build can be had.

The pins already in requirements.lock are kept (given to pip as constraints) unless --upgrade;
a package new to the lock gets what pip resolves today.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FULL, CPU = ROOT / "requirements.lock", ROOT / "requirements-cpu.lock"
EXTRA = ["pip", "setuptools", "playwright>=1.40"]   # env.sh pins pip/setuptools; e2e-setup.sh


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """name -> version of a lock file (markers and comments dropped)."""
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.split("#", 1)[0].split(";", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canon(name)] = version.strip()
    return out


def resolve(requirements: list[str], constraints: dict[str, str], plain_index: bool,
            find_links: str | None) -> list[dict]:
    """pip's resolution as its JSON report's `install` list (name, version, requires_dist)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfile, report = Path(tmp, "constraints.txt"), Path(tmp, "report.json")
        cfile.write_text("".join(f"{n}=={v}\n" for n, v in constraints.items()))
        env = dict(os.environ)
        if plain_index:   # no config file, wheel folder or extra index: the public index alone
            for key in [k for k in env if k.startswith("PIP_")]:
                del env[key]
            env["PIP_CONFIG_FILE"] = os.devnull
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--quiet", "--report", str(report), "-c", str(cfile), *requirements]
        if find_links:
            cmd += ["--find-links", find_links]
        subprocess.run(cmd, check=True, env=env)
        return json.loads(report.read_text())["install"]


def requirement_lines() -> list[str]:
    lines = [ln.split("#", 1)[0].strip() for ln in (ROOT / "requirements.txt").read_text()
             .splitlines()]
    return [ln for ln in lines if ln] + EXTRA


def markers(installed: list[dict]) -> dict[str, str]:
    """name -> the environment marker under which its dependents ask for it (torch's
    `platform_system == "Linux"` on the CUDA packages), when every request carries one."""
    asked: dict[str, set] = {}
    for item in installed:
        for req in item["metadata"].get("requires_dist") or []:
            spec, _, marker = req.partition(";")
            if "extra ==" in marker:
                continue
            name = canon(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec.strip()).group())
            asked.setdefault(name, set()).add(marker.strip())
    return {n: m.pop() for n, m in asked.items() if len(m) == 1 and "" not in m}


def write(path: Path, installed: list[dict], header: list[str], marks: dict[str, str],
          torch_version: str | None = None) -> None:
    rows = []
    for item in installed:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if canon(name) == "labkit":
            continue
        if canon(name) == "torch" and torch_version:
            version = torch_version
        mark = marks.get(canon(name))
        rows.append(f"{name}=={version}" + (f" ; {mark}" if mark else ""))
    path.write_text("\n".join(header + sorted(rows, key=str.lower)) + "\n")


def verify() -> int:
    """What `pip install -r requirements.lock` resolves on a fresh machine with the public index
    alone, against the lock: every package pinned, at its version."""
    want = pins(FULL)
    got = {canon(i["metadata"]["name"]): i["metadata"]["version"]
           for i in resolve(["-r", str(FULL)], {}, plain_index=True, find_links=None)}
    extra = {n: v for n, v in got.items() if want.get(n) != v}
    print(f"{FULL.name}: pip resolves {len(got)} packages from the public index alone; "
          f"{len(want)} pinned; not pinned or at another version: {extra or 'none'}")
    return 1 if extra else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upgrade", action="store_true",
                    help="resolve afresh instead of keeping the versions already locked")
    ap.add_argument("--cpu-wheels", default=os.environ.get("LABKIT_CPU_WHEELS"),
                    help="a folder or index page holding torch's +cpu wheel (PyTorch's CPU wheel "
                         "index, or a local wheel folder); without it pip's configuration decides")
    ap.add_argument("--verify", action="store_true",
                    help="resolve requirements.lock from the public index alone and fail if pip "
                         "would install anything the lock does not pin, at its version")
    args = ap.parse_args(argv)
    if args.verify:
        return verify()
    kept = {} if args.upgrade else {n: v.split("+")[0] for n, v in pins(FULL).items()}
    reqs = requirement_lines()
    full = resolve(reqs, kept, plain_index=True, find_links=None)
    torch = next(i["metadata"]["version"] for i in full if canon(i["metadata"]["name"]) == "torch")
    locked = {canon(i["metadata"]["name"]): i["metadata"]["version"] for i in full}
    cpu_reqs = [r for r in reqs if canon(re.match(r"[A-Za-z0-9._-]+", r).group()) != "torch"]
    cpu = resolve(cpu_reqs + [f"torch=={torch}+cpu"],
                  {n: v for n, v in locked.items() if n != "torch"},
                  plain_index=False, find_links=args.cpu_wheels)
    cuda_only = sorted(set(locked) - {canon(i["metadata"]["name"]) for i in cpu})
    day = datetime.date.today().isoformat()
    py = ".".join(map(str, sys.version_info[:3]))
    common = [f"# Generated by scripts/lock.sh on {day} with Python {py}; do not edit by hand.",
              "# Ranges live in requirements.txt (and pyproject.toml, for pip install -e . into",
              "# your own environment)."]
    # the CUDA packages torch asks for through cuda-toolkit's extras carry no marker of their own:
    # they come with torch's CUDA build only, which exists for Linux only
    marks = markers(full)
    for name in cuda_only:
        marks.setdefault(name, 'platform_system == "Linux"')
    write(FULL, full, common + [
        "# What a plain package index resolves: on Linux x86-64 torch's CUDA build and every",
        f"# package it pulls in ({len(cuda_only)} CUDA packages, marked as torch marks them).",
        "# The CPU-only variant is requirements-cpu.lock (scripts/env.sh picks it without a GPU)."],
        marks)
    write(CPU, cpu, common + [
        "# The CPU-only variant of requirements.lock: the same versions, torch's +cpu build (from",
        "# PyTorch's CPU wheel index or a wheel folder) and none of the CUDA packages."],
        markers(cpu), torch_version=None)
    print(f"wrote {FULL.name} ({len(full)} packages, {len(cuda_only)} of them CUDA-only: "
          f"{', '.join(cuda_only)}) and {CPU.name} ({len(cpu)} packages); now run ./test.sh --full")
    return 0


if __name__ == "__main__":
    sys.exit(main())
