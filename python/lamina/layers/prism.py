"""Prism Transformer layers: attention with a per-layer head count, the block, the decoder.

Every layer has the same ``d_model``; only its head count ``h_l`` (and so its head
dim ``d_model // h_l``) follows a ``PrismSchedule``. The projections are
``d_model x d_model`` whatever ``h_l`` is (with GQA the key and value projections
are ``d_model x (n_kv_heads * head_dim)``), so a Prism decoder has exactly the
parameters of the uniform decoder with the same ``d_model`` and ``n_layers``
(and the same query heads per key/value head).

The modules never launch kernels: attention runs through ``lamina.prism_attention``
with the module's ``backend``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn

from lamina._dispatch import BACKENDS
from lamina._validate import check_cu_seqlens, check_tensor
from lamina.layers.rotary import RotaryEmbedding
from lamina.schedule import PrismSchedule

NORMS = ("layernorm", "rmsnorm")


def _attention_op() -> Callable[..., torch.Tensor]:
    # Imported on first use so that building a module needs neither the op module nor triton.
    from lamina.ops.prism_attention import prism_attention

    return prism_attention


def _check_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _max_seqlen(cu_seqlens: torch.Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


class KVCache:
    """Keys and values of the tokens one attention layer has seen: ``k, v: [B, S, HKV, D]``.

    ``update`` appends the new tokens' keys and values (concatenation along S) and returns
    the full ones. The cache is updated in place, so the module's output type does not
    change when decoding.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def seq_len(self) -> int:
        """Number of tokens held, S."""
        return 0 if self.k is None else self.k.shape[1]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k, v: [B, T, HKV, D]`` and return the cached ``[B, S + T, HKV, D]`` pair."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            if k.shape[0] != self.k.shape[0] or k.shape[2:] != self.k.shape[2:]:
                raise ValueError(
                    f"cache holds keys of shape [B, S, HKV, D] = {tuple(self.k.shape)}, "
                    f"cannot append keys of shape {tuple(k.shape)}"
                )
            self.k = torch.cat((self.k, k), dim=1)
            self.v = torch.cat((self.v, v), dim=1)
        return self.k, self.v

    def reset(self) -> None:
        self.k = self.v = None


class PrismCache:
    """One ``KVCache`` per layer of a ``PrismDecoder``; ``layers[l]`` belongs to block ``l``."""

    def __init__(self, n_layers: int) -> None:
        self.layers = [KVCache() for _ in range(n_layers)]

    @property
    def seq_len(self) -> int:
        return self.layers[0].seq_len if self.layers else 0

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()


class PrismAttention(nn.Module):
    """Causal (or full) softmax attention with ``n_heads`` heads of dim ``d_model // n_heads``.

    Args:
        d_model: model width; the query and output projections are ``d_model x d_model``.
        n_heads: query heads H; must divide ``d_model``. The head dim ``d_model // n_heads`` must be
            one ``lamina.prism_attention`` runs (multiples of 8 from 16 to 512); the op checks it.
        n_kv_heads: key/value heads HKV (GQA/MQA); must divide ``n_heads``. Default ``n_heads``.
        rotary: apply rotary embeddings to q and k (needs an even head dim).
        rope_base: rotary frequency base.
        bias: biases in the projections.
        backend: passed to ``lamina.prism_attention`` ("auto", "triton", "cuda", "torch").
        device, dtype: where and in which dtype the parameters are created (``device="meta"``
            builds shapes only).

    Shapes: ``x: [B, T, d_model]`` -> ``[B, T, d_model]``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        rotary: bool = True,
        rope_base: float = 10000.0,
        bias: bool = False,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_int("d_model", d_model)
        _check_int("n_heads", n_heads)
        n_kv_heads = n_heads if n_kv_heads is None else _check_int("n_kv_heads", n_kv_heads)
        if d_model % n_heads:
            raise ValueError(f"n_heads must divide d_model={d_model}, got n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads must divide n_heads={n_heads}, got n_kv_heads={n_kv_heads}")
        self.backend = _check_choice("backend", backend, BACKENDS)
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = d_model // n_heads
        self.kv_dim = n_kv_heads * self.head_dim
        factory = dict(device=device, dtype=dtype)
        self.qkv_proj = nn.Linear(d_model, d_model + 2 * self.kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.rotary = RotaryEmbedding(self.head_dim, rope_base) if rotary else None

    def project(
        self,
        x: torch.Tensor,
        offset: int = 0,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[B, T, H, Dh]``, keys and values ``[B, T, HKV, Dh]`` of ``x: [B, T, d_model]``,
        with rotary embeddings at positions ``offset + t`` (or per sequence with ``cu_seqlens``)."""
        q, k, v = self.qkv_proj(x).split((self.d_model, self.kv_dim, self.kv_dim), dim=-1)
        q = rearrange(q, "b t (h d) -> b t h d", h=self.n_heads)
        k = rearrange(k, "b t (h d) -> b t h d", h=self.n_kv_heads)
        v = rearrange(v, "b t (h d) -> b t h d", h=self.n_kv_heads)
        if self.rotary is not None:
            q, k = self.rotary(q, k, offset=offset, cu_seqlens=cu_seqlens)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        causal: bool = True,
    ) -> torch.Tensor:
        """Attend ``x: [B, T, d_model]`` to itself and to the tokens in ``cache``.

        Args:
            x: ``[B, T, d_model]``.
            cache: keys and values of earlier tokens; updated in place with this call's tokens.
                The new tokens sit at positions ``cache.seq_len .. cache.seq_len + T - 1`` and,
                when causal, token ``t`` sees every cached token and new tokens ``<= t``.
            cu_seqlens: ``[N + 1]`` offsets of sequences packed along T (B = 1); not with ``cache``.
            causal: mask future tokens.

        Returns: ``[B, T, d_model]``.
        """
        check_tensor("x", x, ndim=3)
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape [B, T, d_model={self.d_model}], got {tuple(x.shape)}")
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
        if cache is not None and cu_seqlens is not None:
            raise ValueError("cache and cu_seqlens cannot be combined: decode packed sequences one batch row each")
        check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1])
        offset = 0 if cache is None else cache.seq_len
        q, k, v = self.project(x, offset=offset, cu_seqlens=cu_seqlens)
        if cache is not None:
            k, v = cache.update(k, v)
        varlen = {}
        if cu_seqlens is not None:
            max_len = _max_seqlen(cu_seqlens)
            varlen = dict(
                cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_len, max_seqlen_k=max_len
            )
        o = _attention_op()(q, k, v, causal=causal, backend=self.backend, **varlen)
        return self.out_proj(rearrange(o, "b t h d -> b t (h d)"))

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"head_dim={self.head_dim}, backend={self.backend!r}"
        )


