"""Naive PyTorch references for every fast op (float64-capable, run on CPU).

Loaded lazily: ``lamina.reference.<name>`` imports only the module that defines it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "delta_rule_family_recurrent_ref": "lamina.reference.delta_rule",
    "delta_rule_family_chunk_ref": "lamina.reference.delta_rule",
    "delta_rule_ref": "lamina.reference.delta_rule",
    "gated_delta_rule_ref": "lamina.reference.delta_rule",
    "kda_ref": "lamina.reference.delta_rule",
    "gdn2_ref": "lamina.reference.delta_rule",
    "attention_ref": "lamina.reference.attention",
    "attention_grads_ref": "lamina.reference.attention",
    "hrm_gated_update_ref": "lamina.reference.hrm",
    "causal_conv1d_ref": "lamina.reference.short_conv",
    "causal_conv1d_update_ref": "lamina.reference.short_conv",
    "rms_norm_ref": "lamina.reference.norm",
    "rms_norm_gated_ref": "lamina.reference.norm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lamina.reference' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
