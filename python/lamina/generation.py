"""Token generation for lamina's models, reusing their decoding caches.

A model that generates implements two methods:

* ``new_cache(batch_size, max_length)``: an empty cache for ``batch_size`` rows of at most
  ``max_length`` tokens each (prompt plus generated);
* ``decode(input_ids, cache, attention_mask=None) -> logits [B, T, vocab]``: run ``input_ids [B, T]``
  after the tokens already in ``cache`` and append them to it. Row ``b`` holds its own number of
  tokens: on the first call (prefill) ``attention_mask [B, T]`` is a prefix of ones per row (right
  padding) and row ``b`` keeps only its ``attention_mask[b].sum()`` tokens; the logits at padded
  positions are unspecified. Later calls (``T == 1``, no mask) append one token to every row.

``generate`` prefills the prompts once, then decodes one token per step for the whole batch, so
prompts of different lengths share every step. Greedy unless ``do_sample=True`` (temperature,
top-k, top-p).
"""

from __future__ import annotations

from typing import Protocol

import torch

from lamina._validate import check_tensor


class GenerationModel(Protocol):
    def new_cache(self, batch_size: int, max_length: int) -> object: ...

    def decode(self, input_ids: torch.Tensor, cache: object,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor: ...


def check_padding_mask(attention_mask: object, B: int, T: int, device: torch.device) -> torch.Tensor:
    """A ``[B, T]`` 0/1 mask (any dtype) on ``device``, as bool."""
    check_tensor("attention_mask", attention_mask, ndim=2, dtypes=None)
    if tuple(attention_mask.shape) != (B, T):
        raise ValueError(f"attention_mask must have shape [B, T] = {(B, T)} like the input, "
                         f"got {tuple(attention_mask.shape)}")
    if attention_mask.device != device:
        raise ValueError(f"attention_mask must be on {device}, got {attention_mask.device}")
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    return attention_mask.bool()


def prefix_lengths(attention_mask: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor | None:
    """Tokens each row keeps on a ``decode`` call (int64 ``[B]``): ``attention_mask.sum(1)``, checked to be a
    prefix of ones (right padding); None without a mask (every row keeps T)."""
    if attention_mask is None:
        return None
    mask = check_padding_mask(attention_mask, B, T, device)
    counts = mask.sum(1)
    if not torch.equal(mask, torch.arange(T, device=device)[None, :] < counts[:, None]):
        raise ValueError("attention_mask must have the ones first in every row (right padding) when decoding")
    return counts


def _right_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, lengths) with each row's valid tokens moved to the front (left padding or holes allowed)."""
    B, T = input_ids.shape
    if attention_mask is None:
        mask = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
    else:
        mask = check_padding_mask(attention_mask, B, T, input_ids.device)
    lengths = mask.sum(1)
    if (lengths == 0).any():
        raise ValueError("every prompt needs at least one token (a row of attention_mask is all zeros)")
    # stable sort puts the valid tokens first, in their order
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    ids = torch.gather(input_ids, 1, order)
    new_mask = torch.arange(T, device=input_ids.device)[None, :] < lengths[:, None]
    return torch.where(new_mask, ids, torch.zeros_like(ids)), new_mask.to(torch.int64), lengths


def _pick(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float,
          generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from ``logits [B, vocab]``."""
    if not do_sample:
        return logits.argmax(-1)
    scores = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, idx = torch.sort(scores, dim=-1, descending=True)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum - sorted_scores.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, idx, sorted_scores)
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: GenerationModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Generate ``max_new_tokens`` tokens after each prompt; returns them as ``[B, max_new_tokens]``.

    Args:
        model: implements ``new_cache`` and ``decode`` (module docstring).
        input_ids: ``[B, T]`` int prompts.
        max_new_tokens: tokens to generate per row (>= 1).
        attention_mask: ``[B, T]`` 0/1, 1 for prompt tokens (left or right padding); None: all ones.
        do_sample: sample from the softmax of ``logits / temperature`` restricted to the ``top_k``
            most likely tokens (0: all) and the smallest set of probability ``>= top_p``; else greedy.
        eos_token_id: after a row produces it, the row's later tokens are ``pad_token_id``.
        generator: random generator for sampling.
    """
    check_tensor("input_ids", input_ids, ndim=2, dtypes=(torch.int32, torch.int64))
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if do_sample:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    B, T = input_ids.shape
    ids, mask, lengths = _right_padded(input_ids.long(), attention_mask)
    cache = model.new_cache(B, T + max_new_tokens)
    logits = model.decode(ids, cache, attention_mask=mask)
    last = logits[torch.arange(B, device=ids.device), lengths - 1]
    out = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=ids.device)
    done = torch.zeros(B, dtype=torch.bool, device=ids.device)
    for i in range(max_new_tokens):
        token = _pick(last, do_sample, temperature, top_k, top_p, generator)
        token = torch.where(done, torch.full_like(token, pad_token_id), token)
        out[:, i] = token
        if eos_token_id is not None:
            done |= token == eos_token_id
        if i + 1 < max_new_tokens:
            last = model.decode(token[:, None], cache)[:, -1]
    return out


class GenerationMixin:
    """``generate`` for a model that implements ``new_cache`` and ``decode`` (module docstring)."""

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | None = None,
        pad_token_id: int = 0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``lamina.generation.generate`` with this model: ``[B, max_new_tokens]`` new tokens after the
        prompts ``input_ids [B, T]`` (``attention_mask [B, T]``: left or right padding)."""
        return generate(self, input_ids, max_new_tokens, attention_mask=attention_mask, do_sample=do_sample,
                        temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                        pad_token_id=pad_token_id, generator=generator)


__all__ = ["GenerationMixin", "GenerationModel", "check_padding_mask", "generate", "prefix_lengths"]
