"""The pieces of the grader's sandbox, in this process (fast): what crosses back is data of exact
types, and a forbidden reference refuses the student's code however it was reached."""
import functools
import importlib
import io
import textwrap
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from labkit.check.answers import Opaque
from labkit.grade import guard, link, plain
from labkit.pipeline.base import F

SPECS = ("labkit.ddp",)


@pytest.fixture(scope="module")
def student():
    """Functions as a notebook cell defines them (their file is not labkit's)."""
    mod = types.ModuleType("student_cell")
    code = textwrap.dedent('''
        import functools, importlib
        from labkit.ddp import assign_buckets as bucketize

        def alias(p, mb):
            return bucketize(p, mb)

        by_partial = functools.partial(importlib.import_module("labkit.ddp").assign_buckets)

        def via_partial(p, mb):
            return by_partial(p, mb)

        def default(p, mb, impl=bucketize):
            return impl(p, mb)

        def by_string(p, mb):
            return getattr(importlib.import_module("labkit." + "ddp"), "assign_buckets")(p, mb)
    ''')
    exec(compile(code, "<ipython-input-3-0123456789ab>", "exec"), mod.__dict__)  # noqa: S102
    return mod


def _params():
    return [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]


@pytest.mark.parametrize("name", ["alias", "via_partial", "default", "by_string"])
def test_the_reference_refuses_the_students_code_however_reached(student, name):
    fn = getattr(student, name)
    assert len(fn(_params(), None)) == 1                     # outside a check: it runs
    with guard.refusing(SPECS), pytest.raises(guard.Refused, match="forbids it"):
        fn(_params(), None)
    assert len(fn(_params(), None)) == 1                     # and runs again afterwards


def test_the_graders_own_calls_and_threads(student):
    ddp = importlib.import_module("labkit.ddp")
    with guard.refusing(SPECS):
        with ThreadPoolExecutor(1) as pool, pytest.raises(guard.Refused):
            pool.submit(ddp.assign_buckets, _params(), None).result()   # nobody's: refused
        guard.refuse_answers([student.alias], SPECS)                   # the student's own
        for answer in (ddp.assign_buckets, student.by_partial):
            with pytest.raises(guard.Refused, match="your answer is labkit.ddp"):
                guard.refuse_answers([answer], SPECS)                  # the reference itself


def test_only_exact_types_cross_and_labkits_records_are_rebuilt():
    class LyingFloat(float):
        def __sub__(self, other):
            return 0.0

    sent = {"x": LyingFloat(1.0), "n": 3, "t": torch.ones(2), "act": F(1), "np": 2.5,
            "fp8": torch.ones(2).to(torch.float8_e4m3fn)}
    buf = io.BytesIO()
    torch.save(plain.plain(sent), buf)
    got = link._unwrap(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert isinstance(got["x"], Opaque) and type(got["x"]).__name__ == "LyingFloat"
    assert got["x"] != 1.0 and not isinstance(got["x"], float)
    assert type(got["n"]) is int and torch.equal(got["t"], torch.ones(2))
    assert got["act"] == F(1) and got["fp8"].dtype == torch.float8_e4m3fn


def test_a_reply_that_is_not_plain_data_is_no_message():
    buf = io.BytesIO()
    torch.save({"ok": functools.partial(print)}, buf)     # a pickle that names a function
    assert link._load(buf.getvalue()) == {}


def test_the_sandbox_copy_has_no_checker_and_no_oracle():
    from labkit.grade import copy

    root = copy.make(0)
    try:
        check = root / "labkit" / "check"
        assert sorted(p.name for p in check.iterdir()) == [
            "__init__.py", "answers.py", "ch00", "forbidden.py", "source.py"]
        assert not (root / "labkit" / "check" / "ch00" / "training_state.py").exists()
        assert "costs_prediction" not in (check / "ch00" / "__init__.py").read_text()
        assert not (root / "solutions").exists()
        assert not (check / "__init__.py").stat().st_mode & 0o222        # read-only
    finally:
        copy.remove(root)
    assert not root.exists()
