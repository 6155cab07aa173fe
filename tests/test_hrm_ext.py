"""The C++ side of the HRM gated update: the CPU kernel of lamina._C (when built) against the
reference, and compile checks of the CUDA sources that need no GPU (nvcc, and the torch binding)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from lamina._optional import compiled_extension
from lamina.ops.hrm_update import hrm_gated_update, resolve_backend
from tests.test_hrm_update import CASES, check_against_reference, make_inputs, run_op

CSRC = Path(__file__).resolve().parent.parent / "csrc"


def _ext_has_hrm() -> bool:
    return compiled_extension() is not None and hasattr(torch.ops.lamina_C, "hrm_update_fwd")


needs_ext = pytest.mark.skipif(
    not _ext_has_hrm(),
    reason="lamina._C is not built: `LAMINA_BUILD_CPU=1 pip install --no-build-isolation -e .` builds the CPU kernels",
)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gate, bias, norm", CASES)
def test_cpu_ext_matches_reference(gate, bias, norm, dtype):
    # 150 rows: three fixed chunks of the two-stage reduction, the last one partial
    check_against_reference(make_inputs((3, 50, 40), gate, bias, norm, dtype), "cpu-ext", dtype, norm)


@needs_ext
@pytest.mark.parametrize("gate", ["channel", "token"])
def test_cpu_ext_gradcheck(gate):
    inputs = make_inputs((2, 3, 8), gate, True, True, torch.float64, torch.float64)
    leaves = tuple(t.requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(lambda *a: hrm_gated_update(*a, backend="cpu-ext"), leaves)


@needs_ext
def test_cpu_ext_reductions_do_not_depend_on_threads():
    inputs = make_inputs((300, 64), "channel", True, True, torch.float32)
    dy = torch.randn(300, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, one = run_op(inputs, "cpu-ext", dy)
        torch.set_num_threads(2)
        _, two = run_op(inputs, "cpu-ext", dy)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


@needs_ext
def test_cpu_ext_in_place_and_auto(monkeypatch):
    h, c, logits, b, w = make_inputs((5, 24), "token", True, True, torch.float32)
    expected = hrm_gated_update(h, c, logits, b, w, backend="torch")
    inplace = h.clone()
    hrm_gated_update(inplace, c, logits, b, w, out=inplace, backend="cpu-ext")
    assert torch.allclose(inplace, expected, rtol=0, atol=1e-6)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve_backend("auto", [h]) == "cpu-ext"


def test_cpu_ext_backend_without_extension_says_how_to_build():
    if _ext_has_hrm():
        pytest.skip("lamina._C is built here; this checks the message when it is not")
    with pytest.raises(ImportError, match="LAMINA_BUILD_CPU=1"):
        hrm_gated_update(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4), backend="cpu-ext")


# --- compile checks that need no GPU -------------------------------------------------------------

def _nvcc() -> str | None:
    candidates = [shutil.which("nvcc")]
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            candidates.append(str(Path(root) / "bin" / "nvcc"))
    return next((c for c in candidates if c and Path(c).is_file()), None)


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cuda_kernels_compile_without_spills(tmp_path, arch):
    """Every entry function of the HRM CUDA kernels (forward and backward, every dtype and layout)
    compiles with 0 spill bytes (ptxas -v reports per entry)."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    obj = tmp_path / "hrm_update_kernel.o"
    result = subprocess.run(
        [nvcc, "-c", f"-arch={arch}", "-std=c++17", "-O3", "--use_fast_math", "-Xptxas", "-v",
         str(CSRC / "hrm_update_kernel.cu"), "-o", str(obj)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert obj.stat().st_size > 0
    entries = result.stderr.split("Compiling entry function")[1:]
    names = [e.split("'")[1] for e in entries]
    assert sum("fwd" in n for n in names) >= 2 * 3 and sum("bwd" in n for n in names) >= 2 * 3
    spilling = [n for n, e in zip(names, entries) if "0 bytes spill stores, 0 bytes spill loads" not in e]
    assert not spilling, spilling


def test_cuda_binding_compiles_against_torch_headers(tmp_path):
    """Syntax-check csrc/hrm_update_cuda.cpp as the CUDA build sees it (LAMINA_WITH_CUDA defined).

    torch's CPU wheel ships the c10/ATen CUDA headers but not the configure-time
    ``c10/cuda/impl/cuda_cmake_macros.h``; a one-line stand-in is written for this check.
    """
    from torch.utils.cpp_extension import include_paths

    gxx = shutil.which("g++")
    cuda_include = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    torch_include = Path(include_paths()[0])
    if gxx is None or not (cuda_include / "cuda_runtime_api.h").is_file():
        pytest.skip("needs g++ and the CUDA runtime headers (CUDA_HOME or /usr/local/cuda)")
    if not (torch_include / "c10" / "cuda" / "CUDAGuard.h").is_file():
        pytest.skip("this torch install ships no c10/cuda headers")
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cmd = [gxx, "-fsyntax-only", "-std=c++17", "-Wall", "-DLAMINA_WITH_CUDA",
           *[f"-I{p}" for p in include_paths()], f"-I{sysconfig.get_paths()['include']}", f"-I{cuda_include}",
           f"-I{tmp_path}", f"-I{CSRC}", str(CSRC / "hrm_update_cuda.cpp")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    # no diagnostic points into our file (torch's own headers may warn about the language standard)
    assert not re.search(r"hrm_update_cuda\.cpp:\d+:\d+: (warning|error)", result.stderr), result.stderr[-4000:]
