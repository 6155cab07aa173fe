"""Prism attention backward (FlashAttention-2 style, no atomics), head dims 16..512.

Three launches, with ``P = exp(S - lse)`` recomputed from the forward's log-sum-exp:

* ``_prism_attn_bwd_preprocess_kernel``: ``delta = rowsum(dO * O)`` per query row and head (fp32).
* ``_prism_attn_bwd_dkdv_kernel``: one program per key block, key/value head and output piece;
  it loops over the query heads of its GQA group and their query blocks, so ``dK``/``dV`` sum over
  the group inside the program: ``dV += P^T dO``, ``dK += scale * dS^T Q`` with
  ``dS = P * (dO V^T - delta)``.
* ``_prism_attn_bwd_dq_kernel``: one program per query block, query head and output piece, looping
  over the visible key blocks: ``dQ += scale * dS K``.

Causal masks, sliding windows (``window_size``) and softcapping follow the forward. Both kernels visit only the
blocks the window reaches and mask only the blocks a mask cuts (diagonal, window edges, ragged ends).

Head-dim reductions (``Q K^T``, ``dO V^T``) run over chunks of ``BLOCK_DC`` columns; the outputs
are written one piece per launch (``prism_attn_common``), as in the forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels._utils import MAX_GRID_YZ, AotSpec, autotune, cdiv, fp_fusion, raw_jit, register_aot
from lamina.kernels.prism_attn_common import (
    AOT_HEAD_DIMS,
    AOT_OPTIONS,
    LOG2E,
    LOG2E_C,
    all_configs,
    aot_attrs,
    aot_launches,
    config_label,
    dot_precision,
    head_dot,
    keep_bucket_configs,
    key_range,
    load_tile,
    output_pieces,
    query_range,
    reduction_chunk,
    sequence_bounds,
    store_tile,
    tanh,
    window_args,
    window_visible,
)

# Tile configurations per head-dim bucket, checked by the static report (0 spills, HGMMA, shared
# memory within sm_90 and sm_80 limits, measured with 16-divisible strides, bf16, causal).
# dK/dV hold two fp32 accumulators of the output piece, so their query tile is the smaller one:
# at D = 64, 64 x 64 spilled on sm_80 (4 STL over one stage, 11 over two), 32 x 64 over two stages 7 STL
# under Triton 3.6, over one stage it does not; at D = 128,
# 64 x 64 spilled on sm_90 (29 STL), 32 x 64 does not; above 128, 32 x 64 spilled 4 STL at D = 192 on
# sm_80, 16 x 64 does not; above 128 the head-dim reductions run as a runtime loop over chunks (a static
# one let the compiler hoist all of K and V into registers: 21-163 STL at D = 512 for every tile tried).
# dQ's reductions do the same: with a static loop its pipelined chunks needed 288 KB of shared memory at
# D = 512 (64 x 32 tiles).
DKDV_CONFIGS: dict[int, list[triton.Config]] = {
    64: [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=8, num_stages=1)],
    128: [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=8, num_stages=2)],
    256: [triton.Config({"BLOCK_M": 16, "BLOCK_N": 64}, num_warps=8, num_stages=2)],
    512: [triton.Config({"BLOCK_M": 16, "BLOCK_N": 64}, num_warps=8, num_stages=2)],
}
DQ_CONFIGS: dict[int, list[triton.Config]] = {
    64: [triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2)],
    128: [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=2)],
    256: [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=2)],
    512: [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=2)],
}
# With a window or softcapping, where the plain tile spilled in the static report (every flag on,
# Triton 3.6 or 3.9): dK/dV at D = 128, 32 x 64 over two stages spilled 2 STL on sm_90 under Triton 3.6,
# over one stage it does not; dQ at D <= 64, 128 x 64 spilled 14 STL on sm_80, 64 x 64 does not (215 / 167
# registers).
DKDV_OPTION_CONFIGS: dict[int, list[triton.Config]] = {
    **DKDV_CONFIGS, 128: [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=8, num_stages=1)],
}
DQ_OPTION_CONFIGS: dict[int, list[triton.Config]] = {**DQ_CONFIGS, 64: DQ_CONFIGS[128]}
DKDV_TABLES = (DKDV_CONFIGS, DKDV_OPTION_CONFIGS)
DQ_TABLES = (DQ_CONFIGS, DQ_OPTION_CONFIGS)
# Under the interpreter: tiles smaller than the test sequences, with BLOCK_M != BLOCK_N.
DKDV_INTERPRET_CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1)
DQ_INTERPRET_CONFIG = triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)
# Rows per program of the delta = rowsum(dO * O) preprocess: the head dim is read in BLOCK_DC
# chunks, so a [64, <=128] fp32 product is at most 64 values a thread at 4 warps, for any D.
PREPROCESS_BLOCK_M = 64
PREPROCESS_WARPS = 4


@triton.jit
def _prism_attn_bwd_preprocess_kernel(
    O, DO, DELTA, CU_Q,
    stride_ob, stride_ot, stride_oh,
    stride_db, stride_dt, stride_dh,
    stride_lb, stride_lh,
    seqlen_q, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_DC: tl.constexpr, IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    batch, bos_q, len_q = sequence_bounds(CU_Q, seq, seqlen_q, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return
    row_q = bos_q + m0
    o_blk = O + batch * stride_ob + row_q * stride_ot + head * stride_oh
    do_blk = DO + batch * stride_db + row_q * stride_dt + head * stride_dh
    rows_q = len_q - m0
    offs_c = tl.arange(0, BLOCK_DC)
    delta = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c in tl.static_range(0, HEAD_DIM, BLOCK_DC):
        o = load_tile(o_blk, stride_ot, c + offs_c, rows_q, BLOCK_M, HEAD_DIM).to(tl.float32)
        do = load_tile(do_blk, stride_dt, c + offs_c, rows_q, BLOCK_M, HEAD_DIM).to(tl.float32)
        delta += tl.sum(o * do, 1)
    offs = tl.arange(0, BLOCK_M)
    tl.store(DELTA + batch * stride_lb + head * stride_lh + row_q + offs, delta, mask=offs < rows_q)


@triton.jit
def _dkdv_query_block(dk, dv, k_res, v_res, k_blk, v_blk, q_head, do_head, lse_head, delta_head, start_m, offs_n,
                      offs_out, rows_k, len_q, len_k, diag, stride_kt, stride_vt, stride_qt, stride_dt, qk_scale, win_left,
                      win_right, cap2, cut, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_DC: tl.constexpr, KV_RESIDENT: tl.constexpr, MASK_OUT_COLS: tl.constexpr,
                      WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
                      SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add query block ``[start_m, start_m + BLOCK_M)`` to dK and dV of the key block. Rows past the sequence
    read as zeros; the causal/window mask is applied only when ``cut`` (a runtime branch: a block that lies in
    the sequence and sees every key of the block skips it, and keys past the sequence only touch dK/dV rows
    that are never stored)."""
    q_blk = q_head + start_m * stride_qt.to(tl.int64)
    do_blk = do_head + start_m * stride_dt.to(tl.int64)
    rows_q = len_q - start_m
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < len_q
    lse = tl.load(lse_head + offs_m, mask=row_ok, other=0.0) * LOG2E_C
    delta = tl.load(delta_head + offs_m, mask=row_ok, other=0.0)
    # Transposed tiles [BLOCK_N, BLOCK_M]: keys along rows, queries along columns.
    s_t = head_dot(k_res, k_blk, stride_kt, rows_k, q_blk, stride_qt, rows_q,
                   BLOCK_N, BLOCK_M, HEAD_DIM, BLOCK_DC, KV_RESIDENT, True, DOT_PRECISION, True) * qk_scale
    if SOFTCAP:
        t_t = tanh(s_t / cap2)
        s_t = cap2 * t_t
    p_t = tl.math.exp2(s_t - lse[None, :])
    if cut:
        visible = row_ok[None, :] & (offs_n[:, None] < len_k) & window_visible(
            offs_m[None, :], offs_n[:, None], diag, win_left, win_right, WINDOW_LEFT, WINDOW_RIGHT)
        # a row with lse = -inf (no visible key) gives inf above: the mask makes it 0
        p_t = tl.where(visible, p_t, 0.0)
    do_out = load_tile(do_blk, stride_dt, offs_out, rows_q, BLOCK_M, HEAD_DIM, True, MASK_OUT_COLS)
    dv = tl.dot(p_t.to(do_out.dtype), do_out, dv, input_precision=DOT_PRECISION)
    dp_t = head_dot(v_res, v_blk, stride_vt, rows_k, do_blk, stride_dt, rows_q,
                    BLOCK_N, BLOCK_M, HEAD_DIM, BLOCK_DC, KV_RESIDENT, True, DOT_PRECISION, True)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP:  # through cap * tanh(s / cap): d/ds = 1 - tanh^2
        ds_t = ds_t * (1.0 - t_t * t_t)
    q_out = load_tile(q_blk, stride_qt, offs_out, rows_q, BLOCK_M, HEAD_DIM, True, MASK_OUT_COLS)
    dk = tl.dot(ds_t.to(q_out.dtype), q_out, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _prism_attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_db, stride_dt, stride_dh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, num_kv_heads, group_size, qk_scale, sm_scale, win_left, win_right, cap2,
    HEAD_DIM: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DO: tl.constexpr, OUT_OFFSET: tl.constexpr,
    CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid: (key blocks, sequences, key/value heads). dK/dV share K's and V's strides. Window and
    softcap flags as in the forward kernel."""
    pid_n = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2).to(tl.int64)
    batch, bos_q, len_q = sequence_bounds(CU_Q, seq, seqlen_q, IS_VARLEN)
    _, bos_k, len_k = sequence_bounds(CU_K, seq, seqlen_k, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= len_k:
        return
    KV_RESIDENT: tl.constexpr = BLOCK_DC >= HEAD_DIM
    MASK_OUT_COLS: tl.constexpr = OUT_OFFSET + BLOCK_DO > HEAD_DIM

    row_k = bos_k + n0
    k_blk = K + batch * stride_kb + row_k * stride_kt + kv_head * stride_kh
    v_blk = V + batch * stride_vb + row_k * stride_vt + kv_head * stride_vh
    dk_blk = DK + batch * stride_kb + row_k * stride_kt + kv_head * stride_kh
    dv_blk = DV + batch * stride_vb + row_k * stride_vt + kv_head * stride_vh
    rows_k = len_k - n0
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_out = OUT_OFFSET + tl.arange(0, BLOCK_DO)
    if KV_RESIDENT:
        k_res = load_tile(k_blk, stride_kt, tl.arange(0, BLOCK_DC), rows_k, BLOCK_N, HEAD_DIM)
        v_res = load_tile(v_blk, stride_vt, tl.arange(0, BLOCK_DC), rows_k, BLOCK_N, HEAD_DIM)
    else:
        k_res = offs_n  # unused: K and V are reloaded chunk by chunk
        v_res = offs_n
    dk = tl.zeros([BLOCK_N, BLOCK_DO], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DO], dtype=tl.float32)

    diag = len_k - len_q
    start, full_lo, full_hi, end = query_range(n0, len_q, diag, win_left, win_right, BLOCK_M, BLOCK_N, WINDOW_LEFT,
                                               WINDOW_RIGHT)
    for g in range(0, group_size):
        head = kv_head * group_size + g
        q_head = Q + batch * stride_qb + bos_q * stride_qt + head * stride_qh
        do_head = DO + batch * stride_db + bos_q * stride_dt + head * stride_dh
        lse_head = LSE + batch * stride_lb + head * stride_lh + bos_q
        delta_head = DELTA + batch * stride_lb + head * stride_lh + bos_q
        # One loop, the mask a runtime branch: separate masked and unmasked loops (as dQ has) spilled here
        # (sm_90, D = 64 at 64 x 64 and D = 128 at every tile with 64 keys tried).
        for start_m in range(start, end, BLOCK_M):
            cut = (start_m < full_lo) | (start_m >= full_hi)
            dk, dv = _dkdv_query_block(
                dk, dv, k_res, v_res, k_blk, v_blk, q_head, do_head, lse_head, delta_head, start_m, offs_n, offs_out,
                rows_k, len_q, len_k, diag, stride_kt, stride_vt, stride_qt, stride_dt, qk_scale, win_left, win_right,
                cap2, cut, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_DC, KV_RESIDENT, MASK_OUT_COLS, WINDOW_LEFT,
                WINDOW_RIGHT, SOFTCAP, DOT_PRECISION)
    store_tile(dk_blk, dk * sm_scale, stride_kt, offs_out, rows_k, BLOCK_N, HEAD_DIM)
    store_tile(dv_blk, dv, stride_vt, offs_out, rows_k, BLOCK_N, HEAD_DIM)


@triton.jit
def _dq_key_block(dq, q_res, do_res, q_blk, do_blk, k_base, v_base, start_n, offs_m, offs_out, rows_q, len_q, len_k,
                  diag, lse, delta, stride_qt, stride_dt, stride_kt, stride_vt, qk_scale, win_left, win_right, cap2,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DC: tl.constexpr,
                  QDO_RESIDENT: tl.constexpr, MASK_OUT_COLS: tl.constexpr, MASKED: tl.constexpr,
                  WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Add key block ``[start_n, start_n + BLOCK_N)`` to dQ of the query tile. Without ``MASKED`` every key of
    the block is in the sequence and seen by every row (rows past the sequence only write rows not stored)."""
    k_blk = k_base + start_n * stride_kt.to(tl.int64)
    v_blk = v_base + start_n * stride_vt.to(tl.int64)
    rows_k = len_k - start_n
    offs_n = start_n + tl.arange(0, BLOCK_N)
    s = head_dot(q_res, q_blk, stride_qt, rows_q, k_blk, stride_kt, rows_k,
                 BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_DC, QDO_RESIDENT, MASKED, DOT_PRECISION, True) * qk_scale
    if SOFTCAP:
        t = tanh(s / cap2)
        s = cap2 * t
    if MASKED:
        visible = (offs_m < len_q)[:, None] & (offs_n[None, :] < len_k) & window_visible(
            offs_m[:, None], offs_n[None, :], diag, win_left, win_right, WINDOW_LEFT, WINDOW_RIGHT)
        p = tl.where(visible, tl.math.exp2(s - lse[:, None]), 0.0)
    else:
        p = tl.math.exp2(s - lse[:, None])
    dp = head_dot(do_res, do_blk, stride_dt, rows_q, v_blk, stride_vt, rows_k,
                  BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_DC, QDO_RESIDENT, MASKED, DOT_PRECISION, True)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    k_out = load_tile(k_blk, stride_kt, offs_out, rows_k, BLOCK_N, HEAD_DIM, MASKED, MASK_OUT_COLS)
    return tl.dot(ds.to(k_out.dtype), k_out, dq, input_precision=DOT_PRECISION)


@triton.jit
def _prism_attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_db, stride_dt, stride_dh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, num_heads, group_size, qk_scale, sm_scale, win_left, win_right, cap2,
    HEAD_DIM: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DO: tl.constexpr, OUT_OFFSET: tl.constexpr,
    CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid: (query blocks, sequences, query heads). dQ shares Q's strides."""
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    kv_head = head // group_size
    batch, bos_q, len_q = sequence_bounds(CU_Q, seq, seqlen_q, IS_VARLEN)
    _, bos_k, len_k = sequence_bounds(CU_K, seq, seqlen_k, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return
    QDO_RESIDENT: tl.constexpr = BLOCK_DC >= HEAD_DIM
    MASK_OUT_COLS: tl.constexpr = OUT_OFFSET + BLOCK_DO > HEAD_DIM

    row_q = bos_q + m0
    q_blk = Q + batch * stride_qb + row_q * stride_qt + head * stride_qh
    do_blk = DO + batch * stride_db + row_q * stride_dt + head * stride_dh
    dq_blk = DQ + batch * stride_qb + row_q * stride_qt + head * stride_qh
    k_base = K + batch * stride_kb + bos_k * stride_kt + kv_head * stride_kh
    v_base = V + batch * stride_vb + bos_k * stride_vt + kv_head * stride_vh
    rows_q = len_q - m0
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_out = OUT_OFFSET + tl.arange(0, BLOCK_DO)
    row_ok = offs_m < len_q
    lse_off = batch * stride_lb + head * stride_lh + row_q + tl.arange(0, BLOCK_M)
    lse = tl.load(LSE + lse_off, mask=row_ok, other=0.0) * LOG2E_C
    delta = tl.load(DELTA + lse_off, mask=row_ok, other=0.0)
    if QDO_RESIDENT:
        q_res = load_tile(q_blk, stride_qt, tl.arange(0, BLOCK_DC), rows_q, BLOCK_M, HEAD_DIM)
        do_res = load_tile(do_blk, stride_dt, tl.arange(0, BLOCK_DC), rows_q, BLOCK_M, HEAD_DIM)
    else:
        q_res = offs_m  # unused: Q and dO are reloaded chunk by chunk
        do_res = offs_m
    dq = tl.zeros([BLOCK_M, BLOCK_DO], dtype=tl.float32)

    diag = len_k - len_q
    # As in the forward: only the key blocks the window cuts pay for the mask.
    start, full_lo, full_hi, end = key_range(m0, BLOCK_M, len_k, diag, win_left, win_right, BLOCK_N, WINDOW_LEFT,
                                             WINDOW_RIGHT)
    for start_n in range(start, tl.minimum(full_lo, end), BLOCK_N):
        dq = _dq_key_block(dq, q_res, do_res, q_blk, do_blk, k_base, v_base, start_n, offs_m, offs_out, rows_q, len_q,
                           len_k, diag, lse, delta, stride_qt, stride_dt, stride_kt, stride_vt, qk_scale, win_left,
                           win_right, cap2, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_DC, QDO_RESIDENT, MASK_OUT_COLS, True,
                           WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, DOT_PRECISION)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        dq = _dq_key_block(dq, q_res, do_res, q_blk, do_blk, k_base, v_base, start_n, offs_m, offs_out, rows_q, len_q,
                           len_k, diag, lse, delta, stride_qt, stride_dt, stride_kt, stride_vt, qk_scale, win_left,
                           win_right, cap2, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_DC, QDO_RESIDENT, MASK_OUT_COLS, False,
                           WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, DOT_PRECISION)
    for start_n in range(full_hi, end, BLOCK_N):
        dq = _dq_key_block(dq, q_res, do_res, q_blk, do_blk, k_base, v_base, start_n, offs_m, offs_out, rows_q, len_q,
                           len_k, diag, lse, delta, stride_qt, stride_dt, stride_kt, stride_vt, qk_scale, win_left,
                           win_right, cap2, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_DC, QDO_RESIDENT, MASK_OUT_COLS, True,
                           WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, DOT_PRECISION)
    store_tile(dq_blk, dq * sm_scale, stride_qt, offs_out, rows_q, BLOCK_M, HEAD_DIM)


_KEY = ["HEAD_DIM", "BLOCK_DO", "OUT_OFFSET", "CAUSAL", "IS_VARLEN", "WINDOW_LEFT", "WINDOW_RIGHT", "SOFTCAP"]
_dkdv_tuned = autotune(
    all_configs(DKDV_TABLES), key=_KEY, interpret_config=DKDV_INTERPRET_CONFIG,
    prune_configs_by={"early_config_prune": keep_bucket_configs(DKDV_TABLES)},
)(_prism_attn_bwd_dkdv_kernel)
_dq_tuned = autotune(
    all_configs(DQ_TABLES), key=_KEY, interpret_config=DQ_INTERPRET_CONFIG,
    prune_configs_by={"early_config_prune": keep_bucket_configs(DQ_TABLES)},
)(_prism_attn_bwd_dq_kernel)


def _strides3(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def prism_attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dlse: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels on validated, contiguous inputs.

    do, q, o: [B, T, H, D]; k, v: [B, S, HKV, D]; lse: [B, H, T] float32 from ``prism_attn_fwd``;
    dlse: [B, H, T], the gradient of lse when the caller used it (d lse_i / d s_ij = P_ij, so it
    enters as ``dS = P * (dO V^T - (delta - dlse))``).
    Returns dq: [B, T, H, D], dk and dv: [B, S, HKV, D], in the inputs' dtype.
    """
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    is_varlen = cu_seqlens_q is not None
    if is_varlen:
        n_seq = cu_seqlens_q.numel() - 1
        max_q = int(max_seqlen_q) if max_seqlen_q is not None else int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        max_k = int(max_seqlen_k) if max_seqlen_k is not None else int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
    else:
        n_seq, max_q, max_k = batch, seqlen_q, seqlen_k
    if n_seq > MAX_GRID_YZ or num_heads > MAX_GRID_YZ:
        raise ValueError(f"sequences and heads must each be <= {MAX_GRID_YZ} (grid axes 1 and 2), "
                         f"got {n_seq} and {num_heads}")
    do = do.contiguous()
    delta = torch.empty_like(lse)
    block_dc = reduction_chunk(head_dim)
    _prism_attn_bwd_preprocess_kernel[(cdiv(max_q, PREPROCESS_BLOCK_M), n_seq, num_heads)](
        o, do, delta, cu_seqlens_q, *_strides3(o), *_strides3(do), lse.stride(0), lse.stride(1),
        seqlen_q, num_heads, HEAD_DIM=head_dim, BLOCK_DC=block_dc, IS_VARLEN=is_varlen,
        BLOCK_M=PREPROCESS_BLOCK_M, num_warps=PREPROCESS_WARPS, enable_fp_fusion=fp_fusion(),
    )
    if dlse is not None:
        delta = delta - torch.where(torch.isinf(lse), torch.zeros_like(lse), dlse.float())
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    group = num_heads // num_kv_heads
    common = (*_strides3(q), *_strides3(k), *_strides3(v), *_strides3(do), lse.stride(0), lse.stride(1))
    window, window_flags = window_args(causal, window_size, softcap)
    flags = dict(HEAD_DIM=head_dim, BLOCK_DC=block_dc, CAUSAL=bool(causal), IS_VARLEN=is_varlen,
                 DOT_PRECISION=dot_precision(q.dtype), **window_flags)
    for out_offset, block_do in output_pieces(head_dim):
        _dkdv_tuned[lambda meta: (cdiv(max_k, meta["BLOCK_N"]), n_seq, num_kv_heads)](
            q, k, v, do, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, *common,
            seqlen_q, seqlen_k, num_kv_heads, group, scale * LOG2E, scale, *window,
            BLOCK_DO=block_do, OUT_OFFSET=out_offset, **flags, enable_fp_fusion=fp_fusion(),
        )
    for out_offset, block_do in output_pieces(head_dim):
        _dq_tuned[lambda meta: (cdiv(max_q, meta["BLOCK_M"]), n_seq, num_heads)](
            q, k, v, do, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, *common,
            seqlen_q, seqlen_k, num_heads, group, scale * LOG2E, scale, *window,
            BLOCK_DO=block_do, OUT_OFFSET=out_offset, **flags, enable_fp_fusion=fp_fusion(),
        )
    return dq, dk, dv


def _aot_signature(kernel: str, dtype: str, head_dim: int, piece: tuple[int, int], config: triton.Config | None,
                   options: tuple[bool, tuple[int, int], float] = AOT_OPTIONS[""]) -> tuple[dict, dict]:
    ptr = f"*{dtype}"
    if kernel == "preprocess":
        sig = {"O": ptr, "DO": ptr, "DELTA": "*fp32", "CU_Q": "*i32"}
        names = ("o", "d")
        scalars = {"seqlen_q": "i32", "num_heads": "i32"}
        constexprs = {"HEAD_DIM": head_dim, "BLOCK_DC": reduction_chunk(head_dim), "IS_VARLEN": False,
                      "BLOCK_M": PREPROCESS_BLOCK_M}
    else:
        sig = {"Q": ptr, "K": ptr, "V": ptr, "DO": ptr, "LSE": "*fp32", "DELTA": "*fp32"}
        sig.update({"DK": ptr, "DV": ptr} if kernel == "dkdv" else {"DQ": ptr})
        sig.update({"CU_Q": "*i32", "CU_K": "*i32"})
        names = ("q", "k", "v", "d")
        heads = "num_kv_heads" if kernel == "dkdv" else "num_heads"
        scalars = {"seqlen_q": "i32", "seqlen_k": "i32", heads: "i32", "group_size": "i32",
                   "qk_scale": "fp32", "sm_scale": "fp32", "win_left": "i32", "win_right": "i32", "cap2": "fp32"}
        constexprs = {"HEAD_DIM": head_dim, "BLOCK_DC": reduction_chunk(head_dim), "BLOCK_DO": piece[1],
                      "OUT_OFFSET": piece[0], "CAUSAL": options[0], "IS_VARLEN": False, "DOT_PRECISION": "tf32",
                      **window_args(*options)[1], **config.kwargs}
    for name in names:
        sig.update({f"stride_{name}b": "i32", f"stride_{name}t": "i32", f"stride_{name}h": "i32"})
    sig.update({"stride_lb": "i32", "stride_lh": "i32", **scalars})
    sig.update({name: "constexpr" for name in constexprs})
    return sig, constexprs


_KERNELS = {"preprocess": _prism_attn_bwd_preprocess_kernel, "dkdv": _prism_attn_bwd_dkdv_kernel,
            "dq": _prism_attn_bwd_dq_kernel}


def _register_static_report() -> None:
    for head_dim in AOT_HEAD_DIMS:
        fn = _KERNELS["preprocess"]
        sig, constexprs = _aot_signature("preprocess", "bf16", head_dim, (0, 0), None)
        register_aot(AotSpec(
            name="prism_attn_bwd_preprocess", config=f"D{head_dim}-M{PREPROCESS_BLOCK_M}", fn=fn,
            signature=sig, constexprs=constexprs, num_warps=PREPROCESS_WARPS, uses_dot=False,
            meta={"attrs": aot_attrs(fn, sig)},
        ))
        for kernel, tables in (("dkdv", DKDV_TABLES), ("dq", DQ_TABLES)):
            fn = raw_jit(_KERNELS[kernel])
            for suffix, options, config, piece in aot_launches(tables, head_dim):
                sig, constexprs = _aot_signature(kernel, "bf16", head_dim, piece, config, options)
                register_aot(AotSpec(
                    name=f"prism_attn_bwd_{kernel}", config=config_label(head_dim, piece, config) + suffix,
                    fn=fn, signature=sig, constexprs=constexprs, num_warps=config.num_warps,
                    num_stages=config.num_stages, uses_dot=True, meta={"attrs": aot_attrs(fn, sig)},
                ))


_register_static_report()

__all__ = ["DKDV_CONFIGS", "DKDV_OPTION_CONFIGS", "DQ_CONFIGS", "DQ_OPTION_CONFIGS", "prism_attn_bwd"]
