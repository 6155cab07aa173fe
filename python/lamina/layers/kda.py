"""``KimiDeltaAttention``: fla 0.6's layer of the same name (arguments, parameters, cache), on lamina's ops.

Kimi Delta Attention: Gated DeltaNet with a per-key-channel decay,
``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``, where
``g_t = -exp(A_log) * softplus(f_proj(x_t) + dt_bias)`` comes from a low-rank two-layer projection
(or, with ``lower_bound``, ``lower_bound * sigmoid(exp(A_log) * (f_proj(x_t) + dt_bias))``), and the
output RMSNorm is gated by ``sigmoid(g_proj(x))`` (low rank, with bias). The cached state is
``[N, HV, V, K]`` (``state_v_first``), as fla keeps it.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

import lamina.ops.delta_rule as ops
from lamina.layers.fla_base import FlaDeltaLayer, init_A_log, init_dt_bias, no_weight_decay


class KimiDeltaAttention(FlaDeltaLayer):
    """KDA token mixer; drop-in for ``fla.layers.KimiDeltaAttention`` (strict state_dict loading).

    Args:
        hidden_size: model width. expand_v: value head dim = ``head_dim * expand_v``.
        head_dim: key head dim K. num_heads: q/k heads H. num_v_heads: value heads HV (multiple of H).
        mode: "chunk" or "fused_recurrent" (see ``GatedDeltaNet``).
        use_short_conv, conv_size, conv_bias: causal depthwise convolutions + SiLU on q, k, v.
        allow_neg_eigval: beta in (0, 2).
        safe_gate: ``A_log`` starts at 0 and the gate uses ``lower_bound`` (which must then be in [-5, 0)).
        lower_bound: the bounded gate ``lower_bound * sigmoid(...)`` instead of ``-exp(A_log) * softplus(...)``.
        layer_idx: slot in ``past_key_values``. norm_eps: output RMSNorm epsilon.
        routing: None, "clvr" or "cler": what ``forward(..., output_routed=True)`` returns as a fourth
            result for the next layer (``lamina.layers.routing``); lamina's own, fla has no such option.
    """

    state_v_first = True

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 1,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: int | None = None,
        mode: str = "chunk",
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        safe_gate: bool = False,
        lower_bound: float | None = None,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        routing: str | None = None,
    ) -> None:
        super().__init__()
        self._set_routing(routing)
        self._set_heads(hidden_size=hidden_size, expand_v=expand_v, head_dim=head_dim, num_heads=num_heads,
                        num_v_heads=num_v_heads, mode=mode, use_short_conv=use_short_conv,
                        allow_neg_eigval=allow_neg_eigval, conv_size=conv_size, conv_bias=conv_bias,
                        layer_idx=layer_idx)
        self.safe_gate, self.lower_bound = safe_gate, lower_bound
        self._make_qkv_proj()
        if use_short_conv:
            self._make_convs(conv_size, conv_bias)
        self.gate_dim = self.num_v_heads * self.head_k_dim
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, self.gate_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        A_log = torch.zeros(self.num_v_heads, dtype=torch.float32) if safe_gate \
            else init_A_log(self.num_v_heads, 1.0, 16.0)
        self.A_log = no_weight_decay(nn.Parameter(A_log))
        self.dt_bias = no_weight_decay(nn.Parameter(init_dt_bias(self.gate_dim)))
        self._make_low_rank_output_gate(norm_eps)

    def _mix(self, x, q, k, v, state, mode, use_cache, cu_seqlens, **decode):
        g = rearrange(self.f_proj(x), "... (h d) -> ... h d", d=self.head_k_dim)
        common = dict(initial_state=state, output_final_state=use_cache, use_qk_l2norm_in_kernel=True,
                      use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval,
                      lower_bound=self.lower_bound, state_v_first=True, cu_seqlens=cu_seqlens,
                      A_log=self.A_log, dt_bias=self.dt_bias)
        if mode == "chunk":
            return ops.chunk_kda(q, k, v, g, self.b_proj(x), safe_gate=self.safe_gate, **common, **decode)
        return ops.fused_recurrent_kda(q, k, v, g, self.b_proj(x), **common, **decode)

