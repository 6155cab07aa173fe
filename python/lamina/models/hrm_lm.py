"""HRM-LM: a small causal language model whose depth is an ``HRMCore`` recurrence.

Embedding -> HRMCore (a fast and a slow block, shared over M steps) -> RMSNorm -> tied LM head.
``parameter_report`` compares its stored parameters with an L-layer transformer of the same
width, where L is the number of block applications of one pass (M fast + n_cycles slow steps;
M in flat mode): the recurrence stores 2 blocks (1 in flat mode) where the stack stores L.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(self.norm1(x)), "b t (three h d) -> three b h t d", three=3, h=self.n_heads)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(rearrange(attn, "b h t d -> b t (h d)"))
        return x + self.mlp(self.norm2(x))


def default_block(config: HRMLMConfig) -> nn.Module:
    return CausalBlock(config.d_model, config.n_heads, config.mlp_ratio)


@dataclass
class HRMLMOutput:
    """``logits``: one [B, T, V] tensor per supervision pass; ``loss``: their mean cross-entropy."""

    logits: list[torch.Tensor]
    loss: torch.Tensor | None = None


class HRMLM(nn.Module):
    """Causal LM: token + position embedding, ``HRMCore``, RMSNorm, LM head tied to the embedding.

    ``block_factory(config)`` builds the fast and slow blocks (default: ``CausalBlock``; any
    [B, T, D] -> [B, T, D] module works, e.g. a Prism or delta-rule block).
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

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> HRMLMOutput:
        """input_ids: [B, T] int64, T <= max_seq_len; targets: [B, T] (ignore_index -100) or None."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape [B, T], got {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.config.max_seq_len}")
        # scaled to unit RMS, the scale of the HRM states (the embedding is tied to the head at std D^-1/2)
        x = (self.embed(input_ids) + self.pos(torch.arange(t, device=input_ids.device))) * self.config.d_model ** 0.5
        logits = [self.norm(out) @ self.embed.weight.t() for out in self.core(x)]
        loss = None
        if targets is not None:
            losses = [F.cross_entropy(rearrange(lg, "b t v -> (b t) v"), rearrange(targets, "b t -> (b t)"),
                                      ignore_index=-100) for lg in logits]
            loss = torch.stack(losses).mean()
        return HRMLMOutput(logits, loss)


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
