"""Optional dependencies, loaded in one place.

Each loader returns the module or ``None``; ``require_*`` raises an ImportError
that says how to fix the install.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType


@functools.cache
def _try_import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return None


def fla() -> ModuleType | None:
    """flash-linear-attention (``pip install fla-core``), used only as an oracle and a benchmark provider."""
    return _try_import("fla")


def flash_attn() -> ModuleType | None:
    """FlashAttention (``pip install flash-attn``), an optional benchmark provider and fast path for D <= 256."""
    return _try_import("flash_attn")


def compiled_extension() -> ModuleType | None:
    """``lamina._C``, built with ``LAMINA_BUILD_CUDA=1`` or ``LAMINA_BUILD_CPU=1``; when it is not
    installed and ``LAMINA_JIT=1``, the same sources compiled on first use (``lamina._jit``)."""
    ext = _try_import("lamina._C")
    if ext is None and os.environ.get("LAMINA_JIT") == "1":
        from lamina._jit import extension_or_none

        ext = extension_or_none()
    return ext


def _jit_error() -> str | None:
    """Why the ``LAMINA_JIT=1`` build failed, if it was tried."""
    if os.environ.get("LAMINA_JIT") != "1":
        return None
    from lamina._jit import last_error

    return last_error()


def require_compiled_extension() -> ModuleType:
    ext = compiled_extension()
    if ext is None:
        jit_error = _jit_error()
        raise ImportError(
            "lamina._C is not built. Reinstall with the extension: "
            "`LAMINA_BUILD_CUDA=1 pip install --no-build-isolation -e .` (CUDA and CPU kernels) or "
            "`LAMINA_BUILD_CPU=1 pip install --no-build-isolation -e .` (CPU kernels only), or set LAMINA_JIT=1 "
            "in an editable checkout to compile it on first use."
            + (f" ({jit_error})" if jit_error else "")
        )
    return ext


def require_fla() -> ModuleType:
    mod = fla()
    if mod is None:
        raise ImportError("fla is not installed: `pip install fla-core==0.6.0` (or `pip install -e .[test]`).")
    return mod
