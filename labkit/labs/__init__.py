"""Every chapter's lab as a script: `labkit run NAME --nproc N`, or under torchrun.

One module per lab with `main(argv)`: labs/NAME.py, or labs/NAME/__init__.py when the lab's topic
has experiments of its own. Those live beside the lab, in labs/TOPIC/ (the topic package,
labkit.TOPIC, holds the algorithm): their rank jobs, sweeps, measurement harnesses and report
builders, which the lab, the chapter, the benchmarks, the checkers and the tests import from
there. A package with no `main` (labs/parallel/: chapter 10's, whose lab is hybrid) is no lab.

Each lab calls labkit.launch.run, which starts N local processes, or, under `torchrun`, runs as
the current rank; rank 0 prints a line per finished phase (labkit.progress) and ends with a table.

A lab module says BACKEND = "auto" when its ranks put their tensors on labkit.launch.device():
it runs on NCCL where there is a GPU per (local) rank, else on Gloo, and prints the backend and
device in its table's header (`ran_on`). BACKEND = "gloo" is for a lab whose lesson is on the
CPU (checkpoint: bitwise RNG equality and file I/O; train_ft: a killed rank and its restart):
`labkit run` hides the GPUs from it, so it runs on Gloo even on a GPU machine, and `labkit list`
says so (`backend_of`).

Which lab belongs to which chapter is the chapter manifest's (labkit.chapters): `labkit list`
prints it, and a test checks that every chapter has a lab and that each exists."""
import ast
from pathlib import Path


def source_of(name: str) -> Path:
    """The file lab `name` runs: labs/NAME/__init__.py (a lab with its experiments beside it)
    before labs/NAME.py, as the import system picks them."""
    here = Path(__file__).parent
    package = here / name / "__init__.py"
    return package if package.is_file() else here / f"{name}.py"


def is_lab(name: str) -> bool:
    """Whether labs/NAME defines `main` (read with ast, not imported): labs/parallel/ holds
    experiments only."""
    tree = ast.parse(source_of(name).read_text(encoding="utf-8"))
    return any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)


def backend_of(name: str) -> str:
    """The lab's BACKEND ("auto" or "gloo"), read from its source without importing it: a lab
    imports torch and its topic at the top, and `labkit list` should not pay for twenty of them."""
    tree = ast.parse(source_of(name).read_text(encoding="utf-8"))
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BACKEND"
                                                 for t in node.targets)
                and isinstance(node.value, ast.Constant)):
            return node.value.value
    return "auto"


def ran_on(backend: str, device: str) -> str:
    """What a lab's table header says about where it ran: 'backend nccl, device cuda:0'."""
    return f"backend {backend}, device {device}"


def rank_place() -> tuple:
    """(backend, device) of this rank, as strings (call inside a launched function)."""
    import torch.distributed as dist

    # here: labkit list and the CLI import this package without torch
    from labkit.launch import device

    return dist.get_backend(), str(device())
