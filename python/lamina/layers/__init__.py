"""nn.Modules built on lamina's ops. Modules never launch kernels themselves.

Loaded lazily so that importing one layer does not import every kernel.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "DeltaRuleAttention": "lamina.layers.delta_rule",
    # fla 0.6's layers, cache and building blocks, with fla's names, arguments and parameters
    "DeltaNet": "lamina.layers.deltanet",
    "GatedDeltaNet": "lamina.layers.gated_deltanet",
    "KimiDeltaAttention": "lamina.layers.kda",
    "GatedDeltaNet2": "lamina.layers.gdn2",
    "Cache": "lamina.layers.cache",
    "ShortConvolution": "lamina.layers.short_conv",
    "RMSNorm": "lamina.layers.norm",
    "FusedRMSNormGated": "lamina.layers.norm",
    "PrismAttention": "lamina.layers.prism",
    "PrismBlock": "lamina.layers.prism",
    "PrismDecoder": "lamina.layers.prism",
    "PrismDecoderConfig": "lamina.layers.prism",
    "HRMGatedUpdate": "lamina.layers.hrm",
    "HRMCore": "lamina.layers.hrm",
    "CrossLayerRouter": "lamina.layers.routing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lamina.layers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
