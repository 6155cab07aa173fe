"""The HRM gated update on a CUDA device: Triton and the CUDA C++ kernel against the float64 reference.

Skipped without a GPU (conftest); run by the device check on an H200.
"""

from __future__ import annotations

import pytest
import torch

from lamina._optional import compiled_extension
from lamina.ops.hrm_update import hrm_gated_update, resolve_backend
from lamina.reference.hrm import hrm_gated_update_ref
from tests.test_hrm_update import check_against_reference, make_inputs, run_op
from tests.tolerances import assert_close

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (shape, why): the benchmark width, a narrow width (several rows per program / one warp
# per row), a width above the Triton tile limits and the CUDA register layouts (column loops),
# and a width that is no multiple of 8 (scalar CUDA path, masked Triton columns).
SHAPES = [
    ((4, 256, 4096), "model width 4096"),
    ((2048, 64), "narrow rows"),
    ((5, 20000), "wide rows"),
    ((33, 1001), "odd width"),
]
GATE_CASES = [("channel", True, True), ("token", True, True), ("channel", False, False), ("token", True, False)]


def _cuda_ext_ready() -> bool:
    ext = compiled_extension()
    return ext is not None and getattr(ext, "WITH_CUDA", False)


def _backend_or_skip(backend: str) -> str:
    if backend == "cuda" and not _cuda_ext_ready():
        pytest.skip("lamina._C is not built with CUDA (LAMINA_BUILD_CUDA=1 pip install --no-build-isolation -e .)")
    return backend


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate, bias, norm", GATE_CASES)
@pytest.mark.parametrize("shape, why", SHAPES, ids=[w for _, w in SHAPES])
def test_gpu_matches_reference(shape, why, gate, bias, norm, dtype, backend):
    backend = _backend_or_skip(backend)
    inputs = make_inputs(shape, gate, bias, norm, dtype, device="cuda")
    check_against_reference(inputs, backend, dtype, norm)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("gate", ["channel", "token"])
def test_gpu_backward_is_deterministic(gate, backend):
    backend = _backend_or_skip(backend)
    inputs = make_inputs((8192, 1024), gate, True, True, torch.bfloat16, device="cuda")
    dy = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
    _, first = run_op(inputs, backend, dy)
    _, second = run_op(inputs, backend, dy)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_gpu_auto_dispatch_and_out():
    inputs = make_inputs((64, 512), "channel", True, True, torch.bfloat16, device="cuda")
    assert resolve_backend("auto", inputs) == ("auto" if _cuda_ext_ready() else "triton")
    check_against_reference(inputs, "auto", torch.bfloat16, True)
    out = torch.empty_like(inputs[0])
    y = hrm_gated_update(*inputs, out=out)
    assert y is out
    expected = hrm_gated_update_ref(*[t.cpu().double() for t in inputs])
    assert_close("out", out, expected, kind="elementwise", dtype=torch.bfloat16)


def test_gpu_float64_falls_back_to_triton():
    inputs = make_inputs((16, 96), "token", True, True, torch.float64, torch.float64, device="cuda")
    assert resolve_backend("auto", inputs) == "triton"
    check_against_reference(inputs, "auto", torch.float64, True)


def test_gpu_torch_compile_fullgraph():
    inputs = make_inputs((32, 256), "channel", True, True, torch.bfloat16, device="cuda")
    compiled = torch.compile(lambda *a: hrm_gated_update(*a, backend="triton"), fullgraph=True)
    eager = hrm_gated_update(*inputs, backend="triton")
    assert torch.equal(compiled(*inputs), eager)
