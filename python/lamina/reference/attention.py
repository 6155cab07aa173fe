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


def _probabilities(
    q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, window_size: tuple[int, int], softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw scaled scores ``[b, h, t, s]``, the probabilities and the log-sum-exp ``[b, h, t]``; ``k`` already
    repeated over the query heads."""
    raw = torch.einsum("bthd,bshd->bhts", q, k) * scale
    scores = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    if causal:
        scores = scores.masked_fill(~_causal_visible(q.shape[1], k.shape[1], q.device), float("-inf"))
    if tuple(window_size) != (-1, -1):
        scores = scores.masked_fill(~_window_visible(q.shape[1], k.shape[1], *window_size, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # Rows without a visible key have lse = -inf: their probabilities are defined as 0.
    lse_shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return raw, torch.exp(scores - lse_shift[..., None]), lse


def _dense_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    group = q.shape[2] // k.shape[2]
    k = repeat(k, "b s hk d -> b s (hk g) d", g=group)
    v = repeat(v, "b s hk d -> b s (hk g) d", g=group)
    _, probs, lse = _probabilities(q, k, causal, scale, window_size, softcap)
    out = torch.einsum("bhts,bshd->bthd", probs, v)
    return out, lse


def _dense_grads_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool, scale: float,
    window_size: tuple[int, int], softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    group = q.shape[2] // k.shape[2]
    kr = repeat(k, "b s hk d -> b s (hk g) d", g=group)
    vr = repeat(v, "b s hk d -> b s (hk g) d", g=group)
    raw, probs, _ = _probabilities(q, kr, causal, scale, window_size, softcap)
    out = torch.einsum("bhts,bshd->bthd", probs, vr)
    dp = torch.einsum("bthd,bshd->bhts", do, vr)
    delta = (do * out).sum(-1).transpose(1, 2)  # [b, h, t]
    ds = probs * (dp - delta[..., None])
    if softcap > 0:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    dq = torch.einsum("bhts,bshd->bthd", ds, kr) * scale
    dk = torch.einsum("bhts,bthd->bshd", ds, q) * scale
    dv = torch.einsum("bhts,bthd->bshd", probs, do)
    return dq, dk.unflatten(2, (-1, group)).sum(3), dv.unflatten(2, (-1, group)).sum(3)


def attention_grads_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of ``attention_ref`` by FlashAttention's backward, written out in the input dtype: the
    probabilities recomputed from the log-sum-exp, ``dS = P * (dO V^T - rowsum(dO * O))`` with the output
    ``O`` formed again. The float32 baseline of ``lamina fuzz``: the error a plain float32 implementation of
    the math the kernels run makes (where ``P`` is one, the two row sums that cancel in ``dS`` are
    rounded differently, unlike autograd's softmax backward). Arguments as ``attention_ref``'s."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens_q is None:
        return _dense_grads_ref(q, k, v, do, causal, scale, window_size, softcap)
    return _per_sequence(lambda q, do, k, v: _dense_grads_ref(q, k, v, do, causal, scale, window_size, softcap),
                         (q, do), (k, v), cu_seqlens_q, cu_seqlens_k, cat_dims=(1, 1, 1))


def _per_sequence(dense, query_rows: tuple, key_rows: tuple, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_k: torch.Tensor, cat_dims: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """``dense`` on each packed sequence, its arguments the tensors of ``query_rows`` sliced (dim 1) at the
    query offsets, then those of ``key_rows`` at the key offsets; its outputs concatenated along
    ``cat_dims``."""
    offs_q, offs_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    parts = [dense(*(x[:, offs_q[n]:offs_q[n + 1]] for x in query_rows),
                   *(x[:, offs_k[n]:offs_k[n + 1]] for x in key_rows)) for n in range(len(offs_q) - 1)]
    return tuple(torch.cat(outs, dim=d) for outs, d in zip(zip(*parts), cat_dims))


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
        out, lse = _per_sequence(lambda q, k, v: _dense_ref(q, k, v, causal, scale, window_size, softcap),
                                 (q,), (k, v), cu_seqlens_q, cu_seqlens_k, cat_dims=(1, 2))
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out

