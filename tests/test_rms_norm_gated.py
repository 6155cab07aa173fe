"""RMSNorm and the gated RMSNorm (``rms_norm``, ``rms_norm_gated``, ``RMSNorm``, ``FusedRMSNormGated``):
Triton (interpreter) and PyTorch paths against the float64 reference with every gradient, the
residual / prenorm stream, wide rows in column tiles, determinism, the custom ops' registrations,
and errors. fla checkpoint parity: test_fla_module_parity.py."""

from __future__ import annotations

import pytest
import torch

from lamina.layers.norm import FusedRMSNormGated, RMSNorm
from lamina.ops.rms_norm_gated import l2_norm, rms_norm, rms_norm_gated
from lamina.reference.norm import l2_norm_ref, rms_norm_gated_ref, rms_norm_ref
from tests.tolerances import assert_close

# 3 x 11 = 33 rows of 48: several row blocks per program of the backward's persistent grid, masked columns.
SHAPE = (3, 11, 48)
NAMES = ("dx", "dg", "dweight", "dbias", "dresidual")  # gradients of (x, g, weight, bias, residual)


def make_inputs(shape, dtype, gate, weight=True, bias=False, residual=False, residual_dtype=None, seed=0):
    """x, g, weight, bias, residual; weight and bias in float32 (module parameters)."""
    gen = torch.Generator().manual_seed(seed)
    d = shape[-1]
    x = (2 * torch.randn(shape, generator=gen)).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype) if gate else None
    w = (1 + 0.5 * torch.randn(d, generator=gen)) if weight else None
    b = torch.randn(d, generator=gen) if bias else None
    r = torch.randn(shape, generator=gen).to(residual_dtype or dtype) if residual else None
    return x, g, w, b, r


def call(fn, leaves, activation, prenorm, residual_in_fp32, eps, **kwargs):
    x, g, w, b, r = leaves
    if activation is None:
        return fn[0](x, w, b, residual=r, eps=eps, prenorm=prenorm, residual_in_fp32=residual_in_fp32, **kwargs)
    return fn[1](x, g, w, b, activation=activation, residual=r, prenorm=prenorm, residual_in_fp32=residual_in_fp32,
                 eps=eps, **kwargs)


