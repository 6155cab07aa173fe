"""``ShortConvolution``: fla 0.6's depthwise causal convolution module, on lamina's ops.

Constructor, parameters (``weight [D, 1, W]``, ``bias [D]``, as ``nn.Conv1d`` with ``groups=D``),
initialisation and ``forward`` / ``step`` signatures are fla's, so checkpoints load either way and
``lamina.patch_fla`` can put ``forward`` and ``step`` on fla's class (they read only attributes
fla's module has: ``weight``, ``bias``, ``kernel_size``, ``activation``, ``backend``).
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from lamina._validate import check_layer_input, check_positive_int, check_tensor
from lamina.ops.short_conv import ACTIVATIONS, causal_conv1d, causal_conv1d_update

# fla's backends ("triton", "cuda") and lamina's ("auto", "torch"); see lamina.ops.short_conv.
LAYER_BACKENDS = ("triton", "cuda", "auto", "torch")


class ShortConvolution(nn.Conv1d):
    """Depthwise causal conv1d over ``[B, T, D]`` with optional SiLU and a decoding window cache.

    Args:
        hidden_size: D, channels in and out.
        kernel_size: W, the window width.
        bias: learn a per-channel bias.
        activation: "silu", "swish" or None.
        backend: "triton" (fla's default) or "cuda" (fla's names: lamina's Triton kernels on CUDA
            tensors, the dispatch default elsewhere, i.e. "auto"), "auto" or "torch".
        device, dtype: of the parameters.
    """

    def __init__(
        self,
        hidden_size: int,
        kernel_size: int,
        bias: bool = False,
        activation: str | None = "silu",
        backend: str | None = "triton",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("kernel_size", kernel_size)
        if backend not in LAYER_BACKENDS:
            raise ValueError(f"backend must be one of {LAYER_BACKENDS}, got {backend!r}")
        super().__init__(in_channels=hidden_size, out_channels=hidden_size, kernel_size=kernel_size,
                         padding=kernel_size - 1, groups=hidden_size, bias=bias, device=device, dtype=dtype)
        self.hidden_size = hidden_size
        self.activation = activation
        self.backend = backend

    def extra_repr(self) -> str:
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.activation is not None:
            s += f", activation={self.activation}"
        return s + f", backend={self.backend}"

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: torch.Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        chunk_indices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Convolve ``x`` (optionally continuing from ``cache``).

        Args:
            x: [B, T, D]; B == 1 with ``cu_seqlens``.
            residual: [B, T, D], added after the activation.
            mask: [B, T], multiplies x (padding positions to zero); not with ``cu_seqlens``. The
                caller's x is not modified (fla multiplies it in place).
            cache: [N, D, W], the previous W inputs of each sequence. A call of one token per
                sequence without autograd is a decoding step and updates it in place.
            output_final_state: return the new window [N, D, W] (else None).
            cu_seqlens: [N + 1] offsets of packed sequences.
            chunk_indices: accepted for fla's signature (see ``causal_conv1d``).

        Returns:
            (y [B, T, D], final window [N, D, W] or None).
        """
        D, W = self.weight.shape[0], self.weight.shape[-1]
        check_layer_input("x", x, self, width=D, match_dtype=False, width_name="hidden_size")
        B, T = x.shape[0], x.shape[1]
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if cache is not None:
            check_tensor("cache", cache, ndim=3)
            if tuple(cache.shape) != (N, D, W):
                raise ValueError(f"cache must have shape [N, D, W] = {(N, D, W)}, got {tuple(cache.shape)}")
        if mask is not None:
            if cu_seqlens is not None:
                raise ValueError("mask and cu_seqlens cannot both be given: packed sequences carry no padding")
            if tuple(mask.shape) != (B, T):
                raise ValueError(f"mask must have shape [B, T] = {(B, T)}, got {tuple(mask.shape)}")
            x = x * mask.unsqueeze(-1).to(x.dtype)
        if (not torch.is_grad_enabled() and B * T == N
                and (cu_seqlens is None or bool((cu_seqlens.diff() == 1).all()))):
            return self.step(x, residual, cache, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        return causal_conv1d(
            x=x,
            weight=rearrange(self.weight, "d 1 w -> d w"),
            bias=self.bias,
            residual=residual,
            initial_state=cache,
            output_final_state=output_final_state,
            activation=self.activation,
            backend=_op_backend(self.backend),
            cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices,
        )

    def step(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cache: torch.Tensor | None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decoding step: ``x`` holds one token per sequence ([N, 1, D], or [1, N, D] with
        ``cu_seqlens``); ``cache [N, D, W]`` is updated in place (zeros when None).

        Returns:
            (y like x, cache if ``output_final_state`` else None).
        """
        W = self.kernel_size[0]
        N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if cache is None:
            cache = x.new_zeros((N, x.shape[-1], W))
        y, cache = causal_conv1d_update(
            x=x,
            cache=cache,
            residual=residual,
            weight=rearrange(self.weight, "d 1 w -> d w"),
            bias=self.bias,
            activation=self.activation,
            backend=_op_backend(self.backend),
        )
        return y, (cache if output_final_state else None)

    @property
    def state_size(self) -> int:
        return self.hidden_size * self.kernel_size[0]


def _op_backend(backend: str | None) -> str:
    """The op's backend for a module's: fla's names run lamina's GPU kernels where they can ("auto")."""
    return "auto" if backend in (None, "triton", "cuda") else backend


__all__ = ["ShortConvolution"]