def _norm(kind: str, d_model: int, eps: float, bias: bool, factory: dict) -> nn.Module:
    if kind == "rmsnorm":
        return nn.RMSNorm(d_model, eps=eps, **factory)
    return nn.LayerNorm(d_model, eps=eps, bias=bias, **factory)


class PrismBlock(nn.Module):
    """Pre-norm Transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Args:
        d_model, n_heads, n_kv_heads, rotary, rope_base, bias, backend: as in ``PrismAttention``.
        mlp_ratio: MLP hidden width over ``d_model`` (GELU MLP, 4 in GPT-2).
        norm: "layernorm" or "rmsnorm".
        norm_eps: epsilon of the norms.
        device, dtype: as in ``PrismAttention``.

    Shapes: ``x: [B, T, d_model]`` -> ``[B, T, d_model]``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        mlp_ratio: float = 4.0,
        bias: bool = False,
        norm: str = "layernorm",
        norm_eps: float = 1e-5,
        rotary: bool = True,
        rope_base: float = 10000.0,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_choice("norm", norm, NORMS)
        if not isinstance(mlp_ratio, (int, float)) or isinstance(mlp_ratio, bool) or mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be a positive number, got {mlp_ratio!r}")
        hidden = int(round(mlp_ratio * d_model))
        factory = dict(device=device, dtype=dtype)
        self.attn_norm = _norm(norm, d_model, norm_eps, bias, factory)
        self.attn = PrismAttention(d_model, n_heads, n_kv_heads, rotary, rope_base, bias, backend, **factory)
        self.mlp_norm = _norm(norm, d_model, norm_eps, bias, factory)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, hidden, bias=bias, **factory),
            nn.GELU(approximate="tanh"),
            nn.Linear(hidden, d_model, bias=bias, **factory),
        )

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        causal: bool = True,
    ) -> torch.Tensor:
        """``x: [B, T, d_model]`` -> ``[B, T, d_model]``; ``cache``, ``cu_seqlens``, ``causal`` as in
        ``PrismAttention.forward``."""
        x = x + self.attn(self.attn_norm(x), cache=cache, cu_seqlens=cu_seqlens, causal=causal)
        return x + self.mlp(self.mlp_norm(x))


@dataclass(frozen=True)
class PrismDecoderConfig:
    """Configuration of a ``PrismDecoder``.

    The head schedule is ``PrismSchedule(d_model, n_layers, h_base, widths=widths, preset=preset)``,
    or the uniform one (``h_base`` heads everywhere) when neither ``widths`` nor ``preset`` is given.

    Args:
        vocab_size: number of token ids.
        d_model, n_layers, h_base, widths, preset: the schedule (see ``PrismSchedule``).
        kv_group_size: query heads per key/value head (1: multi-head; >1: GQA). Must divide every
            ``h_l``; the key/value width ``d_model / kv_group_size`` is then the same in every layer,
            so the parameter count still equals the uniform model's with the same group size.
        mlp_ratio, bias, norm, norm_eps, rotary, rope_base, backend: as in ``PrismBlock``.
        tie_embeddings: share the embedding matrix with the LM head.
        init_std: standard deviation of the normal weight initialisation (GPT-2: 0.02); the
            residual output projections use ``init_std / sqrt(2 * n_layers)``.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    h_base: int
    widths: tuple[int, ...] | None = None
    preset: str | None = None
    kv_group_size: int = 1
    mlp_ratio: float = 4.0
    bias: bool = False
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    rotary: bool = True
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    init_std: float = 0.02
    backend: str = "auto"

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size)
        _check_int("kv_group_size", self.kv_group_size)
        _check_choice("norm", self.norm, NORMS)
        _check_choice("backend", self.backend, BACKENDS)
        if self.widths is not None:
            object.__setattr__(self, "widths", tuple(self.widths))
        schedule = self.schedule()
        for layer, h in enumerate(schedule.heads):
            if h % self.kv_group_size:
                raise ValueError(
                    f"kv_group_size={self.kv_group_size} must divide the head count of every layer, "
                    f"got h={h} at layer {layer}"
                )

    @classmethod
    def from_preset(cls, name: str, vocab_size: int, **kwargs: object) -> PrismDecoderConfig:
        """Config for ``PrismSchedule`` preset ``name``; ``kwargs`` set the other fields."""
        s = PrismSchedule.from_preset(name)
        return cls(vocab_size, s.d_model, s.n_layers, s.h_base, preset=name, **kwargs)

    def schedule(self) -> PrismSchedule:
        if self.widths is None and self.preset is None:
            return PrismSchedule.uniform(self.d_model, self.n_layers, self.h_base)
        return PrismSchedule(self.d_model, self.n_layers, self.h_base, widths=self.widths, preset=self.preset)

    def uniform(self) -> PrismDecoderConfig:
        """The same config with the uniform schedule (``h_base`` heads in every layer)."""
        return dataclasses.replace(self, widths=None, preset=None)


