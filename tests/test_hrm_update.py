"""lamina.hrm_gated_update: Triton (interpreter) and PyTorch paths against the float64 reference,
gradients, determinism, out=, validation errors, torch.compile, and the byte/FLOP model."""

from __future__ import annotations

import pytest
import torch

from lamina.ops.hrm_update import hrm_gated_update, hrm_update_bytes, hrm_update_flops, resolve_backend
from lamina.reference.hrm import hrm_gated_update_ref
from tests.tolerances import assert_close

LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16)


def make_inputs(shape, gate, bias, norm, dtype, param_dtype=torch.float32, seed=0, device="cpu"):
    """h, c, gate logits in ``dtype``; bias and norm weight in ``param_dtype`` (as a module keeps them)."""
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    gd = d if gate == "channel" else 1
    h = torch.randn(shape, generator=g).to(device, dtype)
    c = torch.randn(shape, generator=g).to(device, dtype)
    logits = (2 * torch.randn((*shape[:-1], gd), generator=g)).to(device, dtype)
    b = torch.randn(gd, generator=g).to(device, param_dtype) if bias else None
    w = (1 + 0.5 * torch.randn(d, generator=g)).to(device, param_dtype) if norm else None
    return h, c, logits, b, w


def run_op(inputs, backend, dy):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    y = hrm_gated_update(*leaves, backend=backend)
    y.backward(dy)
    return y, [t.grad if t is not None else None for t in leaves]


def run_ref(inputs, dy):
    leaves = [t.detach().cpu().double().requires_grad_() if t is not None else None for t in inputs]
    y = hrm_gated_update_ref(*leaves)
    y.backward(dy.cpu().double())
    return y, [t.grad if t is not None else None for t in leaves]


def check_against_reference(inputs, backend, dtype, norm):
    dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)).to(inputs[0].device, dtype)
    y, grads = run_op(inputs, backend, dy)
    y_ref, grads_ref = run_ref(inputs, dy)
    assert y.dtype == dtype
    assert_close("y", y, y_ref, kind="elementwise", dtype=dtype)
    for name, grad, grad_ref, inp in zip(("dh", "dc", "dgate", "dbias", "dnorm_weight"), grads, grads_ref, inputs):
        if inp is None:
            assert grad is None
            continue
        assert grad.dtype == inp.dtype and grad.shape == inp.shape, name
        if name in ("dbias", "dnorm_weight"):
            # sums over all rows: compared as a reduction (RMS error ratio) at the accumulation precision
            assert_close(name, grad, grad_ref, kind="recurrence", dtype=torch.float32 if dtype != torch.float64
                         else torch.float64)
        elif norm:
            # the RMSNorm backward subtracts a row reduction (cancellation): RMS error ratio
            assert_close(name, grad, grad_ref, kind="recurrence", dtype=dtype)
        else:
            assert_close(name, grad, grad_ref, kind="elementwise", dtype=dtype)


CASES = [(gate, bias, norm) for gate in ("channel", "token") for bias in (True, False) for norm in (True, False)]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("gate, bias, norm", CASES)
def test_triton_matches_reference(gate, bias, norm, dtype):
    # 200 rows of 48: several row blocks per program of the persistent backward grid, masked columns
    check_against_reference(make_inputs((4, 50, 48), gate, bias, norm, dtype), "triton", dtype, norm)


@pytest.mark.interpret
@pytest.mark.parametrize("gate", ["channel", "token"])
def test_triton_float64(gate):
    check_against_reference(make_inputs((3, 5, 40), gate, True, True, torch.float64, torch.float64), "triton",
                            torch.float64, True)


@pytest.mark.interpret
@pytest.mark.parametrize("gate, norm", [("channel", True), ("token", True), ("channel", False)])
def test_triton_wide_rows_use_column_tiles(gate, norm):
    from lamina.kernels.hrm_update import MAX_BLOCK_D_FWD

    d = MAX_BLOCK_D_FWD + 72  # wider than one tile in both directions, not a multiple of the tile
    check_against_reference(make_inputs((3, d), gate, True, norm, torch.float32), "triton", torch.float32, norm)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("gate, bias, norm", CASES)
def test_torch_path_matches_reference(gate, bias, norm, dtype):
    check_against_reference(make_inputs((2, 7, 24), gate, bias, norm, dtype), "torch", dtype, norm)


