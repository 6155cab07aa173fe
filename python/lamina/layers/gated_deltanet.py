"""``GatedDeltaNet``: fla 0.6's layer of the same name (arguments, parameters, cache), on lamina's ops.

Gated DeltaNet (Yang et al., "Gated Delta Networks: Improving Mamba2 with Delta Rule"):
``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = S_t^T q_t``, with a
per-head decay ``g_t = -exp(A_log) * softplus(a_proj(x_t) + dt_bias)``, ``beta_t =
sigmoid(b_proj(x_t))`` (times 2 with ``allow_neg_eigval``), l2-normalised q and k, then a per-head
RMSNorm of the output gated by ``act(g_proj(x))``. The gate, beta and l2norm are applied by the ops
(``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``, ``use_qk_l2norm_in_kernel``); the cached
state is ``[N, HV, V, K]`` (``state_v_first``), as fla keeps it.
"""

from __future__ import annotations

import torch
from torch import nn

import lamina.ops.delta_rule as ops
from lamina.layers.fla_base import FlaDeltaLayer, init_A_log, init_dt_bias, no_weight_decay
from lamina.layers.norm import FusedRMSNormGated, RMSNorm

OUTPUT_GATE_ACTIVATIONS = ("swish", "silu", "sigmoid")


class GatedDeltaNet(FlaDeltaLayer):
    """Gated DeltaNet token mixer; drop-in for ``fla.layers.GatedDeltaNet`` (strict state_dict loading).

    Args:
        hidden_size: model width. expand_v: value head dim = ``head_dim * expand_v``.
        head_dim: key head dim K. num_heads: q/k heads H.
        num_v_heads: value heads HV (default H; a multiple of H: grouped value attention).
        mode: "chunk" or "fused_recurrent" (inference on inputs longer than 64 tokens; training
            always runs "chunk", and short inference inputs "fused_recurrent").
        use_gate: output gate ``act(g_proj(x))`` on the normalised output.
        use_short_conv: causal depthwise convolutions (``conv_size`` taps, ``conv_bias``) + SiLU on q, k, v.
        allow_neg_eigval: beta in (0, 2) instead of (0, 1).
        layer_idx: this layer's slot in ``past_key_values``. norm_eps: output RMSNorm epsilon.
        output_gate_activation: "swish" (= "silu") or "sigmoid".
        routing: None, "clvr" or "cler": what ``forward(..., output_routed=True)`` returns as a fourth
            result for the next layer (``lamina.layers.routing``); lamina's own, fla has no such option.
    """

    state_v_first = True

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 2,
        head_dim: int = 256,
        num_heads: int = 6,
        num_v_heads: int | None = None,
        mode: str = "chunk",
        use_gate: bool = True,
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        output_gate_activation: str = "swish",
        routing: str | None = None,
    ) -> None:
        super().__init__()
        self._set_routing(routing)
        if output_gate_activation not in OUTPUT_GATE_ACTIVATIONS:
            raise ValueError(f"output_gate_activation must be one of {OUTPUT_GATE_ACTIVATIONS}, "
                             f"got {output_gate_activation!r}")
        self._set_heads(hidden_size=hidden_size, expand_v=expand_v, head_dim=head_dim, num_heads=num_heads,
                        num_v_heads=num_v_heads, mode=mode, use_short_conv=use_short_conv,
                        allow_neg_eigval=allow_neg_eigval, conv_size=conv_size, conv_bias=conv_bias,
                        layer_idx=layer_idx)
        self.use_gate = use_gate
        self._make_qkv_proj()
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.A_log = no_weight_decay(nn.Parameter(init_A_log(self.num_v_heads, 0.0, 16.0)))
        self.dt_bias = no_weight_decay(nn.Parameter(init_dt_bias(self.num_v_heads)))
        if use_short_conv:
            self._make_convs(conv_size, conv_bias)
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = FusedRMSNormGated(self.head_v_dim, eps=norm_eps, activation=output_gate_activation)
        else:
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps, dtype=torch.float32)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def _mix(self, x, q, k, v, state, mode, use_cache, cu_seqlens, **decode):
        op = ops.chunk_gated_delta_rule if mode == "chunk" else ops.fused_recurrent_gated_delta_rule
        return op(q, k, v, g=self.a_proj(x), beta=self.b_proj(x), initial_state=state, output_final_state=use_cache,
                  use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  allow_neg_eigval=self.allow_neg_eigval, state_v_first=True, cu_seqlens=cu_seqlens,
                  use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias, **decode)

