"""The package's shape, as a contract: arrows point one way, private names stay home, modules
stay small, and importing labkit does no work.

- Core modules never import the grader, the labs or the widgets (labkit.check, labkit.labs,
  labkit.widgets): those sit on top of the core, and an arrow back would make the core depend
  on exercise plumbing. Imports inside functions count too (they are read with ast, not run).
- A topic package (labkit.zero, labkit.ddp, ...) holds the algorithm; its experiments (rank jobs,
  sweeps, measurement harnesses, report builders) live with its lab in labkit/labs/TOPIC/, and
  the topic package never imports them (nor anything else in labkit.labs).
- No module imports a private name (`_x`, or a private module) from outside its own package.
- No module is over MAX_LINES lines unless its docstring has a line starting "Long because:".
- Nothing in labkit replaces a torch.distributed function (`dist.all_reduce = ...`,
  `setattr(dist, ...)`): communication is observed through labkit.observe.commlog, kernel counters
  (labkit.observe.netcount) or a dispatch mode, never by patching torch.
- Importing every module starts no process, thread or process group.
- The import graph (imports inside functions included, read with ast) has no cycle.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "labkit"
MAX_LINES = 330
# modules on top of the core: they may import anything
# (labkit.profiling.jobs: rank jobs that labs and chapters run under the profiler, experiments too)
TOP = ("labkit.check", "labkit.labs", "labkit.widgets", "labkit.cli", "labkit.grade",
       "labkit.bench", "labkit.book", "labkit.site", "labkit.__main__", "labkit.profiling.jobs")
FORBIDDEN_FOR_CORE = ("labkit.check", "labkit.labs", "labkit.widgets")
# (core file, labs module) imports known today, each with the owner who removes it. Keep small.
LABS_ALLOWED: dict[tuple[str, str], str] = {}
TOPICS = ("zero", "ddp", "tp", "pipeline", "context", "precision", "checkpoint", "parallel", "moe")
# (importer, imported name) pairs known today, each with the owner who removes it. Keep small.
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {}
# modules over MAX_LINES being split by their owner; remove the entry with the split
LONG_ALLOWED: dict[str, str] = {
    "labkit/pipeline/executor.py": "H3 (pipeline)",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _imports(name: str, path: Path):
    """(imported module, imported name or None, line) for every import in the file, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    here = name if _is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in MODULES:          # `from labkit import check`: a module
                    yield full, None, node.lineno
                else:
                    yield base, a.name, node.lineno


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _home(name: str) -> str:
    """A module's own package: labkit.<first part> (labkit.launch.rank -> labkit.launch)."""
    return ".".join(name.split(".")[:2])


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _imports_of(importers, forbidden) -> tuple:
    """(offending lines, LABS_ALLOWED pairs seen): imports of a `forbidden` package by the
    modules `importers(name)` picks, the allowed (file, module) pairs excepted."""
    bad, seen = [], set()
    for name, path in MODULES.items():
        if not importers(name):
            continue
        for mod, _, line in _imports(name, path):
            key = (str(path.relative_to(ROOT)), mod)
            if key in LABS_ALLOWED:
                seen.add(key)
            elif any(_within(mod, f) for f in forbidden):
                bad.append(f"{key[0]}:{line} imports {mod}")
    return bad, seen


def test_core_never_imports_check_labs_or_widgets():
    bad, seen = _imports_of(lambda name: not any(_within(name, t) for t in TOP),
                            FORBIDDEN_FOR_CORE)
    assert not bad, ("core modules import the layers above them (move the shared code into the "
                     "core, e.g. labkit.testing):\n" + "\n".join(bad))
    stale = set(LABS_ALLOWED) - seen
    assert not stale, f"allowed imports of labkit.labs that no longer occur (remove them): {stale}"


def test_topic_packages_hold_the_algorithm_not_its_experiments():
    """labkit/TOPIC/ never imports labkit.labs (its experiments live there, above it): issue #39
    item 5's rule, checked on its own (today's one exception: LABS_ALLOWED, with its owner)."""
    assert all(any(_within(n, f"labkit.{t}") for n in MODULES) for t in TOPICS), TOPICS
    bad, _ = _imports_of(lambda name: any(_within(name, f"labkit.{t}") for t in TOPICS),
                         ("labkit.labs",))
    assert not bad, ("a topic package imports an experiment (move the shared piece into the "
                     "topic package, or the importer into labkit/labs/TOPIC/):\n" + "\n".join(bad))


