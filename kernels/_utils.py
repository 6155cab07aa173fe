"""Shared helpers for lamina's Triton kernels: interpreter mode, autotuning, the AOT registry."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import triton

# Read once, before any kernel is decorated: ``@triton.jit`` picks the interpreter at decoration time.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotune(
    configs: Sequence[triton.Config],
    key: list[str],
    interpret_config: triton.Config | None = None,
    **kwargs: Any,
) -> Callable:
    """``triton.autotune`` that keeps one config under the interpreter.

    The interpreter cannot benchmark (more than one config fails with
    "0 active drivers"), so it runs ``interpret_config`` (default: the first).
    Keys must name dims and dtypes only, never T or the number of sequences,
    so a varlen batch does not retune.
    """
    if INTERPRET:
        configs = [interpret_config or configs[0]]
    return triton.autotune(configs=list(configs), key=key, **kwargs)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


FP_FUSION_ENV = "TRITON_DEFAULT_FP_FUSION"
# Environment variables that change what Triton compiles: FP fusion (lamina's launches ask for it unless the first
# is set: ``fp_fusion``), the float32 products' precision, and ptxas's options. Results records and ``lamina info``
# name those set.
TRITON_ENV = (FP_FUSION_ENV, "TRITON_FORCE_DISABLE_FP_FUSION", "TRITON_F32_DEFAULT", "PTXAS_OPTIONS",
              "DISABLE_PTXAS_OPT")


def fp_fusion() -> bool | None:
    """The ``enable_fp_fusion`` that every launch of lamina's kernels and the static report's compiles pass.

    True (a multiply followed by an add compiles to one fused multiply-add): Triton's default up to 3.9, which
    lamina's tolerance tables and timings were measured with. Triton 3.9 warns that the default turns to
    False in 3.10 unless ``TRITON_DEFAULT_FP_FUSION`` is set; asking for it explicitly keeps lamina's kernels
    as measured on either side of that change, without the warning. None where the user set that variable:
    their default applies (None is "not requested" to Triton). Triton 3.9's ``TRITON_FORCE_DISABLE_FP_FUSION=1``
    (3.6 has none) turns fusion off either way."""
    return None if FP_FUSION_ENV in os.environ else True


def fp_fusion_enabled() -> bool:
    """Whether the kernels compile with FP fusion here: ``fp_fusion()`` as Triton resolves it, with the user's
    ``TRITON_DEFAULT_FP_FUSION`` where ``fp_fusion()`` is None and Triton 3.9's ``TRITON_FORCE_DISABLE_FP_FUSION``
    over both (``lamina info`` prints it)."""
    language = triton.knobs.language
    requested = fp_fusion()
    if hasattr(language, "fp_fusion_enabled"):  # Triton >= 3.9 resolves it in one place
        return language.fp_fusion_enabled(requested)
    return language.default_fp_fusion if requested is None else requested


def multiprocessors(device: torch.device) -> int | None:
    """The streaming multiprocessors of a CUDA ``device``; None for any other device (the interpreter runs a
    grid's programs one after another)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


# Grid axes y and z are limited to 65535 on CUDA (fla #1077): keep large counts on axis 0.
MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class AotSpec:
    """One kernel configuration compiled ahead of time by ``lamina info --kernels``.

    ``signature`` maps every argument to a Triton type string (``"*bf16"``, ``"i32"``,
    ``"fp32"``) or ``"constexpr"``; ``constexprs`` gives the constexpr values.
    ``uses_dot`` says whether the kernel does a matrix product (HGMMA expected on sm_90).
    """

    name: str
    config: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4
    # None: the installed Triton's default, which is what a launch that names no ``num_stages`` runs
    num_stages: int | None = None
    # None: no register cap beyond ptxas's own; else the launch's ``maxnreg`` (PTX ``.maxnreg``)
    maxnreg: int | None = None
    uses_dot: bool = True
    default: bool = True
    meta: dict[str, Any] = field(default_factory=dict)


_REGISTRY: list[AotSpec] = []


def register_aot(spec: AotSpec) -> AotSpec:
    """Add a kernel configuration to the static report."""
    _REGISTRY.append(spec)
    return spec


def registered_aot() -> list[AotSpec]:
    return list(_REGISTRY)


# Which shapes the registrations that have a grid add (kernels/delta_report.py): "default" (what CI
# compiles) or "full"; read when the registering module is imported (`lamina info --kernels --grid`).
REPORT_GRID_ENV = "LAMINA_REPORT_GRID"
REPORT_GRIDS = ("default", "full")


def report_grid() -> str:
    grid = os.environ.get(REPORT_GRID_ENV, "default") or "default"
    if grid not in REPORT_GRIDS:
        raise ValueError(f"{REPORT_GRID_ENV} must be one of {REPORT_GRIDS}, got {grid!r}")
    return grid


def raw_jit(fn: Any) -> Any:
    """The JITFunction under autotune/heuristics wrappers."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    while isinstance(fn, (Autotuner, Heuristics)):
        fn = fn.fn
    return fn
