"""Device mistakes caught on a CPU-only machine (shared by the tests of the GPU-ready labs).

On a GPU rank every tensor must be made on labkit.launch.device(): a `torch.zeros(n)` without
`device=` lands on the CPU, and NCCL or the next op with a CUDA tensor fails, but only there.
Two ways to see such a call here, where every device is the CPU:

- `default_device("meta")`: torch's default device becomes "meta" while the rank computes on the
  CPU. A tensor made without `device=` is then a meta tensor; the first op that mixes it with a
  CPU tensor raises, or a result comes back on meta. (The GPU case exactly: the default is
  elsewhere than where the rank computes.) For code that builds nothing itself.
- `ImplicitDevice(files)`: a torch function mode that records every factory call (torch.empty,
  zeros, ones, full, rand*, arange, tensor, ...) made *from the given labkit files* without a
  `device=` argument. For whole rank functions that also build models and batches on the CPU
  on purpose (those calls are in labkit/model.py, or say device="cpu").
"""
from __future__ import annotations

import ast
import contextlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path


@contextlib.contextmanager
def default_device(name: str = "meta"):
    import torch

    torch.set_default_device(name)
    try:
        yield
    finally:
        torch.set_default_device(None)


def _factories():
    import torch

    names = ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "arange", "tensor",
             "as_tensor", "eye", "linspace", "empty_strided", "scalar_tensor")
    return {getattr(torch, n) for n in names}


def ImplicitDevice(files):
    """A TorchFunctionMode recording (file, line, function) of factory calls without device=,
    made directly from a file whose path ends with one of `files`."""
    from torch.overrides import TorchFunctionMode

    factories = _factories()

    class _Mode(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in factories and kwargs.get("device") is None:
                frame = sys._getframe(1)
                path = frame.f_code.co_filename.replace("\\", "/")
                if any(path.endswith(f) for f in files):
                    self.calls.append((path.rsplit("labkit/", 1)[-1], frame.f_lineno,
                                       f"torch.{func.__name__}"))
            return func(*args, **kwargs)

    return _Mode()


RANK_SIDE = ("labkit/collectives.py", "labkit/bench/collectives.py", "labkit/tp/operators.py",
             "labkit/tp/layers.py", "labkit/tp/blocks.py", "labkit/tp/gpt.py",
             "labkit/labs/tp/measure.py", "labkit/pipeline/executor.py",
             "labkit/labs/pipeline/measure.py",
             "labkit/labs/hybrid.py", "labkit/parallel/parallelize.py",
             "labkit/labs/parallel/job.py",
             "labkit/parallel/mesh.py", "labkit/observe/commlog.py")


# ---- the static half: factory calls without device= in code that runs on a rank ----------------
# Read by tests/test_device_static.py. No torch needed: the source is parsed (ast), not run.
#
# Rank code is a function that calls torch.distributed (dist.*) or labkit.launch.device(), one
# passed to run(...), one called by name from rank code in the same file, and any function
# defined inside one of those. A factory call there needs device=, or is moved at once
# (`torch.randn(4).to(dev)`), or says why it stays on the CPU with `# cpu: <reason>` on its line.

FACTORY_NAMES = {"empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm",
                 "arange", "tensor", "as_tensor", "eye", "linspace", "logspace", "empty_strided",
                 "scalar_tensor"}
OPT_OUT = re.compile(r"#\s*cpu:\s*\S")
STATIC_GLOBS = ("labkit/labs/**/*.py", "labkit/check/*.py", "chapters/*.ipynb", "solutions/*.ipynb")


@dataclass(frozen=True)
class Finding:
    path: str      # relative to the repository root
    where: str     # "line 12" or "cell 7 line 3"
    function: str  # qualified name of the rank function
    call: str      # the call's source, whitespace collapsed

    def key(self) -> tuple:
        return (self.path, self.function, self.call)


def _units(path: Path) -> list:
    """(label, source) of a Python file, or of each code cell of a notebook (magics -> pass)."""
    if path.suffix == ".py":
        return [("", path.read_text(encoding="utf-8"))]
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    out = []
    for i, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
        src = "".join(cell["source"])
        src = "\n".join("pass" if re.match(r"\s*[%!]", ln) else ln for ln in src.splitlines())
        out.append((f"cell {i + 1} ", src))
    return out


def _aliases(trees) -> tuple:
    """Names bound to torch, torch.distributed (and functions from it), labkit.launch, device()."""
    torch_, dist, dist_fns, launch, device = {"torch"}, set(), set(), set(), set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "torch.distributed" and a.asname:
                        dist.add(a.asname)
                    elif a.name == "torch" and a.asname:
                        torch_.add(a.asname)
                    elif a.name == "labkit.launch" and a.asname:
                        launch.add(a.asname)
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    bound = a.asname or a.name
                    if node.module == "torch" and a.name == "distributed":
                        dist.add(bound)
                    elif node.module == "torch.distributed":
                        dist_fns.add(bound)
                    elif node.module == "labkit" and a.name == "launch":
                        launch.add(bound)
                    elif node.module == "labkit.launch" and a.name == "device":
                        device.add(bound)
    return torch_, dist, dist_fns, launch, device


def _chain(node) -> list:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def _own_nodes(fn):
    """Nodes of a function's body, not descending into functions or classes defined in it."""
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    todo = [n for n in fn.body if not isinstance(n, nested)]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, nested):
                todo.append(child)


