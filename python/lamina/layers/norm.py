"""``RMSNorm`` and ``FusedRMSNormGated``: fla 0.6's norm modules, on lamina's ops.

Constructor arguments and defaults, parameter names, shapes and initialisation (weight ones, bias
zeros) and ``forward`` signatures are fla's (``fla.modules.norm``), so checkpoints load either way
and ``lamina.patch_fla`` can put ``forward`` on fla's classes (it reads only ``weight``, ``bias``,
``eps`` and, for the gated norm, ``activation``).
"""

from __future__ import annotations

import torch
from torch import nn

from lamina._validate import check_bool, check_eps, check_positive_int
from lamina.ops.rms_norm_gated import ACTIVATIONS, rms_norm, rms_norm_gated


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, optionally adding a residual first (``prenorm`` returns the sum).

    Args:
        hidden_size: D.
        elementwise_affine: learn a scale ``weight [D]`` (and a ``bias [D]`` with ``bias=True``).
        bias: learn a shift (only with ``elementwise_affine``).
        eps: added to the mean square.
        device, dtype: of the parameters.
    """

    def __init__(
        self,
        hidden_size: int,
        elementwise_affine: bool = True,
        bias: bool = False,
        eps: float = 1e-5,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = check_positive_int("hidden_size", hidden_size)
        self.elementwise_affine = check_bool("elementwise_affine", elementwise_affine)
        self.eps = check_eps("eps", eps)
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
            if check_bool("bias", bias):
                self.bias = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        affine = "" if self.elementwise_affine else ", elementwise_affine=False"
        return f"{self.hidden_size}{affine}, eps={self.eps}"

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        prenorm: bool = False,
        residual_in_fp32: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x, residual: [..., D]`` -> y [..., D], or (y, residual_out) with ``prenorm``
        (``lamina.ops.rms_norm_gated.rms_norm``)."""
        return rms_norm(x, self.weight, self.bias, residual=residual, eps=self.eps, prenorm=prenorm,
                        residual_in_fp32=residual_in_fp32)


class FusedRMSNormGated(nn.Module):
    """RMSNorm over the last dim, then times ``act(g)`` (the output norm of gated linear attention).

    Args:
        hidden_size: D.
        elementwise_affine: learn a scale ``weight [D]``. fla registers ``bias`` as None: no shift.
        eps: added to the mean square.
        activation: "swish" / "silu" or "sigmoid".
        device, dtype: of the parameters.
    """

    def __init__(
        self,
        hidden_size: int,
        elementwise_affine: bool = True,
        eps: float = 1e-5,
        activation: str = "swish",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.hidden_size = check_positive_int("hidden_size", hidden_size)
        self.elementwise_affine = check_bool("elementwise_affine", elementwise_affine)
        self.eps = check_eps("eps", eps)
        self.activation = activation
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        affine = "" if self.elementwise_affine else ", elementwise_affine=False"
        return f"{self.hidden_size}{affine}, eps={self.eps}, activation={self.activation}"

    def forward(
        self,
        x: torch.Tensor,
        g: torch.Tensor,
        residual: torch.Tensor | None = None,
        prenorm: bool = False,
        residual_in_fp32: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x, g, residual: [..., D]`` -> y [..., D], or (y, residual_out) with ``prenorm``
        (``lamina.ops.rms_norm_gated.rms_norm_gated``)."""
        return rms_norm_gated(x, g, self.weight, self.bias, activation=self.activation, residual=residual,
                              prenorm=prenorm, residual_in_fp32=residual_in_fp32, eps=self.eps)


__all__ = ["FusedRMSNormGated", "RMSNorm"]
