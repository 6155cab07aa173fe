"""Padding masks to packed sequences and back, for the fla-compatible layers.

A ``[B, T]`` 0/1 mask (1 = token, 0 = padding; left or right padding, or holes) becomes the
``cu_seqlens`` of the kept tokens packed along T, so the varlen kernels see no padding at all.
Nothing here writes into the caller's tensors; both directions are differentiable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange


@dataclass(frozen=True)
class Unpadded:
    """Where the kept tokens came from: ``indices`` into the flattened ``[B * T]`` positions."""

    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    batch_size: int
    seq_len: int


def check_attention_mask(attention_mask: object, batch_size: int, q_len: int) -> torch.Tensor:
    """``attention_mask`` must be a ``[B, T_mask]`` 0/1 tensor with ``T_mask >= q_len``.

    Returns the mask's last ``q_len`` columns (fla's rule: while decoding with a cache, the mask
    covers the whole history and the current tokens are its last columns).
    """
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.dim() != 2:
        raise ValueError(
            "attention_mask must be a [batch_size, seq_len] 0/1 padding mask (1 = token, 0 = padding), got shape "
            f"{tuple(attention_mask.shape)}; arbitrary [B, T, T] attention masks are not supported by these layers"
        )
    if attention_mask.shape[0] != batch_size or attention_mask.shape[1] < q_len:
        raise ValueError(
            f"attention_mask must have shape [{batch_size}, >= {q_len}] for hidden_states of batch size {batch_size} "
            f"and length {q_len}, got {tuple(attention_mask.shape)}"
        )
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise ValueError(f"attention_mask must be a bool or integer tensor of 0/1, got dtype {attention_mask.dtype}")
    mask = attention_mask[:, -q_len:]
    if attention_mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    return mask


def unpad(hidden_states: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, Unpadded]:
    """``hidden_states [B, T, ...]`` and a checked ``[B, T]`` mask -> ``[1, kept, ...]`` and where they came from."""
    B, T = mask.shape
    keep = mask.reshape(-1).bool()
    indices = torch.nonzero(keep).flatten()
    lengths = mask.bool().sum(dim=1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    where = Unpadded(indices, cu_seqlens, B, T)
    return unpad_like(hidden_states, where), where


def unpad_like(x: torch.Tensor, where: Unpadded) -> torch.Tensor:
    """``x [B, T, ...]`` packed as :func:`unpad` packed the tensor that gave ``where``: ``[1, kept, ...]``."""
    return rearrange(x, "b t ... -> (b t) ...").index_select(0, where.indices).unsqueeze(0)


def repad(packed: torch.Tensor, where: Unpadded) -> torch.Tensor:
    """Inverse of :func:`unpad`: ``[1, kept, ...]`` -> ``[B, T, ...]`` with zeros at the padding."""
    flat = packed.squeeze(0)
    out = flat.new_zeros(where.batch_size * where.seq_len, *flat.shape[1:]).index_copy(0, where.indices, flat)
    return rearrange(out, "(b t) ... -> b t ...", b=where.batch_size)