def static_findings(path: Path, root: Path) -> list:
    units = []
    for label, src in _units(path):
        try:
            units.append((label, src, ast.parse(src)))
        except SyntaxError:
            continue
    torch_, dist, dist_fns, launch, device = _aliases(t for _, _, t in units)
    funcs = []  # (qualified name, node, parent function or None, label, source)

    def collect(node, prefix, parent, label, src):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((prefix + child.name, child, parent, label, src))
                collect(child, prefix + child.name + ".", child, label, src)
            elif isinstance(child, ast.ClassDef):
                collect(child, prefix + child.name + ".", parent, label, src)
            else:
                collect(child, prefix, parent, label, src)

    for label, src, tree in units:
        collect(tree, "", None, label, src)

    def is_rank_call(call) -> bool:
        c = _chain(call.func)
        return bool(c) and ((c[0] in dist and len(c) > 1) or c[:2] == ["torch", "distributed"]
                            or (len(c) == 1 and c[0] in dist_fns | device)
                            or (c[-1] == "device" and len(c) > 1
                                and (c[-2] in launch or c[-2] == "launch")))

    by_name = {}
    for _, node, *_ in funcs:
        by_name.setdefault(node.name, []).append(node)
    rank = {id(node) for _, node, *_ in funcs
            if any(isinstance(n, ast.Call) and is_rank_call(n) for n in _own_nodes(node))}
    for _, _, tree in units:  # run(fn, ...), launch.run(fn, ...), a checker's c.launch(fn, ...)
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and _chain(n.func)[-1:] in (["run"], ["launch"]):
                target = n.args[0] if n.args else next(
                    (k.value for k in n.keywords if k.arg == "fn"), None)
                if (isinstance(target, ast.Call) and _chain(target.func)[-1:] == ["partial"]
                        and target.args):
                    target = target.args[0]
                if isinstance(target, ast.Name):
                    rank |= {id(f) for f in by_name.get(target.id, [])}
    changed = True
    while changed:  # called from rank code, or defined inside it
        changed = False
        for _, node, parent, *_ in funcs:
            if id(node) in rank:
                continue
            callers = [f for _, f, *_ in funcs if id(f) in rank and any(
                isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == node.name
                for n in _own_nodes(f))]
            if (parent is not None and id(parent) in rank) or callers:
                rank.add(id(node))
                changed = True

    rel = path.resolve().relative_to(root.resolve()).as_posix()
    found = []
    for name, fn, _, label, src in funcs:
        if id(fn) not in rank:
            continue
        lines = src.splitlines()
        parents = {id(ch): n for n in _own_nodes(fn) for ch in ast.iter_child_nodes(n)}
        for n in _own_nodes(fn):
            if not isinstance(n, ast.Call):
                continue
            c = _chain(n.func)
            if not (len(c) == 2 and c[0] in torch_ and c[1] in FACTORY_NAMES):
                continue
            if any(k.arg == "device" or k.arg is None for k in n.keywords):
                continue
            up = parents.get(id(n))
            if isinstance(up, ast.Attribute) and up.attr in ("to", "cuda"):
                continue  # made, then moved at once
            if any(OPT_OUT.search(ln) for ln in lines[n.lineno - 1:n.end_lineno]):
                continue
            call = " ".join((ast.get_source_segment(src, n) or "").split())
            unit = units.index(next(u for u in units if u[1] is src))
            found.append((unit, n.lineno, n.col_offset,
                          Finding(rel, f"{label}line {n.lineno}", name, call)))
    seen = {}
    out = []
    # the same call twice in one function: keep both, distinguishable
    for *_, f in sorted(found, key=lambda t: t[:3]):
        k = f.key()
        seen[k] = seen.get(k, 0) + 1
        out.append(f if seen[k] == 1
                   else Finding(f.path, f.where, f.function, f"{f.call} #{seen[k]}"))
    return out


