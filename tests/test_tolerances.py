"""The tolerance functions catch planted errors that a plain RMS ratio lets through."""

import pytest
import torch

from lamina.testing import (
    BASELINE_FACTOR,
    RECURRENCE_RMS_RATIO,
    ZERO_GRADIENT_FRACTION,
    _rms,
    assert_attention_close,
    assert_close,
    gradient_scale,
    reduction_scale,
)

# fla's benchmark shape of one output (B, T, H, V) and an interpreter-test shape
GPU_SHAPE = (2, 2048, 4, 128)
INTERPRETER_SHAPE = (1, 40, 2, 32)


def _reference(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _flip(x: torch.Tensor, count: int, typical: bool, seed: int = 1) -> torch.Tensor:
    """Negate ``count`` elements chosen at random (with ``typical``, among those with |x| >= rms(x))."""
    flat = x.clone().flatten()
    pool = (flat.abs() >= _rms(flat)).nonzero().flatten() if typical else torch.arange(flat.numel())
    pick = pool[torch.randperm(pool.numel(), generator=torch.Generator().manual_seed(seed))[:count]]
    flat[pick] = -flat[pick]
    return flat.view_as(x)


def test_hundred_sign_flips_at_gpu_shape_fail():
    ref = _reference(GPU_SHAPE)
    wrong = _flip(ref.to(torch.bfloat16).double(), 100, typical=False).to(torch.bfloat16)
    # the RMS ratio alone passes it (ratio ~1.4e-2 < 2e-2): the worst-element bound must catch it
    assert _rms(wrong.double() - ref) / _rms(ref) <= RECURRENCE_RMS_RATIO[torch.bfloat16]
    with pytest.raises(AssertionError, match="worst element"):
        assert_close("o", wrong, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_sign_flip_at_interpreter_shape_fails(dtype):
    ref = _reference(INTERPRETER_SHAPE)
    wrong = _flip(ref.to(dtype).double(), 1, typical=True).to(dtype)
    with pytest.raises(AssertionError):
        assert_close("o", wrong, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [GPU_SHAPE, INTERPRETER_SHAPE])
def test_rounding_noise_at_the_rms_bound_passes(dtype, shape):
    # a correct kernel: the reference rounded to the dtype plus Gaussian noise at half the RMS bound
    ref = _reference(shape)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    close = (ref + 0.5 * RECURRENCE_RMS_RATIO[dtype] * _rms(ref) * noise).to(dtype)
    assert_close("o", close, ref)


def test_all_nan_against_all_nan_fails():
    nan = torch.full((4, 8), float("nan"))
    with pytest.raises(AssertionError, match="nothing finite"):
        assert_close("o", nan, nan.double())
    with pytest.raises(AssertionError, match="nothing finite"):
        assert_close("o", nan, nan.double(), kind="elementwise")
    with pytest.raises(AssertionError, match="nothing finite"):
        assert_attention_close("o", nan, nan.double(), nan)


def test_nan_in_different_places_fails_and_matching_nan_passes():
    ref = _reference((4, 8))
    ref[1, 2] = float("nan")
    moved = ref.clone()
    moved[1, 2], moved[3, 3] = 0.0, float("nan")
    with pytest.raises(AssertionError, match="NaN/inf mismatch"):
        assert_close("o", moved.float(), ref)
    assert_close("o", ref.float(), ref)


def test_elementwise_flags_one_element():
    ref = _reference(INTERPRETER_SHAPE)
    wrong = ref.float().clone()
    wrong.view(-1)[7] += 0.01
    with pytest.raises(AssertionError, match="elementwise mismatch"):
        assert_close("y", wrong, ref, kind="elementwise")


def test_gradient_zero_in_exact_math_is_compared_at_the_call_scale():
    grads = [_reference((64, 32), seed=s) for s in range(3)]
    exact_zero = torch.zeros(64, 32, dtype=torch.float64)
    roundoff = 1e-8 * _reference((64, 32), seed=5)  # what cancelling fp32 terms of size ~1 leave
    with pytest.raises(AssertionError, match="RMS error ratio"):
        assert_close("dg", roundoff.float(), exact_zero)
    scale = gradient_scale([*grads, exact_zero])
    assert scale == pytest.approx(ZERO_GRADIENT_FRACTION * max(_rms(g) for g in grads))
    assert_close("dg", roundoff.float(), exact_zero, scale=scale)
    # a wrong gradient of a thousandth of the call's size is still caught
    with pytest.raises(AssertionError):
        assert_close("dg", (1e-3 * _reference((64, 32), seed=6)).float(), exact_zero, scale=scale)


def test_attention_floor_follows_the_call_scale():
    dv = _reference((8, 16))
    exact_zero = torch.zeros(8, 16, dtype=torch.float64)
    roundoff = (2e-7 * _reference((8, 16), seed=7)).float()
    with pytest.raises(AssertionError, match="max error"):
        assert_attention_close("dq", roundoff, exact_zero, exact_zero.float(), grad=True)
    peak = gradient_scale([dv, exact_zero], peak=True)
    assert peak == dv.abs().max().item()
    assert_attention_close("dq", roundoff, exact_zero, exact_zero.float(), grad=True, scale=peak)
    with pytest.raises(AssertionError, match="max error"):
        assert_attention_close("dq", (1e-4 * dv).float(), exact_zero, exact_zero.float(), grad=True, scale=peak)


def test_baseline_allows_three_times_plain_float32_error_and_no_more():
    expected = _reference((64, 32))
    noise = _reference((64, 32), seed=8)
    ratio = RECURRENCE_RMS_RATIO[torch.float32]
    baseline = expected + 2 * ratio * _rms(expected) * noise  # a plain float32 run: 2x the table's bound
    near = expected + 1.5 * BASELINE_FACTOR * ratio * _rms(expected) * noise  # 3x that baseline's error: 1.5/2
    far = expected + 2.5 * BASELINE_FACTOR * ratio * _rms(expected) * noise  # 2.5/2 of 3x the baseline's
    with pytest.raises(AssertionError, match="RMS error ratio"):
        assert_close("x", near.float(), expected)
    assert_close("x", near.float(), expected, baseline=baseline.float())
    with pytest.raises(AssertionError, match="RMS error ratio"):
        assert_close("x", far.float(), expected, baseline=baseline.float())


def test_baseline_does_not_hide_a_planted_error():
    expected = _reference(INTERPRETER_SHAPE)
    baseline = expected + 2 * RECURRENCE_RMS_RATIO[torch.float32] * _rms(expected) * _reference(INTERPRETER_SHAPE, 9)
    with pytest.raises(AssertionError):
        assert_close("o", _flip(expected, 1, typical=True).float(), expected, baseline=baseline.float())


def test_reduction_scale_is_the_largest_root_sum_square_of_the_terms():
    terms = torch.tensor([[3.0, -3.0], [4.0, 4.0]], dtype=torch.float64)  # column sums 7 and 1
    assert reduction_scale(terms, (1, 2)) == pytest.approx(5.0)
    assert reduction_scale(terms, (2, 1)) == pytest.approx(32 ** 0.5)
    # rms: the RMS over the gradient's elements of their root-sum-squares (sqrt(18) and sqrt(32))
    assert reduction_scale(terms, (2, 1), rms=True) == pytest.approx(5.0)
    assert reduction_scale(torch.tensor([[3.0, float("nan")], [4.0, 1.0]]), (1, 2)) == pytest.approx(5.0)
    # a sum that cancels to ~0 is compared at the size of its terms: an error of 1e-7 of them passes,
    # an error of 1e-4 of them does not
    exact = terms.sum(0, keepdim=True) * 0
    scale = reduction_scale(terms, exact.shape)
    assert_attention_close("d", exact.float() + 4e-7 * scale / 4, exact, exact.float(), grad=True, scale=scale)
    with pytest.raises(AssertionError, match="max error"):
        assert_attention_close("d", exact.float() + 1e-4 * scale, exact, exact.float(), grad=True, scale=scale)
