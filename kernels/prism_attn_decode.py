"""Prism attention decoding: a few new queries against a KV cache, the key range split across programs.

Three kernels, each launched by a thin launcher:

* ``_prism_kv_append_kernel`` writes the new keys and values ``[B, T_new, HKV, D]`` into the cache
  at positions ``cache_seqlens[b] .. cache_seqlens[b] + T_new - 1`` (in place).
* ``_prism_attn_decode_kernel`` (split-KV, "flash decoding"): program ``(b * HKV + kv head, split,
  m block)`` walks keys ``[split * keys_per_split, (split + 1) * keys_per_split)`` of sequence ``b``
  for every query head of the KV group at once: the ``T_q x G`` (query, head-in-group) pairs are
  packed into the M dimension of the dots (GQA packing), so each key tile is read once per group.
  With one split it writes the output; with more it writes a partial ``(o / l, lse)`` in fp32.
* ``_prism_attn_decode_combine_kernel`` merges the partials of each (batch, query, head) row with
  their log-sum-exps.

The cache is contiguous ``[B_cache, S_max, HKV, D]`` (row ``b`` of the batch uses cache row ``b``) or
paged ``[num_blocks, block_size, HKV, D]`` with ``block_table [B, max_blocks]``; the kernels address
it one key row at a time, so any block size works. Key ``j`` of sequence ``b`` exists for
``j < min(cache_seqlens[b] + T_new, capacity)``: every load and store is masked by that bound, and a
block id outside ``[0, num_blocks)`` is clamped to 0 and its rows masked, so a bad length or block
table can give wrong numbers but never an out-of-bounds access.

Causal masking is aligned bottom-right as in ``prism_attn_fwd``: with ``L`` keys and ``T_q``
queries, query ``t`` sees keys ``j <= L - T_q + t`` (with new keys, ``L = cache_seqlens + T_q`` and
query ``t`` sees the cache up to its own position). A row that sees no key gets output 0 and
log-sum-exp ``-inf``.

The head dim is covered by at most two power-of-two pieces (``output_pieces``: D = 320 is 256 + 64),
both held by the same program: the score is the sum of the two pieces' dots, so keys are read once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from lamina.kernels._utils import (
    INTERPRET,
    MAX_GRID_YZ,
    AotSpec,
    cdiv,
    fp_fusion,
    multiprocessors,
    next_power_of_2,
    register_aot,
)
from lamina.kernels.prism_attn_common import (
    AOT_HEAD_DIMS,
    LN2_C,
    LOG2E,
    aot_attrs,
    dot_precision,
    head_dim_bucket,
    output_pieces,
)

# Longest query block the split-KV kernel is meant for (decoding, speculative verification). Longer
# blocks (prefill) go to prism_attn_fwd, whose 64- and 128-row tiles reuse each key tile more.
DECODE_MAX_SEQLEN_Q = 16
# tl.dot needs every operand dimension >= 16: a KV group with fewer (query, head) pairs is padded.
MIN_BLOCK_M = 16


@dataclass(frozen=True)
class DecodeTiles:
    """Tiles of the split-KV kernel: ``block_m`` (query, head) rows, ``block_n`` keys per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Per head-dim bucket, the widest M tile and its key tile (the static report compiles each for
# sm_90 and sm_80: no spills, shared memory within limits). Decoding reads every key once, so the
# key tile is sized for a few loads in flight, not for reuse; M rarely exceeds 16 (T_q x G).
DECODE_TILES: dict[int, DecodeTiles] = {
    64: DecodeTiles(block_m=64, block_n=64, num_warps=8, num_stages=3),
    128: DecodeTiles(block_m=64, block_n=64, num_warps=8, num_stages=3),
    256: DecodeTiles(block_m=32, block_n=64, num_warps=8, num_stages=2),
    512: DecodeTiles(block_m=16, block_n=32, num_warps=4, num_stages=2),
}
# Under the interpreter: 16-key tiles, so that the short test caches span several tiles and splits.
INTERPRET_TILES = DecodeTiles(block_m=16, block_n=16, num_warps=4, num_stages=1)
# New tokens written per program of the append kernel.
APPEND_BLOCK_T = 16

# ---- number of splits -------------------------------------------------------------------------
# Target programs per SM: two resident programs per SM hide one program's load latency behind the
# other's, which is what a bandwidth-bound loop needs.
PROGRAMS_PER_SM = 2
# A split reads at least this many keys: below it the partial's write and the combine cost more
# than the parallelism gains.
MIN_KEYS_PER_SPLIT = 256
# Upper bound on splits (the combine kernel loops over them).
MAX_SPLITS = 128
# SM count the heuristic assumes under the interpreter (CPU tensors, no SMs to ask).
INTERPRET_SM_COUNT = 8


def decode_tiles(head_dim: int, rows: int) -> DecodeTiles:
    """Tiles for ``rows = T_q * G`` (query, head) pairs per KV group: the bucket's tiles with the
    M tile cut to the smallest power of two >= rows (at least ``MIN_BLOCK_M``)."""
    tiles = INTERPRET_TILES if INTERPRET else DECODE_TILES[head_dim_bucket(head_dim)]
    return replace(tiles, block_m=min(tiles.block_m, max(MIN_BLOCK_M, next_power_of_2(rows))))


def sm_count(device: torch.device) -> int:
    sms = multiprocessors(device)
    return INTERPRET_SM_COUNT if sms is None else sms


def num_splits_heuristic(programs: int, max_seqlen_k: int, sms: int) -> int:
    """Splits of the key range for ``programs`` = B x HKV x m blocks programs without splitting.

    One split when those already give every SM ``PROGRAMS_PER_SM`` programs; otherwise as many
    splits as reach that target, at most ``cdiv(max_seqlen_k, MIN_KEYS_PER_SPLIT)`` (every split
    reads enough keys to pay for its partial) and ``MAX_SPLITS``. For example on 132 SMs, B = 1,
    HKV = 8, 32768 keys: 33 splits of 1024 keys; B = 64, HKV = 8: 1 split.
    """
    target = sms * PROGRAMS_PER_SM
    if programs >= target:
        return 1
    return max(1, min(cdiv(target, programs), cdiv(max_seqlen_k, MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def split_plan(num_splits: int, max_seqlen_k: int, block_n: int) -> tuple[int, int]:
    """(splits, keys per split): the key range cut into ``num_splits`` runs of whole key tiles.

    Splits that would start past ``max_seqlen_k`` are dropped (a split count above the number of
    key tiles gives one tile per split).
    """
    tiles = max(1, cdiv(max_seqlen_k, block_n))
    per_split = cdiv(tiles, max(1, num_splits))
    return cdiv(tiles, per_split), per_split * block_n


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _cache_slots(b, offs_n, n_end, TABLE, stride_tb, page_size, num_blocks, PAGED: tl.constexpr):
    """Cache coordinates of positions ``offs_n`` of sequence ``b``: (first index, second index, valid).

    Contiguous: ``(b, j)``. Paged: ``(block_table[b, j // page_size], j % page_size)``. Positions
    ``>= n_end`` and block ids outside ``[0, num_blocks)`` are invalid (and addressed as block 0).
    """
    valid = (offs_n >= 0) & (offs_n < n_end)
    if PAGED:
        block = tl.load(TABLE + b * stride_tb + offs_n // page_size, mask=valid, other=0)
        valid = valid & (block >= 0) & (block < num_blocks)
        first = tl.where(valid, block, 0).to(tl.int64)
        second = tl.where(valid, offs_n % page_size, 0).to(tl.int64)
    else:
        first = b + offs_n.to(tl.int64) * 0
        second = offs_n.to(tl.int64)
    return first, second, valid


@triton.jit
def _load_rows(rows, offs_d, row_ok, HEAD_DIM: tl.constexpr):
    """Rows at pointers ``rows [R]``, columns ``offs_d``; masked rows and columns >= HEAD_DIM read 0."""
    return tl.load(rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _store_rows(rows, value, offs_d, row_ok, HEAD_DIM: tl.constexpr):
    tl.store(rows[:, None] + offs_d[None, :], value.to(rows.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _prism_kv_append_kernel(
    K_NEW, V_NEW, K, V, SEQLENS, TABLE,
    stride_nkb, stride_nkt, stride_nkh,
    stride_nvb, stride_nvt, stride_nvh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_tb,
    seqlen_new, capacity, page_size, num_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, PAGED: tl.constexpr,
):
    """Grid: (B x new-token blocks, HKV). Copies ``BLOCK_T`` new rows of one head into the cache."""
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    t_blocks = tl.cdiv(seqlen_new, BLOCK_T)
    b = (pid // t_blocks).to(tl.int64)
    offs_t = (pid % t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    start = tl.load(SEQLENS + b)
    end = tl.minimum(start + seqlen_new, capacity)
    first, second, ok = _cache_slots(b, start + offs_t, end, TABLE, stride_tb, page_size, num_blocks, PAGED)
    ok = ok & (offs_t < seqlen_new)
    offs_d = tl.arange(0, BLOCK_D)
    t64 = offs_t.to(tl.int64)
    k = _load_rows(K_NEW + b * stride_nkb + head * stride_nkh + t64 * stride_nkt, offs_d, ok, HEAD_DIM)
    v = _load_rows(V_NEW + b * stride_nvb + head * stride_nvh + t64 * stride_nvt, offs_d, ok, HEAD_DIM)
    _store_rows(K + first * stride_kb + second * stride_kt + head * stride_kh, k, offs_d, ok, HEAD_DIM)
    _store_rows(V + first * stride_vb + second * stride_vt + head * stride_vh, v, offs_d, ok, HEAD_DIM)


@triton.jit
def _prism_attn_decode_kernel(
    Q, K, V, SEQLENS, TABLE, O, LSE,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_tb,
    stride_ob, stride_ot, stride_oh, stride_os,
    stride_lb, stride_lt, stride_lh, stride_ls,
    seqlen_q, seqlen_new, num_kv_heads, group_size, capacity, page_size, num_blocks, keys_per_split, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
    CAUSAL: tl.constexpr, PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid: (B x HKV, splits, m blocks). Writes rows ``(b, t, kv_head * G + g)`` of O and LSE at
    split offset ``split * stride_os`` / ``split * stride_ls`` (0 when O is the final output)."""
    pid_bk = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = (pid_bk // num_kv_heads).to(tl.int64)
    kv_head = (pid_bk % num_kv_heads).to(tl.int64)

    # (query, head-in-group) pairs of this KV group, packed along M: row r is query r // G, head r % G.
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < seqlen_q * group_size
    t = offs_r // group_size
    head = kv_head * group_size + (offs_r % group_size)

    len_k = tl.minimum(tl.maximum(tl.load(SEQLENS + b) + seqlen_new, 0), capacity)
    if CAUSAL:
        # query t sees keys j < len_k - seqlen_q + 1 + t
        key_end = tl.minimum(tl.maximum(len_k - seqlen_q + 1 + t, 0), len_k)
    else:
        key_end = t * 0 + len_k
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, len_k)

    offs_d0 = tl.arange(0, BLOCK_D0)
    q_rows = Q + b * stride_qb + t.to(tl.int64) * stride_qt + head * stride_qh
    q0 = _load_rows(q_rows, offs_d0, row_ok, HEAD_DIM)
    acc0 = tl.zeros([BLOCK_M, BLOCK_D0], dtype=tl.float32)
    if BLOCK_D1 > 0:
        offs_d1 = BLOCK_D0 + tl.arange(0, BLOCK_D1)
        q1 = _load_rows(q_rows, offs_d1, row_ok, HEAD_DIM)
        acc1 = tl.zeros([BLOCK_M, BLOCK_D1], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        first, second, key_ok = _cache_slots(b, offs_n, end, TABLE, stride_tb, page_size, num_blocks, PAGED)
        k_rows = K + first * stride_kb + second * stride_kt + kv_head * stride_kh
        s = tl.dot(q0, tl.trans(_load_rows(k_rows, offs_d0, key_ok, HEAD_DIM)), input_precision=DOT_PRECISION)
        if BLOCK_D1 > 0:
            s = tl.dot(q1, tl.trans(_load_rows(k_rows, offs_d1, key_ok, HEAD_DIM)), s,
                       input_precision=DOT_PRECISION)
        visible = key_ok[None, :] & (offs_n[None, :] < key_end[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key so far keeps m = -inf; shift by 0 there so that exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = V + first * stride_vb + second * stride_vt + kv_head * stride_vh
        v0 = _load_rows(v_rows, offs_d0, key_ok, HEAD_DIM)
        acc0 = tl.dot(p.to(v0.dtype), v0, acc0 * alpha[:, None], input_precision=DOT_PRECISION)
        if BLOCK_D1 > 0:
            v1 = _load_rows(v_rows, offs_d1, key_ok, HEAD_DIM)
            acc1 = tl.dot(p.to(v1.dtype), v1, acc1 * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    t64 = t.to(tl.int64)
    o_rows = O + b * stride_ob + t64 * stride_ot + head * stride_oh + split * stride_os
    _store_rows(o_rows, acc0 / l_safe[:, None], offs_d0, row_ok, HEAD_DIM)
    if BLOCK_D1 > 0:
        _store_rows(o_rows, acc1 / l_safe[:, None], offs_d1, row_ok, HEAD_DIM)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2_C)
    tl.store(LSE + b * stride_lb + t64 * stride_lt + head * stride_lh + split * stride_ls, lse, mask=row_ok)


@triton.jit
def _prism_attn_decode_combine_kernel(
    O_PART, LSE_PART, O, LSE,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh,
    seqlen_q, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Grid: (B x T_q x H,). Row ``pid = (b * T_q + t) * H + h`` of the partials ``o_part
    [B, T_q, H, splits, D]`` and ``lse_part [B, T_q, H, splits]`` (fp32) -> O, LSE."""
    pid = tl.program_id(0).to(tl.int64)
    head = pid % num_heads
    t = (pid // num_heads) % seqlen_q
    b = pid // (num_heads * seqlen_q)
    offs_s = tl.arange(0, BLOCK_S)
    lse_s = tl.load(LSE_PART + pid * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse_s - m_shift), 0)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(0, num_splits):
        weight = tl.exp(tl.load(LSE_PART + pid * num_splits + s) - m_shift)
        o_s = tl.load(O_PART + (pid * num_splits + s) * HEAD_DIM + offs_d, mask=offs_d < HEAD_DIM, other=0.0)
        acc += weight * o_s
    empty = total == 0.0
    total_safe = tl.where(empty, 1.0, total)
    o_ptr = O + b * stride_ob + t * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptr, (acc / total_safe).to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)
    tl.store(LSE + b * stride_lb + head * stride_lh + t, tl.where(empty, float("-inf"), m + tl.log(total_safe)))


# ----------------------------------------------------------------------------------------------
# Launchers (inputs validated by lamina.ops.prism_decode)
# ----------------------------------------------------------------------------------------------
def _strides3(x: torch.Tensor) -> tuple[int, int, int]:
    if x.stride(-1) != 1:
        raise ValueError(f"the head dim must be contiguous, got strides {tuple(x.stride())}")
    return x.stride(0), x.stride(1), x.stride(2)


def _cache_geometry(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> tuple[int, int, int, int]:
    """(capacity per sequence, page size, number of blocks, block-table row stride)."""
    if block_table is None:
        return k_cache.shape[1], 1, k_cache.shape[0], 0
    page_size = k_cache.shape[1]
    return block_table.shape[1] * page_size, page_size, k_cache.shape[0], block_table.stride(0)


def prism_kv_append(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None = None,
) -> None:
    """Write ``k, v [B, T_new, HKV, D]`` into the cache at ``cache_seqlens[b] + t`` (int32 ``[B]``), in place."""
    batch, seqlen_new, num_kv_heads, head_dim = k.shape
    if seqlen_new == 0 or batch == 0:
        return
    capacity, page_size, num_blocks, stride_tb = _cache_geometry(k_cache, block_table)
    block_t = min(APPEND_BLOCK_T, max(2, next_power_of_2(seqlen_new)))
    if num_kv_heads > MAX_GRID_YZ:
        raise ValueError(f"key/value heads must be <= {MAX_GRID_YZ}, got {num_kv_heads}")
    grid = (batch * cdiv(seqlen_new, block_t), num_kv_heads)
    _prism_kv_append_kernel[grid](
        k, v, k_cache, v_cache, cache_seqlens, block_table,
        *_strides3(k), *_strides3(v), *_strides3(k_cache), *_strides3(v_cache), stride_tb,
        seqlen_new, capacity, page_size, num_blocks,
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BLOCK_T=block_t, PAGED=block_table is not None,
        enable_fp_fusion=fp_fusion(),
    )


def prism_attn_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    seqlen_new: int,
    causal: bool,
    scale: float,
    num_splits: int,
    max_seqlen_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV attention of ``q [B, T_q, H, D]`` over the cache (keys already appended).

    Sequence ``b`` has ``cache_seqlens[b] + seqlen_new`` keys (int32 ``[B]``). ``num_splits``: 0 for
    the heuristic, else the split count; ``max_seqlen_k`` bounds the key counts (the heuristic's
    sequence length). Returns o ``[B, T_q, H, D]`` in q's dtype and lse ``[B, H, T_q]`` float32.
    """
    batch, seqlen_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = seqlen_q * group
    tiles = decode_tiles(head_dim, rows)
    m_blocks = cdiv(rows, tiles.block_m)
    programs = batch * num_kv_heads * m_blocks
    if num_splits == 0:
        num_splits = num_splits_heuristic(programs, max_seqlen_k, sm_count(q.device))
    num_splits, keys_per_split = split_plan(num_splits, max_seqlen_k, tiles.block_n)
    if num_splits > MAX_GRID_YZ or m_blocks > MAX_GRID_YZ:
        raise ValueError(f"splits and query blocks must be <= {MAX_GRID_YZ}, got {num_splits} and {m_blocks}")
    capacity, page_size, num_blocks, stride_tb = _cache_geometry(k_cache, block_table)
    o = torch.empty_like(q)
    lse = torch.empty((batch, num_heads, seqlen_q), device=q.device, dtype=torch.float32)
    if num_splits == 1:
        o_dst, lse_dst = o, lse
        o_strides = (*_strides3(o), 0)
        lse_strides = (lse.stride(0), lse.stride(2), lse.stride(1), 0)
    else:
        o_dst = torch.empty((batch, seqlen_q, num_heads, num_splits, head_dim), device=q.device,
                            dtype=torch.float32)
        lse_dst = torch.empty((batch, seqlen_q, num_heads, num_splits), device=q.device, dtype=torch.float32)
        o_strides = (o_dst.stride(0), o_dst.stride(1), o_dst.stride(2), o_dst.stride(3))
        lse_strides = lse_dst.stride()
    pieces = output_pieces(head_dim)
    _prism_attn_decode_kernel[(batch * num_kv_heads, num_splits, m_blocks)](
        q, k_cache, v_cache, cache_seqlens, block_table, o_dst, lse_dst,
        *_strides3(q), *_strides3(k_cache), *_strides3(v_cache), stride_tb, *o_strides, *lse_strides,
        seqlen_q, seqlen_new, num_kv_heads, group, capacity, page_size, num_blocks, keys_per_split,
        scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_D0=pieces[0][1], BLOCK_D1=pieces[1][1] if len(pieces) > 1 else 0,
        CAUSAL=bool(causal), PAGED=block_table is not None, DOT_PRECISION=dot_precision(q.dtype),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        enable_fp_fusion=fp_fusion(),
    )
    if num_splits > 1:
        _prism_attn_decode_combine_kernel[(batch * seqlen_q * num_heads,)](
            o_dst, lse_dst, o, lse, *_strides3(o), lse.stride(0), lse.stride(1),
            seqlen_q, num_heads, num_splits,
            HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BLOCK_S=next_power_of_2(num_splits),
            enable_fp_fusion=fp_fusion(),
        )
    return o, lse


# ----------------------------------------------------------------------------------------------
# Static report: the configurations the launchers pick
# ----------------------------------------------------------------------------------------------
def _signature(fn, names_types: dict[str, str], constexprs: dict) -> tuple[dict, dict]:
    sig = dict(names_types)
    sig.update({name: "constexpr" for name in constexprs})
    missing = [n for n in fn.arg_names if n not in sig]
    if missing:
        raise RuntimeError(f"static report signature of {fn.__name__} misses {missing}")
    return {n: sig[n] for n in fn.arg_names}, constexprs


def _decode_spec(dtype: str, head_dim: int, tiles: DecodeTiles, paged: bool) -> AotSpec:
    ptr = f"*{dtype}"
    types = {"Q": ptr, "K": ptr, "V": ptr, "SEQLENS": "*i32", "TABLE": "*i32", "O": "*fp32", "LSE": "*fp32",
             "qk_scale": "fp32"}
    fn = _prism_attn_decode_kernel
    types.update({n: "i32" for n in fn.arg_names if n.startswith("stride") or n in (
        "seqlen_q", "seqlen_new", "num_kv_heads", "group_size", "capacity", "page_size", "num_blocks",
        "keys_per_split")})
    pieces = output_pieces(head_dim)
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D0": pieces[0][1], "BLOCK_D1": pieces[1][1] if len(pieces) > 1 else 0,
                  "CAUSAL": False, "PAGED": paged, "DOT_PRECISION": "tf32",
                  "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n}
    sig, constexprs = _signature(fn, types, constexprs)
    label = (f"D{head_dim}-{'paged' if paged else 'contiguous'}-M{tiles.block_m}xN{tiles.block_n}"
             f"-w{tiles.num_warps}-s{tiles.num_stages}")
    # Decoding packs T_q x G <= 64 rows into M: below sm_90's 64-row warpgroup MMA, so the dots are
    # mma.sync (HMMA) and the HGMMA check does not apply; the loop is bound by the key/value reads.
    return AotSpec(name="prism_attn_decode", config=label, fn=fn, signature=sig, constexprs=constexprs,
                   num_warps=tiles.num_warps, num_stages=tiles.num_stages, uses_dot=False,
                   meta={"attrs": aot_attrs(fn, sig)})


def _register_static_report() -> None:
    fn = _prism_attn_decode_combine_kernel
    for head_dim in AOT_HEAD_DIMS:
        widest = DECODE_TILES[head_dim_bucket(head_dim)]
        # one query of a multi-head group (M = 16), and the widest M tile, contiguous and paged
        for block_m, paged in sorted({(MIN_BLOCK_M, False), (widest.block_m, False), (widest.block_m, True)}):
            register_aot(_decode_spec("bf16", head_dim, replace(widest, block_m=block_m), paged))
        constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": next_power_of_2(head_dim), "BLOCK_S": MAX_SPLITS}
        types = {"O_PART": "*fp32", "LSE_PART": "*fp32", "O": "*bf16", "LSE": "*fp32"}
        types.update({n: "i32" for n in fn.arg_names if n.startswith("stride") or n in (
            "seqlen_q", "num_heads", "num_splits")})
        sig, constexprs = _signature(fn, types, constexprs)
        register_aot(AotSpec(name="prism_attn_decode_combine", config=f"D{head_dim}-S{MAX_SPLITS}", fn=fn,
                             signature=sig, constexprs=constexprs, num_warps=4, uses_dot=False,
                             meta={"attrs": aot_attrs(fn, sig)}))
    fn = _prism_kv_append_kernel
    for paged in (False, True):
        head_dim = max(AOT_HEAD_DIMS)
        types = {"K_NEW": "*bf16", "V_NEW": "*bf16", "K": "*bf16", "V": "*bf16", "SEQLENS": "*i32", "TABLE": "*i32"}
        types.update({n: "i32" for n in fn.arg_names if n.startswith("stride") or n in (
            "seqlen_new", "capacity", "page_size", "num_blocks")})
        constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "BLOCK_T": APPEND_BLOCK_T, "PAGED": paged}
        sig, constexprs = _signature(fn, types, constexprs)
        register_aot(AotSpec(name="prism_kv_append", config=f"D{head_dim}-{'paged' if paged else 'contiguous'}",
                             fn=fn, signature=sig, constexprs=constexprs, num_warps=4, uses_dot=False,
                             meta={"attrs": aot_attrs(fn, sig)}))


_register_static_report()

__all__ = [
    "DECODE_MAX_SEQLEN_Q",
    "DECODE_TILES",
    "decode_tiles",
    "num_splits_heuristic",
    "prism_attn_decode",
    "prism_kv_append",
    "split_plan",
]
