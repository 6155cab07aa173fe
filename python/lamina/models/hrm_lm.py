"""HRM-LM: a small causal language model whose depth is an ``HRMCore`` recurrence.

Embedding -> HRMCore (a fast and a slow block, shared over M steps) -> RMSNorm -> tied LM head.
``parameter_report`` compares its stored parameters with an L-layer transformer of the same
width, where L is the number of block applications of one pass (M fast + n_cycles slow steps;
M in flat mode): the recurrence stores 2 blocks (1 in flat mode) where the stack stores L.

Decoding (``new_cache``, ``decode``, ``generate``; the protocol of ``lamina.generation``): every
block application (pass p, step i, fast or slow) attends to the earlier tokens' keys and values
at that same application, so the cache holds one preallocated key/value buffer per application,
``[B, max_length, H, Dh]``, written in place at each row's own position. A new token's
hierarchical states are then computed from its embedding and those buffers alone: the per-token
states of the earlier tokens live on in their cached keys and values.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from lamina import generation
from lamina._validate import check_positive_int, check_tensor, check_token_ids
from lamina.layers.hrm import MODES, HRMCore


@dataclass
class HRMLMConfig:
    """Shape of an HRM-LM. The defaults are the CPU test size (d_model 64)."""

    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    mlp_ratio: int = 4
    max_seq_len: int = 256
    n_cycles: int = 2
    steps_per_cycle: int = 2
    grad_steps: int = 2
    passes: int = 1
    mode: str = "hierarchical"
    gate: str = "channel"
    norm: bool = True
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "mlp_ratio", "max_seq_len", "n_cycles", "steps_per_cycle",
                     "grad_steps", "passes"):
            check_positive_int(name, getattr(self, name))
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @property
    def steps(self) -> int:
        """M = n_cycles * steps_per_cycle."""
        return self.n_cycles * self.steps_per_cycle

    @property
    def depth(self) -> int:
        """L: block applications in one pass (the depth of the equivalent stacked transformer)."""
        return self.steps if self.mode == "flat" else self.steps + self.n_cycles

    @classmethod
    def family(cls, size: str, **overrides) -> HRMLMConfig:
        """A member of the shape family: widths of GPT-2 small/medium-like models, 2 cycles of 4 steps.

        ``size``: "tiny" (d 64), "small" (d 768, 12 heads), "medium" (d 1024, 16 heads).
        """
        shapes = {
            "tiny": {"d_model": 64, "n_heads": 4, "vocab_size": 256, "max_seq_len": 256},
            "small": {"d_model": 768, "n_heads": 12, "vocab_size": 50304, "max_seq_len": 1024},
            "medium": {"d_model": 1024, "n_heads": 16, "vocab_size": 50304, "max_seq_len": 1024},
        }
        if size not in shapes:
            raise ValueError(f"size must be one of {sorted(shapes)}, got {size!r}")
        base = {"n_cycles": 2, "steps_per_cycle": 4, "grad_steps": 4, **shapes[size]}
        return cls(**{**base, **overrides})


@dataclass(frozen=True)
class AttentionCache:
    """What one block application sees of the decoding cache during one ``HRMLM.decode`` call.

    k, v: ``[B, S, H, Dh]`` buffers of this application (``S`` the cache's ``max_length``), written
    in place; positions: ``[B, T]`` int64, where row b's new tokens go; visible: ``[B, 1, T, span]``
    bool, whether query t of row b reads key position s (``s <= positions[b, t]``: causal per row),
    ``span > max(positions)``. positions and visible are the same for every application.
    """

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor


class CausalBlock(nn.Module):
    """Pre-norm transformer block: causal multi-head attention and a GELU MLP. [B, T, D] -> [B, T, D]."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.norm2 = nn.RMSNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model, bias=False), nn.GELU(),
            nn.Linear(mlp_ratio * d_model, d_model, bias=False),
        )

    def forward(self, x: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        """x: [B, T, D]. With ``cache`` row b's T tokens take ``cache.positions[b]`` after the tokens
        whose keys and values the cache holds; theirs are written into it."""
        q, k, v = rearrange(self.qkv(self.norm1(x)), "b t (three h d) -> three b h t d", three=3, h=self.n_heads)
        if cache is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            attn = self._cached_attention(q, k, v, cache)
        x = x + self.proj(rearrange(attn, "b h t d -> b t (h d)"))
        return x + self.mlp(self.norm2(x))

    @staticmethod
    def _cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        """q, k, v: [B, H, T, Dh] of the new tokens -> attention output [B, H, T, Dh]."""
        rows = torch.arange(q.shape[0], device=q.device)[:, None]
        cache.k[rows, cache.positions] = rearrange(k, "b h t d -> b t h d").to(cache.k.dtype)
        cache.v[rows, cache.positions] = rearrange(v, "b h t d -> b t h d").to(cache.v.dtype)
        span = cache.visible.shape[-1]
        keys, values = (rearrange(t[:, :span], "b s h d -> b h s d").to(q.dtype) for t in (cache.k, cache.v))
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=cache.visible)


