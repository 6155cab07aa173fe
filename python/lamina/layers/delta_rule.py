"""``DeltaRuleAttention``: an fla-style token mixer over the delta-rule family.

One module, four recurrences chosen by ``mode``:

| mode    | decay g                 | erase / write gates             | op                      |
|---------|-------------------------|---------------------------------|-------------------------|
| "delta" | none                    | beta = sigmoid(b_proj x) [HV]   | ``chunk_delta_rule``    |
| "gdn"   | per head, in-op gate    | beta [HV]                       | ``chunk_gated_delta_rule`` |
| "kda"   | per K channel, in-op    | beta [HV]                       | ``chunk_kda``           |
| "gdn2"  | per K channel, in-op    | b [HV, K] erase, w [HV, V] write | ``chunk_gdn2``         |

Layout (as fla's GatedDeltaNet/KDA layers): q, k, v projections (optionally through a causal
depthwise short convolution), SiLU on q, k, v, in-op l2norm of q and k, in-op gate
``-exp(A_log) * softplus(a + dt_bias)``, then a per-head RMSNorm of the output, optionally
gated by ``silu(g_proj x)``, and the output projection. In eval mode with short inputs
(``T <= RECURRENT_MAX_T``) the ``fused_recurrent_*`` twin runs instead of the chunked op.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import lamina.ops.delta_rule as ops
from lamina._validate import check_layer_input, check_positive_int

MODES = ("delta", "gdn", "kda", "gdn2")
# Inference inputs this short go through the token-by-token kernel (fla switches at 64 too).
RECURRENT_MAX_T = 64
# A_log ~ log U(1, 16) and dt ~ logU(1e-3, 1e-1) through the inverse softplus: Mamba's initialisation,
# which fla's GDN/KDA layers use.
A_INIT_RANGE = (1.0, 16.0)
DT_INIT_RANGE = (1e-3, 1e-1)


class _ShortConv(nn.Module):
    """Causal depthwise conv1d over time with SiLU, restarted at every sequence of ``cu_seqlens``."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(rearrange(x, "b t c -> b c t"), (self.kernel_size - 1, 0))
        return rearrange(F.silu(self.conv(x)), "b c t -> b t c")

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        if cu_seqlens is None:
            return self._run(x)
        offs = cu_seqlens.tolist()
        return torch.cat([self._run(x[:, a:b]) for a, b in zip(offs[:-1], offs[1:])], dim=1)


