"""lamina: kernels for delta-rule recurrences, Prism attention and HRM-LM.

Public names are loaded lazily, so ``import lamina`` imports neither triton nor
any compiled extension until an op is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # delta-rule family
    "chunk_delta_rule": "lamina.ops.delta_rule",
    "chunk_gated_delta_rule": "lamina.ops.delta_rule",
    "chunk_kda": "lamina.ops.delta_rule",
    "chunk_gdn2": "lamina.ops.delta_rule",
    "fused_recurrent_delta_rule": "lamina.ops.delta_rule",
    "fused_recurrent_gated_delta_rule": "lamina.ops.delta_rule",
    "fused_recurrent_kda": "lamina.ops.delta_rule",
    "fused_recurrent_gdn2": "lamina.ops.delta_rule",
    # Prism attention
    "prism_attention": "lamina.ops.prism_attention",
    "prism_attention_with_kvcache": "lamina.ops.prism_decode",
    "PrismSchedule": "lamina.schedule",
    # HRM
    "hrm_gated_update": "lamina.ops.hrm_update",
    # fla building blocks
    "causal_conv1d": "lamina.ops.short_conv",
    "causal_conv1d_update": "lamina.ops.short_conv",
    "l2_norm": "lamina.ops.rms_norm_gated",
    "rms_norm": "lamina.ops.rms_norm_gated",
    "rms_norm_gated": "lamina.ops.rms_norm_gated",
    # run fla's layers and models on lamina
    "patch_fla": "lamina.fla_patch",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lamina' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