def test_no_private_name_is_imported_across_packages():
    bad, seen = [], set()
    for name, path in MODULES.items():
        for mod, attr, line in _imports(name, path):
            if not _within(mod, "labkit") or _home(mod) == _home(name):
                continue
            parts = mod.split(".") + ([attr] if attr else [])
            if not any(_private(p) for p in parts[1:]):
                continue
            key = (name, ".".join(parts))
            seen.add(key)
            if key not in PRIVATE_ALLOWED:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {'.'.join(parts)}")
    assert not bad, ("private names imported from another package (make them public there, or "
                     "move the code):\n" + "\n".join(bad))
    stale = set(PRIVATE_ALLOWED) - seen
    assert not stale, f"allowed exceptions that no longer occur (remove them): {sorted(stale)}"


def test_modules_are_small_or_say_why():
    long, seen = [], set()
    for path in MODULES.values():
        n = len(path.read_text().splitlines())
        rel = str(path.relative_to(ROOT))
        if n <= MAX_LINES:
            continue
        seen.add(rel)
        if rel in LONG_ALLOWED:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if not any(line.strip().startswith("Long because:") for line in doc.splitlines()):
            long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, (f"modules over {MAX_LINES} lines without a 'Long because:' line in their "
                      "docstring (split them by idea, or say why not):\n" + "\n".join(long))
    stale = set(LONG_ALLOWED) - seen
    assert not stale, f"allowed long modules that are short now (remove them): {sorted(stale)}"


def _dist_aliases(tree) -> set:
    names = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return names


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id] + parts[::-1]) if isinstance(node, ast.Name) else ""


def test_nothing_patches_torch_distributed():
    bad = []
    for path in MODULES.values():
        tree = ast.parse(path.read_text())
        dist = _dist_aliases(tree)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                targets = [_dotted(t.value) for t in targets if isinstance(t, ast.Attribute)]
            elif isinstance(node, ast.Call) and _dotted(node.func) in ("setattr", "delattr") \
                    and node.args:
                targets = [_dotted(node.args[0])]
            if any(t in dist for t in targets):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "torch.distributed patched (observe with labkit.observe.commlog instead):\n" + \
        "\n".join(bad)


# import cycles known today, each with the owner who removes it (edges a -> b of a cycle inside
# labkit.check or labkit.zero, being restructured by other hands). Keep small.
# none left: the check/ packages import only downward
CYCLES_ALLOWED: dict[tuple[str, str], str] = {}


def _graph() -> dict:
    """{module: {labkit modules it imports, at any depth}}. `from labkit.x import y` counts as
    an edge to labkit.x.y when that is a module, else to labkit.x (a package's __init__)."""
    out = {}
    for name, path in MODULES.items():
        out[name] = {mod for mod, _, _ in _imports(name, path)
                     if mod in MODULES and mod != name}
    return out


def _cycles(graph: dict) -> list:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_import_graph_has_no_cycle():
    graph = _graph()
    for a, b in CYCLES_ALLOWED:              # the known edges, removed before the search
        graph.get(a, set()).discard(b)
    cycles = _cycles(graph)
    assert not cycles, ("import cycles (function-level imports included); move the shared code "
                        "below both, or split a module:\n" + "\n".join(
                            " <-> ".join(c) for c in cycles))
    full = _graph()
    stale = [e for e in CYCLES_ALLOWED if e[1] not in full.get(e[0], set())]
    assert not stale, f"allowed cycle edges that no longer occur (remove them): {stale}"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


IMPORT_ALL = """
import importlib, json, sys, threading
names = json.loads(sys.argv[1])
failed = {}
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as err:  # an optional dependency missing here
        failed[name] = repr(err)
import psutil
import torch.distributed as dist
print(json.dumps({"children": [p.pid for p in psutil.Process().children(recursive=True)],
                  "threads": [t.name for t in threading.enumerate()],
                  "initialized": dist.is_available() and dist.is_initialized(),
                  "failed": failed}))
"""


def test_importing_every_module_does_no_work():
    names = [n for n in MODULES if not n.endswith("__main__")]
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL, json.dumps(names)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["children"] == [], "importing labkit started processes"
    assert not report["initialized"], "importing labkit initialised torch.distributed"
    assert report["threads"] == ["MainThread"], \
        f"importing labkit started threads: {report['threads']}"
    assert len(report["failed"]) < len(names) // 4, report["failed"]  # most modules did import
