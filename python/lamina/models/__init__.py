"""Small reference models built from lamina's layers."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "HRMLM": "lamina.models.hrm_lm",
    "HRMLMConfig": "lamina.models.hrm_lm",
    "LinearLM": "lamina.models.linear_lm",
    "LinearLMConfig": "lamina.models.linear_lm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lamina.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