class PrismDecoder(nn.Module):
    """Decoder-only language model whose blocks follow a ``PrismSchedule``.

    Token embedding, ``n_layers`` ``PrismBlock``s (block ``l`` has ``schedule.heads[l]`` heads),
    final norm, LM head. Shapes: ``input_ids: [B, T]`` (int) -> logits ``[B, T, vocab_size]``.
    ``device`` and ``dtype`` say where the parameters are created; ``device="meta"`` builds the
    shapes only (e.g. to count the parameters of a large preset).
    """

    def __init__(
        self,
        config: PrismDecoderConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, PrismDecoderConfig):
            raise TypeError(f"config must be a PrismDecoderConfig, got {type(config).__name__}")
        self.config = config
        self.schedule = config.schedule()
        c = config
        factory = dict(device=device, dtype=dtype)
        self.embed = nn.Embedding(c.vocab_size, c.d_model, **factory)
        self.blocks = nn.ModuleList(
            PrismBlock(
                c.d_model,
                h,
                h // c.kv_group_size,
                mlp_ratio=c.mlp_ratio,
                bias=c.bias,
                norm=c.norm,
                norm_eps=c.norm_eps,
                rotary=c.rotary,
                rope_base=c.rope_base,
                backend=c.backend,
                **factory,
            )
            for h in self.schedule.heads
        )
        self.final_norm = _norm(c.norm, c.d_model, c.norm_eps, c.bias, factory)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False, **factory)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: normal(0, init_std) weights, zero biases, unit norm weights, and
        residual output projections scaled down by ``sqrt(2 * n_layers)``."""
        if self.embed.weight.is_meta:  # shapes only, no data to initialise (call again after to_empty)
            return
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.out_proj.weight, 0.0, residual_std)
            nn.init.normal_(block.mlp[-1].weight, 0.0, residual_std)

    def new_cache(self) -> PrismCache:
        """An empty KV cache for incremental decoding with ``forward(..., cache=...)``."""
        return PrismCache(len(self.blocks))

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: PrismCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]`` for ``input_ids: [B, T]``.

        Args:
            input_ids: ``[B, T]`` int32/int64 token ids.
            cache: from ``new_cache()``; updated in place. Decoding token by token with a cache
                gives the logits of the full causal forward.
            cu_seqlens: ``[N + 1]`` offsets of sequences packed along T (B = 1); not with ``cache``.
        """
        check_tensor("input_ids", input_ids, ndim=2, dtypes=(torch.int32, torch.int64))
        if cache is not None:
            if not isinstance(cache, PrismCache):
                raise TypeError(f"cache must be a PrismCache (from new_cache()), got {type(cache).__name__}")
            if len(cache.layers) != len(self.blocks):
                raise ValueError(f"cache must have {len(self.blocks)} layers, got {len(cache.layers)}")
        x = self.embed(input_ids)
        for layer, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache.layers[layer]
            x = block(x, cache=layer_cache, cu_seqlens=cu_seqlens)
        return self.lm_head(self.final_norm(x))
