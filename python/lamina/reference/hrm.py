"""Naive PyTorch reference of the HRM gated update (DESIGN.md, "HRM").

``z = sigmoid(gate_logits + bias)``, ``y = z * h + (1 - z) * c``, then optionally
``y / sqrt(mean(y ** 2, -1) + eps) * norm_weight``. Written for clarity, not speed:
it is the oracle every fast path of ``lamina.hrm_gated_update`` is compared with.
"""

from __future__ import annotations

import torch


def hrm_gated_update_ref(
    h: torch.Tensor,
    c: torch.Tensor,
    gate_logits: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Gated mix of two states, optionally RMS-normalised.

    Args:
        h: [..., D] the state kept with weight ``z``.
        c: [..., D] the candidate kept with weight ``1 - z``.
        gate_logits: [..., D] (one gate per channel) or [..., 1] (one gate per token).
        bias: [D] or [1], added to the logits; must match the gate's last dim.
        norm_weight: [D] RMSNorm weight; when None the mix is returned unnormalised.
        eps: added to the mean square before the square root.

    Returns:
        y: [..., D] in the dtype of ``h``. Low-precision inputs are computed in float32
        and rounded once at the end; float64 inputs are computed in float64.
    """
    compute = torch.float64 if h.dtype == torch.float64 else torch.float32
    logits = gate_logits.to(compute)
    if bias is not None:
        logits = logits + bias.to(compute)
    z = torch.sigmoid(logits)
    y = z * h.to(compute) + (1 - z) * c.to(compute)
    if norm_weight is not None:
        y = y * torch.rsqrt(y.pow(2).mean(dim=-1, keepdim=True) + eps) * norm_weight.to(compute)
    return y.to(h.dtype)
