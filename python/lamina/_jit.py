"""``lamina._C`` compiled on first use from an editable checkout (``LAMINA_JIT=1``).

The same sources as ``setup.py``'s extension (``csrc/*.cpp``, plus ``csrc/*.cu`` when torch has
CUDA and nvcc is found), built by ``torch.utils.cpp_extension.load`` into torch's extension cache
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and reused while the sources are
unchanged. Loading it registers the ``lamina_C`` ops exactly as ``import lamina._C`` does, so it is
used only when ``lamina._C`` is not installed (``lamina._optional.compiled_extension``): both at
once would register the ops twice.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

JIT_ENV = "LAMINA_JIT"
MODULE_NAME = "lamina_C_jit"
# setup.py's flags, plus OpenMP so that at::parallel_for in the CPU kernels runs on torch's threads.
CXX_FLAGS = ["-O3", "-std=c++17", "-fopenmp"]
NVCC_FLAGS = ["-O3", "-std=c++17", "--use_fast_math"]

_errors: list[str] = []


def csrc_dir() -> Path | None:
    """``csrc/`` of the checkout lamina is imported from, or None (an installed wheel has none)."""
    root = Path(__file__).resolve().parents[2]
    csrc = root / "csrc"
    return csrc if (csrc / "bindings.cpp").is_file() else None


def _with_cuda() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None


@functools.cache
def load_extension(verbose: bool = False) -> ModuleType:
    """Compile (or reuse) and load the extension; ImportError saying why when it cannot."""
    from torch.utils.cpp_extension import load

    csrc = csrc_dir()
    if csrc is None:
        raise ImportError(f"{JIT_ENV}=1 needs an editable checkout with csrc/ (none beside {__file__})")
    with_cuda = _with_cuda()
    sources = sorted(str(p) for p in csrc.glob("*.cpp"))
    defines = []
    if with_cuda:
        sources += sorted(str(p) for p in csrc.glob("*.cu"))
        defines = ["-DLAMINA_WITH_CUDA=1"]
    try:
        return load(name=MODULE_NAME, sources=sources, extra_cflags=CXX_FLAGS + defines,
                    extra_cuda_cflags=NVCC_FLAGS + defines, extra_ldflags=["-fopenmp"], with_cuda=with_cuda,
                    verbose=verbose)
    except Exception as exc:  # noqa: BLE001 - a compiler or toolchain failure: report it as an import failure
        raise ImportError(f"{JIT_ENV}=1: compiling csrc/ failed: {type(exc).__name__}: {exc}") from exc


def extension_or_none() -> ModuleType | None:
    """``load_extension()``, or None with the reason kept for ``last_error()``."""
    try:
        return load_extension()
    except ImportError as exc:
        if not _errors:
            _errors.append(str(exc))
        return None


def last_error() -> str | None:
    return _errors[-1] if _errors else None
