"""The ``torch-eager`` baselines: each op written the way a PyTorch user would, without lamina.

They are baselines to time against, not oracles (``lamina.reference`` is the oracle).
``torch-compile`` wraps the same functions in ``torch.compile``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for low-precision inputs, float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def delta_family_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    erase: torch.Tensor | None = None,
    write: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token loop over the whole family, batched over sequences and heads, float32 (or float64) state.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] with ``HV % H == 0``.
        g: None, [B, T, HV] or [B, T, HV, K] log decay.
        erase: None, [B, T, HV] or [B, T, HV, K]; write: None, [B, T, HV] or [B, T, HV, V].
        initial_state: [N, HV, K, V] float32 or None; cu_seqlens: [N + 1] (B == 1) or None.

    Returns:
        o: [B, T, HV, V] in ``v.dtype``; final state [N, HV, K, V] in the compute dtype.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    group = HV // H
    compute = _compute_dtype(q.dtype)
    f32 = lambda x: None if x is None else x.to(compute)
    q32, k32 = f32(q).repeat_interleave(group, 2) * scale, f32(k).repeat_interleave(group, 2)
    v32, g32, e32, w32 = f32(v), f32(g), f32(erase), f32(write)
    # Gates per head get a trailing unit dim so that they broadcast over K or V.
    per_head = lambda x: x if x is None or x.dim() == 4 else x.unsqueeze(-1)
    g32, e32, w32 = per_head(g32), per_head(e32), per_head(w32)
    e_all = k32 if e32 is None else e32 * k32
    z_all = v32 if w32 is None else w32 * v32
    spans = [(0, T)] if cu_seqlens is None else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    rows = B if cu_seqlens is None else 1
    outputs, finals = [], []
    for n, (start, end) in enumerate(spans):
        if initial_state is not None:
            S = (initial_state[n : n + rows] if cu_seqlens is not None else initial_state).to(compute)
        else:
            S = q32.new_zeros(rows, HV, K, V)
        steps = []
        for t in range(start, end):
            if g32 is not None:
                S = S * g32[:, t].exp().unsqueeze(-1)
            read = torch.einsum("bhk,bhkv->bhv", e_all[:, t], S)
            S = S + k32[:, t].unsqueeze(-1) * (z_all[:, t] - read).unsqueeze(-2)
            steps.append(torch.einsum("bhk,bhkv->bhv", q32[:, t], S))
        outputs.append(torch.stack(steps, 1) if steps else v32.new_zeros(rows, 0, HV, V))
        finals.append(S)
    return torch.cat(outputs, 1).to(v.dtype), torch.cat(finals, 0)


def attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None) -> torch.Tensor:
    """softmax(Q K^T * scale + mask) V with the scores in float32 (float64 for float64 inputs).

    Args:
        q: [B, Tq, H, D]; k, v: [B, Tk, HKV, D] with ``H % HKV == 0``.

    Returns:
        o: [B, Tq, H, D] in ``q.dtype``.
    """
    H, HKV = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(H // HKV, 1)
    vh = v.transpose(1, 2).repeat_interleave(H // HKV, 1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)).to(_compute_dtype(q.dtype)) * scale
    if causal:
        Tq, Tk = q.shape[1], k.shape[1]
        keep = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, vh).transpose(1, 2)


def hrm_update_eager(h: torch.Tensor, c: torch.Tensor, gate_logits: torch.Tensor,
                     bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                     eps: float = 1e-6) -> torch.Tensor:
    """``z = sigmoid(gate_logits + bias)``, ``y = z h + (1 - z) c``, optional RMS norm in float32 (or float64).

    Args:
        h, c, gate_logits: [N, D]; bias, norm_weight: [D] or None.

    Returns:
        y: [N, D] in ``h.dtype``.
    """
    logits = gate_logits if bias is None else gate_logits + bias
    z = torch.sigmoid(logits)
    y = z * h + (1 - z) * c
    if norm_weight is None:
        return y
    compute = _compute_dtype(h.dtype)
    y32 = y.to(compute)
    y32 = y32 * torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + eps)
    return (y32 * norm_weight.to(compute)).to(h.dtype)


def short_conv_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal conv1d as ``nn.Conv1d(D, D, W, groups=D, padding=W - 1)`` computes it, cut to
    the first T outputs, then SiLU.

    Args:
        x: [B, T, D]; weight: [D, W]; bias: [D] or None; activation: None or "silu".

    Returns:
        y: [B, T, D] in ``x.dtype``.
    """
    T, W = x.shape[1], weight.shape[1]
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=W - 1, groups=x.shape[2])[..., :T]
    y = y.transpose(1, 2)
    return F.silu(y) if activation == "silu" else y


def gdn_decode_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor,
                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One Gated DeltaNet step.

    Args:
        q, k: [B, 1, H, K]; v: [B, 1, HV, V]; g, beta: [B, 1, HV]; state: [B, HV, K, V] float32.

    Returns:
        o: [B, 1, HV, V] in ``v.dtype``; the new state [B, HV, K, V] float32.
    """
    return delta_family_eager(q, k, v, g=g, erase=beta, write=beta, scale=scale, initial_state=state)
