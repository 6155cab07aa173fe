"""The central tolerance table (STYLE.md rule 7) and the one ``assert_close`` every test and ``lamina fuzz`` use.

Three kinds of check, each with its justification:

* ``recurrence``: chunked/recurrent delta-rule kernels against a float64 reference.
  Measured as the RMS error ratio ``rms(actual - ref) / rms(ref)`` (fla's
  ``assert_close``), because individual elements of a long recurrence can be tiny
  and their relative error meaningless. The reference runs on the *same quantised
  inputs* in float64, so what remains is the rounding of intermediate casts: dot
  operands rounded to the input dtype (unit roundoff u: fp16 4.9e-4, bf16 3.9e-3)
  and fp32 accumulation. Each cast contributes about u; a handful of chained casts
  in the chunk pipeline gives the bound of ~4-5 u below. fp32 keeps 2e-5 because the
  triangular solve and the state pass compound ~1e-7 rounding over tens of chunks.
* ``attention``: the FlashAttention rule: the kernel's error against the float64
  reference must be at most ``factor`` times PyTorch's own error when it computes in
  the same low precision (2x outputs, 3x gradients), plus a small absolute floor.
* ``elementwise``: plain rtol/atol per dtype for one-pass ops (a few roundings).

Two measures for results whose exact value is small next to the terms that make it:

* ``reduction_scale``: a gradient that sums many terms (a per-head or per-channel parameter, a
  per-token gate) is compared relative to the root-sum-square of its terms, the size the sum would
  have without cancellation; each term carrying relative error e gives the sum an error of about
  e times that, so the bound asks of every term what it asks of any other gradient. For a gradient
  of many elements (``rms=True``: q's and k's, summed over the value heads that share them) the RMS of
  the elements' root-sum-squares, the measure of the RMS check; without cancellation it is about the
  gradient's own RMS, so only a cancelling sum is compared at its terms' size.
* ``baseline`` (float32 recurrences, and float32 attention gradients against FlashAttention's backward
  written out, ``assert_attention_close``): the FlashAttention rule carried over. Where the RMS-ratio row
  cannot hold because the problem itself is ill-conditioned in float32 (a gradient that scale
  invariance makes nearly zero, a cancelling sum), the error may also be up to
  ``BASELINE_FACTOR`` times that of a plain float32 implementation of the same math (a naive
  ``lamina.reference`` function, never the code under test). The check takes the larger of the
  table's bound and this one.
"""

from __future__ import annotations

import torch

# RMS error ratio bounds for recurrences (see module docstring for the derivation).
RECURRENCE_RMS_RATIO: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 2.5e-3,
    torch.bfloat16: 2e-2,
}

# A gradient that is zero (or tiny) in exact math, e.g. dg of a decay applied to a zero state, comes
# out as roundoff of the terms that cancel in it, which are of the size of the call's other
# gradients. Such a gradient is compared relative to this fraction of the largest RMS among the
# call's reference gradients (``gradient_scale``): 1e-2 of it times the fp32 RMS bound is ~3 ulps
# of the call's gradients, far below any error a wrong formula makes.
ZERO_GRADIENT_FRACTION = 1e-2

# Worst-element bound for recurrences: max abs error relative to max|ref| (4x the RMS bound; see above).
RECURRENCE_MAX_RATIO: dict[torch.dtype, float] = {dt: 4 * r for dt, r in RECURRENCE_RMS_RATIO.items()}

# A float32 result may be this many times as far from float64 as a plain float32 implementation of the
# same math (FlashAttention's factor for gradients); see ``baseline`` in the module docstring.
BASELINE_FACTOR = 3.0

# Element-wise (rtol, atol) for single-pass ops: ~4 u for rtol, atol for values near 0.
ELEMENTWISE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 8e-3),
}

# FlashAttention-style bound: multiples of PyTorch's own low-precision error.
ATTENTION_FACTOR_OUTPUT = 2.0
ATTENTION_FACTOR_GRAD = 3.0
# Floor for the attention bound, in units of the dtype's unit roundoff times rms(ref), so that a
# case where PyTorch is exact (e.g. fp32 with tiny shapes) does not demand an exact kernel.
ATTENTION_FLOOR_ULPS = 4.0

UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def _rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item() if x.numel() else 0.0


def gradient_scale(references: list[torch.Tensor | None], peak: bool = False) -> float:
    """``ZERO_GRADIENT_FRACTION`` times the largest RMS (``peak``: the largest magnitude, unscaled, for
    ``assert_attention_close``) among a call's reference gradients (``None`` entries skipped)."""
    values = [x.detach().double() for x in references if x is not None and x.numel()]
    if not values:
        return 0.0
    finite = [x[torch.isfinite(x)] for x in values]
    if peak:
        return max((x.abs().max().item() for x in finite if x.numel()), default=0.0)
    return ZERO_GRADIENT_FRACTION * max(_rms(x) for x in finite)