@pytest.mark.parametrize("gate", ["channel", "token"])
def test_gradcheck_torch_path(gate):
    inputs = make_inputs((2, 3, 8), gate, True, True, torch.float64, torch.float64)
    leaves = tuple(t.requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(lambda *a: hrm_gated_update(*a, backend="torch"), leaves)


def test_reference_properties():
    h, c, logits, _, _ = make_inputs((4, 16), "token", False, False, torch.float64)
    # a per-token gate is the per-channel gate with its logit repeated over the row
    per_token = hrm_gated_update_ref(h, c, logits)
    assert_close("per token", per_token, hrm_gated_update_ref(h, c, logits.expand(4, 16)), kind="elementwise")
    # gate -> +inf keeps h, -inf keeps c; normalised rows have unit RMS with a unit weight
    assert torch.equal(hrm_gated_update_ref(h, c, torch.full_like(logits, 1e4)), h)
    assert torch.equal(hrm_gated_update_ref(h, c, torch.full_like(logits, -1e4)), c)
    y = hrm_gated_update_ref(h, c, logits, norm_weight=torch.ones(16, dtype=torch.float64), eps=0.0)
    assert_close("rms", y.pow(2).mean(-1), torch.ones(4, dtype=torch.float64), kind="elementwise")


@pytest.mark.interpret
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_parameter_gradients_are_deterministic(backend):
    inputs = make_inputs((6, 40, 32), "channel", True, True, torch.float32)
    dy = torch.randn(6, 40, 32)
    _, first = run_op(inputs, backend, dy)
    _, second = run_op(inputs, backend, dy)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.interpret
def test_zero_rows():
    h, c, logits, b, w = make_inputs((0, 16), "channel", True, True, torch.float32)
    for backend in ("triton", "torch"):
        y, grads = run_op((h, c, logits, b, w), backend, torch.zeros(0, 16))
        assert y.shape == (0, 16)
        assert torch.equal(grads[3], torch.zeros(16)) and torch.equal(grads[4], torch.zeros(16))


# --- out= ----------------------------------------------------------------------------------------

@pytest.mark.interpret
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_out_is_written_and_returned(backend):
    h, c, logits, b, w = make_inputs((3, 5, 16), "channel", True, True, torch.float32)
    expected = hrm_gated_update_ref(h, c, logits, b, w)
    out = torch.empty_like(h)
    assert hrm_gated_update(h, c, logits, b, w, out=out, backend=backend) is out
    assert_close("out", out, expected, kind="elementwise")
    # in place over h is allowed when nothing records a backward
    h_inplace = h.clone()
    hrm_gated_update(h_inplace, c, logits, b, w, out=h_inplace, backend=backend)
    assert_close("in place", h_inplace, expected, kind="elementwise")


@pytest.mark.interpret
def test_out_with_autograd_matches_functional():
    inputs = make_inputs((4, 24), "token", True, True, torch.float32)
    dy = torch.randn(4, 24)
    y_ref, grads_ref = run_op(inputs, "triton", dy)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = torch.empty(4, 24)
    y = hrm_gated_update(*leaves, out=out, backend="triton")
    assert y is out and y.grad_fn is not None
    y.backward(dy)
    assert torch.equal(out, y_ref.detach())
    for leaf, g in zip(leaves, grads_ref):
        assert torch.equal(leaf.grad, g)


def test_out_errors():
    h, c, logits, b, w = make_inputs((4, 8), "channel", True, True, torch.float32)
    with pytest.raises(ValueError, match="out must have the shape of h"):
        hrm_gated_update(h, c, logits, out=torch.empty(4, 9))
    with pytest.raises(ValueError, match="out must have the dtype of h"):
        hrm_gated_update(h, c, logits, out=torch.empty(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be contiguous"):
        hrm_gated_update(h, c, logits, out=torch.empty(8, 4).t())
    with pytest.raises(ValueError, match="out must not require grad"):
        hrm_gated_update(h, c, logits, out=torch.zeros(4, 8, requires_grad=True))
    hg = h.clone().requires_grad_()
    with pytest.raises(ValueError, match="out overlaps h, which the backward needs"):
        hrm_gated_update(hg, c, logits, out=hg.detach())
    cg = c.clone().requires_grad_()
    with pytest.raises(ValueError, match="out overlaps gate_logits"):
        hrm_gated_update(h, cg, logits, out=logits)
    buf = torch.zeros(5, 8)
    with pytest.raises(ValueError, match="out partially overlaps h"):
        hrm_gated_update(buf[:4], c, logits, out=buf[1:])
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        hrm_gated_update(h, c, logits, out=[0.0])


# --- validation ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"c": torch.zeros(1, 8)}, ValueError,
         r"c must have the shape of h \(4, 8\) \(no broadcasting\), got \(1, 8\)"),
        ({"gate_logits": torch.zeros(4, 4)}, ValueError, r"gate_logits must have shape \(4, 8\) \(per channel\) "
                                                         r"or \(4, 1\) \(per token\), got \(4, 4\)"),
        ({"gate_logits": torch.zeros(8)}, ValueError, "gate_logits must have shape"),
        ({"bias": torch.zeros(1)}, ValueError, r"bias must have shape \(8,\) to match the last dim of gate_logits"),
        ({"bias": torch.zeros(2, 8)}, ValueError, "bias must have 1 dimensions"),
        ({"norm_weight": torch.zeros(4)}, ValueError, r"norm_weight must have shape \(8,\), got \(4,\)"),
        ({"c": torch.zeros(4, 8, dtype=torch.float64)}, ValueError, "c must have the dtype of h"),
        ({"h": torch.zeros(4, 8, dtype=torch.int32)}, ValueError, "h must have dtype in"),
        ({"h": "x"}, TypeError, "h must be a torch.Tensor, got str"),
        ({"eps": -1.0}, ValueError, "eps must be a finite float >= 0"),
        ({"backend": "tpu"}, ValueError, "backend must be one of"),
    ],
)
def test_validation_errors_name_the_argument(kwargs, error, message):
    args = {"h": torch.zeros(4, 8), "c": torch.zeros(4, 8), "gate_logits": torch.zeros(4, 8), **kwargs}
    with pytest.raises(error, match=message):
        hrm_gated_update(**args)


