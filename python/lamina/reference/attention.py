"""Naive softmax attention: the oracle for ``lamina.prism_attention``.

It materialises the full score matrix and computes every step in the input dtype, so a float64
call is the oracle and a bf16/fp16 call shows the error PyTorch itself makes in that precision
(the yardstick of the FlashAttention test rule in ``tests/tolerances.py``).
"""

from __future__ import annotations

import torch
from einops import repeat


def _causal_visible(t_q: int, t_k: int, device: torch.device) -> torch.Tensor:
    """[t_q, t_k] bool: query i sees key j iff j <= i + t_k - t_q (bottom-right alignment)."""
    i = torch.arange(t_q, device=device)[:, None]
    j = torch.arange(t_k, device=device)[None, :]
    return j <= i + (t_k - t_q)


def _window_visible(t_q: int, t_k: int, left: int, right: int, device: torch.device) -> torch.Tensor:
    """[t_q, t_k] bool: query i (at key position c = i + t_k - t_q) sees key j iff c - left <= j <= c + right,
    a bound of -1 being none (FlashAttention's window_size)."""
    c = torch.arange(t_q, device=device)[:, None] + (t_k - t_q)
    j = torch.arange(t_k, device=device)[None, :]
    visible = torch.ones(t_q, t_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= j >= c - left
    if right >= 0:
        visible &= j <= c + right
    return visible


def _dense_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    group = q.shape[2] // k.shape[2]
    k = repeat(k, "b s hk d -> b s (hk g) d", g=group)
    v = repeat(v, "b s hk d -> b s (hk g) d", g=group)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        visible = _causal_visible(q.shape[1], k.shape[1], q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    if tuple(window_size) != (-1, -1):
        scores = scores.masked_fill(~_window_visible(q.shape[1], k.shape[1], *window_size, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # Rows without a visible key have lse = -inf: their probabilities are defined as 0.
    lse_shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - lse_shift[..., None])
    out = torch.einsum("bhts,bshd->bthd", probs, v)
    return out, lse


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    return_lse: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention computed naively in the dtype of ``q``.

    q: [B, T, H, D]; k, v: [B, S, HKV, D] with H % HKV == 0 (query head h uses key/value head
    h // (H / HKV)). With ``cu_seqlens_q``/``cu_seqlens_k`` ([N + 1], B == 1) the rows are N packed
    sequences. ``causal`` masks key j for query i unless j <= i + S - T (aligned bottom-right, per
    sequence). ``scale`` defaults to D ** -0.5. ``window_size = (left, right)``: query i also sees only
    keys ``c - left <= j <= c + right`` with ``c = i + S - T`` (-1: no bound), FlashAttention's sliding
    window; ``softcap > 0``: scores become ``softcap * tanh(scores / softcap)`` before the softmax.

    Returns o: [B, T, H, D] and, with ``return_lse``, lse: [B, H, T] (natural-log log-sum-exp of the
    scaled, masked scores, in q's dtype). A row that sees no key has o = 0 and lse = -inf.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens_q is None:
        out, lse = _dense_ref(q, k, v, causal, scale, window_size, softcap)
    else:
        offs_q = cu_seqlens_q.tolist()
        offs_k = cu_seqlens_k.tolist()
        outs, lses = [], []
        for n in range(len(offs_q) - 1):
            qs = q[:, offs_q[n]:offs_q[n + 1]]
            ks = k[:, offs_k[n]:offs_k[n + 1]]
            vs = v[:, offs_k[n]:offs_k[n + 1]]
            o_n, lse_n = _dense_ref(qs, ks, vs, causal, scale, window_size, softcap)
            outs.append(o_n)
            lses.append(lse_n)
        out = torch.cat(outs, dim=1)
        lse = torch.cat(lses, dim=2)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out

