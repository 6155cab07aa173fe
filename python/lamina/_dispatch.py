"""Which implementation runs an op (DESIGN.md, "Dispatch contract").

| tensors on | condition                                  | path                             |
|------------|--------------------------------------------|----------------------------------|
| CUDA       | default                                    | Triton (CUDA C++ where faster)   |
| CPU        | ``TRITON_INTERPRET=1`` or ``backend="triton"`` | Triton kernels, interpreted  |
| CPU        | default                                    | PyTorch (or ``lamina._C`` CPU)   |
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

import torch

BACKENDS = ("auto", "triton", "cuda", "torch")


def interpreter_enabled() -> bool:
    """True when Triton kernels run under the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def enable_interpreter() -> None:
    """Run lamina's Triton kernels on CPU tensors through the Triton interpreter.

    Must be called before ``lamina.kernels`` (and so triton's ``@jit``) is first imported,
    because triton chooses the interpreter when a kernel is decorated.
    """
    if "lamina.kernels" in sys.modules and not interpreter_enabled():
        raise RuntimeError(
            "enable_interpreter() was called after lamina.kernels was imported; set "
            "TRITON_INTERPRET=1 in the environment before importing lamina's kernels."
        )
    os.environ["TRITON_INTERPRET"] = "1"


def _device_of(tensors: Iterable[torch.Tensor | None]) -> torch.device:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    return devices.pop() if devices else torch.device("cpu")


def select_backend(
    op: str,
    backend: str,
    tensors: Iterable[torch.Tensor | None],
    has_cuda_kernel: bool = False,
) -> str:
    """Resolve ``backend`` for ``op`` on the device of ``tensors``: one of triton, cuda, torch.

    Raises ValueError for an unknown backend or one that cannot run on that device.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    device = _device_of(tensors)
    on_cuda = device.type == "cuda"
    if backend == "auto":
        if on_cuda:
            return "cuda" if has_cuda_kernel and _cuda_extension_ready() else "triton"
        return "triton" if interpreter_enabled() else "torch"
    if backend == "triton" and not on_cuda and not interpreter_enabled():
        raise ValueError(
            f"{op}: backend='triton' on {device.type} tensors needs the Triton interpreter; set "
            "TRITON_INTERPRET=1 before importing lamina (or call lamina._dispatch.enable_interpreter())"
        )
    if backend == "cuda":
        if not has_cuda_kernel:
            raise ValueError(f"{op}: backend='cuda' is not available for this op (no CUDA C++ kernel)")
        if not on_cuda:
            raise ValueError(f"{op}: backend='cuda' needs CUDA tensors, got {device.type} tensors")
        from lamina._optional import require_compiled_extension

        require_compiled_extension()
    return backend


def _cuda_extension_ready() -> bool:
    from lamina._optional import compiled_extension

    ext = compiled_extension()
    return ext is not None and getattr(ext, "WITH_CUDA", False)
