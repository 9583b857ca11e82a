"""labkit.testing: dtype-aware closeness, and messages that name what differs."""
import pytest
import torch

from labkit.testing import TOLERANCES, compare_dicts, tensors_close, tolerance


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_reordered_sum_is_close_and_a_real_error_is_not(dtype):
    """Summing the same terms in another order (what a ring does) stays within the default
    tolerance; an error of 10 rtol does not."""
    g = torch.Generator().manual_seed(0)
    terms = torch.rand(64, 256, generator=g, dtype=torch.float64).to(dtype)  # (ranks, n)
    forward = terms.sum(0)
    backward = terms.flip(0).cumsum(0)[-1]            # same terms, the other order
    tensors_close(backward, forward, what="reordered sum")
    rtol, _ = TOLERANCES[dtype]
    wrong = forward.double().mul(1 + 10 * rtol).to(dtype)
    with pytest.raises(AssertionError, match=r"reordered sum differs at \d+ of 256 positions"):
        tensors_close(wrong, forward, what="reordered sum")


def test_shape_dtype_and_type_mismatches_are_named():
    with pytest.raises(AssertionError, match=r"has shape \(2,\), expected \(3,\)"):
        tensors_close(torch.zeros(2), torch.zeros(3))
    with pytest.raises(AssertionError, match="has dtype torch.float32, expected torch.float64"):
        tensors_close(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(AssertionError, match="should be a torch.Tensor, got list"):
        tensors_close([0.0], torch.zeros(1))
    with pytest.raises(AssertionError, match=r"first at index \(1,\): got 2, expected 3"):
        tensors_close(torch.tensor([1, 2]), [1, 3])             # integers: exact
    assert tolerance(torch.int64) == (0.0, 0.0)


def test_explicit_tolerance_overrides_the_default():
    a, b = torch.tensor([1.0]), torch.tensor([1.001])
    with pytest.raises(AssertionError):
        tensors_close(a, b)
    tensors_close(a, b, rtol=1e-2)


def test_compare_dicts_names_missing_keys_and_first_mismatch():
    ref = {"w": torch.ones(2), "b": torch.zeros(2), "c": torch.ones(1)}
    with pytest.raises(AssertionError,
                       match=r"grads keys differ: missing 1: 'c'; unexpected 1: 'x'"):
        compare_dicts({"w": torch.ones(2), "b": torch.zeros(2), "x": torch.ones(1)}, ref,
                      what="grads")
    got = {"w": torch.ones(2), "b": torch.tensor([0.0, 0.5]), "c": torch.ones(1) * 2}
    with pytest.raises(AssertionError, match=r"grads 'b' differs at 1 of 2 positions; first at "
                                             r"index \(1,\): got 0.5, expected 0"):
        compare_dicts(got, ref, what="grads")
    compare_dicts(dict(ref), ref)
