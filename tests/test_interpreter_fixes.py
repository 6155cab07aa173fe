"""lamina.kernels._interpreter: device-function calls patch the language modules once per launch; the NumPy
type of a Triton type comes from a table; a tensor used as an integer converts as NumPy 2.4 allows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl


def _load_data_module(name: str):
    """A module from tests/data, loaded from its file (the workers' ``sys.path`` stays as it was)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / "data" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


core_only_helpers = _load_data_module("core_only_helpers")

pytestmark = pytest.mark.interpret


@triton.jit
def _square(x):
    return x * x


@triton.jit
def _plain_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1.0)


@triton.jit
def _helper_kernel(x_ptr, y_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    y = x + 1.0
    for _ in tl.static_range(CALLS):
        y += _square(x)
    tl.store(y_ptr + offs, y)


@triton.jit
def _core_only_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(y_ptr + offs, core_only_helpers.relu(tl.load(x_ptr + offs)))


def _count_patches(monkeypatch):
    """Calls of the interpreter's ``_patch_builtin`` (each ``_patch_lang`` makes a fixed number of them)."""
    from triton.runtime import interpreter as interp

    calls = []
    original = interp._patch_builtin
    monkeypatch.setattr(interp, "_patch_builtin", lambda *a: calls.append(a[0]) or original(*a))
    return calls


def test_helpers_do_not_patch_again_within_a_launch(monkeypatch):
    import lamina.kernels  # noqa: F401  (applies the fixes)

    x = torch.randn(4 * 16)
    calls = _count_patches(monkeypatch)
    y = torch.empty_like(x)
    _plain_kernel[(4,)](x, y, N=16)
    per_launch = len(calls)
    assert per_launch > 0 and torch.equal(y, x + 1)
    calls.clear()
    _helper_kernel[(4,)](x, y, N=16, CALLS=3)  # 12 helper calls: the interpreter alone would patch 13 times
    assert len(calls) == per_launch
    torch.testing.assert_close(y, x + 1 + 3 * x * x, rtol=1e-6, atol=1e-6)
    # the next launch patches again (the last one restored the modules when it ended)
    calls.clear()
    _helper_kernel[(4,)](x, y, N=16, CALLS=1)
    assert len(calls) == per_launch


def test_launch_restores_the_language_modules():
    import lamina.kernels  # noqa: F401

    before = {name: getattr(tl, name) for name in ("arange", "load", "where", "program_id")}
    methods = {name: getattr(tl.tensor, name) for name in ("__add__", "__mul__")}
    x = torch.randn(32)
    y = torch.empty_like(x)
    _helper_kernel[(2,)](x, y, N=16, CALLS=2)
    assert all(getattr(tl, name) is fn for name, fn in before.items())
    assert all(getattr(tl.tensor, name) is fn for name, fn in methods.items())


def test_a_helper_seeing_other_language_modules_is_patched(monkeypatch):
    """A helper whose module holds ``tl.core`` alone, called from a kernel whose module holds ``tl``: its call
    patches ``tl.core`` (which the launch did not), once, and computes the right result."""
    import lamina.kernels  # noqa: F401

    calls = _count_patches(monkeypatch)
    x = torch.randn(3 * 16)
    y = torch.empty_like(x)
    _core_only_kernel[(3,)](x, y, N=16)
    assert torch.equal(y, x.clamp_min(0))
    assert tl.core in calls  # the helper's module was patched
    core_patches = sum(1 for module in calls if module is tl.core)
    assert core_patches == 1, core_patches  # by its first call only, not by the other two programs'


SCALARS = ("int1", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "bfloat16",
           "float32", "float64", "float8e5", "float8e4nv")


def test_numpy_types_of_triton_types_are_the_interpreters():
    """The table's answers are the interpreter's own (scalars, blocks of them, pointers, blocks of pointers),
    the first time and from the table; bf16 is stored as uint16 and pointers as uint64 there."""
    from triton.runtime import interpreter as interp

    import lamina.kernels  # noqa: F401

    get, original = interp._get_np_dtype, interp._get_np_dtype.__wrapped__
    types = [getattr(tl, name) for name in SCALARS]
    types += [tl.block_type(t, [4, 8]) for t in types] + [tl.pointer_type(tl.float32)]
    types += [tl.block_type(tl.pointer_type(tl.bfloat16), [16])]
    for _ in range(2):
        assert [get(t) for t in types] == [original(t) for t in types]
    assert get(tl.bfloat16) == np.uint16 and get(tl.block_type(tl.float16, [2])) == np.float16
    assert get(tl.pointer_type(tl.int8)) == np.uint64
    with pytest.raises(KeyError):  # a type the interpreter has no NumPy type for raises as it did
        get(tl.void)


@triton.jit
def _runtime_bound_kernel(n_ptr, y_ptr, N: tl.constexpr):
    pid = tl.program_id(0)
    for i in range(tl.load(n_ptr + pid)):  # the bound is a tensor: the interpreter takes its __index__
        tl.store(y_ptr + pid * N + i, i + 1.0)


# NumPy 1.25 to 2.3 warn of the conversion Triton 3.6's interpreter made (pyproject.toml's filterwarnings makes
# the warning an error); NumPy 2.4 raises TypeError for it. Either fails the launch without the fix.
def test_loop_bound_loaded_at_run_time():
    import lamina.kernels  # noqa: F401

    before = tl.core.tensor.__dict__.get("__index__")
    n = torch.tensor([0, 3, 8, 1], dtype=torch.int32)
    y = torch.zeros(4 * 8)
    _runtime_bound_kernel[(4,)](n, y, N=8)
    expected = torch.zeros(4, 8)
    for row, count in enumerate(n.tolist()):
        expected[row, :count] = torch.arange(1, count + 1)
    assert torch.equal(y.view(4, 8), expected)
    assert tl.core.tensor.__dict__.get("__index__") is before  # the launch restores what it patched
