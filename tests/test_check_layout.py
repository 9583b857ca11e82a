"""labkit.check's shape: its import graph (imports inside functions included, read with ast) is a
DAG, no module is 400 lines or more, an exercise module imports neither another exercise module
nor its chapter's __init__ (shared tools live in labkit/check itself), and an import inside a
function says why it waits. Takes under a second."""
from __future__ import annotations

import ast
from pathlib import Path

import test_architecture as architecture

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400


# labkit's modules by dotted name, as the architecture test reads them; here only labkit.check's
MODULES = {name: path for name, path in architecture.MODULES.items()
           if name == "labkit.check" or name.startswith("labkit.check.")}


def _imports(name: str, path: Path) -> set:
    """The labkit.check modules `name` imports, at any depth (`from labkit.check import ch05`
    names the module; `from labkit.check import Checker` the package)."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            bases = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            bases = [(base, a.name) for a in node.names]
        else:
            continue
        for base, attr in bases:
            full = f"{base}.{attr}" if attr else base
            while full and full not in MODULES:     # `import a.b.c` imports a.b.c's module
                full = full.rpartition(".")[0]
            if full and full != name:
                out.add(full)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_import_graph_of_labkit_check_is_a_dag():
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles in labkit.check:\n" + "\n".join(cycles)


def test_every_module_is_under_400_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) >= MAX_LINES]
    assert not long, "modules of 400 lines or more (split them by idea):\n" + "\n".join(long)


def test_exercise_modules_import_only_downward():
    """labkit.check.chNN.<exercise> imports shared tools (labkit.check.*, and the chapter's own
    chNN/common.py where its exercises share assertions), never another exercise of its chapter
    nor the chapter's __init__; an exercise split into a package of its own (chNN/<exercise>/)
    imports its parts, never its own __init__ from below. common imports no exercise."""
    bad = []
    for name, deps in GRAPH.items():
        parts = name.split(".")
        if len(parts) < 4 or not parts[2].startswith("ch"):
            continue
        chapter, exercise = ".".join(parts[:3]), ".".join(parts[:4])
        for d in deps:
            if not (d == chapter or d.startswith(chapter + ".")):
                continue                                # a shared tool, or outside labkit.check
            if d.startswith(exercise + ".") and d != name:
                continue                                # a part of this exercise's own package
            if d == chapter + ".common" and not exercise.endswith(".common"):
                continue                                # the chapter's shared assertions
            bad.append(f"{name} imports {d}")
    assert not bad, "exercise modules importing their chapter or each other:\n" + "\n".join(bad)


def test_every_chapter_is_a_package():
    flat = [n for n, p in MODULES.items() if n.split(".")[-1].startswith("ch")
            and p.name != "__init__.py" and n.count(".") == 2]
    assert not flat, f"chapter checkers still flat modules (make a package per chapter): {flat}"


def test_imports_inside_functions_say_why():
    """A function-level import carries a comment (on its line or the line above) saying why it
    must wait; every other import sits at the module's top, where the graph is visible."""
    bad = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    here, above = lines[node.lineno - 1], lines[node.lineno - 2]
                    if "#" not in here and not above.strip().startswith("#"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {here.strip()}")
    assert not bad, "imports inside functions without a reason:\n" + "\n".join(bad)


def test_each_exercise_registers_the_checker_its_module_names():
    """@graded registers whatever function follows it: a helper slipped in between once made
    a private function exercise 2.3's checker (caught only by grading the solution)."""
    import importlib

    from labkit.check.answers import REGISTRY

    for name in MODULES:
        importlib.import_module(name)
    assert REGISTRY, "no checker registered"
    for exercise, checker in REGISTRY.items():
        module = importlib.import_module(checker.__module__)
        where = f"{checker.__module__}.{checker.__name__}"
        assert not checker.__name__.startswith("_"), \
            f"exercise {exercise}: @graded sits on the private {where}"
        own = getattr(module, "EXERCISE", exercise)
        assert own == exercise or exercise in getattr(module, "EXERCISES", ()), \
            f"exercise {exercise} is registered in {checker.__module__}, whose EXERCISE is {own}"