def default_block(config: HRMLMConfig) -> nn.Module:
    return CausalBlock(config.d_model, config.n_heads, config.mlp_ratio)


@dataclass
class HRMLMOutput:
    """``logits``: one [B, T, V] tensor per supervision pass; ``loss``: their mean cross-entropy."""

    logits: list[torch.Tensor]
    loss: torch.Tensor | None = None


class HRMLMCache:
    """Decoding cache of an ``HRMLM`` (from ``new_cache``).

    keys, values: one ``[B, max_length, H, Dh]`` buffer each per block application (in the order of
    ``HRMCore.block_schedule()``); lengths: ``[B]`` int64, the tokens each row holds; bound: a
    host-side upper bound of ``max(lengths)`` (the tokens given so far), so that a decoding step
    needs no device-to-host copy to know how many key positions it reads.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: torch.Tensor) -> None:
        self.keys, self.values, self.lengths = keys, values, lengths
        self.bound = 0

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_length(self) -> int:
        return self.keys[0].shape[1]


class HRMLM(generation.GenerationMixin, nn.Module):
    """Causal LM: token + position embedding, ``HRMCore``, RMSNorm, LM head tied to the embedding.

    ``block_factory(config)`` builds the fast and slow blocks (default: ``CausalBlock``; any
    [B, T, D] -> [B, T, D] module works, e.g. a Prism or delta-rule block). Decoding with a cache
    needs blocks whose forward takes ``cache=`` an ``AttentionCache`` (as ``CausalBlock``'s does).
    """

    def __init__(self, config: HRMLMConfig,
                 block_factory: Callable[[HRMLMConfig], nn.Module] = default_block) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.max_seq_len, config.d_model)
        slow = None if config.mode == "flat" else block_factory(config)
        self.core = HRMCore(
            block_factory(config), slow, config.d_model, config.n_cycles, config.steps_per_cycle,
            config.grad_steps, passes=config.passes, mode=config.mode, gate=config.gate, norm=config.norm,
            backend=config.backend,
        )
        self.norm = nn.RMSNorm(config.d_model)
        nn.init.normal_(self.embed.weight, std=config.d_model ** -0.5)
        nn.init.normal_(self.pos.weight, std=config.d_model ** -0.5)

    def _encode(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # scaled to unit RMS, the scale of the HRM states (the embedding is tied to the head at std D^-1/2)
        return (self.embed(input_ids) + self.pos(positions)) * self.config.d_model ** 0.5

    def _head(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out) @ self.embed.weight.t()

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> HRMLMOutput:
        """input_ids: [B, T] int32/int64, T <= max_seq_len; targets: [B, T] int64 (ignore_index -100) or None."""
        device = self.embed.weight.device
        check_token_ids("input_ids", input_ids, self.config.vocab_size, device)
        t = input_ids.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"input_ids: sequence length {t} exceeds max_seq_len {self.config.max_seq_len}")
        if targets is not None:
            check_token_ids("targets", targets, self.config.vocab_size, device, dtypes=(torch.int64,),
                            ignore_index=-100)
            if targets.shape != input_ids.shape:
                raise ValueError(f"targets must have the shape of input_ids {tuple(input_ids.shape)}, "
                                 f"got {tuple(targets.shape)}")
        x = self._encode(input_ids, torch.arange(t, device=input_ids.device))
        logits = [self._head(out) for out in self.core(x)]
        loss = None
        if targets is not None:
            losses = [F.cross_entropy(rearrange(lg, "b t v -> (b t) v"), rearrange(targets, "b t -> (b t)"),
                                      ignore_index=-100) for lg in logits]
            loss = torch.stack(losses).mean()
        return HRMLMOutput(logits, loss)

    # --- decoding (the protocol of lamina.generation) -------------------------------------------

    def _check_decodable(self) -> None:
        for name in ("fast_block", "slow_block"):
            block = getattr(self.core, name)
            params = inspect.signature(block.forward).parameters.values() if block is not None else ()
            takes_cache = any(p.name == "cache" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
            if block is not None and not takes_cache:
                raise TypeError(f"block {name} ({type(block).__name__}) does not support decoding with a cache: "
                                "its forward takes no cache= argument (HRMLM.decode passes each block "
                                "application an AttentionCache)")

    def new_cache(self, batch_size: int, max_length: int) -> HRMLMCache:
        """An empty cache for ``batch_size`` rows of at most ``max_length <= max_seq_len`` tokens each:
        per block application ``k, v: [batch_size, max_length, n_heads, d_model // n_heads]`` (zeros)."""
        for name, value in (("batch_size", batch_size), ("max_length", max_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if max_length > self.config.max_seq_len:
            raise ValueError(f"max_length must be <= max_seq_len {self.config.max_seq_len} (the position "
                             f"embedding), got {max_length}")
        self._check_decodable()
        c, w = self.config, self.embed.weight
        shape = (batch_size, max_length, c.n_heads, c.d_model // c.n_heads)
        n = self.core.block_applications
        keys = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(n)]
        values = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(n)]
        return HRMLMCache(keys, values, torch.zeros(batch_size, dtype=torch.int64, device=w.device))

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, cache: HRMLMCache,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``input_ids [B, T]`` after the tokens in ``cache``, append them; logits ``[B, T, vocab]``
        of the last supervision pass.

        ``attention_mask [B, T]``: 0/1 with a prefix of ones per row (right padding); row b keeps its
        first ``attention_mask[b].sum()`` tokens, the logits at its padding are unspecified. None:
        every row keeps all T. Each row's tokens take the positions after its own tokens.
        """
        check_tensor("input_ids", input_ids, ndim=2, dtypes=(torch.int32, torch.int64))
        if not isinstance(cache, HRMLMCache):
            raise TypeError(f"cache must be an HRMLMCache (from new_cache()), got {type(cache).__name__}")
        self._check_decodable()
        B, T = input_ids.shape
        if B != cache.batch_size or T < 1:
            raise ValueError(f"input_ids must have shape [{cache.batch_size}, >= 1] for this cache of "
                             f"{cache.batch_size} rows, got {tuple(input_ids.shape)}")
        if cache.keys[0].device != input_ids.device:
            raise ValueError(f"input_ids must be on the cache's device {cache.keys[0].device}, got {input_ids.device}")
        counts = generation.prefix_lengths(attention_mask, B, T, input_ids.device)
        if counts is None:
            counts = torch.full((B,), T, dtype=torch.int64, device=input_ids.device)
        span = cache.bound + T  # every row's new tokens lie below it (its padding too)
        if span > cache.max_length:
            raise ValueError(f"the cache holds at most {cache.max_length} tokens per row: after {cache.bound} "
                             f"tokens it cannot take {T} more")
        positions = cache.lengths[:, None] + torch.arange(T, device=input_ids.device)  # [B, T]
        visible = torch.arange(span, device=input_ids.device)[None, None, :] <= positions[:, :, None]
        x = self._encode(input_ids, positions)
        entries = [AttentionCache(k, v, positions, visible[:, None]) for k, v in zip(cache.keys, cache.values)]
        out = self.core(x, cache=entries)[-1]
        cache.lengths = cache.lengths + counts
        cache.bound = span
        return self._head(out)


def _count(module: nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


@dataclass
class ParameterReport:
    """Stored parameters of an HRM-LM and of an L-layer transformer of the same width.

    ``*_core``: the depth-carrying part (blocks, gates, initial states); ``*_total``: with
    embeddings, final norm and (tied) head. ``reduction``: transformer_core / hrm_core.
    """

    depth: int
    stored_blocks: int
    block: int
    hrm_core: int
    hrm_total: int
    transformer_core: int
    transformer_total: int
    reduction: float = field(init=False)

    def __post_init__(self) -> None:
        self.reduction = self.transformer_core / self.hrm_core

    def __str__(self) -> str:
        return (f"L={self.depth}: HRM-LM stores {self.hrm_core:,} core / {self.hrm_total:,} total parameters, "
                f"a {self.depth}-layer transformer {self.transformer_core:,} / {self.transformer_total:,} "
                f"({self.reduction:.2f}x fewer in the core)")


def parameter_report(config: HRMLMConfig,
                     block_factory: Callable[[HRMLMConfig], nn.Module] = default_block) -> ParameterReport:
    """Count both models for ``config`` (built on the meta device: no memory is allocated)."""
    with torch.device("meta"):
        model = HRMLM(config, block_factory)
        block = _count(block_factory(config))
    core = _count(model.core)
    total = _count(model)
    stored = 1 if config.mode == "flat" else 2
    transformer_core = config.depth * block
    return ParameterReport(
        depth=config.depth, stored_blocks=stored, block=block, hrm_core=core, hrm_total=total,
        transformer_core=transformer_core, transformer_total=total - core + transformer_core,
    )
