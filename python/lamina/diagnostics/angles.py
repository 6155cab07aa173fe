"""Angles between consecutive layers' hidden states, per token.

For hidden states ``h_0 .. h_{L-1}`` (each ``[B, T, D]``) the state angle of layer ``l`` is
``theta(h_l, h_{l+1})`` and the update angle ``theta(dh_l, dh_{l+1})`` with ``dh_l = h_{l+1} - h_l``,
in degrees. Most layers of a trained deep model turn the state by a small angle and make updates
that point alike; the layers that differ stand out in these curves.

The angle between ``a`` and ``b`` is ``2 atan2(|u - v|, |u + v|)`` with ``u, v`` the unit vectors,
computed in float64: exact near 0 and 180 degrees, where ``acos`` of the cosine is not. A zero
vector has no direction: its angles are NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lamina._validate import check_tensor


@dataclass
class LayerAngles:
    """Result of ``layer_angles`` (float32 tensors; padded tokens are NaN in the per-token fields).

    Attributes:
        state: ``[B, T, L-1]`` angle between ``h_l`` and ``h_{l+1}`` per token, degrees.
        update: ``[B, T, L-2]`` angle between ``dh_l`` and ``dh_{l+1}`` per token, degrees.
        state_mean, state_std, update_mean, update_std: ``[L-1]`` / ``[L-2]`` over the kept tokens.
        pca: ``[B, T, L, k]`` the token trajectories ``h_0 .. h_{L-1}`` projected on the top ``k``
            principal directions of all kept (token, layer) states (centred).
        pca_explained: ``[k]`` fraction of the variance each direction explains.
    """

    state: torch.Tensor
    update: torch.Tensor
    state_mean: torch.Tensor
    state_std: torch.Tensor
    update_mean: torch.Tensor
    update_std: torch.Tensor
    pca: torch.Tensor
    pca_explained: torch.Tensor


def _angle(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Degrees between the last-dim vectors of ``a`` and ``b`` (float64); NaN where either is zero."""
    na, nb = a.norm(dim=-1, keepdim=True), b.norm(dim=-1, keepdim=True)
    u, v = a / na, b / nb
    theta = 2 * torch.atan2((u - v).norm(dim=-1), (u + v).norm(dim=-1))
    zero = (na.squeeze(-1) == 0) | (nb.squeeze(-1) == 0)
    return torch.rad2deg(theta).masked_fill(zero, math.nan)


def _summary(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation over [B, T] of ``x [B, T, N]``, ignoring NaN (padded tokens)."""
    flat = x.flatten(0, 1)
    keep = ~torch.isnan(flat)
    count = keep.sum(0).clamp(min=1)
    mean = torch.where(keep, flat, 0).sum(0) / count
    var = torch.where(keep, (flat - mean) ** 2, 0).sum(0) / count
    empty = keep.sum(0) == 0
    return mean.masked_fill(empty, math.nan), var.sqrt().masked_fill(empty, math.nan)


def layer_angles(
    hidden_states: Sequence[torch.Tensor] | torch.Tensor,
    mask: torch.Tensor | None = None,
    pca_components: int = 2,
) -> LayerAngles:
    """Per-token angles between consecutive hidden states and consecutive updates.

    Args:
        hidden_states: ``L >= 2`` tensors ``[B, T, D]`` (e.g. transformers' ``output_hidden_states``,
            or the states of ``HRMCore`` steps), or one tensor ``[L, B, T, D]``. Any float dtype.
        mask: ``[B, T]``, true (or 1) at tokens to keep; padding is excluded from every summary
            and NaN in the per-token results.
        pca_components: ``k`` principal directions for the trajectory projection (``<= D``).

    Returns:
        ``LayerAngles`` (``update`` is ``[B, T, 0]`` when ``L == 2``).
    """
    if isinstance(hidden_states, torch.Tensor):
        check_tensor("hidden_states", hidden_states, ndim=4)
        states = list(hidden_states.unbind(0))
    else:
        if isinstance(hidden_states, (str, bytes)) or not isinstance(hidden_states, Sequence):
            raise TypeError(f"hidden_states must be a sequence of [B, T, D] tensors or one [L, B, T, D] tensor, "
                            f"got {type(hidden_states).__name__}")
        states = list(hidden_states)
        for i, h in enumerate(states):
            check_tensor(f"hidden_states[{i}]", h, ndim=3)
    if len(states) < 2:
        raise ValueError(f"hidden_states must hold at least 2 layers, got {len(states)}")
    shape = states[0].shape
    for i, h in enumerate(states):
        if h.shape != shape:
            raise ValueError(f"hidden_states[{i}] must have the shape of hidden_states[0] {tuple(shape)}, "
                             f"got {tuple(h.shape)}")
    B, T, D = shape
    if isinstance(pca_components, bool) or not isinstance(pca_components, int) or not 1 <= pca_components <= D:
        raise ValueError(f"pca_components must be an int in [1, D={D}], got {pca_components!r}")
    keep = torch.ones(B, T, dtype=torch.bool, device=states[0].device)
    if mask is not None:
        check_tensor("mask", mask, ndim=2, dtypes=None)
        if tuple(mask.shape) != (B, T):
            raise ValueError(f"mask must have shape [B, T] = {(B, T)}, got {tuple(mask.shape)}")
        keep = mask.to(device=keep.device) != 0

    h = [x.double() for x in states]
    state = torch.stack([_angle(a, b) for a, b in zip(h[:-1], h[1:])], dim=-1)
    deltas = [b - a for a, b in zip(h[:-1], h[1:])]
    update = (torch.stack([_angle(a, b) for a, b in zip(deltas[:-1], deltas[1:])], dim=-1) if len(deltas) > 1
              else state.new_zeros(B, T, 0))
    state = state.masked_fill(~keep[..., None], math.nan)
    update = update.masked_fill(~keep[..., None], math.nan)
    state_mean, state_std = _summary(state)
    update_mean, update_std = _summary(update)

    stacked = torch.stack(h, dim=2)  # [B, T, L, D]
    points = stacked[keep].flatten(0, 1)  # kept (token, layer) states
    k = pca_components
    if points.shape[0] == 0:
        pca, explained = stacked.new_full((B, T, len(h), k), math.nan), stacked.new_full((k,), math.nan)
    else:
        centre = points.mean(0)
        _, sing, vh = torch.linalg.svd(points - centre, full_matrices=False)
        pca = (stacked - centre) @ vh[:k].T
        pca = pca.masked_fill(~keep[..., None, None], math.nan)
        total = sing.pow(2).sum()
        explained = sing[:k].pow(2) / total if total > 0 else torch.zeros(k, dtype=torch.float64)
        if explained.numel() < k:  # fewer points than directions
            explained = torch.cat([explained, explained.new_zeros(k - explained.numel())])
            pca = torch.cat([pca, pca.new_zeros(*pca.shape[:-1], k - pca.shape[-1])], dim=-1)
    f = lambda t: t.float()  # noqa: E731
    return LayerAngles(f(state), f(update), f(state_mean), f(state_std), f(update_mean), f(update_std), f(pca),
                       f(explained))