class DeltaRuleAttention(nn.Module):
    """Delta-rule token mixer (module docstring).

    Args:
        hidden_size: model width D.
        num_heads: q/k heads H.
        head_dim: key head dim K (default ``hidden_size // num_heads``).
        num_v_heads: value heads HV (default H; must be a multiple of H, GVA).
        expand_v: value head dim V = ``int(head_dim * expand_v)``.
        mode: "delta", "gdn", "kda" or "gdn2".
        use_short_conv: causal depthwise conv (``conv_size`` taps) on q, k, v before SiLU.
        use_output_gate: multiply the normalised output by ``silu(g_proj x)``.
        allow_neg_eigval: beta (and GDN-2's erase gate) in [0, 2) instead of [0, 1).
        chunk_size: 16, 32 or 64 (the Triton kernels'; the PyTorch path on CPU cuts its own).
        backend: passed to the ops ("auto", "triton", "torch").

    ``forward(x [B, T, D], cu_seqlens=None, initial_state=None, output_final_state=False)``
    returns ``(y [B, T, D], final_state [N, HV, K, V] float32 or None)``.
    """

    def __init__(
        self,
        hidden_size: int = 1024,
        num_heads: int = 4,
        head_dim: int | None = None,
        num_v_heads: int | None = None,
        expand_v: float = 1.0,
        mode: str = "gdn",
        use_short_conv: bool = False,
        conv_size: int = 4,
        use_output_gate: bool = True,
        allow_neg_eigval: bool = False,
        norm_eps: float = 1e-5,
        chunk_size: int = 64,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("num_heads", num_heads)
        head_dim = check_positive_int("head_dim", hidden_size // num_heads if head_dim is None else head_dim)
        num_v_heads = check_positive_int("num_v_heads", num_heads if num_v_heads is None else num_v_heads)
        if use_short_conv:
            check_positive_int("conv_size", conv_size)
        if num_v_heads % num_heads != 0:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_heads ({num_heads})")
        self.mode, self.backend, self.chunk_size = mode, backend, chunk_size
        self.allow_neg_eigval, self.use_output_gate = allow_neg_eigval, use_output_gate
        self.H, self.HV, self.K = num_heads, num_v_heads, head_dim
        self.V = int(head_dim * expand_v)
        H, HV, K, V = self.H, self.HV, self.K, self.V
        self.q_proj = nn.Linear(hidden_size, H * K, bias=False)
        self.k_proj = nn.Linear(hidden_size, H * K, bias=False)
        self.v_proj = nn.Linear(hidden_size, HV * V, bias=False)
        self.b_proj = nn.Linear(hidden_size, HV * K if mode == "gdn2" else HV, bias=False)
        self.w_proj = nn.Linear(hidden_size, HV * V, bias=False) if mode == "gdn2" else None
        self.gate_width = {"delta": 0, "gdn": 1, "kda": K, "gdn2": K}[mode]
        if self.gate_width:
            self.a_proj = nn.Linear(hidden_size, HV * self.gate_width, bias=False)
            self.A_log = nn.Parameter(torch.empty(HV).uniform_(*A_INIT_RANGE).log())
            dt = torch.exp(torch.empty(HV * self.gate_width).uniform_(*(math.log(x) for x in DT_INIT_RANGE)))
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.convs = nn.ModuleList([_ShortConv(n, conv_size) for n in (H * K, H * K, HV * V)]) \
            if use_short_conv else None
        self.g_proj = nn.Linear(hidden_size, HV * V, bias=False) if use_output_gate else None
        self.o_norm = nn.RMSNorm(V, eps=norm_eps)
        self.o_proj = nn.Linear(HV * V, hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_layer_input("x", x, self, width=self.q_proj.in_features, width_name="hidden_size")
        qkv = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
        if self.convs is not None:
            qkv = [conv(t, cu_seqlens) for conv, t in zip(self.convs, qkv)]
        else:
            qkv = [F.silu(t) for t in qkv]
        q, k = (rearrange(t, "b t (h d) -> b t h d", h=self.H) for t in qkv[:2])
        v = rearrange(qkv[2], "b t (h d) -> b t h d", h=self.HV)
        recurrent = not self.training and x.shape[1] <= RECURRENT_MAX_T
        common = dict(initial_state=initial_state, output_final_state=output_final_state,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, backend=self.backend)
        if not recurrent:
            common["chunk_size"] = self.chunk_size
        gate = {}
        if self.gate_width:
            a = self.a_proj(x)
            a = a if self.gate_width == 1 else rearrange(a, "b t (h k) -> b t h k", h=self.HV)
            gate = dict(use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias)
        if self.mode == "gdn2":
            scale = 2.0 if self.allow_neg_eigval else 1.0
            b = rearrange(torch.sigmoid(self.b_proj(x)) * scale, "b t (h k) -> b t h k", h=self.HV)
            w = rearrange(torch.sigmoid(self.w_proj(x)), "b t (h v) -> b t h v", h=self.HV)
            fn = ops.fused_recurrent_gdn2 if recurrent else ops.chunk_gdn2
            o, state = fn(q, k, v, a, b, w, **gate, **common)
        else:
            beta = self.b_proj(x)
            beta_args = dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval)
            if self.mode == "delta":
                beta = torch.sigmoid(beta) * (2.0 if self.allow_neg_eigval else 1.0)
                fn = ops.fused_recurrent_delta_rule if recurrent else ops.chunk_delta_rule
                o, state = fn(q, k, v, beta, **common)
            elif self.mode == "gdn":
                fn = ops.fused_recurrent_gated_delta_rule if recurrent else ops.chunk_gated_delta_rule
                # by keyword: fla's fused_recurrent_gated_delta_rule takes (q, k, v, g, gk, gv, beta, ...)
                o, state = fn(q, k, v, g=a, beta=beta, **gate, **beta_args, **common)
            else:
                fn = ops.fused_recurrent_kda if recurrent else ops.chunk_kda
                o, state = fn(q, k, v, a, beta, **gate, **beta_args, **common)
        o = self.o_norm(o.to(x.dtype) if o.dtype != x.dtype else o)
        if self.g_proj is not None:
            o = o * F.silu(rearrange(self.g_proj(x), "b t (h v) -> b t h v", h=self.HV))
        return self.o_proj(rearrange(o, "b t h v -> b t (h v)")), state
