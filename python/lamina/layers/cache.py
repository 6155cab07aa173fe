"""Decoding cache for the fla-compatible layers, with fla 0.6's cache protocol.

Each layer owns the entry ``cache[layer_idx]``, a dict with ``"recurrent_state"`` (the delta-rule
state ``[N, HV, K, V]``, or ``[N, HV, V, K]`` for the layers that keep it value-first as fla's
GatedDeltaNet and KimiDeltaAttention do), ``"conv_state"`` (the three short-convolution windows
``[N, D, W]`` of q, k and v, or None), ``"attn_state"`` (keys and values of attention layers in
hybrid stacks) and ``"ffn_state"``. Layers write through ``update(..., layer_idx=, offset=)``.

The layers use nothing but ``len(cache)``, ``cache[i]`` and ``cache.update(...)``, so fla's own
``fla.models.cache_utils.Cache`` works with them too, and this one works inside fla's models and
generation loops. It needs no ``transformers``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

STATE_KEYS = ("recurrent_state", "attn_state", "conv_state", "ffn_state")


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


class Cache:
    """Per-layer recurrent, short-convolution and attention states, and the number of tokens seen.

    ``Cache()`` starts empty; layers append their entries on their first call with
    ``past_key_values=cache``. ``get_seq_length()`` counts the tokens layer 0 has consumed.
    """

    is_compileable = False

    def __init__(self, seen_tokens: int = 0) -> None:
        self.states: list[dict[str, Any]] = []
        self._seen_tokens: list[int] = []
        self._initial_seen = int(seen_tokens)

    def __getitem__(self, layer_idx: int) -> dict[str, Any]:
        if not 0 <= layer_idx < len(self.states):
            raise KeyError(f"the cache holds {len(self.states)} layers, layer_idx {layer_idx} is out of range")
        return self.states[layer_idx]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def update(
        self,
        recurrent_state: torch.Tensor | None = None,
        attn_state: tuple[torch.Tensor, ...] | None = None,
        conv_state: Any | None = None,
        ffn_state: Any | None = None,
        layer_idx: int = 0,
        offset: int | None = 1,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Store a layer's new states (None leaves a state as it is) and count ``offset`` tokens.

        ``attn_state`` tensors ``[B, T, ...]`` are appended along T; ``cache_kwargs`` may carry
        ``window_size`` to keep only the last so many positions (sliding-window attention).
        """
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be a non-negative int, got {layer_idx!r}")
        while len(self.states) <= layer_idx:
            self.states.append(dict.fromkeys(STATE_KEYS))
            self._seen_tokens.append(self._initial_seen)
        state = self.states[layer_idx]
        if recurrent_state is not None:
            state["recurrent_state"] = recurrent_state
        if attn_state is not None:
            if not isinstance(attn_state, (tuple, list)):
                raise TypeError(f"attn_state must be a tuple of tensors, got {type(attn_state).__name__}")
            window = (cache_kwargs or {}).get("window_size")
            old = state["attn_state"]
            new = tuple(attn_state) if old is None else tuple(torch.cat([a, b], dim=1) for a, b in zip(old, attn_state))
            if window is not None:
                new = tuple(t[:, -window:] for t in new)
            state["attn_state"] = new
            offset = attn_state[0].shape[1]
        if conv_state is not None:
            state["conv_state"] = conv_state
        if ffn_state is not None:
            state["ffn_state"] = ffn_state
        self._seen_tokens[layer_idx] += 1 if offset is None else int(offset)
        return state

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        layer_idx = layer_idx or 0
        return self._seen_tokens[layer_idx] if layer_idx < len(self.states) else 0

    def get_max_length(self) -> int:
        return -1

    def _map_states(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.states = [{key: _map_tensors(value, fn) for key, value in state.items()} for state in self.states]

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Select/reorder the batch rows of every state (beam search)."""
        self._map_states(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_states(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        self.states, self._seen_tokens = [], []

    def to_legacy_cache(self) -> tuple[dict[str, Any], ...]:
        return tuple(self.states)

    @classmethod
    def from_legacy_cache(cls, past_key_values: tuple[dict[str, Any], ...] | None = None,
                          seen_tokens: int = 0) -> Cache:
        """A cache holding the given per-layer state dicts (e.g. another cache's ``to_legacy_cache()``)."""
        cache = cls(seen_tokens=seen_tokens)
        for state in past_key_values or ():
            cache.states.append({key: state.get(key) for key in STATE_KEYS})
            cache._seen_tokens.append(int(seen_tokens))
        return cache
