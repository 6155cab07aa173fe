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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lamina._validate import check_positive_int, check_token_ids
from lamina.distributed import ContextParallel, all_reduce_sum, next_tokens
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
        norm_eps: RMSNorm epsilon (the blocks' norms and, as in fla's models, the layers' output norms).
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
                              routing=c.routing, norm_eps=c.norm_eps)
                kwargs.update(c.layer_kwargs)
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
        cp_context: ContextParallel | None = None,
    ) -> LinearLMOutput:
        """``input_ids [B, T]`` -> ``LinearLMOutput``. ``labels [B, T]`` (int64, -100 ignored): the loss of
        predicting ``labels[:, t + 1]`` from position ``t``. ``cache``/``attention_mask``: decoding, as in
        ``decode``.

        ``cp_context`` (``lamina.distributed.ContextParallel``): ``input_ids`` and
        ``labels`` are this rank's tokens of sequences split across the context's ranks (``cp.shard``);
        the logits are this rank's, and the loss is this rank's share scaled by the number of ranks: the
        mean over ranks is the whole sequences' loss, so the gradient averaging of data parallelism (DDP,
        FSDP) over the ranks gives its gradients."""
        device = self.embed.weight.device
        check_token_ids("input_ids", input_ids, self.config.vocab_size, device)
        if cache is not None and not isinstance(cache, LinearLMCache):
            raise TypeError(f"cache must be a LinearLMCache (from new_cache()), got {type(cache).__name__}")
        if attention_mask is not None and cache is None:
            raise ValueError("attention_mask needs a cache: it says how many tokens each row keeps in it")
        if cp_context is not None:
            if cache is not None:
                raise ValueError("cache cannot be combined with cp_context (context parallelism is for training "
                                 "and prefill; decode on one rank)")
        x = self.embed(input_ids)
        attention_index = delta_index = 0
        routed = None
        for block in self.blocks:
            h = block.mixer_norm(x)
            if isinstance(block.mixer, PrismAttention):
                layer_cache = None if cache is None else cache.attention.layers[attention_index]
                attention_index += 1
                out = block.mixer(h, cache=layer_cache, attention_mask=attention_mask, cp_context=cp_context)
            else:
                values = None if routed is None else self.routers[delta_index - 1](routed)
                send = delta_index < len(self.routers)  # a later delta-rule layer receives what this one routes
                out, _, _, *sent = block.mixer(h, attention_mask=attention_mask,
                                               past_key_values=None if cache is None else cache.delta,
                                               use_cache=cache is not None, routed_values=values,
                                               output_routed=send, cp_context=cp_context)
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
            if cp_context is None:
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                       ignore_index=-100)
            else:
                targets = next_tokens(cp_context, labels, -100)
                total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                                        reduction="sum")
                counted = all_reduce_sum(cp_context, (targets != -100).sum().float()).clamp_min(1)
                loss = total * cp_context.world_size / counted
        return LinearLMOutput(logits, loss)

    # --- weights of fla's causal LMs --------------------------------------------------------------------

    def load_fla_state_dict(self, source: nn.Module | Mapping[str, torch.Tensor]) -> None:
        """Load the weights of an fla causal LM of the same shape (``fla.models.GatedDeltaNetForCausalLM``,
        ``KDAForCausalLM``, ``DeltaNetForCausalLM``, ...: a model or its ``state_dict()``).

        fla's names map one to one: ``model.embeddings`` -> ``embed``; per block ``i``
        ``model.layers.i.attn_norm`` -> ``blocks.i.mixer_norm``, ``.attn.*`` -> ``blocks.i.mixer.*`` (the
        layers are fla's, parameter for parameter), ``.mlp_norm`` -> ``blocks.i.mlp_norm``,
        ``.mlp.gate_proj`` and ``.mlp.up_proj`` -> ``blocks.i.mlp.gate_up`` (stacked, gate first),
        ``.mlp.down_proj`` -> ``blocks.i.mlp.down``; ``model.norm`` -> ``final_norm``; ``lm_head``. The
        config must match fla's: ``mlp_ratio = intermediate_size / hidden_size``, ``norm_eps``, the
        layer's keyword arguments (e.g. ``use_short_conv``), ``tie_embeddings`` (with tied embeddings
        fla's ``lm_head``, when present, must equal its embeddings). Strict: a parameter left unfilled
        (routers excepted: they start at zero), an fla weight left over, or a shape that differs is a
        ValueError naming it. Attention blocks (``attention_every``) are not loaded (lamina's
        ``PrismAttention`` has parameters of its own): refused.
        """
        if self.config.attention_every:
            raise ValueError("load_fla_state_dict loads pure delta-rule stacks (attention_every=0); PrismAttention "
                             "blocks have no fla counterpart")
        fla = source.state_dict() if isinstance(source, nn.Module) else source
        if not isinstance(fla, Mapping):
            raise TypeError(f"source must be an fla model or its state_dict, got {type(source).__name__}")
        fla = dict(fla)
        ours: dict[str, torch.Tensor] = {}

        def take(name: str) -> torch.Tensor:
            if name not in fla:
                raise ValueError(f"the fla state_dict has no {name!r}; is it a {self.config.num_layers}-layer fla "
                                 f"causal LM of {self.config.layer}?")
            return fla.pop(name)

        ours["embed.weight"] = take("model.embeddings.weight")
        ours["final_norm.weight"] = take("model.norm.weight")
        for i in range(len(self.blocks)):
            src, dst = f"model.layers.{i}.", f"blocks.{i}."
            ours[dst + "mixer_norm.weight"] = take(src + "attn_norm.weight")
            ours[dst + "mlp_norm.weight"] = take(src + "mlp_norm.weight")
            ours[dst + "mlp.gate_up.weight"] = torch.cat([take(src + "mlp.gate_proj.weight"),
                                                          take(src + "mlp.up_proj.weight")])
            ours[dst + "mlp.down.weight"] = take(src + "mlp.down_proj.weight")
            for name in [n for n in fla if n.startswith(src + "attn.")]:
                ours[dst + "mixer." + name[len(src + "attn."):]] = fla.pop(name)
        head = fla.pop("lm_head.weight", None)
        if self.config.tie_embeddings:
            if head is not None and not torch.equal(head, ours["embed.weight"]):
                raise ValueError("this LinearLM ties its LM head to the embeddings, but the fla model's lm_head "
                                 "differs from its embeddings: build the LinearLM with tie_embeddings=False")
        else:
            if head is None:
                raise ValueError("the fla state_dict has no 'lm_head.weight' (tied embeddings?): build the LinearLM "
                                 "with tie_embeddings=True")
            ours["lm_head.weight"] = head
        if fla:
            raise ValueError(f"fla weights with no place in this LinearLM: {sorted(fla)[:8]}")
        mine = self.state_dict()
        missing = sorted(n for n in mine if n not in ours and not n.startswith("routers.")
                         and not (self.config.tie_embeddings and n == "lm_head.weight"))
        if missing:
            raise ValueError(f"parameters this LinearLM has and the fla model lacks: {missing[:8]}")
        for name, value in ours.items():
            if name not in mine:
                raise ValueError(f"fla weight for {name!r}, which this LinearLM does not have (other layer options?)")
            if value.shape != mine[name].shape:
                raise ValueError(f"{name}: the fla weight has shape {tuple(value.shape)}, this LinearLM "
                                 f"{tuple(mine[name].shape)}; match the config (mlp_ratio = intermediate_size / "
                                 "hidden_size, heads, head_dim, expand_v)")
        self.load_state_dict(ours, strict=False)

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
