"""``prism_attention_with_kvcache``: Prism attention against a preallocated KV cache, written in place.

FlashAttention's ``flash_attn_with_kvcache`` argument names and semantics (the subset below), for
every head dim ``prism_attention`` runs (16..512). What runs:

* CUDA tensors, or CPU tensors under the Triton interpreter, through the custom op
  ``lamina::prism_attention_with_kvcache`` (it declares that it mutates ``k_cache`` and ``v_cache``):
  new keys and values are written into the cache by ``prism_kv_append``; then, for
  ``T_q <= DECODE_MAX_SEQLEN_Q`` (16) queries, the split-KV kernel ``prism_attn_decode`` runs
  directly on the (contiguous or paged) cache; for longer query blocks (prefill) the visible keys
  of every sequence are gathered into a packed varlen batch and ``prism_attn_fwd`` runs on it. The
  prefill path reads the key counts to the host.
* CPU tensors by default: a PyTorch implementation (writes with indexing, gathers the cache,
  masks by length, explicit softmax in float32 or float64).

No gradient: the op is for inference, as FlashAttention's is; it runs under ``torch.no_grad()``.

Validation: shapes, dtypes and devices always; the values of ``cache_seqlens`` (cache long enough)
and ``block_table`` (block ids in range for the blocks in use) are read to the host once per call,
except while a CUDA graph is being captured or ``torch.compile`` is tracing. The kernels mask
every access by the cache's capacity and the block count, so unchecked bad values give wrong
numbers, never an out-of-bounds access.
"""

from __future__ import annotations

import torch
from einops import rearrange

