"""Device-correct everywhere, checked on a CPU-only machine: in labs, checkers, chapters and
solutions, every tensor factory (torch.zeros, ones, empty, full, rand*, arange, tensor, ...)
called in rank code says device= (labkit.launch.device()), is moved at once (`.to(dev)`), or
carries `# cpu: <reason>` on its line. Rank code: a function that calls torch.distributed or
labkit.launch.device(), one passed to run(...), and what those call or define
(tests/devicecheck.py).

ALLOWED lists the findings of the day this test was written, each with who fixes it. A new finding
fails; so does an entry that is no longer found (delete it: the list only shrinks).
`python tests/devicecheck.py` prints today's findings as entries; `--write` rewrites ALLOWED with
them (after a fix; a new entry instead of a fix needs its owner's reason).
"""
import textwrap
from pathlib import Path

from devicecheck import all_static_findings, owner_of, static_findings

ROOT = Path(__file__).resolve().parent.parent

ALLOWED = {  # (file, function, call): owner
}


def _where(f):
    return f"{f.path} {f.where} in {f.function}(): {f.call}  [owner {owner_of(f.path)}]"


def test_no_new_tensor_without_a_device_in_rank_code():
    found = all_static_findings(ROOT)
    new = [_where(f) for f in found if f.key() not in ALLOWED]
    assert not new, ("tensors made without device= in rank code (on a GPU rank they land on the "
                     "CPU; pass device=labkit.launch.device(), or add `# cpu: <why>` on the "
                     "line):\n  " + "\n  ".join(new))


def test_allow_list_only_shrinks():
    keys = {f.key() for f in all_static_findings(ROOT)}
    fixed = [f"{k} (owner {o})" for k, o in ALLOWED.items() if k not in keys]
    assert not fixed, ("no longer a violation: delete from ALLOWED in "
                       "tests/test_device_static.py:\n  " + "\n  ".join(fixed))


def test_allow_list_names_owners():
    assert all(owner == owner_of(path) for (path, _, _), owner in ALLOWED.items())


def _findings(tmp_path, code):
    path = tmp_path / "lab.py"
    path.write_text(textwrap.dedent(code))
    return [(f.function, f.call) for f in static_findings(path, tmp_path)]


def test_checker_flags_rank_code_only(tmp_path):
    found = _findings(tmp_path, """
        import torch
        import torch.distributed as dist
        from labkit.launch import device, run

        def reference(n):                      # never on a rank: CPU is right here
            return torch.ones(n)

        def helper(n):                         # called from rank code: a rank runs it
            return torch.zeros(n)

        def rank_fn(n):
            dev = device()
            a = torch.ones(n, device=dev)
            b = torch.randn(n).to(dev)         # made, then moved at once
            c = torch.arange(n)  # cpu: indices for a CPU-side lookup
            d = torch.empty(n, dtype=torch.float32)
            e = torch.zeros_like(a)
            def inner():
                return torch.full((n,), 2.0)
            dist.all_reduce(a)
            return helper(n), inner()

        def passed_to_run():                   # no dist call, but run() makes it rank code
            return torch.tensor([1.0])

        def checker_job(x):                    # a checker launches it: c.launch(fn, n, ...)
            return torch.ones(x)

        run(passed_to_run, 2)
        c.launch(functools.partial(checker_job, 3), 2)
        """)
    assert sorted(found) == [("checker_job", "torch.ones(x)"), ("helper", "torch.zeros(n)"),
                             ("passed_to_run", "torch.tensor([1.0])"),
                             ("rank_fn", "torch.empty(n, dtype=torch.float32)"),
                             ("rank_fn.inner", "torch.full((n,), 2.0)")]


def test_checker_reads_notebook_cells_as_one_program(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import torch\nfrom labkit.launch import run"),
                nbformat.v4.new_code_cell("%time x = 1\ndef hello():\n    return torch.ones(3)"),
                nbformat.v4.new_code_cell("run(hello, 2)")]
    path = tmp_path / "00_x.ipynb"
    nbformat.write(nb, str(path))
    [f] = static_findings(path, tmp_path)
    assert (f.where, f.function, f.call) == ("cell 2 line 3", "hello", "torch.ones(3)")