def run(fn, inputs, activation, prenorm, residual_in_fp32, cotangents=None, eps=1e-5, **kwargs):
    """(outputs, gradients, cotangents) for the loss <y, dy> (+ <residual_out, dres>)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    out = call(fn, leaves, activation, prenorm, residual_in_fp32, eps, **kwargs)
    outs = out if prenorm else (out,)
    if cotangents is None:
        gen = torch.Generator().manual_seed(1)
        cotangents = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
    sum(((o.double() * c.double()).sum() for o, c in zip(outs, cotangents))).backward()
    return outs, [t.grad if t is not None else None for t in leaves], cotangents


OPS = (rms_norm, rms_norm_gated)
REFS = (rms_norm_ref, rms_norm_gated_ref)


def check(inputs, backend, activation, prenorm=False, residual_in_fp32=False):
    x, g, w, b, r = inputs
    outs, grads, cot = run(OPS, inputs, activation, prenorm, residual_in_fp32, backend=backend)
    inputs64 = [t.double() if t is not None else None for t in inputs]
    outs_ref, grads_ref, _ = run(REFS, inputs64, activation, prenorm, residual_in_fp32, cot)
    assert outs[0].dtype == x.dtype
    assert_close("y", outs[0], outs_ref[0], kind="elementwise", dtype=x.dtype)
    if prenorm:
        expected_dtype = r.dtype if r is not None else (torch.float32 if residual_in_fp32 else x.dtype)
        assert outs[1].dtype == expected_dtype
        assert_close("residual_out", outs[1], outs_ref[1], kind="elementwise", dtype=expected_dtype)
    for name, inp, grad, grad_ref in zip(NAMES, inputs, grads, grads_ref):
        if inp is None:
            assert grad is None, name
            continue
        assert grad is not None and grad.dtype == inp.dtype and grad.shape == inp.shape, name
        if name in ("dweight", "dbias"):  # sums over rows, accumulated in float32
            assert_close(name, grad, grad_ref, kind="recurrence", dtype=torch.float32)
        else:  # the norm's backward subtracts a row reduction (cancellation): RMS error ratio
            assert_close(name, grad, grad_ref, kind="recurrence", dtype=inp.dtype)


# (activation, weight, bias, residual, prenorm, residual_in_fp32, dtype, residual dtype)
CASES = [
    (None, True, True, True, True, False, torch.float32, None),
    (None, True, False, False, False, False, torch.bfloat16, None),
    (None, False, False, False, True, True, torch.bfloat16, None),
    ("swish", True, False, False, False, False, torch.bfloat16, None),
    ("sigmoid", True, True, True, True, False, torch.float32, None),
    ("silu", False, False, True, True, False, torch.float16, torch.float32),
]


@pytest.mark.interpret
@pytest.mark.parametrize("activation, weight, bias, residual, prenorm, fp32_res, dtype, res_dtype", CASES)
def test_triton_matches_reference(activation, weight, bias, residual, prenorm, fp32_res, dtype, res_dtype):
    inputs = make_inputs(SHAPE, dtype, activation is not None, weight, bias, residual, res_dtype)
    check(inputs, "triton", activation, prenorm, fp32_res)


@pytest.mark.parametrize("activation, weight, bias, residual, prenorm, fp32_res, dtype, res_dtype", CASES)
def test_torch_matches_reference(activation, weight, bias, residual, prenorm, fp32_res, dtype, res_dtype):
    inputs = make_inputs(SHAPE, dtype, activation is not None, weight, bias, residual, res_dtype)
    check(inputs, "torch", activation, prenorm, fp32_res)


@pytest.mark.interpret
@pytest.mark.parametrize("activation", [None, "swish"])
def test_triton_wide_rows_use_column_tiles(activation):
    from lamina.kernels.rms_norm_gated import MAX_BLOCK_D_FWD

    d = MAX_BLOCK_D_FWD + 72  # wider than one tile forward and backward, not a multiple of either
    inputs = make_inputs((4, d), torch.float32, activation is not None, True, True, True)
    check(inputs, "triton", activation, prenorm=True)


@pytest.mark.interpret
def test_triton_backward_is_deterministic():
    inputs = make_inputs(SHAPE, torch.float32, True, True, True, True)
    first = run(OPS, inputs, "swish", True, False, backend="triton")[1]
    second = run(OPS, inputs, "swish", True, False, backend="triton")[1]
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


def test_prenorm_without_residual_returns_the_input_stream():
    """fla returns x itself as the residual stream (float32 with residual_in_fp32)."""
    x, _, w, _, _ = make_inputs(SHAPE, torch.bfloat16, False)
    y, res = rms_norm(x, w, prenorm=True, backend="torch")
    assert res is x
    y32, res32 = rms_norm(x, w, prenorm=True, residual_in_fp32=True, backend="torch")
    assert res32.dtype == torch.float32 and torch.equal(res32, x.float()) and torch.equal(y32, y)


@pytest.mark.interpret
def test_auto_runs_float64_on_the_torch_path():
    x, g, w, _, _ = make_inputs(SHAPE, torch.float64, True)
    y = rms_norm_gated(x, g, w, backend="auto")
    assert_close("y", y, rms_norm_gated_ref(x, g, w), kind="elementwise", dtype=torch.float64)
    with pytest.raises(ValueError, match="the Triton kernels take float32/float16/bfloat16"):
        rms_norm_gated(x, g, w, backend="triton")


@pytest.mark.versions
@pytest.mark.interpret
def test_custom_ops_pass_opcheck():
    """Schema, autograd registration, fake implementation and AOT dispatch of the Triton path's op."""
    x, g, w, b, r = (t.requires_grad_() for t in make_inputs((6, 16), torch.float32, True, True, True, True))
    results = torch.library.opcheck(torch.ops.lamina.rms_norm_fwd.default, (x, r, g, w, b, 1e-5, "swish",
                                                                            torch.float32, "rms"))
    assert all(v == "SUCCESS" for v in results.values()), results
    results = torch.library.opcheck(torch.ops.lamina.rms_norm_fwd.default, (x, None, None, None, None, 1e-6, "none",
                                                                            None, "l2"))
    assert all(v == "SUCCESS" for v in results.values()), results


# --- the L2 norm (the same kernels, the sum of squares in place of the mean) -----------------------

