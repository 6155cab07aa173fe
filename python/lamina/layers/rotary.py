"""Rotary position embeddings (RoPE) for any even head dim.

Prism layers have head dims that are not powers of two (96, 160, 192, 320) and
wider than the usual 128 (256, 512); nothing here assumes either. The rotation
pairs channel ``i`` with channel ``i + D/2`` ("rotate half", the GPT-NeoX and
LLaMA layout): channel pair ``i`` of the token at position ``p`` is rotated by
the angle ``p * base ** (-2 i / D)``.

The angles are computed in float32 (float64 for float64 inputs) on every call
from the positions at hand, so a KV-cache decoding step (positions offset by the
cache length) and a packed varlen batch (positions restarting in each sequence)
need no precomputed table.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from lamina._validate import check_tensor


def rotary_positions(
    seq_len: int,
    offset: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Token positions ``[T]`` (int64): ``offset .. offset + T - 1``, or restarting at 0 at every
    sequence start when ``cu_seqlens [N + 1]`` packs several sequences along T."""
    if cu_seqlens is None:
        return torch.arange(offset, offset + seq_len, device=device, dtype=torch.int64)
    starts = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = starts[1:] - starts[:-1]
    index = torch.arange(seq_len, device=device, dtype=torch.int64)
    seq_start = torch.repeat_interleave(starts[:-1], lengths, output_size=seq_len)
    return offset + index - seq_start


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [B, T, H, D]`` by angles given as ``cos, sin: [T, D]`` (or ``[B, T, D]``).

    Computed in the precision of ``cos`` and returned in ``x.dtype``.
    """
    if cos.dim() == 2:
        cos, sin = rearrange(cos, "t d -> 1 t 1 d"), rearrange(sin, "t d -> 1 t 1 d")
    else:
        cos, sin = rearrange(cos, "b t d -> b t 1 d"), rearrange(sin, "b t d -> b t 1 d")
    xf = x.to(cos.dtype)
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary embedding for heads of dim ``head_dim`` (any even number, e.g. 64, 96, 320, 512).

    Args:
        head_dim: the head dim D; must be even.
        base: the frequency base (10000 in the original RoPE).

    The inverse frequencies ``[D/2]`` are recomputed on every call on the device of the
    positions (D/2 numbers): the module holds no buffer, so its parameter count and state
    dict are empty and it needs no re-initialisation after ``to_empty`` from the meta device.
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int):
            raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__}")
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim >= 2, got {head_dim}")
        if not isinstance(base, (int, float)) or isinstance(base, bool) or not base > 1.0:
            raise ValueError(f"rope_base must be a number > 1, got {base!r}")
        self.head_dim = head_dim
        self.base = float(base)

    def inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        """``base ** (-2 i / D)`` for ``i < D/2``, float64."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim
        return self.base**-exponents

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin: [*positions.shape, D]`` for integer ``positions``; float32 unless ``dtype`` is float64."""
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        angles = positions.to(compute)[..., None] * self.inv_freq(positions.device).to(compute)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        offset: int = 0,
        cu_seqlens: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q: [B, T, H, D]`` and ``k: [B, T, HKV, D]``.

        Token ``t`` sits at position ``offset + t`` (``offset`` = tokens already in a KV cache),
        or at its index inside its own sequence when ``cu_seqlens [N + 1]`` packs sequences (B = 1),
        or at ``positions[t]`` when given (``[T]`` integers; then neither ``offset`` nor ``cu_seqlens``).
        """
        check_tensor("q", q, ndim=4)
        check_tensor("k", k, ndim=4)
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"q and k must have head dim {self.head_dim}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        if q.shape[:2] != k.shape[:2]:
            raise ValueError(f"q and k must share [B, T], got q {tuple(q.shape)} and k {tuple(k.shape)}")
        if positions is None:
            positions = rotary_positions(q.shape[1], offset, cu_seqlens, device=q.device)
        elif offset or cu_seqlens is not None or positions.shape != (q.shape[1],) or positions.is_floating_point():
            raise ValueError(f"positions must be [T={q.shape[1]}] integers, without offset or cu_seqlens")
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"
