"""Benchmark inputs: seeded, never zeros, in the value ranges the models see.

Delta rule: q and k L2-normalised per head (as the models do before the recurrence),
gates in their natural ranges (log decay ``logsigmoid(x) <= 0``, beta and the GDN-2
gates in (0, 1)), so every provider runs a stable recurrence. Attention: unit normal
q, k, v. Short convolution: unit normal x, window weights scaled by ``W ** -0.5``.
Layers: unit normal hidden states (the scale an RMS-normalised block input has).
All floating inputs are leaves; ``requires_grad`` is set for backward modes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lamina.bench.specs import ATTENTION_OPS, DELTA_GATES, DELTA_OPS, LAYER_OPS

SEED = 0
TORCH_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(TORCH_DTYPES)}, got {name!r}")
    return TORCH_DTYPES[name]


def _leaf(x: torch.Tensor, dtype: torch.dtype, requires_grad: bool) -> torch.Tensor:
    return x.to(dtype).detach().contiguous().requires_grad_(requires_grad)


def _gen(device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(SEED)
    return g


def make_inputs(op: str, params: dict[str, Any], device: str | torch.device,
                requires_grad: bool = False) -> dict[str, Any]:
    """The canonical inputs of ``op`` at ``params``; providers convert them to their own layout.

    Delta family: ``q, k: [B, T, H, K]``, ``v: [B, T, HV, V]``, gates per ``DELTA_GATES``
    (``[B, T, HV]`` or ``[B, T, HV, K|V]``), ``cu_seqlens: [N + 1]`` int64 or None.
    Attention: ``q: [B, Tq, H, D]``, ``k, v: [B, Tk, HKV, D]``.
    HRM: ``h, c, gate_logits: [N, D]``, ``bias, norm_weight: [D]``.
    Short convolution: ``x: [B, T, D]``, ``weight: [D, W]`` (scaled by ``W ** -0.5``), no bias, SiLU.
    GDN decode: ``q, k: [B, 1, H, K]``, ``v: [B, 1, HV, V]``, ``g, beta: [B, 1, HV]``,
    ``state: [B, HV, K, V]`` float32 (never requires grad).
    Layers: ``x: [B, T, hidden_size]`` (the layer's weights belong to the providers).
    """
    device = torch.device(device)
    dtype = torch_dtype(params["dtype"])
    gen = _gen(device)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
    rg = requires_grad
    if op in DELTA_OPS:
        B, T, H, HV, K, V = (params[n] for n in ("B", "T", "H", "HV", "K", "V"))
        out: dict[str, Any] = {
            "q": _leaf(F.normalize(randn(B, T, H, K), dim=-1), dtype, rg),
            "k": _leaf(F.normalize(randn(B, T, H, K), dim=-1), dtype, rg),
            "v": _leaf(randn(B, T, HV, V), dtype, rg),
        }
        for name, width in DELTA_GATES[op].items():
            shape = (B, T, HV) + ((params[width],) if width else ())
            x = F.logsigmoid(randn(*shape)) if name == "g" else torch.sigmoid(randn(*shape))
            out[name] = _leaf(x, dtype, rg)
        seqlens = params.get("seqlens")
        out["cu_seqlens"] = None if not seqlens else torch.tensor(
            [0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int64, device=device)
        return out
    if op in ATTENTION_OPS:
        B, Tq, Tk, H, HKV, D = (params[n] for n in ("B", "Tq", "Tk", "H", "HKV", "D"))
        return {"q": _leaf(randn(B, Tq, H, D), dtype, rg), "k": _leaf(randn(B, Tk, HKV, D), dtype, rg),
                "v": _leaf(randn(B, Tk, HKV, D), dtype, rg), "causal": bool(params["causal"])}
    if op == "hrm_update":
        N, D = params["N"], params["D"]
        out = {"h": _leaf(randn(N, D), dtype, rg), "c": _leaf(randn(N, D), dtype, rg),
               "gate_logits": _leaf(randn(N, D), dtype, rg), "bias": _leaf(0.1 * randn(D), dtype, rg),
               "norm_weight": None}
        if params["norm"]:
            out["norm_weight"] = _leaf(1.0 + 0.1 * randn(D), dtype, rg)
        return out
    if op == "gdn_decode":
        B, H, HV, K, V = (params[n] for n in ("B", "H", "HV", "K", "V"))
        return {
            "q": _leaf(F.normalize(randn(B, 1, H, K), dim=-1), dtype, rg),
            "k": _leaf(F.normalize(randn(B, 1, H, K), dim=-1), dtype, rg),
            "v": _leaf(randn(B, 1, HV, V), dtype, rg),
            "g": _leaf(F.logsigmoid(randn(B, 1, HV)), dtype, rg),
            "beta": _leaf(torch.sigmoid(randn(B, 1, HV)), dtype, rg),
            "state": _leaf(0.1 * randn(B, HV, K, V), torch.float32, False),
        }
    if op == "short_conv":
        B, T, D, W = (params[n] for n in ("B", "T", "D", "W"))
        return {"x": _leaf(randn(B, T, D), dtype, rg), "weight": _leaf(randn(D, W) / W ** 0.5, dtype, rg),
                "bias": None, "activation": "silu"}
    if op in LAYER_OPS:
        B, T, D = params["B"], params["T"], params["layer"]["hidden_size"]
        return {"x": _leaf(randn(B, T, D), dtype, rg)}
    raise ValueError(f"no input maker for op {op!r}")


def grad_leaves(inputs: dict[str, Any]) -> list[torch.Tensor]:
    """The inputs that receive gradients (floating tensors with requires_grad)."""
    return [x for x in inputs.values() if isinstance(x, torch.Tensor) and x.requires_grad]
