"""Naive PyTorch references of RMSNorm, the gated RMSNorm and the L2 norm (fla's ``rms_norm``,
``rms_norm_gated`` and ``l2_norm``), computed in float64::

    s = x + residual
    y = (s / sqrt(mean(s^2) + eps) * weight + bias) * act(g)     # act(g): g * sigmoid(g) or sigmoid(g)

With ``prenorm`` they also return ``residual_out = s`` (in the residual's dtype; without a residual,
x's dtype, or float32 with ``residual_in_fp32``).
"""

from __future__ import annotations

import torch


def _norm(x, g, weight, bias, activation, residual, prenorm, residual_in_fp32, eps):
    s = x.double()
    if residual is not None:
        s = s + residual.double()
    y = s / torch.sqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    if g is not None:
        gate = torch.sigmoid(g.double())
        if activation in ("swish", "silu"):
            gate = g.double() * gate
        y = y * gate
    y = y.to(x.dtype)
    if not prenorm:
        return y
    if residual is not None:
        return y, s.to(residual.dtype)
    return y, s.to(torch.float32 if residual_in_fp32 else x.dtype)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of ``x: [..., D]`` (+ ``residual``), ``weight, bias: [D]`` or None."""
    return _norm(x, None, weight, bias, None, residual, prenorm, residual_in_fp32, eps)


def rms_norm_gated_ref(
    x: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    activation: str = "swish",
    residual: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x: [..., D]`` (+ ``residual``), then times ``act(g)``, ``g: [..., D]``;
    ``activation``: "swish" / "silu" or "sigmoid"."""
    return _norm(x, g, weight, bias, activation, residual, prenorm, residual_in_fp32, eps)


def l2_norm_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim of ``x: [..., D]``, in float64, returned in x's dtype."""
    xd = x.double()
    return (xd / torch.sqrt((xd * xd).sum(dim=-1, keepdim=True) + eps)).to(x.dtype)
