"""``DeltaNet``: fla 0.6's layer of the same name (arguments, parameters, cache), on lamina's ops.

DeltaNet (Yang et al., "Parallelizing Linear Transformers with the Delta Rule over Sequence
Length"): ``S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = S_t^T q_t``, with
``beta_t = sigmoid(b_proj(x_t))`` (or 1 without ``use_beta``; times 2 with ``allow_neg_eigval``),
a feature map on q and k (``qk_activation``) and a normalisation (``qk_norm``: l2 in the op, or
L1), then a per-head RMSNorm of the output (gated by ``silu(g_proj(x))`` with ``use_gate``).
Unlike the gated layers, DeltaNet runs the token-by-token op for every input of at most 64
tokens, in training too (as fla does). The cached state is ``[N, H, K, V]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import lamina.ops.delta_rule as ops
from lamina._validate import check_positive_int
from lamina.layers.fla_base import FUSED_RECURRENT_MAX_T, FlaDeltaLayer
from lamina.layers.norm import FusedRMSNormGated, RMSNorm

QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")
QK_NORMS = ("l2", "sum")


class DeltaNet(FlaDeltaLayer):
    """DeltaNet token mixer; drop-in for ``fla.layers.DeltaNet`` (strict state_dict loading).

    Args:
        mode: "chunk" or "fused_recurrent" (for inputs longer than 64 tokens).
        d_model: alias of ``hidden_size`` (wins when given).
        hidden_size: model width. expand_k, expand_v: key/value width = ``hidden_size * expand``,
            split over ``num_heads`` heads.
        use_beta: learned beta ``sigmoid(b_proj(x))``, else 1.
        use_gate: output gate ``silu(g_proj(x))``.
        use_short_conv, conv_size, conv_bias: causal depthwise convolutions on q, k (SiLU only when
            ``qk_activation == "silu"``) and v (SiLU).
        allow_neg_eigval: beta in (0, 2).
        layer_idx: slot in ``past_key_values``.
        qk_activation: "silu", "relu", "elu" (``elu(x) + 1``) or "identity".
        qk_norm: "l2" (in the op) or "sum" (``x / max(sum |x|, 1e-6)`` over the head dim).
        norm_eps: output RMSNorm epsilon.
        routing: None, "clvr" or "cler": what ``forward(..., output_routed=True)`` returns as a fourth
            result for the next layer (``lamina.layers.routing``); lamina's own, fla has no such option.
    """

    def __init__(
        self,
        mode: str = "chunk",
        d_model: int | None = None,
        hidden_size: int = 1024,
        expand_k: float = 1.0,
        expand_v: float = 1.0,
        num_heads: int = 4,
        use_beta: bool = True,
        use_gate: bool = False,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        allow_neg_eigval: bool = False,
        layer_idx: int | None = None,
        qk_activation: str = "silu",
        qk_norm: str = "l2",
        norm_eps: float = 1e-5,
        routing: str | None = None,
    ) -> None:
        super().__init__()
        self._set_routing(routing)
        self._check_mode(mode)
        if qk_activation not in QK_ACTIVATIONS:
            raise ValueError(f"qk_activation must be one of {QK_ACTIVATIONS}, got {qk_activation!r}")
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {qk_norm!r}")
        if d_model is not None:
            hidden_size = d_model
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("num_heads", num_heads)
        check_positive_int("conv_size", conv_size)
        self.mode, self.qk_activation, self.qk_norm = mode, qk_activation, qk_norm
        self.hidden_size, self.expand_k, self.expand_v = hidden_size, expand_k, expand_v
        self.num_heads = self.num_v_heads = num_heads
        self.use_gate, self.use_short_conv = use_gate, use_short_conv
        self.conv_size, self.conv_bias, self.allow_neg_eigval = conv_size, conv_bias, allow_neg_eigval
        key_dim, value_dim = hidden_size * expand_k, hidden_size * expand_v
        self.key_dim, self.value_dim = round(key_dim), round(value_dim)
        if not (math.isclose(key_dim, self.key_dim) and math.isclose(value_dim, self.value_dim)):
            raise ValueError(f"hidden_size * expand_k and hidden_size * expand_v must be integers, got "
                             f"{key_dim} and {value_dim}")
        if self.key_dim % num_heads or self.value_dim % num_heads:
            raise ValueError(f"key width {self.key_dim} and value width {self.value_dim} must be multiples of "
                             f"num_heads ({num_heads})")
        self.head_k_dim, self.head_v_dim = self.key_dim // num_heads, self.value_dim // num_heads
        self.layer_idx = layer_idx

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.use_beta = use_beta
        if use_beta:
            self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        if use_short_conv:
            self._make_convs(conv_size, conv_bias, qk_activation="silu" if qk_activation == "silu" else None)
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = FusedRMSNormGated(self.head_v_dim, eps=norm_eps)
        else:
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps, dtype=torch.float32)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def _choose_mode(self, q_len: int) -> str:
        return "fused_recurrent" if q_len <= FUSED_RECURRENT_MAX_T else self.mode

    def _mix(self, x, q, k, v, state, mode, use_cache, cu_seqlens, **decode):
        if self.qk_activation == "relu":
            q, k = q.relu(), k.relu()
        elif self.qk_activation == "elu":
            # elu(x) + 1, written without the cancellation of exp(x) - 1 + 1
            q, k = (torch.where(t >= 0, t + 1, t.clamp_max(0).exp()) for t in (q, k))
        if self.qk_norm == "sum":
            q, k = (F.normalize(t, p=1, dim=-1, eps=1e-6) for t in (q, k))
        beta = self.b_proj(x).sigmoid() if self.use_beta else torch.ones_like(q[..., 0])
        if self.allow_neg_eigval:
            beta = beta * 2.0
        op = ops.chunk_delta_rule if mode == "chunk" else ops.fused_recurrent_delta_rule
        return op(q, k, v, beta, initial_state=state, output_final_state=use_cache, cu_seqlens=cu_seqlens,
                  use_qk_l2norm_in_kernel=self.qk_norm == "l2", **decode)

