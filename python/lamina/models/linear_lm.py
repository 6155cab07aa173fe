"""LinearLM: a small causal LM of delta-rule layers, optionally hybrid with Prism attention layers.

Token embedding, ``num_layers`` pre-norm blocks (a mixer, then a SwiGLU MLP, each with a residual),
final RMSNorm, LM head (tied to the embedding by default). The mixer of block ``i`` is one of
lamina's fla-compatible delta-rule layers (``DeltaNet``, ``GatedDeltaNet``, ``KimiDeltaAttention``,
``GatedDeltaNet2``), or, with ``attention_every = n``, ``PrismAttention`` in every n-th block
(blocks ``n-1, 2n-1, ...``).

Cross-layer routing (``routing="clvr" | "cler"``, ``lamina.layers.routing``): each delta-rule layer but
the first receives the previous delta-rule layer's value target (CLVR) or write error (CLER) through a
``CrossLayerRouter`` (``self.routers[i - 1]`` feeds delta layer ``i``), zero at initialisation, so a
fresh model computes exactly what the same model without routing computes. Attention blocks pass
nothing; routing skips over them to the next delta-rule layer.

Decoding (``new_cache``, ``decode``, ``generate``; the protocol of ``lamina.generation``): the delta
layers keep their recurrent and short-convolution states in a ``lamina.layers.Cache`` (one row per
sequence; a prefill with right padding unpads to varlen, so each row's state is taken after its own
last token), the attention layers their keys and values in a ``PrismCache``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lamina._validate import check_positive_int, check_token_ids
from lamina.generation import GenerationMixin
from lamina.layers import Cache, DeltaNet, GatedDeltaNet, GatedDeltaNet2, KimiDeltaAttention, PrismAttention
from lamina.layers.prism import PrismCache
from lamina.layers.routing import CrossLayerRouter, check_routing

# GPT-2's embedding initialisation: with the head tied to it, logits start near 0 (loss ~ log V).
EMBED_INIT_STD = 0.02
LAYERS: dict[str, type[nn.Module]] = {"DeltaNet": DeltaNet, "GatedDeltaNet": GatedDeltaNet,
                                      "KimiDeltaAttention": KimiDeltaAttention, "GatedDeltaNet2": GatedDeltaNet2}


@dataclass
class LinearLMConfig:
    """Shape of a ``LinearLM``.

    Args:
        vocab_size, hidden_size, num_layers: tokens, width, blocks.
        layer: the delta-rule layer (a key of ``LAYERS``).
        num_heads: heads of the delta-rule layers; ``head_dim`` their key head dim (default
            ``hidden_size // num_heads``; ``DeltaNet`` always uses that).
        attention_every: 0 for a pure delta-rule stack; n > 0 puts ``PrismAttention`` in every n-th block.
        attention_heads: heads of the attention layers (default ``num_heads``; the head dim
            ``hidden_size // attention_heads`` must be one ``lamina.prism_attention`` runs).
        mlp_ratio: SwiGLU hidden width over ``hidden_size``.
        tie_embeddings: share the embedding matrix with the LM head.
        norm_eps: RMSNorm epsilon.
        layer_kwargs: further keyword arguments of the delta-rule layer (e.g. ``mode``,
            ``use_short_conv``, ``allow_neg_eigval``).
        backend: ``PrismAttention``'s backend.
        routing: None, "clvr" or "cler": cross-layer routing between consecutive delta-rule layers.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    layer: str = "GatedDeltaNet"
    num_heads: int = 4
    head_dim: int | None = None
    attention_every: int = 0
    attention_heads: int | None = None
    mlp_ratio: float = 4.0
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    layer_kwargs: dict[str, Any] = field(default_factory=dict)
    backend: str = "auto"
    routing: str | None = None

    def __post_init__(self) -> None:
        check_routing(self.routing)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads"):
            check_positive_int(name, getattr(self, name))
        if self.layer not in LAYERS:
            raise ValueError(f"layer must be one of {sorted(LAYERS)}, got {self.layer!r}")
        if self.head_dim is not None:
            check_positive_int("head_dim", self.head_dim)
        if isinstance(self.attention_every, bool) or not isinstance(self.attention_every, int) \
                or self.attention_every < 0:
            raise ValueError(f"attention_every must be an int >= 0, got {self.attention_every!r}")
        if self.attention_heads is not None:
            check_positive_int("attention_heads", self.attention_heads)
        if self.attention_every > 0:
            from lamina.kernels.prism_attn_common import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, MIN_HEAD_DIM

            heads = self.attention_heads or self.num_heads
            dim = self.hidden_size // heads
            if self.hidden_size % heads or dim % HEAD_DIM_MULTIPLE or not MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM:
                raise ValueError(f"attention_heads must split hidden_size={self.hidden_size} into heads of a dim "
                                 f"lamina.prism_attention runs (multiples of {HEAD_DIM_MULTIPLE} in "
                                 f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]), got {heads} heads")
        if not isinstance(self.mlp_ratio, (int, float)) or isinstance(self.mlp_ratio, bool) or self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be a number > 0, got {self.mlp_ratio!r}")
        if not isinstance(self.layer_kwargs, dict):
            raise TypeError(f"layer_kwargs must be a dict, got {type(self.layer_kwargs).__name__}")

    def is_attention(self, block: int) -> bool:
        return self.attention_every > 0 and (block + 1) % self.attention_every == 0


@dataclass
class LinearLMOutput:
    """``logits [B, T, vocab_size]``; ``loss``: mean next-token cross-entropy when ``labels`` were given."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class LinearLMCache:
    """Decoding cache of a ``LinearLM`` (from ``new_cache``): the delta layers' ``Cache`` and the
    attention layers' ``PrismCache``."""

    def __init__(self, delta: Cache, attention: PrismCache) -> None:
        self.delta, self.attention = delta, attention


class _SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(width, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class _Block(nn.Module):
    def __init__(self, mixer: nn.Module, width: int, mlp_hidden: int, eps: float) -> None:
        super().__init__()
        self.mixer_norm, self.mixer = nn.RMSNorm(width, eps=eps), mixer
        self.mlp_norm, self.mlp = nn.RMSNorm(width, eps=eps), _SwiGLU(width, mlp_hidden)


class LinearLM(GenerationMixin, nn.Module):
    """Causal LM of delta-rule layers (module docstring). ``forward(input_ids, labels=None)`` returns
    ``LinearLMOutput`` (transformers style ``.logits``, ``.loss``)."""

    def __init__(self, config: LinearLMConfig) -> None:
        super().__init__()
        if not isinstance(config, LinearLMConfig):
            raise TypeError(f"config must be a LinearLMConfig, got {type(config).__name__}")
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        nn.init.normal_(self.embed.weight, std=EMBED_INIT_STD)
        mlp_hidden = max(1, int(c.mlp_ratio * c.hidden_size))
        blocks, delta_index = [], 0
        for i in range(c.num_layers):
            if c.is_attention(i):
                mixer = PrismAttention(c.hidden_size, c.attention_heads or c.num_heads, backend=c.backend)
            else:
                kwargs = dict(hidden_size=c.hidden_size, num_heads=c.num_heads, layer_idx=delta_index,
                              routing=c.routing, **c.layer_kwargs)
                if c.layer != "DeltaNet":
                    kwargs["head_dim"] = c.head_dim or c.hidden_size // c.num_heads
                mixer = LAYERS[c.layer](**kwargs)
                delta_index += 1
            blocks.append(_Block(mixer, c.hidden_size, mlp_hidden, c.norm_eps))
        self.blocks = nn.ModuleList(blocks)
        delta = [b.mixer for b in blocks if not isinstance(b.mixer, PrismAttention)]
        self.routers = nn.ModuleList(
            [CrossLayerRouter(a.value_dim, b.value_dim, c.routing) for a, b in zip(delta[:-1], delta[1:])]
            if c.routing is not None else [])
        self.final_norm = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        cache: LinearLMCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> LinearLMOutput:
        """``input_ids [B, T]`` -> ``LinearLMOutput``. ``labels [B, T]`` (int64, -100 ignored): the loss of
        predicting ``labels[:, t + 1]`` from position ``t``. ``cache``/``attention_mask``: decoding, as in
        ``decode``."""
        device = self.embed.weight.device
        check_token_ids("input_ids", input_ids, self.config.vocab_size, device)
        if cache is not None and not isinstance(cache, LinearLMCache):
            raise TypeError(f"cache must be a LinearLMCache (from new_cache()), got {type(cache).__name__}")
        if attention_mask is not None and cache is None:
            raise ValueError("attention_mask needs a cache: it says how many tokens each row keeps in it")
        x = self.embed(input_ids)
        attention_index = delta_index = 0
        routed = None
        for block in self.blocks:
            h = block.mixer_norm(x)
            if isinstance(block.mixer, PrismAttention):
                layer_cache = None if cache is None else cache.attention.layers[attention_index]
                attention_index += 1
                out = block.mixer(h, cache=layer_cache, attention_mask=attention_mask)
            else:
                values = None if routed is None else self.routers[delta_index - 1](routed)
                send = delta_index < len(self.routers)  # a later delta-rule layer receives what this one routes
                out, _, _, *sent = block.mixer(h, attention_mask=attention_mask,
                                               past_key_values=None if cache is None else cache.delta,
                                               use_cache=cache is not None, routed_values=values,
                                               output_routed=send)
                routed = sent[0] if send else None
                delta_index += 1
            x = x + out
            x = x + block.mlp(block.mlp_norm(x))
        logits = self.lm_head(self.final_norm(x))
        loss = None
        if labels is not None:
            check_token_ids("labels", labels, self.config.vocab_size, device, dtypes=(torch.int64,),
                            ignore_index=-100)
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, "
                                 f"got {tuple(labels.shape)}")
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return LinearLMOutput(logits, loss)

    # --- decoding (the protocol of lamina.generation) -----------------------------------------------

    def new_cache(self, batch_size: int | None = None, max_length: int | None = None) -> LinearLMCache:
        """An empty cache; with ``batch_size`` and ``max_length`` the attention layers allocate now."""
        weight = self.embed.weight
        attention = [b.mixer for b in self.blocks if isinstance(b.mixer, PrismAttention)]
        geometry = [(a.n_kv_heads, a.head_dim) for a in attention]
        return LinearLMCache(Cache(), PrismCache(len(attention), batch_size, max_length, geometry, weight.dtype,
                                                 weight.device))

    def decode(self, input_ids: torch.Tensor, cache: LinearLMCache,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``input_ids [B, T]`` after the tokens in ``cache`` and append them; logits ``[B, T, V]``.
        ``attention_mask [B, T]`` on the prefill: right padding, row ``b`` keeps its first
        ``attention_mask[b].sum()`` tokens."""
        if not isinstance(cache, LinearLMCache):
            raise TypeError(f"cache must be a LinearLMCache (from new_cache()), got {type(cache).__name__}")
        return self.forward(input_ids, cache=cache, attention_mask=attention_mask).logits


__all__ = ["LAYERS", "LinearLM", "LinearLMCache", "LinearLMConfig", "LinearLMOutput"]
