"""``GatedDeltaNet2``: fla 0.6's layer of the same name (arguments, parameters, cache), on lamina's ops.

Gated DeltaNet-2: a per-key-channel decay and separate erase and write gates,
``S_t = (I - k_t (b_t * k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T``, with
``g_t = -exp(A_log) * softplus(f_proj(x_t) + dt_bias)`` (low-rank ``f_proj``; ``A_log`` per q/k
head), ``b_t = sigmoid(b_proj(x_t))`` over the key axis (times 2 with ``allow_neg_eigval``),
``w_t = sigmoid(w_proj(x_t))`` over the value axis, and a sigmoid-gated output RMSNorm. As in fla
the gates are formed here in float32 and q, k, g, b are repeated over grouped value heads; the
cached state is ``[N, HV, K, V]``.
"""

from __future__ import annotations

import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

import lamina.ops.delta_rule as ops
from lamina.layers.fla_base import FlaDeltaLayer, init_A_log, init_dt_bias, no_weight_decay


class GatedDeltaNet2(FlaDeltaLayer):
    """GDN-2 token mixer; drop-in for ``fla.layers.GatedDeltaNet2`` (strict state_dict loading).

    Args:
        hidden_size: model width. expand_v: value head dim = ``head_dim * expand_v``.
        head_dim: key head dim K. num_heads: q/k heads H. num_v_heads: value heads HV (multiple of H).
        mode: "chunk" or "fused_recurrent" (see ``GatedDeltaNet``).
        use_short_conv, conv_size, conv_bias: causal depthwise convolutions + SiLU on q, k, v.
        allow_neg_eigval: erase gate b in (0, 2).
        layer_idx: slot in ``past_key_values``. norm_eps: output RMSNorm epsilon.
        routing: None, "clvr" or "cler": what ``forward(..., output_routed=True)`` returns as a fourth
            result for the next layer (``lamina.layers.routing``); lamina's own, fla has no such option.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 1.0,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: int | None = None,
        mode: str = "chunk",
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
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
        self._make_qkv_proj()
        if use_short_conv:
            self._make_convs(conv_size, conv_bias)
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, self.key_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.w_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.A_log = no_weight_decay(nn.Parameter(init_A_log(num_heads, 1.0, 16.0)))
        self.dt_bias = no_weight_decay(nn.Parameter(init_dt_bias(self.key_dim)))
        self._make_low_rank_output_gate(norm_eps)

    def _mix(self, x, q, k, v, state, mode, use_cache, cu_seqlens, **decode):
        per_key = "... (h d) -> ... h d"
        g = rearrange(F.softplus(self.f_proj(x).float() + self.dt_bias), per_key, d=self.head_k_dim)
        g = -self.A_log.float().exp().unsqueeze(-1) * g
        b = rearrange(self.b_proj(x).sigmoid(), per_key, d=self.head_k_dim)
        w = rearrange(self.w_proj(x).sigmoid(), per_key, d=self.head_v_dim)
        group = self.num_v_heads // self.num_heads
        if group > 1:
            q, k, g, b = (repeat(t, "... h d -> ... (h g) d", g=group) for t in (q, k, g, b))
        if self.allow_neg_eigval:
            b = b * 2.0
        op = ops.chunk_gdn2 if mode == "chunk" else ops.fused_recurrent_gdn2
        return op(q, k, v, g, b, w, initial_state=state, output_final_state=use_cache, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=cu_seqlens, **decode)