from lamina._dispatch import select_backend
from lamina._validate import check_no_overlap, check_same_device, check_scale, check_tensor
from lamina.kernels.prism_attn_common import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, MIN_HEAD_DIM

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The PyTorch path also takes float64 (oracles, greedy-decoding checks without rounding ties).
TORCH_DTYPES = KERNEL_DTYPES + (torch.float64,)
SEQLEN_DTYPES = (torch.int32, torch.int64)
# Query rows per step of the PyTorch path: bounds its score buffer to [B, H, 1024, S] at a time.
TORCH_QUERY_BLOCK = 1024


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
def _host_values_readable(x: torch.Tensor) -> bool:
    """False while tracing (torch.compile) or capturing a CUDA graph: no host reads then."""
    if torch.compiler.is_compiling():
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: int | torch.Tensor | None,
    block_table: torch.Tensor | None,
    softmax_scale: float | None,
    num_splits: int,
) -> tuple[torch.Tensor, int, int | None]:
    """Raise ValueError/TypeError naming the bad argument.

    Returns (cache_seqlens as int32 ``[B]`` on q's device, capacity per sequence, longest key
    count after the append or None when the lengths could not be read).
    """
    check_tensor("q", q, ndim=4, dtypes=TORCH_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=TORCH_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=TORCH_DTYPES)
    seqlens_tensor = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=seqlens_tensor,
                      block_table=block_table)
    batch, _, num_heads, head_dim = q.shape
    if head_dim % HEAD_DIM_MULTIPLE or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"q: head dim must be a multiple of {HEAD_DIM_MULTIPLE} in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], "
            f"got {head_dim} (shape {tuple(q.shape)})"
        )
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous head dim (it is written in place), "
                             f"got strides {tuple(x.stride())}")
    layout = "[num_blocks, block_size, HKV, D]" if block_table is not None else "[B_cache, S_max, HKV, D]"
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache must have shape {layout} with D={head_dim} (q's head dim), "
                         f"got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    check_no_overlap("v_cache", v_cache, k_cache=k_cache)
    num_kv_heads = k_cache.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"k_cache: the number of key/value heads must divide the query heads H={num_heads} "
                         f"(GQA/MQA), got HKV={num_kv_heads}")
    if block_table is not None:
        check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,))
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape [B={batch}, max_blocks_per_seq], "
                             f"got {tuple(block_table.shape)}")
        if block_table.stride(-1) != 1:
            raise ValueError(f"block_table must be contiguous along its last dim, got strides "
                             f"{tuple(block_table.stride())}")
        if k_cache.shape[1] == 0 or k_cache.shape[0] == 0:
            raise ValueError(f"k_cache: a paged cache needs blocks of at least one slot, got {tuple(k_cache.shape)}")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        if k_cache.shape[0] < batch:
            raise ValueError(f"k_cache must hold at least B={batch} sequences (shape {layout}), "
                             f"got {tuple(k_cache.shape)}")
        capacity = k_cache.shape[1]
    if (k is None) != (v is None):
        raise ValueError(f"k and v must be given together, got k={'a tensor' if k is not None else None}, "
                         f"v={'a tensor' if v is not None else None}")
    seqlen_new = 0
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            check_tensor(name, x, ndim=4, dtypes=TORCH_DTYPES)
            if x.dtype != q.dtype:
                raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
            if x.shape[0] != batch or x.shape[2:] != k_cache.shape[2:]:
                raise ValueError(f"{name} must have shape [B={batch}, T_new, HKV={num_kv_heads}, D={head_dim}], "
                                 f"got {tuple(x.shape)}")
        if v.shape != k.shape:
            raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        seqlen_new = k.shape[1]
    check_scale("softmax_scale", softmax_scale)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: heuristic), got {num_splits!r}")

    # cache_seqlens -> int32 [B]
    if cache_seqlens is None:
        seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, torch.Tensor):
        check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=SEQLEN_DTYPES)
        if cache_seqlens.shape[0] != batch:
            raise ValueError(f"cache_seqlens must have shape [B={batch}], got {tuple(cache_seqlens.shape)}")
        seqlens = cache_seqlens.to(torch.int32).contiguous()
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if cache_seqlens < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens}")
        seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        raise TypeError(f"cache_seqlens must be an int, an int32 tensor [B] or None, "
                        f"got {type(cache_seqlens).__name__}")

    if not _host_values_readable(q):
        return seqlens, capacity, None
    lengths = seqlens.tolist()
    for b, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {n} for sequence {b}")
        if n + seqlen_new > capacity:
            raise ValueError(
                f"cache too short: sequence {b} has cache_seqlens={n} and {seqlen_new} new keys, "
                f"the cache holds {capacity} per sequence ({'block_table' if block_table is not None else 'k_cache'} "
                f"shape {tuple(block_table.shape if block_table is not None else k_cache.shape)})"
            )
    if block_table is not None:
        page = k_cache.shape[1]
        used = (seqlens.long() + seqlen_new + page - 1) // page  # blocks in use per sequence
        in_use = torch.arange(block_table.shape[1], device=q.device)[None, :] < used[:, None]
        bad = in_use & ((block_table < 0) | (block_table >= k_cache.shape[0]))
        if bool(bad.any()):
            b, i = (int(x) for x in bad.nonzero()[0].tolist())
            raise ValueError(f"block_table[{b}, {i}] = {int(block_table[b, i])} is not a block of k_cache "
                             f"(0 <= id < num_blocks={k_cache.shape[0]})")
    return seqlens, capacity, max(lengths, default=0) + seqlen_new


