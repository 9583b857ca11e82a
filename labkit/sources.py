"""The labkit package on disk, read with ast: which file a module name is, what each file imports
(at module level and inside functions), and the closure of files that importing some modules can
run or read. labkit.book stamps each notebook with that closure's hashes (its freshness).
"""
from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

EXCLUDED = {"labkit/book.py"}  # the runner: running the book does not depend on it


def digest(data: bytes) -> str:
    """sha256, 16 hex: the stamp's hash of a file or of code cells."""
    return hashlib.sha256(data).hexdigest()[:16]


class Sources:
    """The labkit package on disk: which file a module name is, and what each file imports."""

    def __init__(self, package_dir: Path | None = None):
        if package_dir is None:
            # here: the package's own path, read when the reader runs, not at import
            import labkit

            package_dir = Path(labkit.__file__).parent
        self.pkg = Path(package_dir).resolve()
        self._imports, self._data = {}, {}

    def key(self, path: Path) -> str:
        return path.resolve().relative_to(self.pkg.parent).as_posix()

    def file_of(self, name: str):
        """The file module `name` (labkit.x.y) runs, as the import system picks it: a package's
        __init__.py before a same-named .py; None when it is no module (or a namespace folder)."""
        parts = name.split(".")
        if parts[0] != self.pkg.name:
            return None
        base = self.pkg.joinpath(*parts[1:])
        for cand in (base / "__init__.py", base.with_suffix(".py")):
            if cand.is_file():
                return cand
        return None

    def is_module(self, name: str) -> bool:
        return self.file_of(name) is not None or self.pkg.joinpath(*name.split(".")[1:]).is_dir()

    def names_in(self, tree: ast.AST, module: str = "", is_package: bool = False) -> set:
        """labkit module names that `tree` imports or names, anywhere in it (functions too)."""
        found, alias = set(), {}
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    found.add(a.name)
                    top = a.name.split(".")[0]
                    alias[a.asname or top] = a.name if a.asname else top
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                found.add(base)
                for a in node.names:
                    found.add(f"{base}.{a.name}")
                    alias[a.asname or a.name] = f"{base}.{a.name}"
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"labkit(\.\w+)+", node.value):  # importlib / `python -m labkit.x`
                    found |= {node.value, node.value + ".__main__"}
                elif package and re.fullmatch(r"\w+\.py", node.value):  # a sibling run as a file
                    found.add(f"{package}.{node.value[:-3]}")
        for node in ast.walk(tree):  # attribute chains on a bound module: costs.memory.f
            chain = []
            while isinstance(node, ast.Attribute):
                chain.append(node.attr)
                node = node.value
            if chain and isinstance(node, ast.Name) and node.id in alias:
                found.add(".".join([alias[node.id]] + chain[::-1]))
        return {self._module_prefix(n) for n in found if n.split(".")[0] == self.pkg.name} - {None}

    def _module_prefix(self, name: str):
        """The longest prefix of a dotted name that is a module (costs.memory.f -> costs.memory)."""
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if self.is_module(".".join(parts[:n])):
                return ".".join(parts[:n])
        return None

    def _imports_of(self, name: str) -> set:
        if name not in self._imports:
            path = self.file_of(name)
            names, data = set(), set()
            if path is not None:
                tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
                names = self.names_in(tree, name, path.name == "__init__.py")
                data = {f for n in ast.walk(tree)
                        if isinstance(n, ast.Constant) and isinstance(n.value, str)
                        and re.fullmatch(r"[\w./-]+\.(txt|json|csv|npz|pt)", n.value)
                        for f in (self.pkg / n.value, path.parent / n.value) if f.is_file()}
            self._imports[name] = names
            self._data[name] = data  # read by name: resources.files("labkit") / "data/x.txt"
        return self._imports[name]

    def closure(self, names) -> dict:
        """{file key: sha256-16} of every labkit file that importing `names` can run or read."""
        seen, todo = set(), list(names)
        while todo:
            name = todo.pop()
            parts = name.split(".")
            for n in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__
                sub = ".".join(parts[:n])
                if sub not in seen:
                    seen.add(sub)
                    todo.extend(self._imports_of(sub))
        files = ({self.file_of(n) for n in seen}
                 | {f for n in seen for f in self._data.get(n, ())}) - {None}
        keyed = {self.key(p): p for p in files}
        return {k: digest(p.read_bytes()) for k, p in sorted(keyed.items()) if k not in EXCLUDED}
