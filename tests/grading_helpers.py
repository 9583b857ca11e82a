"""What the tests of chapter exercises share: the reference answer scores full marks and the
exercise's stub zero; a known-wrong answer fails the case it should, with the hint that says why."""
import pytest


def assert_reference_full_stub_zero(grade, reference, points: int, exercise: str) -> None:
    """grade(answer) -> the checker's result. The stub raises as the generated exercise's does."""
    res = grade(reference)
    assert res.score == res.points == points, res.table()

    def stub(*args):
        raise NotImplementedError(f"Exercise {exercise}: write your code here")
    assert grade(stub).score == 0


def assert_case_fails(res, case: int, needle: str) -> None:
    """Case number `case` failed, and its message holds `needle` (the hint naming the mistake)."""
    assert not res.cases[case]["passed"] and needle in res.cases[case]["message"], res.table()


class WrongAnswers(list):
    """A test module's known-wrong answers, each registered where it is written, with the case it
    must fail and words its hint must hold: `@wrong(grade, case, needle)` over the answer, then
    parametrize a test with "grade,fn,case,needle" over the list."""

    def __call__(self, grade, case: int, needle: str):
        def register(fn):
            self.append(pytest.param(grade, fn, case, needle, id=fn.__name__))
            return fn
        return register