# ----------------------------------------------------------------------------------------------
# PyTorch path
# ----------------------------------------------------------------------------------------------
def _cache_index(block_table: torch.Tensor | None, page: int, positions: torch.Tensor, batch: int,
                 num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, second) indices of positions ``[B, N]`` in the cache (block ids clamped into range)."""
    if block_table is None:
        rows = torch.arange(batch, device=positions.device)[:, None].expand_as(positions)
        return rows, positions
    pages = (positions // page).clamp_(max=block_table.shape[1] - 1)
    blocks = block_table.long().gather(1, pages).clamp_(0, num_blocks - 1)
    return blocks, positions % page


def _append_torch(k, v, k_cache, v_cache, seqlens, block_table) -> None:
    positions = seqlens.long()[:, None] + torch.arange(k.shape[1], device=k.device)
    first, second = _cache_index(block_table, k_cache.shape[1], positions, k.shape[0], k_cache.shape[0])
    k_cache[first, second] = k
    v_cache[first, second] = v


def _with_kvcache_torch(q, k_cache, v_cache, seqlens, block_table, seqlen_new, scale, causal):
    """o [B, T_q, H, D] and lse [B, H, T_q] over the cache (new keys already written)."""
    batch, seqlen_q, num_heads, _ = q.shape
    lengths = seqlens.long() + seqlen_new
    max_len = int(lengths.max()) if batch else 0
    positions = torch.arange(max_len, device=q.device)
    first, second = _cache_index(block_table, k_cache.shape[1], positions.expand(batch, max_len), batch,
                                 k_cache.shape[0])
    present = positions[None, :] < lengths[:, None]  # [B, S]
    compute = torch.promote_types(q.dtype, torch.float32)
    # Slots past a sequence's length may hold anything (NaN included): zero them, do not just mask.
    keys = torch.where(present[..., None, None], k_cache[first, second].to(compute), 0.0)
    values = torch.where(present[..., None, None], v_cache[first, second].to(compute), 0.0)
    group = num_heads // k_cache.shape[2]
    qg = rearrange(q.to(compute), "b t (hk g) d -> b hk g t d", g=group)
    kg = rearrange(keys, "b s hk d -> b hk s d")
    vg = rearrange(values, "b s hk d -> b hk s d")
    outs, lses = [], []
    for start in range(0, seqlen_q, TORCH_QUERY_BLOCK):
        rows = torch.arange(start, min(start + TORCH_QUERY_BLOCK, seqlen_q), device=q.device)
        visible = present[:, None, :]  # [B, t, S]
        if causal:
            last = lengths[:, None] - seqlen_q + rows[None, :]  # last key each query sees
            visible = visible & (positions[None, None, :] <= last[..., None])
        scores = torch.einsum("bhgtd,bhsd->bhgts", qg[:, :, :, rows], kg) * scale
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        # Rows without a visible key: lse = -inf, probabilities 0, output 0.
        probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        outs.append(torch.einsum("bhgts,bhsd->bhgtd", probs, vg))
        lses.append(lse)
    if not outs:
        return torch.zeros_like(q), q.new_zeros((batch, num_heads, 0), dtype=torch.float32)
    o = rearrange(torch.cat(outs, dim=3), "b hk g t d -> b t (hk g) d").to(q.dtype)
    return o, rearrange(torch.cat(lses, dim=3), "b hk g t -> b (hk g) t").float()


# ----------------------------------------------------------------------------------------------
# Triton path: one custom op that mutates the cache
# ----------------------------------------------------------------------------------------------
def _prefill_packed(q, k_cache, v_cache, seqlens, block_table, seqlen_new, scale, causal):
    """Longer query blocks: gather each sequence's keys into a packed varlen batch, run prism_attn_fwd."""
    from lamina.kernels.prism_attn_fwd import prism_attn_fwd

    batch, seqlen_q, num_heads, head_dim = q.shape
    lengths = (seqlens.long() + seqlen_new).tolist()
    device = q.device
    which = torch.repeat_interleave(torch.arange(batch, device=device),
                                    torch.tensor(lengths, device=device), output_size=sum(lengths))
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    positions = torch.arange(sum(lengths), device=device) - cu_k.long()[which]
    if block_table is None:
        first, second = which, positions
    else:
        # Clamped into range like the kernels' addressing (the values were checked on the host).
        page = k_cache.shape[1]
        pages = (positions // page).clamp_(max=block_table.shape[1] - 1)
        first = block_table.long()[which, pages].clamp_(0, k_cache.shape[0] - 1)
        second = positions % page
    keys = k_cache[first, second][None]
    values = v_cache[first, second][None]
    cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=device)
    o, lse = prism_attn_fwd(q.reshape(1, batch * seqlen_q, num_heads, head_dim).contiguous(), keys, values,
                            causal, scale, cu_q, cu_k, seqlen_q, max(lengths, default=0))
    o = o.reshape(batch, seqlen_q, num_heads, head_dim)
    return o, rearrange(lse, "1 h (b t) -> b h t", b=batch)