def test_backend_resolution(monkeypatch):
    x = torch.zeros(2, 4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", [x]) == "triton"
    assert resolve_backend("torch", [x]) == "torch"
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA tensors"):
        resolve_backend("cuda", [x])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve_backend("auto", [x]) in ("torch", "cpu-ext")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", [x])


# --- torch.compile -------------------------------------------------------------------------------

@pytest.mark.versions
@pytest.mark.parametrize("gate", ["channel", "token"])
def test_torch_compile_fullgraph(gate):
    torch._dynamo.reset()
    inputs = make_inputs((3, 16), gate, True, True, torch.float32)
    dy = torch.randn(3, 16)
    y_eager, grads_eager = run_op(inputs, "torch", dy)
    compiled = torch.compile(lambda *a: hrm_gated_update(*a, backend="torch") * 2.0, fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = compiled(*leaves)
    y.backward(2.0 * dy)
    assert_close("y", y / 2.0, y_eager.detach(), kind="elementwise")
    for leaf, g in zip(leaves, grads_eager):
        assert_close("grad", leaf.grad, 4.0 * g, kind="recurrence")


# --- performance model ---------------------------------------------------------------------------

def test_bytes_and_flops_by_hand():
    # 8192 x 4096 bf16, per-channel gate with bias and norm (float32 params), forward:
    # reads h, c, gate (3 * 2 B per element) + bias, weight (2 * 4096 * 4 B); writes y (2 B) + rstd (8192 * 4 B)
    n, d = 8192, 4096
    fwd = 4 * 2 * n * d + 2 * d * 4 + n * 4
    assert hrm_update_bytes((n, d), torch.bfloat16) == fwd
    # backward reads dy, h, c, gate, rstd, bias, weight; writes dh, dc, dgate, dbias, dweight
    bwd = 4 * 2 * n * d + n * 4 + 2 * d * 4 + 3 * 2 * n * d + 2 * d * 4
    assert hrm_update_bytes((n, d), torch.bfloat16, mode="bwd") == bwd
    assert hrm_update_bytes((n, d), torch.bfloat16, mode="fwd+bwd") == fwd + bwd
    # per-token gate, no bias, no norm: h, c read + y written, gate N elements
    token = hrm_update_bytes((2, n, d), torch.float32, gate="token", bias=False, norm=False)
    assert token == (3 * 2 * n * d + 2 * n) * 4
    assert hrm_update_flops((n, d)) == 13 * n * d
    assert hrm_update_flops((n, d), norm=False, mode="bwd") == 17 * n * d
    with pytest.raises(ValueError, match="gate must be one of"):
        hrm_update_bytes((n, d), torch.float32, gate="row")
