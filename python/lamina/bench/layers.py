"""The layer ops' two sides: ``lamina.layers.<Name>`` and ``fla.layers.<Name>`` with the same weights.

Weights: on CUDA, where fla's layer is the comparison, fla's layer is built on the CPU in float32
under ``LAYER_SEED`` and its ``state_dict`` is the case's weights; lamina's layer loads them strictly
(``load_state_dict(strict=True)``). On the CPU (fla's kernels need a GPU: no comparison), or without
an importable ``fla.layers``, lamina's own layer built under the same seed provides them: it draws
the same values (``tests/test_fla_layers.py::test_parameters_match_fla``), without importing fla and
transformers (seconds). Each side is then cast as a whole to the case's dtype and moved to the device.

Calls: forward (``requires_grad`` inputs: with autograd, for the backward modes; else under
``torch.no_grad()``), the layer in training mode (the chunked recurrence, as in training), no
padding mask, no cache. The layer returns ``(o, None, cache)``; the suite times and differentiates
``o``. The last case's layers are kept (one per side), so the modes of a shape build them once.
"""

from __future__ import annotations

import importlib
import json
import warnings
from typing import Any

import torch
from torch import nn

from lamina.bench.layer_dims import LAYER_CLASSES
from lamina.bench.providers import Bound, ProviderSkip

LAYER_SEED = 0
SIDES = {"lamina": "lamina.layers", "fla": "fla.layers"}
# Importing fla.layers imports transformers (flash-linear-attention's dependency): what to install.
FLA_LAYERS_HINT = "pip install flash-linear-attention==0.6.0 fla-core==0.6.0 (fla.layers needs transformers)"

_weights: dict[str, Any] = {}
_built: dict[str, tuple[str, nn.Module]] = {}


def _case_key(op: str, params: dict[str, Any]) -> str:
    return json.dumps([op, params], sort_keys=True)


def layer_class(side: str, op: str) -> type[nn.Module]:
    """``lamina.layers.<Name>`` or ``fla.layers.<Name>`` (ProviderSkip with the reason when not importable)."""
    module = SIDES[side]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fla warns at import about optional packages
            mod = importlib.import_module(module)
        return getattr(mod, LAYER_CLASSES[op])
    except Exception as exc:  # noqa: BLE001 - any failure to import means this side cannot run
        hint = f"; {FLA_LAYERS_HINT}" if side == "fla" else ""
        raise ProviderSkip(f"cannot import {module}.{LAYER_CLASSES[op]}: {type(exc).__name__}: {exc}{hint}") from exc


def _construct(side: str, op: str, params: dict[str, Any]) -> nn.Module:
    cls = layer_class(side, op)
    torch.manual_seed(LAYER_SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla warns when a layer runs without short convolutions
        return cls(**params["layer"])


def case_weights(op: str, params: dict[str, Any], from_fla: bool = True) -> dict[str, torch.Tensor]:
    """The case's weights (float32, CPU): fla's layer's ``state_dict`` (``from_fla`` and fla's layers
    importable), else lamina's layer's under the same seed. Kept for the last case asked for."""
    key = _case_key(op, params) + f"|{from_fla}"
    if _weights.get("key") != key:
        layer = None
        if from_fla:
            try:
                layer = _construct("fla", op, params)
            except ProviderSkip:
                pass
        if layer is None:
            layer = _construct("lamina", op, params)
        _weights.clear()
        _weights.update(key=key, state={k: v.detach().clone() for k, v in layer.state_dict().items()})
    return _weights["state"]


def build_layer(side: str, op: str, params: dict[str, Any], device: str | torch.device,
                dtype: torch.dtype, weights_from_fla: bool | None = None) -> nn.Module:
    """``side``'s layer of the case with the case's weights, in ``dtype`` on ``device``, in training mode.
    ``weights_from_fla``: take fla's weights (default: on CUDA only, module docstring)."""
    if weights_from_fla is None:
        weights_from_fla = torch.device(device).type == "cuda"
    key = _case_key(op, params) + f"|{device}|{dtype}|{weights_from_fla}"
    cached = _built.get(side)
    if cached is not None and cached[0] == key:
        return cached[1]
    _built.pop(side, None)  # free the previous case's layer before building the next one
    layer = _construct(side, op, params)
    layer.load_state_dict(case_weights(op, params, weights_from_fla), strict=True)
    layer = layer.to(device=device, dtype=dtype).train()
    _built[side] = (key, layer)
    return layer


def bind_layer(side: str, op: str, params: dict[str, Any], x: dict[str, Any]) -> Bound:
    """The runner of one case: ``layer(x)``; its leaves are x and the layer's parameters."""
    hidden = x["x"]
    layer = build_layer(side, op, params, hidden.device, hidden.dtype)
    if hidden.requires_grad:
        return Bound(lambda: layer(hidden), [hidden, *layer.parameters()])

    def forward() -> Any:
        with torch.no_grad():
            return layer(hidden)

    return Bound(forward, [])


def clear() -> None:
    """Drop the kept weights and layers (tests; the end of a run)."""
    _weights.clear()
    _built.clear()