def all_static_findings(root: Path) -> list:
    return [f for g in STATIC_GLOBS for p in sorted(root.glob(g)) for f in static_findings(p, root)]


OWNERS = {  # who fixes a finding (the helpers' lanes of this session), by file
    "labkit/labs/intro.py": "H5", "labkit/labs/ring.py": "H5", "labkit/check/ch00.py": "H5",
    "labkit/check/ch01.py": "H5", "labkit/labs/ddp/__init__.py": "H6",
    "labkit/labs/checkpoint/__init__.py": "H6",
    "labkit/labs/train_ft.py": "H6", "labkit/check/ch02.py": "H6", "labkit/check/ch06.py": "H6",
    "labkit/labs/zero/__init__.py": "H2", "labkit/labs/tp.py": "H2", "labkit/check/ch03.py": "H2",
    "labkit/check/ch04.py": "H2", "labkit/labs/pipeline.py": "H3", "labkit/check/ch05.py": "H3",
    "labkit/check/ch10.py": "H4", "labkit/labs/hybrid.py": "lead", "labkit/check/__init__.py": "H1",
    "labkit/labs/__init__.py": "lead"}
NOTEBOOK_OWNERS = {"00": "H5", "01": "H5", "02": "H6", "03": "H2", "04": "H2", "05": "H3",
                   "06": "H6", "07": "H4"}


def owner_of(path: str) -> str:
    if path.endswith(".ipynb"):
        return NOTEBOOK_OWNERS.get(Path(path).name[:2], "lead")
    return OWNERS.get(path, "lead")


def allow_list_lines(root: Path) -> list:
    return [f"    ({f.path!r}, {f.function!r}, {f.call!r}): {owner_of(f.path)!r},  # {f.where}"
            for f in all_static_findings(root)]


if __name__ == "__main__":
    # python tests/devicecheck.py          today's findings, as allow-list entries
    # python tests/devicecheck.py --write  make them test_device_static.py's ALLOWED
    here = Path(__file__).resolve().parent
    lines = allow_list_lines(here.parent)
    if "--write" not in sys.argv:
        print("\n".join(lines))
        sys.exit(0)
    test = here / "test_device_static.py"
    head, rest = test.read_text().split("ALLOWED = {", 1)
    first, rest = rest.split("\n", 1)
    tail = rest[rest.index("\n}\n"):]
    test.write_text(head + "ALLOWED = {" + first + "\n"
                    + "\n".join(ln.split("  # ")[0] for ln in lines) + tail)
    print(f"{test.name}: ALLOWED has {len(lines)} entries")