@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.interpret), "torch"])
@pytest.mark.parametrize("dtype, shape", [
    (torch.float32, SHAPE),
    (torch.bfloat16, (5, 2, 128)),
    (torch.float16, (9, 64)),
    (torch.float32, (2, 8192 + 72)),  # wider than one tile forward (8192) and backward (4096)
])
def test_l2_norm_matches_reference(backend, dtype, shape):
    x = make_inputs(shape, dtype, False)[0].requires_grad_()
    xd = x.detach().double().requires_grad_()
    y, y_ref = l2_norm(x, backend=backend), l2_norm_ref(xd)
    assert y.dtype == dtype
    assert_close("y", y, y_ref, kind="elementwise", dtype=dtype)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (dx,), (dx_ref,) = torch.autograd.grad(y, x, dy), torch.autograd.grad(y_ref, xd, dy.double())
    assert dx.dtype == dtype
    # the backward subtracts y * sum(dy * y) (cancellation): RMS error ratio, as for RMSNorm's dx
    assert_close("dx", dx, dx_ref, kind="recurrence", dtype=dtype)


@pytest.mark.interpret
def test_l2_norm_is_not_rms_norm():
    # the two statistics differ by the factor D; a kernel that took the mean would be off by sqrt(D)
    x = make_inputs((4, 64), torch.float32, False)[0]
    y = l2_norm(x, backend="triton")
    assert_close("row norms", y.norm(dim=-1), torch.ones(4), kind="elementwise", dtype=torch.float32)
    assert_close("rms", rms_norm(x, None, backend="triton").pow(2).mean(-1), torch.ones(4), kind="elementwise",
                 dtype=torch.float32)


# --- the layers -----------------------------------------------------------------------------------

def test_layers_call_the_ops():
    x, g, w, _, r = make_inputs(SHAPE, torch.float32, True, residual=True)
    norm = RMSNorm(SHAPE[-1], eps=1e-6)
    gated = FusedRMSNormGated(SHAPE[-1], activation="sigmoid")
    with torch.no_grad():
        norm.weight.copy_(w)
        gated.weight.copy_(w)
    y, res = norm(x, residual=r, prenorm=True)
    y_ref, res_ref = rms_norm_ref(x.double(), w.double(), residual=r.double(), eps=1e-6, prenorm=True)
    assert_close("y", y, y_ref, kind="elementwise")
    assert_close("residual_out", res, res_ref, kind="elementwise")
    assert_close("gated", gated(x, g), rms_norm_gated_ref(x.double(), g.double(), w.double(), None, "sigmoid",
                                                          eps=1e-5), kind="elementwise")
    assert norm(x).shape == x.shape


# --- bad inputs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("change, error, message", [
    (dict(x=[1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
    (dict(g=torch.randn(3, 47)), ValueError, "g must have the shape of x"),
    (dict(weight=torch.randn(47)), ValueError, r"weight must have shape \(48,\)"),
    (dict(bias=torch.randn(48, 1)), ValueError, "bias must have 1 dimensions"),
    (dict(residual=torch.randn(2, 48)), ValueError, "residual must have the shape of x"),
    (dict(eps=-1.0), ValueError, "eps must be a finite float >= 0"),
    (dict(activation="relu"), ValueError, "activation must be one of"),
    (dict(prenorm="yes"), TypeError, "prenorm must be a bool"),
    (dict(backend="cudnn"), ValueError, "backend must be one of"),
    (dict(x=torch.randn(3, 48, dtype=torch.float64), g=torch.randn(3, 48, dtype=torch.float64), backend="cuda"),
     ValueError, "backend='cuda' is not available"),
])
def test_rms_norm_gated_rejects_bad_inputs(change, error, message):
    kwargs = dict(x=torch.randn(3, 48), g=torch.randn(3, 48), weight=torch.ones(48), bias=None, backend="torch")
    kwargs.update(change)
    with pytest.raises(error, match=message):
        rms_norm_gated(**kwargs)


def test_layers_reject_bad_arguments():
    with pytest.raises(ValueError, match="activation must be one of"):
        FusedRMSNormGated(48, activation="relu")
    with pytest.raises(ValueError, match=r"weight must have shape \(48,\)"):
        RMSNorm(47)(torch.randn(2, 48))
