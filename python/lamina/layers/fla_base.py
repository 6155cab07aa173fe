"""What the four fla-compatible delta-rule layers share: input checks, padding, cache, short convs.

Each layer (``DeltaNet``, ``GatedDeltaNet``, ``KimiDeltaAttention``, ``GatedDeltaNet2``) builds its
parameters exactly as fla 0.6's class of the same name (names, shapes, dtypes and, for a given
seed, the same initial values), and implements two steps: ``_mix`` (gates and the recurrence) and
``_output`` (output norm, gate and projection). ``FlaDeltaLayer.forward`` does the rest with fla's
call signature and semantics:

1. ``hidden_states [B, T, hidden_size]``; a ``[B, T]`` 0/1 ``attention_mask`` unpads to packed
   sequences (``cu_seqlens``) and the output is padded back (zeros at padding); an explicit
   ``cu_seqlens`` (``B == 1``) takes precedence over the mask, as in fla.
2. q, k, v projections, through the short convolutions (with their cached windows) or SiLU.
3. the recurrence: the chunked op for training and long inputs, the token-by-token op for short
   inputs at inference (``FUSED_RECURRENT_MAX_T``), with the cached state.
4. the cache entry ``past_key_values[layer_idx]`` updated with the new states.

Cross-layer routing (``lamina.layers.routing``): a layer built with ``routing="clvr" | "cler"`` returns
what it routes as a fourth result with ``output_routed=True``; any layer adds ``routed_values`` to its
value target (after step 2, before the recurrence).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from lamina._validate import check_layer_input, check_positive_int
from lamina.layers.norm import FusedRMSNormGated
from lamina.layers.padding import check_attention_mask, repad, unpad, unpad_like
from lamina.layers.routing import check_routing
from lamina.layers.short_conv import ShortConvolution

# Inputs this short run through the token-by-token kernel at inference (fla's switch point).
FUSED_RECURRENT_MAX_T = 64
MODES = ("chunk", "fused_recurrent")


def init_A_log(n: int, low: float, high: float) -> torch.Tensor:
    """``log U(low, high)``, drawn as fla draws it (same random stream for the same seed)."""
    return torch.log(torch.empty(n, dtype=torch.float32).uniform_(low, high))


def init_dt_bias(n: int) -> torch.Tensor:
    """Inverse softplus of ``dt ~ logU(1e-3, 1e-1)`` floored at 1e-4 (Mamba's and fla's initialisation)."""
    dt_min, dt_max, dt_floor = 0.001, 0.1, 1e-4
    dt = torch.exp(torch.rand(n, dtype=torch.float32) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=dt_floor)
    return dt + torch.log(-torch.expm1(-dt))


def no_weight_decay(p: nn.Parameter) -> nn.Parameter:
    p._no_weight_decay = True  # read by fla's and many trainers' parameter grouping
    return p


class FlaDeltaLayer(nn.Module):
    """Base of the fla-compatible layers (module docstring). Subclasses set the attributes below."""

    # recurrent_state layout in the cache: fla's GatedDeltaNet and KDA keep it [N, HV, V, K]
    state_v_first = False
    hidden_size: int
    key_dim: int
    value_dim: int
    head_k_dim: int
    head_v_dim: int
    num_heads: int
    num_v_heads: int
    use_short_conv: bool
    layer_idx: int | None
    mode: str
    # what output_routed=True returns: None (no routing), "clvr" or "cler" (lamina.layers.routing)
    routing: str | None = None

    def _set_routing(self, routing: str | None) -> None:
        self.routing = check_routing(routing)

    def _check_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

    def _set_heads(self, *, hidden_size: int, expand_v: float, head_dim: int, num_heads: int,
                   num_v_heads: int | None, mode: str, use_short_conv: bool, allow_neg_eigval: bool,
                   conv_size: int, conv_bias: bool, layer_idx: int | None) -> None:
        """Head geometry and options of GatedDeltaNet, KDA and GDN-2 (fla's attribute names)."""
        self._check_mode(mode)
        for name, value in (("hidden_size", hidden_size), ("head_dim", head_dim), ("num_heads", num_heads),
                            ("conv_size", conv_size)):
            check_positive_int(name, value)
        if num_v_heads is not None:
            check_positive_int("num_v_heads", num_v_heads)
        self.mode, self.allow_neg_eigval = mode, allow_neg_eigval
        self.hidden_size, self.expand_v = hidden_size, expand_v
        self.use_short_conv, self.conv_size, self.conv_bias = use_short_conv, conv_size, conv_bias
        self.head_dim, self.num_heads = head_dim, num_heads
        self.num_v_heads = num_v_heads if num_v_heads is not None else num_heads
        self.head_k_dim, self.head_v_dim = head_dim, int(head_dim * expand_v)
        self.key_dim = num_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.layer_idx = layer_idx
        if not math.isclose(head_dim * expand_v, self.head_v_dim, rel_tol=1e-5):
            raise ValueError(f"head_dim * expand_v must be an integer, got {head_dim} * {expand_v}")
        if self.num_v_heads < num_heads or self.num_v_heads % num_heads != 0:
            raise ValueError(f"num_v_heads ({self.num_v_heads}) must be a multiple of num_heads ({num_heads})")

    def _make_qkv_proj(self) -> None:
        self.q_proj = nn.Linear(self.hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.value_dim, bias=False)

    def _make_low_rank_output_gate(self, norm_eps: float) -> None:
        """KDA's and GDN-2's output: RMSNorm gated by ``sigmoid(g_proj(x))``, ``g_proj`` low rank with bias."""
        self.g_proj = nn.Sequential(nn.Linear(self.hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, self.value_dim, bias=True))
        self.o_norm = FusedRMSNormGated(self.head_v_dim, activation="sigmoid", eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

    def _make_convs(self, conv_size: int, conv_bias: bool, qk_activation: str | None = "silu") -> None:
        self.q_conv1d = ShortConvolution(hidden_size=self.key_dim, kernel_size=conv_size, bias=conv_bias,
                                         activation=qk_activation)
        self.k_conv1d = ShortConvolution(hidden_size=self.key_dim, kernel_size=conv_size, bias=conv_bias,
                                         activation=qk_activation)
        self.v_conv1d = ShortConvolution(hidden_size=self.value_dim, kernel_size=conv_size, bias=conv_bias,
                                         activation="silu")

    def _choose_mode(self, q_len: int) -> str:
        """fla's rule for GatedDeltaNet, KDA and GDN-2 (DeltaNet overrides it)."""
        if torch.is_grad_enabled():
            return "chunk"
        mode = "fused_recurrent" if q_len <= FUSED_RECURRENT_MAX_T and not self.training else self.mode
        if self.training and mode != "chunk":
            raise ValueError(f"{type(self).__name__}: training runs in mode 'chunk' only, got mode {self.mode!r}")
        return mode

    def _expected_state_shape(self) -> tuple[int, int, int]:
        K, V = self.head_k_dim, self.head_v_dim
        return (self.num_v_heads, V, K) if self.state_v_first else (self.num_v_heads, K, V)

    def _layer_cache(self, past_key_values: Any) -> dict[str, Any] | None:
        """This layer's entry of ``past_key_values`` (None before its first update), checked."""
        if past_key_values is None:
            return None
        name = type(self).__name__
        if self.layer_idx is None:
            raise ValueError(f"{name} needs layer_idx (its slot in past_key_values) when past_key_values is given")
        if len(past_key_values) <= self.layer_idx:
            return None
        entry = past_key_values[self.layer_idx]
        if not isinstance(entry, dict):
            raise ValueError(f"past_key_values[{self.layer_idx}] must be a dict of states, got {type(entry).__name__}")
        where = f"past_key_values[{self.layer_idx}]"
        state = entry.get("recurrent_state")
        if state is None and entry.get("attn_state") is not None:
            raise ValueError(f"{where} holds an attention layer's key/value cache, not the state of {name} "
                             f"(layer_idx {self.layer_idx}); was the cache filled by another model?")
        expected = self._expected_state_shape()
        if state is not None and (not isinstance(state, torch.Tensor) or state.dim() != 4
                                  or tuple(state.shape[1:]) != expected):
            got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
            layout = "[N, HV, V, K]" if self.state_v_first else "[N, HV, K, V]"
            raise ValueError(f"{where}['recurrent_state'] must have shape [N, {', '.join(map(str, expected))}] "
                             f"({layout} of {name}), got {got}; the cache comes from another layer type or shape")
        conv = entry.get("conv_state")
        if self.use_short_conv and conv is not None:
            widths = (self.key_dim, self.key_dim, self.value_dim)
            ok = isinstance(conv, (tuple, list)) and len(conv) == 3 and all(
                c is None or (isinstance(c, torch.Tensor) and c.dim() == 3 and c.shape[1] == d
                              and c.shape[2] == self.q_conv1d.kernel_size[0]) for c, d in zip(conv, widths))
            if not ok:
                raise ValueError(f"{where}['conv_state'] must be 3 short-convolution windows [N, D, W] with D = "
                                 f"{widths} and W = {self.q_conv1d.kernel_size[0]} for {name}; the cache comes from "
                                 "another layer type or shape")
        return entry

    def _check_context_parallel(self, cp_context: Any, attention_mask: torch.Tensor | None,
                                cu_seqlens: torch.Tensor | None, past_key_values: Any, use_cache: bool | None) -> None:
        from lamina.distributed import ContextParallel

        name = type(self).__name__
        if not isinstance(cp_context, ContextParallel):
            raise TypeError(f"{name}: cp_context must be a lamina.distributed.ContextParallel, "
                            f"got {type(cp_context).__name__}")
        for arg, given in (("attention_mask", attention_mask is not None), ("cu_seqlens", cu_seqlens is not None),
                           ("past_key_values", past_key_values is not None), ("use_cache", bool(use_cache))):
            if given:
                raise ValueError(f"{name}: {arg} cannot be combined with cp_context (context parallelism is for "
                                 "training and prefill of whole sequences; the packed layout is the context's)")

    def _qkv(self, x: torch.Tensor, entry: dict[str, Any] | None, use_cache: bool,
             cu_seqlens: torch.Tensor | None, cp_context: Any | None = None):
        """q, k [.., H, K] and v [.., HV, V] after the short convolutions (or SiLU), and their windows.

        Without short convolutions q and k get SiLU unless the layer sets another ``qk_activation``
        (DeltaNet applies it after this step); v always gets SiLU. With ``cp_context`` the convolutions
        start from the previous segment's last inputs.
        """
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        conv_state = None
        if self.use_short_conv:
            cached = (entry or {}).get("conv_state") or (None, None, None)
            if cp_context is not None:
                from lamina.distributed import context_halo, local_cu_seqlens

                cached = context_halo(cp_context, [q, k, v], self.q_conv1d.weight.shape[-1])
                cu_seqlens = local_cu_seqlens(cp_context, x.shape[1], x.device)
                q, k, v = (cp_context.split_rows(t) for t in (q, k, v))  # a row per segment and sequence
            outs = [conv(x=t, cache=c, output_final_state=use_cache, cu_seqlens=cu_seqlens)
                    for conv, t, c in zip((self.q_conv1d, self.k_conv1d, self.v_conv1d), (q, k, v), cached)]
            (q, cq), (k, ck), (v, cv) = outs
            if cp_context is not None:
                q, k, v = (cp_context.join_rows(t) for t in (q, k, v))
            conv_state = (cq, ck, cv)
        else:
            if getattr(self, "qk_activation", "silu") == "silu":
                q, k = F.silu(q), F.silu(k)
            v = F.silu(v)
        q, k = (rearrange(t, "... (h d) -> ... h d", d=self.head_k_dim) for t in (q, k))
        v = rearrange(v, "... (h d) -> ... h d", d=self.head_v_dim)
        return q, k, v, conv_state

    @staticmethod
    def _decode_keywords(state: torch.Tensor | None, mode: str, use_cache: bool) -> dict[str, bool]:
        """Decoding without autograd updates the cached state in place (no new state per token)."""
        inplace = (mode == "fused_recurrent" and use_cache and state is not None and not torch.is_grad_enabled()
                   and state.dtype == torch.float32 and state[0].is_contiguous())
        return {"inplace_final_state": True} if inplace else {}

    def _mix(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             state: torch.Tensor | None, mode: str, use_cache: bool, cu_seqlens: torch.Tensor | None,
             **decode: bool):
        raise NotImplementedError

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per-head output norm (gated by ``g_proj`` when the layer has one) and the output projection."""
        if getattr(self, "g_proj", None) is not None:
            o = self.o_norm(o, rearrange(self.g_proj(x), "... (h d) -> ... h d", d=self.head_v_dim))
        else:
            o = self.o_norm(o)
        return self.o_proj(rearrange(o, "b t h d -> b t (h d)"))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any | None = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
        *,
        cu_seqlens: torch.Tensor | None = None,
        routed_values: torch.Tensor | None = None,
        output_routed: bool = False,
        cp_context: Any | None = None,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """fla's layer call: ``(o [B, T, hidden_size], None, past_key_values)``.

        Args:
            hidden_states: ``[B, T, hidden_size]``.
            attention_mask: optional ``[B, T_mask]`` 0/1 padding mask (1 = token), ``T_mask >= T``;
                its last T columns apply (decoding with a cache passes the whole history's mask).
            past_key_values: a :class:`lamina.layers.Cache` or fla's cache; read and updated at
                ``layer_idx``.
            use_cache: return the new states through ``past_key_values``.
            output_attentions: accepted for fla's block signature; no attention map exists (None).
            cu_seqlens: ``[N + 1]`` offsets of sequences packed along T (``B == 1``).
            routed_values: ``[B, T, value_dim]``, added to the value target ``v`` (cross-layer routing:
                the previous layer's routed tensor through a ``CrossLayerRouter``).
            output_routed: return a fourth result, ``[B, T, value_dim]``: the value target (``routing="clvr"``)
                or the write error (``"cler"``) of every token (zeros at padding).
            cp_context: a ``lamina.distributed.ContextParallel``: ``hidden_states`` holds this rank's tokens
                of sequences split across its ranks (``cp.shard``); the short convolutions take their
                windows from the segment before and the delta rule runs context-parallel (training and
                prefill: no cache, no padding mask, the packed layout is the context's).
            **kwargs: other arguments model stacks pass to every layer (e.g. ``position_ids``),
                unused here as in fla.
        """
        check_layer_input("hidden_states", hidden_states, self, width=self.hidden_size, width_name="hidden_size")
        batch_size, q_len, _ = hidden_states.shape
        if output_routed and self.routing is None:
            raise ValueError(f"{type(self).__name__}: output_routed=True needs a layer built with routing='clvr' "
                             "or 'cler'")
        if routed_values is not None:
            check_layer_input("routed_values", routed_values, self, width=self.value_dim, width_name="value_dim")
            if routed_values.shape[:2] != hidden_states.shape[:2]:
                raise ValueError(f"routed_values must have shape [{batch_size}, {q_len}, {self.value_dim}] "
                                 f"(hidden_states' batch and length), got {tuple(routed_values.shape)}")
        mode = self._choose_mode(q_len)
        entry = self._layer_cache(past_key_values)
        x, where = hidden_states, None
        if cu_seqlens is None and attention_mask is not None:
            x, where = unpad(hidden_states, check_attention_mask(attention_mask, batch_size, q_len))
            cu_seqlens = where.cu_seqlens
        if cp_context is not None:
            self._check_context_parallel(cp_context, attention_mask, cu_seqlens, past_key_values, use_cache)
            mode = "chunk"
        q, k, v, conv_state = self._qkv(x, entry, bool(use_cache), cu_seqlens, cp_context)
        if routed_values is not None:
            routed_values = routed_values if where is None else unpad_like(routed_values, where)
            v = v + rearrange(routed_values.to(v.dtype), "... (h d) -> ... h d", d=self.head_v_dim)
        state = entry.get("recurrent_state") if entry is not None else None
        cler = output_routed and self.routing == "cler"
        extra = {"output_v_new": True} if cler else self._decode_keywords(state, mode, bool(use_cache))
        if cp_context is not None:
            extra["cp_context"] = cp_context
        o, state, *written = self._mix(x, q, k, v, state, mode, bool(use_cache), cu_seqlens, **extra)
        if past_key_values is not None:
            past_key_values.update(recurrent_state=state, conv_state=conv_state if self.use_short_conv else None,
                                   layer_idx=self.layer_idx, offset=q_len)
        o = self._output(o, x)
        if where is not None:
            o = repad(o, where)
        if not output_routed:
            return o, None, past_key_values
        routed = rearrange(written[0] if cler else v, "... h d -> ... (h d)")
        return o, None, past_key_values, routed if where is None else repad(routed, where)