@torch.library.custom_op("lamina::prism_attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _with_kvcache_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    scale: float,
    causal: bool,
    num_splits: int,
    max_seqlen_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    from lamina.kernels.prism_attn_decode import DECODE_MAX_SEQLEN_Q, prism_attn_decode, prism_kv_append

    seqlen_new = 0
    if k is not None:
        prism_kv_append(k.contiguous(), v.contiguous(), k_cache, v_cache, cache_seqlens, block_table)
        seqlen_new = k.shape[1]
    q = q.contiguous()
    if q.shape[0] == 0 or q.shape[1] == 0:  # no query: nothing to launch
        return torch.zeros_like(q), q.new_zeros((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    if q.shape[1] > DECODE_MAX_SEQLEN_Q:
        return _prefill_packed(q, k_cache, v_cache, cache_seqlens, block_table, seqlen_new, scale, causal)
    return prism_attn_decode(q, k_cache, v_cache, cache_seqlens, block_table, seqlen_new, causal, scale,
                             num_splits, max_seqlen_k)


@_with_kvcache_op.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, causal, num_splits, max_seqlen_k):
    batch, seqlen_q, num_heads, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, num_heads, seqlen_q), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def prism_attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: int | torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of new queries against a KV cache, appending new keys and values to it in place.

    FlashAttention's ``flash_attn_with_kvcache`` names and meanings; not implemented from it:
    ``rotary_cos``/``rotary_sin`` (apply rotary embeddings before the call), ``cache_batch_idx``,
    ``cache_leftpad``, ``window_size``, ``softcap``, ``alibi_slopes``. Arguments after ``v`` are
    keyword-only.

    Args:
        q: [B, T_q, H, D] queries (float16, bfloat16, float32; float64 on the torch backend);
            D a multiple of 8 in [16, 512].
        k_cache: [B_cache, S_max, HKV, D] (B_cache >= B; sequence b uses row b), or with
            ``block_table`` the paged pool [num_blocks, block_size, HKV, D]. H % HKV == 0.
        v_cache: same shape as k_cache.
        k, v: optional [B, T_new, HKV, D] new keys and values, written into the cache at positions
            ``cache_seqlens[b] .. cache_seqlens[b] + T_new - 1`` before attending (the cache is
            modified in place; ``cache_seqlens`` is not: the caller advances it).
        cache_seqlens: tokens already in the cache per sequence, int or int32/int64 [B]; None: the
            whole cache (S_max, or max_blocks_per_seq x block_size).
        block_table: [B, max_blocks_per_seq] int32: block ids of the paged cache, block i of
            sequence b holding its positions [i * block_size, (i + 1) * block_size).
        softmax_scale: score scale, default D ** -0.5.
        causal: with ``L_b = cache_seqlens[b] + T_new`` keys, query t sees keys ``j <= L_b - T_q + t``
            (bottom-right aligned; with new keys and T_new = T_q, query t sees the cache up to
            ``cache_seqlens[b] + t``). Otherwise every query sees all ``L_b`` keys.
        num_splits: split-KV programs per sequence and KV head for the decode kernel: 0 chooses
            from the sequence length and the SM count; 1 does not split.
        return_softmax_lse: also return the log-sum-exp of the scaled scores.
        backend: "auto", "triton" or "torch" (see ``lamina._dispatch``).

    Returns:
        out: [B, T_q, H, D] in q's dtype, and with ``return_softmax_lse`` lse: [B, H, T_q] float32
        (natural log). A query that sees no key gets out = 0 and lse = -inf.
    """
    seqlens, capacity, max_seqlen_k = _check_inputs(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                                    softmax_scale, num_splits)
    scale = float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
    path = select_backend("prism_attention_with_kvcache", backend, [q, k_cache, v_cache, k, v, block_table])
    seqlen_new = 0 if k is None else k.shape[1]
    if path != "torch" and q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"q: the triton backend takes dtypes float16, bfloat16, float32, got {q.dtype}")
    # Inference only, on every path: no graph is recorded (the cache writes would otherwise chain
    # every step's graph to the next), and the outputs do not require grad.
    with torch.no_grad():
        if path == "torch":
            if k is not None:
                _append_torch(k, v, k_cache, v_cache, seqlens, block_table)
            o, lse = _with_kvcache_torch(q, k_cache, v_cache, seqlens, block_table, seqlen_new, scale, bool(causal))
        else:
            o, lse = _with_kvcache_op(q, k_cache, v_cache, k, v, seqlens, block_table, scale, bool(causal),
                                      num_splits, capacity if max_seqlen_k is None else max_seqlen_k)
    return (o, lse) if return_softmax_lse else o


__all__ = ["prism_attention_with_kvcache"]
