"""Naive PyTorch reference of the short convolution (fla's ``causal_conv1d``), in float64.

For every sequence, with ``prev`` the previous segment's last W inputs (``initial_state[n]``, column
W - 1 the most recent; zeros without a state)::

    xx      = [prev columns 0..W-1, x[0], ..., x[T-1]]            # input s sits at xx[W + s]
    pre[t]  = bias + sum_k weight[:, k] * xx[W + t - (W - 1) + k]  # inputs t-W+1 .. t
    y[t]    = act(pre[t]) + residual[t]                           # act: identity or SiLU
    final   = the last W entries of xx                            # [D, W]

Token loops written for clarity, not speed: the oracle every fast path is compared with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _spans(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, first token, end token) of every sequence."""
    B, T = x.shape[0], x.shape[1]
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    offs = cu_seqlens.tolist()
    return [(0, bos, eos) for bos, eos in zip(offs[:-1], offs[1:])]


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv1d, optional SiLU, optional residual, with the window state.

    Args:
        x: [B, T, D] (B == 1 with ``cu_seqlens``).
        weight: [D, W]; bias: [D]; residual: [B, T, D], added after the activation.
        initial_state: [N, D, W], the previous W inputs of every sequence.
        output_final_state: also return the last W inputs of every sequence, [N, D, W].
        activation: None, "silu" or "swish".
        cu_seqlens: [N + 1] offsets of packed sequences.

    Returns:
        (y [B, T, D], final_state [N, D, W] or None), in x's dtype, computed in float64.
    """
    D, W = weight.shape
    w = weight.double()
    f64 = {"dtype": torch.float64, "device": x.device}
    y = torch.zeros(x.shape, **f64)
    finals = []
    for n, (b, bos, eos) in enumerate(_spans(x, cu_seqlens)):
        prev = initial_state[n].double() if initial_state is not None else torch.zeros(D, W, **f64)
        xx = torch.cat([prev.T, x[b, bos:eos].double()], dim=0)  # [W + L, D]
        for t in range(eos - bos):
            acc = bias.double() if bias is not None else torch.zeros(D, **f64)
            for k in range(W):
                acc = acc + w[:, k] * xx[W + t - (W - 1) + k]
            if activation in ("silu", "swish"):
                acc = F.silu(acc)
            if residual is not None:
                acc = acc + residual[b, bos + t].double()
            y[b, bos + t] = acc
        finals.append(xx[-W:].T)
    final_state = torch.stack(finals).to(x.dtype) if output_final_state else None
    return y.to(x.dtype), final_state


def causal_conv1d_update_ref(
    x: torch.Tensor,
    cache: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step: ``x: [N, D]``, ``cache: [N, D, W]`` -> (y [N, D], the new cache); nothing in place."""
    window = torch.cat([cache[:, :, 1:].double(), x.double()[:, :, None]], dim=2)
    y = (window * weight.double()).sum(dim=2)
    if bias is not None:
        y = y + bias.double()
    if activation in ("silu", "swish"):
        y = F.silu(y)
    if residual is not None:
        y = y + residual.double()
    return y.to(x.dtype), window.to(cache.dtype)
