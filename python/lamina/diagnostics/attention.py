"""Attention diagnostics: mean attention distance per head (the Prism paper's per-layer analysis).

For query ``i`` with attention probabilities ``p_ij`` over keys ``j``, the attention
distance is ``sum_j p_ij |pos_i - j|``; ``attention_distance`` averages it over the
queries of each (batch, head). Wide early heads of a Prism schedule are expected to
look further than narrow late ones.

The computation is blockwise with an online softmax, FlashAttention style: for one
block of queries it walks over blocks of keys keeping three running numbers per
query (the running max ``m``, the normaliser ``l = sum_j exp(s_ij - m)`` and the
weighted distance ``w = sum_j exp(s_ij - m) |pos_i - j|``), rescaling ``l`` and ``w``
whenever ``m`` grows. Memory is ``O(B * H * block_size^2)``, never ``T x S``, so
T = 8192 needs a few MB.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange
from torch import nn

from lamina._validate import check_tensor

# Query and key block edge. 256 x 256 scores per (batch, head) are 256 KB in float32: large enough
# that the per-block Python overhead is small against the matmul, small enough to stay in cache.
DEFAULT_BLOCK_SIZE = 256


def _check_inputs(q: torch.Tensor, k: torch.Tensor, causal: bool, block_size: int) -> None:
    check_tensor("q", q, ndim=4)
    check_tensor("k", k, ndim=4)
    if q.device != k.device:
        raise ValueError(f"q and k must be on the same device, got q on {q.device} and k on {k.device}")
    B, T, H, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must have shape [B={B}, S, HKV, D={D}], got {tuple(k.shape)}")
    if k.shape[2] == 0 or H % k.shape[2]:
        raise ValueError(f"the key heads HKV must divide the query heads H={H}, got k of shape {tuple(k.shape)}")
    if T == 0 or k.shape[1] == 0:
        raise ValueError(f"q and k need at least one token, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if causal and k.shape[1] < T:
        raise ValueError(
            f"causal attention_distance needs S >= T (queries aligned to the last keys), got T={T}, S={k.shape[1]}"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def attention_distance(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor:
    """Mean attention distance per head, ``[B, H]``.

    Args:
        q: ``[B, T, H, D]`` queries (after any rotary embedding).
        k: ``[B, S, HKV, D]`` keys; ``H % HKV == 0`` (query head ``h`` uses key head ``h // (H // HKV)``).
        causal: mask keys after the query; queries are aligned to the last keys, so query ``i``
            sits at position ``i + S - T`` (needs ``S >= T``).
        scale: softmax scale, default ``1 / sqrt(D)``.
        block_size: edge of the query and key blocks.

    Returns: ``[B, H]``, float32 (float64 for float64 inputs): ``mean_i sum_j p_ij |pos_i - j|``.
    """
    _check_inputs(q, k, causal, block_size)
    B, T, H, D = q.shape
    S, HKV = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    compute = torch.float64 if q.dtype == torch.float64 or k.dtype == torch.float64 else torch.float32
    # Heads grouped as [B, HKV, G, ...] so that each key head serves its G query heads without a copy.
    qg = rearrange(q.to(compute) * scale, "b t (hk g) d -> b hk g t d", hk=HKV)
    kg = rearrange(k.to(compute), "b s hk d -> b hk s d")
    key_pos = torch.arange(S, device=q.device, dtype=compute)
    shift = S - T  # query i sits at key position i + shift
    total = torch.zeros(B, HKV, H // HKV, device=q.device, dtype=compute)

    for i0 in range(0, T, block_size):
        i1 = min(i0 + block_size, T)
        q_blk = qg[:, :, :, i0:i1]
        q_pos = torch.arange(i0 + shift, i1 + shift, device=q.device, dtype=compute)
        running_max = torch.full((B, HKV, H // HKV, i1 - i0), -math.inf, device=q.device, dtype=compute)
        norm = torch.zeros_like(running_max)
        weighted = torch.zeros_like(running_max)
        last_key = i1 - 1 + shift if causal else S - 1
        for j0 in range(0, last_key + 1, block_size):
            j1 = min(j0 + block_size, last_key + 1)
            scores = torch.einsum("bhgtd,bhsd->bhgts", q_blk, kg[:, :, j0:j1])
            dist = (q_pos[:, None] - key_pos[None, j0:j1]).abs()
            if causal and j1 - 1 > i0 + shift:  # only blocks that cross the diagonal need the mask
                scores = scores.masked_fill(key_pos[None, j0:j1] > q_pos[:, None], -math.inf)
            new_max = torch.maximum(running_max, scores.amax(dim=-1))
            # A query with no visible key yet keeps max -inf; use 0 there so exp() gives 0, not NaN.
            safe_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
            rescale = torch.exp(running_max - safe_max)
            p = torch.exp(scores - safe_max[..., None])
            norm = norm * rescale + p.sum(dim=-1)
            weighted = weighted * rescale + (p * dist).sum(dim=-1)
            running_max = new_max
        total += (weighted / norm).sum(dim=-1)

    return rearrange(total / T, "b hk g -> b (hk g)")


@torch.no_grad()
def layer_attention_distance(
    model: nn.Module,
    input_ids: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> list[torch.Tensor]:
    """Mean attention distance of every ``PrismAttention`` in ``model`` on one causal forward.

    Args:
        model: a module (e.g. ``PrismDecoder``) whose forward takes ``input_ids`` and runs its
            ``PrismAttention`` layers without a KV cache.
        input_ids: ``[B, T]`` token ids.
        block_size: as in ``attention_distance``.

    Returns: one ``[B, H_l]`` tensor per attention layer, in execution order (``H_l`` is that
    layer's head count, so the entries differ in width along a Prism schedule).
    """
    from lamina.layers.prism import PrismAttention

    results: list[torch.Tensor] = []

    def record(module: PrismAttention, args: tuple, kwargs: dict) -> None:
        if kwargs.get("cache") is not None or kwargs.get("cu_seqlens") is not None:
            raise ValueError("layer_attention_distance needs a forward without cache and cu_seqlens")
        x = args[0] if args else kwargs["x"]
        q, k, _ = module.project(x)
        results.append(attention_distance(q, k, causal=kwargs.get("causal", True), block_size=block_size))

    handles = [
        m.register_forward_pre_hook(record, with_kwargs=True) for m in model.modules() if isinstance(m, PrismAttention)
    ]
    if not handles:
        raise ValueError(f"model has no PrismAttention layer: {type(model).__name__}")
    try:
        model(input_ids)
    finally:
        for h in handles:
            h.remove()
    return results
