"""A rank's error and a hang report point at the reader's code, whatever cloudpickle does: a
notebook cell by IPython's name (`Cell In[N], line L`), a file by path and line, each with the
source line, and none of the launcher's own frames. Tested from a real kernel (nbclient), from
a module, and for a function nested in another."""
from __future__ import annotations

import sys
import textwrap

import cloudpickle
import nbformat
import pytest
from nbclient import NotebookClient

from labkit.launch import HangError, RankError, run, source

CELL_DEFINE = """\
import torch
import torch.distributed as dist
from labkit.launch import run, RankError, HangError

def my_step(x):
    y = x * 2
    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot step")
    return y

def shift():
    t = torch.ones(4)
    dist.send(t, dst=(dist.get_rank() + 1) % dist.get_world_size())   # everyone sends: a hang
    return 0

def outer():
    def inner_step():
        z = 1
        raise KeyError("nested")
    return inner_step
"""

CELL_RUN = """\
for fn, kw in [(my_step, dict(args=(3,))), (shift, dict(timeout=4)), (outer(), {})]:
    try:
        run(fn, 2, **kw)
    except (RankError, HangError) as err:
        print("=====", type(err).__name__)
        print(err)
"""


@pytest.fixture(scope="module")
def notebook_report(tmp_path_factory):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("1 + 1"), nbformat.v4.new_code_cell(CELL_DEFINE),
                nbformat.v4.new_code_cell(CELL_RUN)]
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path_factory.mktemp("nb"))}}).execute()
    text = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    return nb.cells[1].execution_count, text.split("=====")[1:]


def test_a_rank_error_from_a_cell_names_the_cell_and_line(notebook_report):
    count, (rank_error, _, _) = notebook_report
    assert f"Cell In[{count}], line 8, in my_step" in rank_error, rank_error
    assert 'raise ValueError("rank 1 cannot step")' in rank_error
    assert "<dynamic-code>" not in rank_error
    assert "labkit/launch" not in rank_error, rank_error   # the launcher's own frames are hidden


def test_a_hang_from_a_cell_names_the_cell_and_line(notebook_report):
    count, (_, hang, _) = notebook_report
    assert hang.startswith(" HangError"), hang
    assert f"Cell In[{count}], line 13, in shift" in hang, hang
    assert "dist.send(t, dst=" in hang
    assert "<dynamic-code>" not in hang and "labkit/launch" not in hang


def test_a_nested_function_from_a_cell_names_the_cell(notebook_report):
    count, (_, _, nested) = notebook_report
    assert f"Cell In[{count}], line 19, in inner_step" in nested, nested
    assert 'raise KeyError("nested")' in nested


# -- functions pickled by value outside a notebook: a test module's, and a nested one
def _fails_here():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise RuntimeError("from a module function")
    return 1


def test_a_module_function_names_its_file_and_line():
    with pytest.raises(RankError) as info:
        run(_fails_here, 2)
    text = info.value.remote_traceback
    assert f'File "{__file__}"' in text and 'raise RuntimeError("from a module function")' in text
    assert "labkit/launch" not in text and "<dynamic-code>" not in text


def test_a_function_nested_in_a_function_names_its_file_and_line():
    def nested():
        raise LookupError("inside nested")

    with pytest.raises(RankError) as info:
        run(nested, 2)
    assert 'raise LookupError("inside nested")' in info.value.remote_traceback
    assert f'File "{__file__}"' in info.value.remote_traceback


def test_a_hang_in_a_module_function_shows_its_line():
    def blocked():
        import torch
        import torch.distributed as dist

        dist.recv(torch.zeros(1), src=1 - dist.get_rank())   # both receive: nobody sends
    with pytest.raises(HangError) as info:
        run(blocked, 2, timeout=3)
    assert "dist.recv(torch.zeros(1), src=1 - dist.get_rank())" in str(info.value)
    assert "labkit/launch" not in str(info.value)


def test_code_from_exec_is_carried_to_the_ranks(tmp_path):
    # code whose file exists only in this process's linecache (as a notebook cell's does)
    import linecache

    fake = str(tmp_path / "never-written.py")
    text = textwrap.dedent("""\
        def from_nowhere():
            raise ArithmeticError("carried source")
        """)
    linecache.cache[fake] = (len(text), None, text.splitlines(True), fake)
    scope = {}
    exec(compile(text, fake, "exec"), scope)
    with pytest.raises(RankError) as info:
        run(scope["from_nowhere"], 2)
    assert f'File "{fake}", line 2, in from_nowhere' in info.value.remote_traceback
    assert 'raise ArithmeticError("carried source")' in info.value.remote_traceback


def test_the_installed_cloudpickle_renames_code_and_ours_does_not():
    """Documents why labkit.launch.source exists: cloudpickle >= 3.1 sends '<dynamic-code>'."""
    def here():
        return 1

    plain = cloudpickle.loads(cloudpickle.dumps(here)).__code__.co_filename
    ours = cloudpickle.loads(source.dumps(here)[0]).__code__.co_filename
    assert ours == __file__
    version = tuple(int(p) for p in cloudpickle.__version__.split(".")[:2])
    if version >= (3, 1) and sys.version_info >= (3, 8):
        assert plain == "<dynamic-code>"