def reduction_scale(terms: torch.Tensor, shape: torch.Size | tuple[int, ...], rms: bool = False) -> float:
    """The largest root-sum-square of the terms that sum to a gradient of ``shape``; with ``rms``, the RMS
    of the root-sum-squares over the gradient's elements (the size of the RMS error a gradient with many
    elements may have, for the RMS check of ``assert_close``).

    ``terms`` holds every summand (e.g. the float64 gradient of a parameter broadcast to the full
    input shape), ``shape`` the gradient's shape (broadcastable from ``terms``). Pass the result as
    ``scale`` to ``assert_close``/``assert_attention_close``.
    """
    t = terms.detach().double()
    t = torch.where(torch.isfinite(t), t, 0.0)
    if t.numel() == 0:
        return 0.0
    squares = t.pow(2).sum_to_size(shape)
    return squares.mean().sqrt().item() if rms else squares.sqrt().max().item()


def _first_diff(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> str:
    bad = ((actual - expected).abs() > bound).nonzero()
    if bad.numel() == 0:
        return "none"
    idx = tuple(bad[0].tolist())
    return f"{idx}: actual {actual[idx].item():.6g} vs expected {expected[idx].item():.6g}"


def _check_finite_match(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Non-finite elements must sit at the same places, and something finite must be left to compare.

    Two all-NaN tensors agree on where their NaNs are but say nothing about the kernel, so they fail;
    a test of NaN propagation asserts ``isnan`` itself.
    """
    a_bad = ~torch.isfinite(actual)
    e_bad = ~torch.isfinite(expected)
    if not torch.equal(a_bad, e_bad):
        where = (a_bad ^ e_bad).nonzero()[0].tolist()
        raise AssertionError(
            f"{name}: NaN/inf mismatch ({int(a_bad.sum())} non-finite in actual, "
            f"{int(e_bad.sum())} in expected), first at {tuple(where)}"
        )
    if expected.numel() and bool(e_bad.all()):
        raise AssertionError(f"{name}: every element of both tensors is NaN/inf; nothing finite to compare")


def assert_close(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    kind: str = "recurrence",
    dtype: torch.dtype | None = None,
    ratio: float | None = None,
    scale: float | None = None,
    baseline: torch.Tensor | None = None,
) -> None:
    """Compare ``actual`` with ``expected`` (usually a float64 reference).

    ``kind`` is ``"recurrence"`` (RMS error ratio and worst element against ``max|expected|``) or
    ``"elementwise"`` (rtol/atol on every element). ``dtype`` selects the row of the table (default:
    ``actual.dtype``); ``ratio`` overrides the recurrence RMS bound (the worst-element bound follows
    at 4x) only where a test documents why. ``scale`` is a magnitude below which a recurrence
    comparison turns absolute (both bounds are taken relative to ``max(rms or max|expected|, scale)``):
    pass ``gradient_scale(...)`` for gradients that can be zero in exact math. Non-finite elements
    must match in place, and two tensors with nothing finite in them fail. ``baseline`` (recurrences
    only): the same result computed plainly in float32 by a naive reference; both bounds then grow to
    ``BASELINE_FACTOR`` times the baseline's own error where that is larger (module docstring).
    The message reports the RMS ratio, the max abs error and the first differing index.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    dtype = dtype or actual.dtype
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    _check_finite_match(name, a, e)
    finite = torch.isfinite(e)
    a, e = a[finite], e[finite]
    err = (a - e).abs()
    max_err = err.max().item() if err.numel() else 0.0
    floor = 1e-30 if scale is None else max(scale, 1e-30)
    rms_ratio = _rms(a - e) / max(_rms(e), floor)
    if kind == "recurrence":
        bound = RECURRENCE_RMS_RATIO[dtype] if ratio is None else ratio
        peak = max(e.abs().max().item() if e.numel() else 0.0, floor)
        max_bound = (RECURRENCE_MAX_RATIO[dtype] if ratio is None else 4 * ratio) * peak
        if baseline is not None:
            b = baseline.detach().double().cpu()
            if b.shape != expected.shape:
                raise AssertionError(f"{name}: baseline shape {tuple(b.shape)} != expected {tuple(expected.shape)}")
            b = b[finite]
            b_err = (b - e).abs()
            if bool(torch.isfinite(b_err).all()):
                bound = max(bound, BASELINE_FACTOR * _rms(b - e) / max(_rms(e), floor))
                max_bound = max(max_bound, BASELINE_FACTOR * (b_err.max().item() if b_err.numel() else 0.0))
        if not rms_ratio <= bound:
            raise AssertionError(
                f"{name}: RMS error ratio {rms_ratio:.3e} > {bound:.1e} ({dtype}); max abs err {max_err:.3e}; "
                f"rms(expected) {_rms(e):.3e}"
            )
        if not max_err <= max_bound:
            first = _first_diff(actual.detach().double().cpu(), expected.detach().double().cpu(),
                                torch.tensor(max_bound, dtype=torch.float64))
            raise AssertionError(
                f"{name}: worst element off by {max_err:.3e} > {max_bound:.3e} = {max_bound / peak:.1e}"
                f" x max|expected| ({dtype}); RMS ratio {rms_ratio:.3e} (within bound); first at {first}"
            )
    elif kind == "elementwise":
        rtol, atol = ELEMENTWISE[dtype]
        allowed = atol + rtol * e.abs()
        if not bool((err <= allowed).all()):
            first = _first_diff(actual.detach().double().cpu(), expected.detach().double().cpu(),
                                atol + rtol * expected.detach().double().cpu().abs())
            raise AssertionError(
                f"{name}: elementwise mismatch ({dtype}, rtol={rtol}, atol={atol}); max abs err {max_err:.3e}; "
                f"RMS ratio {rms_ratio:.3e}; first at {first}"
            )
    else:
        raise ValueError(f"unknown kind {kind!r}")


def assert_attention_close(
    name: str,
    actual: torch.Tensor,
    reference64: torch.Tensor,
    torch_lowp: torch.Tensor,
    grad: bool = False,
    dtype: torch.dtype | None = None,
    scale: float | None = None,
    baseline: torch.Tensor | None = None,
    score_peak: float = 0.0,
) -> None:
    """FlashAttention's rule: ``max|actual - ref| <= factor * max|torch_lowp - ref| + floor``.

    ``torch_lowp`` is PyTorch's own result computed in the low precision under test. The floor is
    ``ATTENTION_FLOOR_ULPS`` units of roundoff of ``max(max|ref|, scale)``: pass the largest
    magnitude of the call's gradients as ``scale`` where one gradient can be zero in exact math
    (one key: dq = dk = 0, which the softmax backward's ``dP - rowsum(dO * O)`` leaves as roundoff).
    ``baseline`` (float32, as for recurrences): the same result by a plain float32 implementation of the
    kernels' own formulas (``lamina.reference.attention_grads_ref``); PyTorch's error is then the larger of
    its autograd's and the baseline's. ``score_peak``: a bound on the scores' size and on that of the terms
    they sum, ``scale * max|q_i| * max|k_j|`` (row norms). The kernels' backward forms the probabilities
    again, ``exp(s - lse)``, with ``s`` rounded in float32 apart from the forward's ``lse`` (where a row sees
    one key, PyTorch's ``P`` is 1 exactly and the kernels' is off by ulps of those terms), so the floor adds
    ``ATTENTION_FLOOR_ULPS`` float32 units of roundoff of ``score_peak`` times the same magnitude:
    negligible next to a 16-bit floor.
    """
    dtype = dtype or actual.dtype
    a = actual.detach().double().cpu()
    r = reference64.detach().double().cpu()
    p = torch_lowp.detach().double().cpu()
    _check_finite_match(name, a, r)
    factor = ATTENTION_FACTOR_GRAD if grad else ATTENTION_FACTOR_OUTPUT
    ours = (a - r).abs().max().item()
    theirs = (p - r).abs().max().item()
    if baseline is not None:
        theirs = max(theirs, (baseline.detach().double().cpu() - r).abs().max().item())
    peak = r.abs().max().item() if r.numel() else 0.0
    roundoff = UNIT_ROUNDOFF[dtype] + UNIT_ROUNDOFF[torch.float32] * score_peak
    floor = ATTENTION_FLOOR_ULPS * roundoff * max(peak, scale or 0.0, 1e-30)
    bound = factor * theirs + floor
    if not ours <= bound:
        raise AssertionError(
            f"{name}: max error {ours:.3e} > {factor}x PyTorch's {theirs:.3e} + floor {floor:.1e} ({dtype})"
        )


# Hypothesis strategies of fuzz cases for users' own tests (``lamina._strategies``; needs hypothesis).
_STRATEGIES = ("attention_cases", "cases", "check_case", "delta_rule_cases", "layer_cases")


def __getattr__(name: str):
    if name in _STRATEGIES:
        from lamina import _strategies

        return getattr(_strategies, name)
    raise AttributeError(f"module 'lamina.testing' has no attribute {name!r}")
