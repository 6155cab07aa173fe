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
from typing import Any

import torch
from einops import rearrange
from torch import nn

from lamina._dispatch import BACKENDS
from lamina._validate import check_bool, check_layer_input, check_same_device, check_token_ids, read_offsets
from lamina.generation import GenerationMixin, prefix_lengths
from lamina.layers.rotary import RotaryEmbedding, apply_rotary, rotary_positions
from lamina.schedule import PrismSchedule

NORMS = ("layernorm", "rmsnorm")


def _attention_with_layout() -> Callable[..., torch.Tensor]:
    # Imported on first use so that building a module needs neither the op module nor triton.
    from lamina.ops.prism_attention import prism_attention_with_layout

    return prism_attention_with_layout


def _varlen_layout() -> type:
    from lamina.ops.prism_attention import Varlen

    return Varlen


def _kvcache_op() -> Callable[..., torch.Tensor]:
    from lamina.ops.prism_decode import prism_attention_with_kvcache

    return prism_attention_with_kvcache


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


# A cache created without max_length allocates this many positions per sequence at a time: on a
# step that does not fit it grows to the next multiple (at least doubling), copying its contents.
GROWTH_GRANULE = 64


class KVCache:
    """Keys and values of one attention layer, preallocated and written in place by the attention op.

    Holds ``k_cache, v_cache``: ``[B, capacity, HKV, D]``, or with ``block_size`` the paged pool
    ``[B * blocks_per_seq, block_size, HKV, D]`` with ``block_table [B, blocks_per_seq]`` int32
    (block ``i`` of sequence ``b`` is block ``i * B + b``), and ``cache_seqlens [B]`` int32, the
    tokens each sequence holds. ``lamina.prism_attention_with_kvcache`` writes new keys at
    ``cache_seqlens[b] ..``; ``advance`` then moves the lengths (``PrismAttention`` does both).

    Args:
        batch_size, n_kv_heads, head_dim, dtype, device: the cache's geometry. With batch_size,
            max_length, n_kv_heads and head_dim all given the cache is allocated here (default
            dtype ``torch.get_default_dtype()``, device CPU); otherwise on the first write, taking
            what was not given from the keys written.
        max_length: tokens per sequence the cache holds. None: the cache starts at the first
            step's length rounded up to ``GROWTH_GRANULE`` and grows (a copy) when a step does not
            fit; give it to allocate once (needed to capture decoding in a CUDA graph: replays
            advance ``cache_seqlens`` on the device, ``seq_len`` counts the eager calls only).
        block_size: page size of a paged cache; None: contiguous.
    """

    def __init__(
        self,
        batch_size: int | None = None,
        max_length: int | None = None,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        block_size: int | None = None,
    ) -> None:
        for name, value in (("batch_size", batch_size), ("max_length", max_length), ("n_kv_heads", n_kv_heads),
                            ("head_dim", head_dim), ("block_size", block_size)):
            if value is not None:
                _check_int(name, value)
        self.batch_size, self.max_length, self.block_size = batch_size, max_length, block_size
        self.n_kv_heads, self.head_dim, self.dtype = n_kv_heads, head_dim, dtype
        self.device = None if device is None else torch.device(device)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.block_table: torch.Tensor | None = None
        self.cache_seqlens: torch.Tensor | None = None
        self.capacity = 0
        self._longest = 0  # host copy of cache_seqlens.max(), so that a step needs no device read
        if None not in (batch_size, max_length, n_kv_heads, head_dim):
            self._allocate(max_length)

    @property
    def seq_len(self) -> int:
        """Tokens held by the longest sequence."""
        return self._longest

    @property
    def k(self) -> torch.Tensor | None:
        """The keys held, ``[B, seq_len, HKV, D]`` (positions past a shorter sequence's length are
        unspecified); None before the first update."""
        return self._held(self.k_cache)

    @property
    def v(self) -> torch.Tensor | None:
        """The values held, as ``k``."""
        return self._held(self.v_cache)

    def _held(self, pool: torch.Tensor | None) -> torch.Tensor | None:
        if pool is None:
            return None
        if self.block_table is None:
            return pool[:, : self._longest]
        pos = torch.arange(self._longest, device=pool.device)
        return pool[self.block_table.long()[:, pos // self.block_size], pos % self.block_size]

    def _allocate(self, capacity: int) -> None:
        """Allocate (or grow to) ``capacity`` positions per sequence, keeping what is held."""
        B, shape = self.batch_size, (self.n_kv_heads, self.head_dim)
        factory = dict(dtype=self.dtype or torch.get_default_dtype(), device=self.device)
        old_k, old_v = self.k_cache, self.v_cache
        if self.block_size is None:
            self.k_cache = torch.zeros((B, capacity, *shape), **factory)
            self.v_cache = torch.zeros((B, capacity, *shape), **factory)
            if old_k is not None:
                self.k_cache[:, : self.capacity] = old_k
                self.v_cache[:, : self.capacity] = old_v
        else:
            blocks = -(-capacity // self.block_size)
            capacity = blocks * self.block_size
            # block ids i * B + b: growing appends blocks at the end and keeps every id in place
            added = (B * blocks - (0 if old_k is None else old_k.shape[0]), self.block_size, *shape)
            fresh_k, fresh_v = torch.zeros(added, **factory), torch.zeros(added, **factory)
            self.k_cache = fresh_k if old_k is None else torch.cat((old_k, fresh_k))
            self.v_cache = fresh_v if old_v is None else torch.cat((old_v, fresh_v))
            ids = torch.arange(blocks, device=self.device)[None, :] * B + torch.arange(B, device=self.device)[:, None]
            self.block_table = ids.to(torch.int32)
        if self.cache_seqlens is None:
            self.cache_seqlens = torch.zeros(B, dtype=torch.int32, device=self.device)
        self.capacity = capacity

    def prepare(self, k: torch.Tensor) -> None:
        """Make room for the new keys ``k: [B, T, HKV, D]``: allocate on first use, grow a cache without
        ``max_length``, or raise ValueError when they do not fit."""
        B, T, n_kv_heads, head_dim = k.shape
        if self.k_cache is None:
            self.batch_size = self.batch_size or B
            self.n_kv_heads = self.n_kv_heads or n_kv_heads
            self.head_dim = self.head_dim or head_dim
            self.dtype = self.dtype or k.dtype
            self.device = self.device or k.device
            if self.max_length is None:
                self._allocate(-(-T // GROWTH_GRANULE) * GROWTH_GRANULE)
            else:
                self._allocate(self.max_length)
        held = (self.batch_size, self.capacity, self.n_kv_heads, self.head_dim)
        if (B, n_kv_heads, head_dim) != (self.batch_size, self.n_kv_heads, self.head_dim):
            raise ValueError(f"cache holds keys of shape [B, S, HKV, D] = {held}, cannot append keys of shape "
                             f"{tuple(k.shape)}")
        if k.dtype != self.k_cache.dtype or k.device != self.k_cache.device:
            raise ValueError(f"cache holds {self.k_cache.dtype} keys on {self.k_cache.device}, cannot append "
                             f"{k.dtype} keys on {k.device}")
        need = self._longest + T
        if self.max_length is not None and need > self.max_length:
            raise ValueError(f"cache holds at most max_length={self.max_length} tokens per sequence, cannot "
                             f"append {T} to a sequence of {self._longest}")
        if need > self.capacity:
            self._allocate(max(2 * self.capacity, -(-need // GROWTH_GRANULE) * GROWTH_GRANULE))

    def positions(self, seq_len: int) -> torch.Tensor:
        """Positions ``[B, T]`` of ``seq_len`` new tokens: ``cache_seqlens[b] + t``."""
        return self.cache_seqlens.long()[:, None] + torch.arange(seq_len, device=self.cache_seqlens.device)

    def advance(self, tokens: int | torch.Tensor) -> None:
        """Count ``tokens`` more (an int, or ``[B]`` per sequence) after they were written."""
        self.cache_seqlens += tokens
        self._longest = self._longest + tokens if isinstance(tokens, int) else int(self.cache_seqlens.max())

    def reset(self) -> None:
        """Forget every token (the memory stays allocated)."""
        if self.cache_seqlens is not None:
            self.cache_seqlens.zero_()
        self._longest = 0


class PrismCache:
    """One ``KVCache`` per layer of a ``PrismDecoder``; ``layers[l]`` belongs to block ``l``.

    ``geometry``: per layer ``(n_kv_heads, head_dim)``; with ``batch_size`` and ``max_length`` the
    layers are allocated now (``dtype``, ``device``), otherwise on first use. ``block_size``: paged.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int | None = None,
        max_length: int | None = None,
        geometry: list[tuple[int, int]] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        block_size: int | None = None,
    ) -> None:
        geometry = geometry or [(None, None)] * n_layers
        if len(geometry) != n_layers:
            raise ValueError(f"geometry must give (n_kv_heads, head_dim) for {n_layers} layers, got {len(geometry)}")
        self.layers = [KVCache(batch_size, max_length, hkv, d, dtype, device, block_size) for hkv, d in geometry]

    @property
    def seq_len(self) -> int:
        return self.layers[0].seq_len if self.layers else 0

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()


def _kept_tokens(attention_mask: torch.Tensor | None, B: int, T: int, device: torch.device) -> int | torch.Tensor:
    """Tokens each row keeps in the cache: T, or ``attention_mask.sum(1)`` checked to be a prefix of ones."""
    counts = prefix_lengths(attention_mask, B, T, device)
    return T if counts is None else counts.to(torch.int32)


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
        q, k, v = self._qkv(x)
        if self.rotary is not None:
            q, k = self.rotary(q, k, offset=offset, cu_seqlens=cu_seqlens)
        return q, k, v

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values before rotary embeddings."""
        q, k, v = self.qkv_proj(x).split((self.d_model, self.kv_dim, self.kv_dim), dim=-1)
        q = rearrange(q, "b t (h d) -> b t h d", h=self.n_heads)
        k = rearrange(k, "b t (h d) -> b t h d", h=self.n_kv_heads)
        v = rearrange(v, "b t (h d) -> b t h d", h=self.n_kv_heads)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        causal: bool = True,
        attention_mask: torch.Tensor | None = None,
        cp_context: Any | None = None,
    ) -> torch.Tensor:
        """Attend ``x: [B, T, d_model]`` to itself and to the tokens in ``cache``.

        Args:
            x: ``[B, T, d_model]``.
            cache: keys and values of earlier tokens, written in place with this call's tokens
                (``lamina.prism_attention_with_kvcache``; no gradient flows through a cached call).
                Row ``b``'s new tokens sit at positions ``cache.cache_seqlens[b] + t`` (rotary
                positions too) and, when causal, token ``t`` sees the row's cached tokens and new
                tokens ``<= t``.
            cu_seqlens: ``[N + 1]`` offsets of sequences packed along T (B = 1); not with ``cache``.
            causal: mask future tokens.
            attention_mask: with ``cache`` only: ``[B, T]`` 0/1 with the ones first in every row (right
                padding); row ``b`` keeps its first ``attention_mask[b].sum()`` tokens in the cache
                (the outputs at its padding are unspecified). None: every row keeps all T.
            cp_context: a ``lamina.distributed.ContextParallel``: ``x`` holds this rank's tokens of sequences
                split across its ranks (``cp.shard``); rotary positions are the whole sequences' and the
                attention is context-parallel (``prism_attention(cp_context=)``). Not with ``cache`` or
                ``cu_seqlens`` (the packed layout is the context's).

        Returns: ``[B, T, d_model]``.
        """
        check_layer_input("x", x, self, width=self.d_model, width_name="d_model")
        causal = check_bool("causal", causal)
        if cp_context is not None:
            return self._forward_context_parallel(x, causal, cp_context, cache, cu_seqlens, attention_mask)
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
        if cache is not None and cu_seqlens is not None:
            raise ValueError("cache and cu_seqlens cannot be combined: decode packed sequences one batch row each")
        if cache is None and attention_mask is not None:
            raise ValueError("attention_mask needs a cache: it says how many tokens each row keeps in it")
        varlen = None
        if cu_seqlens is not None:  # the one host read of a varlen call
            check_same_device(x=x, cu_seqlens=cu_seqlens)
            offs = read_offsets(x.shape[0], {"cu_seqlens": (cu_seqlens, x.shape[1])})["cu_seqlens"]
            longest = max(b - a for a, b in zip(offs[:-1], offs[1:]))
            varlen = _varlen_layout()(offs, offs, longest, longest)
        if cache is not None:
            return self._forward_cached(x, cache, causal, attention_mask)
        q, k, v = self.project(x, cu_seqlens=cu_seqlens)
        o = _attention_with_layout()(q, k, v, causal, None, cu_seqlens, cu_seqlens, None, None, False, self.backend,
                                     layout=varlen)
        return self.out_proj(rearrange(o, "b t h d -> b t (h d)"))

    def _forward_context_parallel(self, x: torch.Tensor, causal: bool, cp: Any, cache: KVCache | None,
                                  cu_seqlens: torch.Tensor | None, attention_mask: torch.Tensor | None) -> torch.Tensor:
        from lamina.distributed import ContextParallel

        if not isinstance(cp, ContextParallel):
            raise TypeError(f"cp_context must be a lamina.distributed.ContextParallel, got {type(cp).__name__}")
        for arg, given in (("cache", cache), ("cu_seqlens", cu_seqlens), ("attention_mask", attention_mask)):
            if given is not None:
                raise ValueError(f"PrismAttention: {arg} cannot be combined with cp_context (training and prefill of "
                                 "whole sequences; the packed layout is the context's)")
        T = x.shape[1]
        if cp.cu_seqlens is not None and cp.cu_seqlens[-1] != T * cp.world_size:
            raise ValueError(f"PrismAttention: the context's cu_seqlens pack {cp.cu_seqlens[-1]} tokens, but "
                             f"{cp.world_size} ranks x {T} local tokens = {T * cp.world_size}")
        q, k, v = self._qkv(x)
        if self.rotary is not None:
            layout = None if cp.cu_seqlens is None else torch.tensor(cp.cu_seqlens, device=x.device)
            positions = cp.shard(rotary_positions(T * cp.world_size, 0, layout, device=x.device), dim=0)
            q, k = self.rotary(q, k, positions=positions)
        from lamina.ops.prism_attention import prism_attention

        o = prism_attention(q, k, v, causal=causal, backend=self.backend, cp_context=cp)
        return self.out_proj(rearrange(o, "b t h d -> b t (h d)"))

    def _forward_cached(self, x: torch.Tensor, cache: KVCache, causal: bool,
                        attention_mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        kept = _kept_tokens(attention_mask, B, T, x.device)
        q, k, v = self._qkv(x)
        cache.prepare(k)
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(cache.positions(T), q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = _kvcache_op()(q, cache.k_cache, cache.v_cache, k, v, cache_seqlens=cache.cache_seqlens,
                          block_table=cache.block_table, causal=causal, backend=self.backend)
        cache.advance(kept)
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
        attention_mask: torch.Tensor | None = None,
        cp_context: Any | None = None,
    ) -> torch.Tensor:
        """``x: [B, T, d_model]`` -> ``[B, T, d_model]``; ``cache``, ``cu_seqlens``, ``causal``,
        ``attention_mask``, ``cp_context`` as in ``PrismAttention.forward``."""
        check_layer_input("x", x, self, width=self.attn.d_model, width_name="d_model")
        x = x + self.attn(self.attn_norm(x), cache=cache, cu_seqlens=cu_seqlens, causal=causal,
                          attention_mask=attention_mask, cp_context=cp_context)
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
        for name in ("vocab_size", "d_model", "n_layers", "h_base"):
            _check_int(name, getattr(self, name))
        _check_int("kv_group_size", self.kv_group_size)
        _check_choice("norm", self.norm, NORMS)
        _check_choice("backend", self.backend, BACKENDS)
        if self.widths is not None:
            object.__setattr__(self, "widths", tuple(self.widths))
        schedule = self.schedule()
        for layer, h in enumerate(schedule.heads):
            if self.rotary and (self.d_model // h) % 2:
                raise ValueError(f"d_model / h must be even for rotary embeddings (rotary=True), got d_model="
                                 f"{self.d_model} with h={h} heads at layer {layer} (head dim {self.d_model // h})")
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


class PrismDecoder(GenerationMixin, nn.Module):
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

    def new_cache(
        self,
        batch_size: int | None = None,
        max_length: int | None = None,
        block_size: int | None = None,
    ) -> PrismCache:
        """A KV cache for decoding with ``forward(..., cache=...)`` or ``decode``.

        With ``batch_size`` and ``max_length`` (tokens per row, prompt included) every layer's cache
        is allocated now in the parameters' dtype and device; otherwise on first use, growing when
        ``max_length`` is None. ``block_size``: a paged cache (see ``KVCache``).
        """
        weight = self.embed.weight
        geometry = [(block.attn.n_kv_heads, block.attn.head_dim) for block in self.blocks]
        return PrismCache(len(self.blocks), batch_size, max_length, geometry, weight.dtype, weight.device, block_size)

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: PrismCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]`` for ``input_ids: [B, T]``.

        Args:
            input_ids: ``[B, T]`` int32/int64 token ids.
            cache: from ``new_cache()``; updated in place. Decoding token by token with a cache
                gives the logits of the full causal forward.
            cu_seqlens: ``[N + 1]`` offsets of sequences packed along T (B = 1); not with ``cache``.
            attention_mask: with ``cache`` only: ``[B, T]`` right padding, row ``b`` keeps its first
                ``attention_mask[b].sum()`` tokens (see ``PrismAttention.forward``).
        """
        check_token_ids("input_ids", input_ids, self.config.vocab_size, self.embed.weight.device)
        if cache is not None:
            if not isinstance(cache, PrismCache):
                raise TypeError(f"cache must be a PrismCache (from new_cache()), got {type(cache).__name__}")
            if len(cache.layers) != len(self.blocks):
                raise ValueError(f"cache must have {len(self.blocks)} layers, got {len(cache.layers)}")
        x = self.embed(input_ids)
        for layer, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache.layers[layer]
            x = block(x, cache=layer_cache, cu_seqlens=cu_seqlens, attention_mask=attention_mask)
        return self.lm_head(self.final_norm(x))

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, cache: PrismCache,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The ``lamina.generation`` protocol: run ``input_ids [B, T]`` after the tokens in ``cache`` and
        append them; logits ``[B, T, vocab_size]``. ``attention_mask [B, T]``: right padding, row ``b``
        keeps its first ``attention_mask[b].sum()`` tokens (its rotary positions follow its own length)."""
        if not isinstance(cache, PrismCache):
            raise TypeError(f"cache must be a PrismCache (from new_cache()), got {type(cache).__name__}")
        return self.forward(input_ids, cache=cache, attention_mask=attention_mask)
