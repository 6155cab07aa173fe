"""Test harness: seeds, interpreter mode, NaN-poisoned allocations, markers, a fresh process after a CUDA fault.

Without CUDA, Triton kernels run under the interpreter on CPU tensors; the
environment variable must be set before triton is imported, so it is set here,
at collection time, before any test module imports lamina.kernels.
"""

from __future__ import annotations

import os
import random

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from cuda_fault import pytest_runtest_logfinish, pytest_runtest_makereport  # noqa: E402,F401  (hooks)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if INTERPRET:
    # @triton.jit reads TRITON_INTERPRET when a kernel module is imported: import them all now, under the
    # interpreter, so that a test that first reaches one with TRITON_INTERPRET=0 (PyTorch dispatch) does
    # not leave compiled-mode kernels behind for the interpreter tests after it in the same process.
    import importlib
    import pkgutil

    import lamina.kernels

    for _module in pkgutil.iter_modules(lamina.kernels.__path__):
        importlib.import_module(f"lamina.kernels.{_module.name}")


# Tests that take minutes start first, so that under pytest-xdist no worker is left running one of them alone
# at the end (the static report compiles every kernel configuration: 2-4 minutes with a cold Triton cache; K = 512
# training of GDN-2 under the interpreter: about 45 s).
LONG_FIRST = ("test_static_report.py::test_kernel_configs_compile_without_spills",
              "test_bench_device_check.py::", "test_hrm_ext.py::test_cuda_", "test_training_with_keys_of_512")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not any(name in item.nodeid for name in LONG_FIRST))  # stable: the rest keep order
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_interp = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (set automatically when no CUDA device)")
    skip_slow = pytest.mark.skip(reason="slow under the interpreter (minutes on a CPU): LAMINA_SLOW=1 runs it")
    run_slow = os.environ.get("LAMINA_SLOW") == "1"
    for item in items:
        if "gpu" in item.keywords and not _HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpret" in item.keywords and not INTERPRET:
            item.add_marker(skip_interp)
        if "interpret" in item.keywords and "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)


# Under pytest-xdist every worker is a process of its own: intra-op threads on top of that oversubscribe
# the cores (measured: small-shape tests 10-40x slower with 2 workers x 2 threads on 2 cores).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
    yield


# torch caches its list of factory functions the first time a device context (``with torch.device(...)``)
# is used; build that cache with the real functions before ``torch.empty`` is patched, or the patched
# function lands in it and ``with torch.device("meta")`` silently allocates on the CPU.
import torch.utils._device  # noqa: E402

torch.utils._device._device_constructors()

_real_empty = torch.empty
_real_empty_like = torch.empty_like
_real_new_empty = torch.Tensor.new_empty


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() and t.numel():
        with torch.no_grad():  # a leaf created with requires_grad=True may not be filled in place otherwise
            t.fill_(float("nan"))
    return t


def _empty(*args, **kwargs):
    return _poison(_real_empty(*args, **kwargs))


def _empty_like(*args, **kwargs):
    return _poison(_real_empty_like(*args, **kwargs))


def _new_empty(self, *args, **kwargs):
    return _poison(_real_new_empty(self, *args, **kwargs))


@pytest.fixture(autouse=True)
def _nan_poisoned_allocations(monkeypatch):
    """Every ``torch.empty``/``empty_like``/``new_empty`` a test triggers is filled with NaN,
    so an output element a kernel forgets to write makes the comparison fail."""
    monkeypatch.setattr(torch, "empty", _empty)
    monkeypatch.setattr(torch, "empty_like", _empty_like)
    monkeypatch.setattr(torch.Tensor, "new_empty", _new_empty)
    yield
