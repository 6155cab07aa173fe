"""Forward kernels of the delta-rule family (DeltaNet, Gated DeltaNet, KDA, GDN-2).

Per token, on a float32 state ``S [K, V]`` per sequence and value head (DESIGN.md)::

    S <- Diag(exp(g_t)) S;  r_t = S^T (b_t * k_t);  S <- S + k_t (w_t * v_t - r_t)^T;  o_t = S^T (scale q_t)

Chunked form (chunk of ``BT`` tokens, ``G`` the in-chunk inclusive cumulative sum of ``g``,
``E = b * k``, ``Z = w * v``, ``E_bar = E * exp(G)``)::

    L    = strict_tril(E K^T  *  exp(G_t - G_s))          (channel-wise: sum over K inside)
    A    = (I + L)^-1                                     (UT transform)
    Y    = A E_bar,  U = A Z                              (WY factors; V_new = U - Y S)
    Aqk  = scale * tril(Q K^T * exp(G_t - G_s))
    O    = scale * (Q * exp(G)) S + Aqk V_new
    S'   = Diag(exp(G_last)) S + (K * exp(G_last - G))^T V_new

Two launches:

1. ``_delta_chunk_prep_fwd_kernel``, one program per (chunk, value head): the gate activation of a raw
   gate input (``GATE_ACT``, fla's ``use_gate_in_kernel``), cumulative decay,
   ``L`` and ``Aqk`` (with channel-wise decay: exponents relative to a row inside the same
   16-token sub-block, so every exp factor is <= 1), the triangular inverse (kept for the backward when
   the states are saved: one solve serves both directions), ``Y`` and ``U``.
2. ``_delta_chunk_scan_fwd_kernel``, one program per (sequence, value head, V tile): walks the
   chunks in order with ``S`` in registers (or, for fp32 activations and for K > 256 on targets
   without warpgroup products, in the final-state buffer one key block at a time: ``scan_tiles``),
   writes ``O`` directly (the state pass and the output are one sweep; ``V_new`` never goes through
   memory) and stores the chunk-start states ``h`` for the backward.

``L2NORM`` (fla's ``use_qk_l2norm_in_kernel``): q and k are the raw rows, and no kernel of their own normalises
them. The preparation kernel takes the inverse norms ``rq`` and ``r`` of its chunk's rows of q and k first
(stored, ``[B, T, H]`` float32) and scales every row of q and k it loads by them (for ``L``, ``Aqk`` and
``Y``); the state pass and the separate output kernel scale the rows of q and k they load by them.

The token-by-token twin for decoding is kernels/delta_recurrent_fwd.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lamina.kernels._utils import autotune, cdiv, fp_fusion, multiprocessors, next_power_of_2
from lamina.kernels.delta_chunk_common import (
    DECAY_CHANNEL,
    DECAY_NONE,
    DECAY_SCALAR,
    DEFAULT_CHUNK_SIZE,
    DOT_PRECISION,
    FP32_MATRIX_MIN_N,
    FP32_NARROW_WARPS,
    GATE_SCALAR,
    MATRIX_WARPS,
    MIN_BLOCK,
    STATE_BLOCK_K,
    SUB_BLOCK_C,
    WARPS_PER_WARPGROUP,
    BetaAct,
    DecayKind,
    GateInput,
    _col_ptrs,
    _load_state,
    _masked_exp,
    _row_ptrs,
    _state_ptrs,
    _store_state,
    _vec_ptrs,
    activated_beta,
    check_beta_act,
    chunk_bounds,
    chunk_indices,
    chunk_rows,
    decay_kind,
    first_chunk,
    gate_kernel_args,
    gate_kind,
    has_warpgroup_mma,
    inverse_norm,
    key_blocks,
    load_gate,
    matrix_warps,
    seq_bounds,
    value_block,
)
from lamina.kernels.delta_tuning import DeltaTuning, active_tuning

# V tile of the preparation kernel's U = A Z loop; K tile of its K loops. The per-channel decay
# path holds about ten [BT, BK] fp32 tiles (k, q, b*k, the cumulative gate and decayed copies)
# next to the [BT, BT] matrices and needs the narrower K tile. Static report (sm_80, 8 warps):
# a V tile of 64 spilled; per-channel with BK = 64 spilled; scalar decay with BK = 32 spilled.
PREP_BLOCK_V = 32
PREP_BLOCK_K = {DecayKind.NONE: 64, DecayKind.SCALAR: 64, DecayKind.CHANNEL: 32}
# K tile for fp32 activations, whose tf32x3 products split every operand in two, on every target and for every
# variant; the kernel's key loop is rolled for fp32. Static report, K = 64 to 512: with the 16-bit tiles the
# prep spilled 2-174 STL on sm_90 from K = 128 on (KDA and GDN-2 from K = 64). DeltaNet and GDN at 32 compiled
# without spills by default (164-203 registers on sm_90), but their solve_block=16 rows, which keep the
# inverse for the backward (STORE_A), spilled 5-9 STL under Triton 3.9; at 16 those compile to 247-255
# registers without spills (3.6 and 3.9) and the fp32 defaults of all four variants to 122-180 (3.9). On sm_80
# (mma.sync keeps every operand in registers) 32 spilled 32-40 STL at K = 128, and per-channel decay spilled
# 8-10 STL at 16 until its sub-block loop was rolled (see _gram_key_block).
PREP_BLOCK_K_FP32 = 16
# The fp32 V tile on targets without warpgroup products. Static report, sm_80, K = 64 to 512, Triton 3.6 and
# 3.9, with the solve by column elimination: at PREP_BLOCK_V, GDN-2 (a per-channel write gate, whose U = A Z
# loop loads a [BT, BV] gate tile next to Z) spilled 92-98 STL and DeltaNet, GDN and KDA 0-3 (255 registers);
# at 16 none does (253-255).
PREP_BLOCK_V_FP32_MMA_SYNC = 16


def prep_key_blocks(K: int, decay: int, fp32: bool = False) -> tuple[int, int]:
    """(BK, NK) of the preparation kernel's K loops, for fp32 activations (``fp32``) or 16-bit ones."""
    k_pad = max(next_power_of_2(K), MIN_BLOCK)
    bk = min(k_pad, PREP_BLOCK_K_FP32 if fp32 else PREP_BLOCK_K[decay])
    return bk, k_pad // bk


def prep_value_block(V: int, fp32: bool = False, warpgroup_mma: bool = True) -> int:
    """BV of the preparation kernel's U = A Z loop for value dim ``V``, for fp32 or 16-bit activations, on a
    target with or without warpgroup products."""
    narrow = fp32 and not warpgroup_mma
    return min(PREP_BLOCK_V_FP32_MMA_SYNC if narrow else PREP_BLOCK_V, max(next_power_of_2(V), MIN_BLOCK))


def prep_store_key_blocks(K: int, decay: int, fp32: bool = False, warpgroup_mma: bool = True) -> tuple[int, int]:
    """(BKY, NKY) of the preparation kernel's ``Y = A (E exp(G))`` loop: the key loops' blocks
    (``prep_key_blocks``), but for fp32 with warpgroup products at least two warpgroups of ``WGMMA_TF32_MIN_N``
    columns wide (``FP32_MATRIX_MIN_N``: a 16-column tf32 product at 8 warps is the shape of Triton issue #10629).
    The loop holds one [BT, BKY] tile next to the inverse, so the wider block costs few registers."""
    bk, nk = prep_key_blocks(K, decay, fp32)
    if not (fp32 and warpgroup_mma):
        return bk, nk
    k_pad = bk * nk
    bky = min(k_pad, max(bk, FP32_MATRIX_MIN_N))
    return bky, k_pad // bky


def prep_warps(bky: int, bv: int, fp32: bool, warpgroup_mma: bool) -> int:
    """Warps of the preparation kernel with Y's key block ``bky`` and U's value block ``bv``: ``matrix_warps`` of
    its narrowest product (those two, or the chunk's [BT, BT] products)."""
    return matrix_warps(min(bky, bv), fp32, warpgroup_mma)


# Warps the state pass's autotuner chooses from (the static report compiles the first).
SCAN_WARPS = (MATRIX_WARPS, WARPS_PER_WARPGROUP)


class ScanTiles(NamedTuple):
    """Blocks of the state pass: ``bk`` x ``nk`` key rows, ``bv`` value columns per program, where the
    state lives (``state_in_memory``: in the final-state buffer, one key block at a time; else registers),
    and the warps its autotuner chooses from (``warps``; the static report compiles the first)."""

    bk: int
    nk: int
    bv: int
    state_in_memory: bool
    warps: tuple[int, ...] = SCAN_WARPS


# Key block of the kernels that read the state from memory one block at a time (the state pass with the
# state in memory, the separate output kernel), in a rolled loop: one [BK, BV] state block next to the
# [BT, BK] tiles of Y, q and k, as in the registers' K = 64 case. fp32 activations (tf32x3 splits each
# operand in two) take half. Static report, sm_90, K = 64 to 512, all four variants: the fp32 state pass
# compiles to 210-236 registers under Triton 3.9 (235-250 under 3.6) without spills; the fp32 output kernel
# with the registers' blocks (64 or 128 rows, unrolled) spilled 7-400 STL from K = 128 on, and with these
# compiles to 174 registers.
MEMORY_STATE_BLOCK_K = STATE_BLOCK_K
MEMORY_STATE_BLOCK_K_FP32 = 32


def memory_key_blocks(K: int, fp32: bool) -> tuple[int, int]:
    """(BK, NK) of the kernels that read the state from memory, for fp32 activations (``fp32``) or 16-bit ones."""
    k_pad = max(next_power_of_2(K), MIN_BLOCK)
    bk = min(k_pad, MEMORY_STATE_BLOCK_K_FP32 if fp32 else MEMORY_STATE_BLOCK_K)
    return bk, k_pad // bk


# Widest key dim whose 16-bit state pass keeps the state in registers on targets without warpgroup products.
# Static report, sm_80, K = 512 (four 128-row blocks, BV = 16): KDA and GDN-2 spilled 1 STL under Triton 3.9
# and GDN, KDA and GDN-2 under 3.6 (255 registers); with the state in memory every variant compiles to
# 196-233 registers without spills under both. sm_90 keeps registers at K = 512 (no spills there).
MMA_SYNC_REGISTER_STATE_MAX_K = 256


def scan_tiles(K: int, V: int, fp32: bool, warpgroup_mma: bool, tuning: DeltaTuning | None = None) -> ScanTiles:
    """The state pass's blocks for key dim ``K``, value dim ``V``, fp32 activations (``fp32``) or 16-bit ones,
    on a target with or without warpgroup products (``has_warpgroup_mma``): used by the launcher and the
    static report alike. fp32 keeps the state in memory: in registers it spilled on sm_90 at every K
    (static report: 2-69 STL up to K = 256, 417-489 at K = 512); so does 16-bit above
    ``MMA_SYNC_REGISTER_STATE_MAX_K`` without warpgroup products. ``tuning.state_in_memory``, where set,
    replaces that choice (the registers hold at most four key blocks, so K = 512 fp32 stays in memory)."""
    in_memory = fp32 or (not warpgroup_mma and K > MMA_SYNC_REGISTER_STATE_MAX_K)
    if tuning is not None and tuning.state_in_memory is not None:
        in_memory = tuning.state_in_memory
    if not in_memory:
        bk, nk = key_blocks(K)
        tiles = ScanTiles(bk, nk, value_block(K, V, fp32=fp32, warpgroup_mma=warpgroup_mma), False)
    else:
        bk, nk = memory_key_blocks(K, fp32)
        # the V tile of a state with a single key block
        tiles = ScanTiles(bk, nk, value_block(bk, V, fp32=fp32, warpgroup_mma=warpgroup_mma), True)
    return tiles._replace(warps=scan_warps(tiles.bk, tiles.bv, fp32, warpgroup_mma))


def scan_warps(bk: int, bv: int, fp32: bool, warpgroup_mma: bool) -> tuple[int, ...]:
    """The warps the state pass's autotuner chooses from for key and value blocks ``bk``, ``bv``: its products are
    [BT, BV] (the output, the writes) and [BK, BV] (the state's update); fp32 with a 16-column one runs only
    ``matrix_warps``'s."""
    warps = matrix_warps(min(bk, bv), fp32, warpgroup_mma)
    return SCAN_WARPS if warps == MATRIX_WARPS else (warps,)


# Diagonal block of the triangular solve (see the kernel), the default of ``DeltaTuning.solve_block``
# (``delta_tuning(solve_block=16)`` picks another per call). 64 (= the chunk): elimination over all
# rows in fp32, no matrix products; 16: four 16-row eliminations merged with four 64x64 fp32 products,
# which at tf32x3 spilled on sm_80 (static report, with the earlier row substitution; the alternatives are
# compiled for sm_90 only now), so the full elimination is the default until a GPU sweep times the two.
SOLVE_BLOCK = DeltaTuning().solve_block


# ----------------------------------------------------------------------------------------------
# 1. per-chunk preparation
# ----------------------------------------------------------------------------------------------
@triton.jit
def _gram_key_block(b_L, b_Aqk, q, k, b, gcum, b_beta, b_rq, b_rk, rk, kb, tok0, t0, seqlen, o_t, m_t, i_h, i_hv,
                    scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr,
                    SUB: tl.constexpr, DECAY: tl.constexpr, ERASE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    L2NORM: tl.constexpr):
    """Adds key block ``kb``'s part of ``L = E K^T`` and ``Aqk = scale Q K^T`` (decayed per channel
    here; a scalar decay and, for 16-bit rows without a per-channel decay, ``scale`` are applied by the caller)
    onto ``b_L`` and ``b_Aqk``; with ``L2NORM`` the rows of q and k scaled by their inverse norms ``b_rq`` and
    ``b_rk`` (``rk`` in memory) as they are loaded. (q times ``scale`` rounded to 16 bits as an operand left
    products that cancel off by a 16-bit ulp of their terms: bf16 DeltaNet, one token whose q.k is about 1/16
    of its terms, RMS error ratio of the output 0.072 with it, 0.0035 with ``scale`` applied after the
    product. fp32 rows round it in fp32 and keep it in the operand: after the product, GDN's fp32
    ``solve_block=16`` alternative spilled 1 STL on sm_90 at 255 registers, Triton 3.9.)"""
    DT = q.dtype.element_ty
    o_k = kb * BK + tl.arange(0, BK)
    m = m_t[:, None] & (o_k < K)[None, :]
    b_k = tl.load(_row_ptrs(k, tok0, o_t, i_h, H, K, o_k), mask=m, other=0.0).to(tl.float32)
    b_q = tl.load(_row_ptrs(q, tok0, o_t, i_h, H, K, o_k), mask=m, other=0.0).to(tl.float32)
    if DECAY == DECAY_CHANNEL or DT == tl.float32:
        b_q = b_q * scale
    if L2NORM:
        b_k = b_k * b_rk[:, None]
        b_q = b_q * b_rq[:, None]
    if ERASE == GATE_SCALAR:
        b_e = b_k * b_beta[:, None]
    else:
        b_e = b_k * tl.load(_row_ptrs(b, tok0, o_t, i_hv, HV, K, o_k), mask=m, other=0.0).to(tl.float32)
    if DECAY == DECAY_CHANNEL:
        b_G = tl.load(_row_ptrs(gcum, tok0, o_t, i_hv, HV, K, o_k), mask=m, other=0.0)
        # strictly block-lower part: rows of sub-block i against every earlier row, both
        # factors taken relative to row r = i*SUB - 1 (exp(G_t - G_r) <= 1 for t > r,
        # exp(G_r - G_s) <= 1 for s <= r). A rolled loop: unrolled (inside the unrolled key blocks of
        # 16-bit), every sub-block's operands were live at once. Static report, Triton 3.9: sm_90 KDA and
        # GDN-2 bf16 K = 128/256 took 232-238 registers unrolled, 127-173 rolled; sm_80 fp32 K = 128 went
        # from 8-10 STL to 0 (KDA) and 3 (GDN-2); and the compile is 3-4 times faster (sm_80 bf16
        # K = 256: 26 s -> 7 s per kernel).
        for i in range(1, NB):
            r = i * SUB - 1
            b_Gr = tl.sum(tl.where((o_t == r)[:, None], b_G, 0.0), 0)
            in_i = (o_t >= i * SUB) & (o_t < i * SUB + SUB) & m_t
            d_left = _masked_exp(b_G - b_Gr[None, :], in_i[:, None])
            # (a sub-block of padding rows has no valid reference row: skip it)
            use = (o_t <= r) & m_t & (t0 + i * SUB < seqlen)
            b_right = b_k * _masked_exp(b_Gr[None, :] - b_G, use[:, None])
            b_right = tl.trans(b_right.to(DT))
            b_L += tl.dot((b_e * d_left).to(DT), b_right, input_precision=DOT_PRECISION)
            b_Aqk += tl.dot((b_q * d_left).to(DT), b_right, input_precision=DOT_PRECISION)
        # diagonal sub-blocks, element-wise with exact exponents: column j of every
        # sub-block at once (row t pairs with s = SUB * (t // SUB) + j <= t)
        off = o_t % SUB
        for j in range(0, SUB):
            rows_j = (o_t // SUB) * SUB + j
            m_j = ((t0 + rows_j) < seqlen)[:, None] & (o_k < K)[None, :]
            b_kj = tl.load(_row_ptrs(k, tok0, rows_j, i_h, H, K, o_k), mask=m_j, other=0.0).to(tl.float32)
            if L2NORM:
                b_rkj = tl.load(_vec_ptrs(rk, tok0, rows_j, i_h, H), mask=(t0 + rows_j) < seqlen, other=0.0)
                b_kj = b_kj * b_rkj[:, None]
            b_Gj = tl.load(_row_ptrs(gcum, tok0, rows_j, i_hv, HV, K, o_k), mask=m_j, other=0.0)
            l_val = tl.sum(b_e * b_kj * _masked_exp(b_G - b_Gj, ((off > j) & m_t)[:, None]), 1)
            q_val = tl.sum(b_q * b_kj * _masked_exp(b_G - b_Gj, ((off >= j) & m_t)[:, None]), 1)
            sel = o_t[None, :] == rows_j[:, None]
            b_L += tl.where(sel, l_val[:, None], 0.0)
            b_Aqk += tl.where(sel, q_val[:, None], 0.0)
    else:
        b_kT = tl.trans(b_k.to(DT))
        b_L += tl.dot(b_e.to(DT), b_kT, input_precision=DOT_PRECISION)
        b_Aqk += tl.dot(b_q.to(DT), b_kT, input_precision=DOT_PRECISION)
    return b_L, b_Aqk


@triton.jit
def _store_inverse_norms(x, dst, tok0, o_t, m_t, i_h, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                         BK: tl.constexpr, NK: tl.constexpr):
    """Stores ``1 / sqrt(sum(x^2) + eps)`` of each of the chunk's rows of ``x [.., T, H, K]`` into ``dst
    [.., T, H]`` (float32), summed over the key blocks in a rolled loop."""
    b_ss = tl.zeros([BT], dtype=tl.float32)
    for kb in range(NK):
        o_k = kb * BK + tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        b_x = tl.load(_row_ptrs(x, tok0, o_t, i_h, H, K, o_k), mask=m, other=0.0).to(tl.float32)
        b_ss += tl.sum(b_x * b_x, 1)
    tl.store(_vec_ptrs(dst, tok0, o_t, i_h, H), inverse_norm(b_ss), mask=m_t)


@triton.jit
def _block_unit_lower_inverse(L, o_t, n_cols, BLOCK: tl.constexpr):
    """``(I + L)^-1`` inside every ``BLOCK``-row diagonal block of a strictly lower triangular ``[BT, BT]``
    fp32 tile ``L`` (``BLOCK = BT``: the whole inverse; entries of ``L`` outside those blocks are not read), by
    elimination column by column: after step ``c``, row ``c`` of every block of ``X`` is final, and each
    later row ``r`` of its block takes ``L[r, c]`` times it off, ``X[r] -= L[r, c] X[c]`` (the rows of
    ``(I + L) X = I``). Columns ``0 .. n_cols - 1`` of each block are eliminated (``BLOCK - 1``: all of them).

    The column of ``L`` comes out of a row sum and the row of ``X`` out of a column sum, each used along the
    axis its sum leaves it on: no layout change per step. Row by row instead (``X[j] = e_j - sum_{c < j}
    L[j, c] X[c]``), the coefficients came out of a column sum and were used down the rows, a layout change
    of a ``[BT]`` vector per step: with 16- and 32-row blocks this kernel spilled on sm_90 (static report:
    243-393 STL under Triton 3.9, 230-264 under 3.6). The backward does not solve: it reads the inverse this
    kernel stores (``STORE_A``). Not built transposed and turned with ``tl.trans`` either: the transpose of a
    tile in a product's layout, stored to shared memory for the next product (TTGIR: ``local_alloc`` of a
    ``#linear`` tensor), is what Triton 3.4-3.6 miscompiles on Hopper (fla issue #640: wrong gradients; fla
    routes around it the same way)."""
    first = (o_t // BLOCK) * BLOCK
    same = first[:, None] == first[None, :]
    X = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    for c in range(0, n_cols):
        col = first + c
        l_col = tl.sum(tl.where(o_t[None, :] == col[:, None], L, 0.0), 1)
        x_row = tl.sum(tl.where(o_t[:, None] == col[None, :], X, 0.0), 0)
        X -= tl.where(same, l_col[:, None] * x_row[None, :], 0.0)
    return X


@triton.jit
def _store_solved_block(dst, src, gate, gcum, b_Ad, b_gate, b_gs, b_rs, blk, tok0, o_t, m_t, i_src, i_hv,
                        HS: tl.constexpr, HV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                        GATE: tl.constexpr, DECAY: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        ROW_SCALE: tl.constexpr):
    """Stores columns ``blk * BD + [0, BD)`` of ``A (X * gate * exp(G))`` into ``dst``: ``Y = A (E exp(G))``
    from the keys (``src = k`` with ``HS = H`` heads, the erase gate) or ``U = A Z`` from the values (``v``,
    ``HS = HV``, the write gate, ``DECAY_NONE``). ``b_Ad``: the chunk's inverse in the activations' dtype;
    ``b_gate``, ``b_gs``: the scalar gate and cumulative decay, where they are scalar; ``b_rs`` (with
    ``ROW_SCALE``): a scale of each row of ``X`` (the keys' inverse norms of the l2norm)."""
    DT = dst.dtype.element_ty
    o_d = blk * BD + tl.arange(0, BD)
    m = m_t[:, None] & (o_d < D)[None, :]
    b_x = tl.load(_row_ptrs(src, tok0, o_t, i_src, HS, D, o_d), mask=m, other=0.0).to(tl.float32)
    if GATE == GATE_SCALAR:
        b_x = b_x * b_gate[:, None]
    else:
        b_x = b_x * tl.load(_row_ptrs(gate, tok0, o_t, i_hv, HV, D, o_d), mask=m, other=0.0).to(tl.float32)
    if ROW_SCALE:
        b_x = b_x * b_rs[:, None]
    if DECAY == DECAY_SCALAR:
        b_x = b_x * tl.exp(b_gs)[:, None]
    if DECAY == DECAY_CHANNEL:
        b_x = b_x * tl.exp(tl.load(_row_ptrs(gcum, tok0, o_t, i_hv, HV, D, o_d), mask=m, other=0.0))
    b_y = tl.dot(b_Ad, b_x.to(DT), input_precision=DOT_PRECISION)
    tl.store(_row_ptrs(dst, tok0, o_t, i_hv, HV, D, o_d), b_y.to(DT), mask=m)


@triton.jit(do_not_specialize=["T", "NT"])
def _delta_chunk_prep_fwd_kernel(
    q, k, v, g, b, w,
    gcum, wy, u, aqk, solve, rq, rk,
    cu_seqlens, chunk_indices,
    A_log, dt_bias, lower_bound,
    scale, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, BKY: tl.constexpr, NKY: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, ERASE: tl.constexpr, WRITE: tl.constexpr, GATE_ACT: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, SOLVE_BLOCK: tl.constexpr, STORE_A: tl.constexpr,
    L2NORM: tl.constexpr, BETA_ACT: tl.constexpr,
):
    SUB: tl.constexpr = SUB_BLOCK_C
    NB: tl.constexpr = BT // SUB
    DT = wy.dtype.element_ty
    pid = tl.program_id(0).to(tl.int64)
    i_c, i_hv = pid // HV, pid % HV
    i_h = i_hv // (HV // H)
    # chunk_bounds rather than chunk_rows: with chunk_rows's 32-bit row count, sm_80 Gated DeltaNet bf16 at
    # K = 256 (255 registers here) spilled 1 STL (static report, Triton 3.9).
    i_n, i_t, bos, eos = chunk_bounds(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0 = i_t * BT
    tok0, seqlen = bos + t0, eos - bos
    o_t = tl.arange(0, BT)
    m_t = (t0 + o_t) < seqlen

    # -- cumulative log decay inside the chunk ------------------------------------------------
    # (the backward's load_gate: one gate cumsum for both directions)
    b_gs = 0.0  # a per-channel decay is loaded with its key block
    if DECAY == DECAY_SCALAR:
        b_gs = load_gate(g, tok0, seqlen - t0, i_hv, HV, K, 0, o_t, o_t, DECAY, A_log, dt_bias, lower_bound, GATE_ACT)
        tl.store(_vec_ptrs(gcum, tok0, o_t, i_hv, HV), b_gs, mask=m_t)
    if DECAY == DECAY_CHANNEL:
        for kb in tl.static_range(NK):
            o_k = kb * BK + tl.arange(0, BK)
            b_G = load_gate(g, tok0, seqlen - t0, i_hv, HV, K, kb * BK, o_t, tl.arange(0, BK), DECAY, A_log, dt_bias,
                            lower_bound, GATE_ACT)
            tl.store(_row_ptrs(gcum, tok0, o_t, i_hv, HV, K, o_k), b_G, mask=m_t[:, None] & (o_k < K)[None, :])
        # the diagonal sub-blocks below read other rows of gcum written by other threads
        tl.debug_barrier()
    b_beta = 1.0  # per-channel erase gates are loaded with their key block
    if ERASE == GATE_SCALAR:
        b_beta = activated_beta(tl.load(_vec_ptrs(b, tok0, o_t, i_hv, HV), mask=m_t, other=0.0).to(tl.float32),
                                BETA_ACT)

    # -- L = strict_tril(E K^T decayed), Aqk = scale * tril(Q K^T decayed) ----------------------
    if L2NORM:
        # The rows' inverse norms, for the products below and for the state pass and the output: a rolled pass
        # over the key blocks first, stored, read back (every program of a group of value heads stores the same
        # values; each reads what its own threads stored, after the barrier) and applied to the rows as the key
        # loop loads them. Static report, sm_90, Triton 3.6, 16-bit KDA and GDN-2 at K = 512 (255 registers
        # with the gate activation alone): with the sums taken inside the unrolled key loop and L and Aqk scaled
        # after it, 28-29 STL; sums first, the products scaled after, 11-12; the rows scaled as loaded, 0.
        _store_inverse_norms(q, rq, tok0, o_t, m_t, i_h, H, K, BT, BK, NK)
        _store_inverse_norms(k, rk, tok0, o_t, m_t, i_h, H, K, BT, BK, NK)
        tl.debug_barrier()
    b_rq = 1.0
    b_rk = 1.0
    if L2NORM:
        b_rq = tl.load(_vec_ptrs(rq, tok0, o_t, i_h, H), mask=m_t, other=0.0)
        b_rk = tl.load(_vec_ptrs(rk, tok0, o_t, i_h, H), mask=m_t, other=0.0)
    b_L = tl.zeros([BT, BT], dtype=tl.float32)
    b_Aqk = tl.zeros([BT, BT], dtype=tl.float32)
    # fp32 (tf32x3 products, split operands) loops over the key blocks; unrolled, their loads and
    # splits overlap and spilled from K = 128 on (sm_90). 16-bit activations keep the unrolled loop:
    # rolled, GDN's bf16 K = 256 prep spilled on sm_80 (static report).
    if DT == tl.float32:
        for kb in range(NK):
            b_L, b_Aqk = _gram_key_block(b_L, b_Aqk, q, k, b, gcum, b_beta, b_rq, b_rk, rk, kb, tok0, t0, seqlen, o_t,
                                         m_t, i_h, i_hv, scale, H, HV, K, BK, NB, SUB, DECAY, ERASE, DOT_PRECISION,
                                         L2NORM)
    else:
        for kb in tl.static_range(NK):
            b_L, b_Aqk = _gram_key_block(b_L, b_Aqk, q, k, b, gcum, b_beta, b_rq, b_rk, rk, kb, tok0, t0, seqlen, o_t,
                                         m_t, i_h, i_hv, scale, H, HV, K, BK, NB, SUB, DECAY, ERASE, DOT_PRECISION,
                                         L2NORM)
    if DECAY != DECAY_CHANNEL:
        m_lower = o_t[:, None] > o_t[None, :]
        m_lower_eq = o_t[:, None] >= o_t[None, :]
        if DECAY == DECAY_SCALAR:
            d = _masked_exp(b_gs[:, None] - b_gs[None, :], m_lower_eq)
            b_L = b_L * d
            b_Aqk = b_Aqk * d
        b_L = tl.where(m_lower, b_L, 0.0)
        b_Aqk = tl.where(m_lower_eq, b_Aqk if DT == tl.float32 else b_Aqk * scale, 0.0)
    tl.store(_row_ptrs(aqk, tok0, o_t, i_hv, HV, BT, o_t), b_Aqk.to(DT), mask=m_t[:, None])

    # -- A = (I + L)^-1 -------------------------------------------------------------------------
    # Block form with SOLVE_BLOCK-row diagonal blocks: D = blockdiag(I + L), N the strictly
    # block-lower rest; (I + L)^-1 = (I + M)^-1 D^-1 with M = D^-1 N nilpotent (M^NS = 0), so
    # (I + M)^-1 = I - M (NS = 2) or (I - M)(I + M^2) (NS = 4). SOLVE_BLOCK = BT is the plain
    # elimination in fp32 of _block_unit_lower_inverse (no products).
    NS: tl.constexpr = BT // SOLVE_BLOCK
    same = (o_t // SOLVE_BLOCK)[:, None] == (o_t // SOLVE_BLOCK)[None, :]
    b_Di = _block_unit_lower_inverse(b_L, o_t, SOLVE_BLOCK - 1, SOLVE_BLOCK)
    if NS == 1:
        b_A = b_Di
    else:
        b_M = tl.dot(b_Di, tl.where(same, 0.0, b_L), input_precision=DOT_PRECISION)
        diag = o_t[:, None] == o_t[None, :]  # I + X as a select, not the sum with a constant identity tile
        if NS == 2:
            b_P = tl.where(diag, 1.0 - b_M, -b_M)
        else:
            b_M2 = tl.dot(b_M, b_M, input_precision=DOT_PRECISION)
            b_P = tl.dot(tl.where(diag, 1.0 - b_M, -b_M), tl.where(diag, 1.0 + b_M2, b_M2),
                         input_precision=DOT_PRECISION)
        b_A = tl.dot(b_P, b_Di, input_precision=DOT_PRECISION)
    if STORE_A:
        # The backward takes this inverse rather than solving again. Stored in fp32: in the activations' dtype,
        # the backward's scan kernel (reading A^T through transposed pointers) spilled 6-12 STL in the
        # scan_bv=32 rows of GDN and KDA bf16/fp16 at K = 128 on sm_90 (Triton 3.9).
        tl.store(_row_ptrs(solve, tok0, o_t, i_hv, HV, BT, o_t), b_A, mask=m_t[:, None])
    b_Ad = b_A.to(DT)

    # -- Y = A (E * exp(G)), U = A Z --------------------------------------------------------------
    # As for the gram: rolled for fp32, unrolled for 16-bit. Static report, sm_90, Triton 3.9: unrolled, the
    # fp32 blocked-solve rows spilled 2-111 STL (A's split operands live beside every key block's loads) and
    # rolled none does, while the fp32 defaults take 28-60 fewer registers; rolled, 16-bit KDA and GDN-2
    # took 20-47 more. Y's key blocks (BKY) are the key loops' (BK) but where 8 warps would split a 16-column
    # product over two warpgroups (fp32 with warpgroup products: prep_store_key_blocks). Those store U first:
    # after Y, with 32-column blocks of Y, GDN-2's solve_block=16 and 32 rows spilled 2 and 1 STL at K = 64
    # (sm_90, Triton 3.9; 254 registers), and U first compiles them without spills.
    U_FIRST: tl.constexpr = BKY > BK
    if U_FIRST:
        _store_solved_values(u, v, w, gcum, b_Ad, b_gs, tok0, o_t, m_t, i_hv, HV, V, BV, WRITE, DOT_PRECISION,
                             BETA_ACT)
    b_rk = 1.0
    if L2NORM:  # loaded again rather than kept live across the solve
        b_rk = tl.load(_vec_ptrs(rk, tok0, o_t, i_h, H), mask=m_t, other=0.0)
    if ERASE == GATE_SCALAR and DECAY == DECAY_CHANNEL:
        # KDA loads its erase gate again rather than keep it live across the solve. Static report, sm_80,
        # Triton 3.6: kept, fp32 K = 128 to 512 and bf16/fp16 K = 512 spilled 1 STL; reloaded, 0.
        # With a dense decay the reload spilled instead (Gated DeltaNet, sm_80 3.6 bf16 K = 256, sm_90 3.9
        # fp32 solve_block=16), so those keep it.
        b_beta = activated_beta(tl.load(_vec_ptrs(b, tok0, o_t, i_hv, HV), mask=m_t, other=0.0).to(tl.float32),
                                BETA_ACT)
    if DT == tl.float32:
        for kb in range(NKY):
            _store_solved_block(wy, k, b, gcum, b_Ad, b_beta, b_gs, b_rk, kb, tok0, o_t, m_t, i_h, i_hv,
                                H, HV, K, BKY, ERASE, DECAY, DOT_PRECISION, L2NORM)
    else:
        for kb in tl.static_range(NKY):
            _store_solved_block(wy, k, b, gcum, b_Ad, b_beta, b_gs, b_rk, kb, tok0, o_t, m_t, i_h, i_hv,
                                H, HV, K, BKY, ERASE, DECAY, DOT_PRECISION, L2NORM)
    if not U_FIRST:
        _store_solved_values(u, v, w, gcum, b_Ad, b_gs, tok0, o_t, m_t, i_hv, HV, V, BV, WRITE, DOT_PRECISION,
                             BETA_ACT)


@triton.jit
def _store_solved_values(u, v, w, gcum, b_Ad, b_gs, tok0, o_t, m_t, i_hv, HV: tl.constexpr, V: tl.constexpr,
                         BV: tl.constexpr, WRITE: tl.constexpr, DOT_PRECISION: tl.constexpr, BETA_ACT: tl.constexpr):
    """Stores ``U = A Z`` (the writes ``w * v``), ``BV`` value columns at a time (``_store_solved_block``)."""
    b_wbeta = 1.0  # a per-column write gate is loaded with its value block
    if WRITE == GATE_SCALAR:
        b_wbeta = activated_beta(tl.load(_vec_ptrs(w, tok0, o_t, i_hv, HV), mask=m_t, other=0.0).to(tl.float32),
                                 BETA_ACT)
    for vb in range(0, tl.cdiv(V, BV)):
        _store_solved_block(u, v, w, gcum, b_Ad, b_wbeta, b_gs, 1.0, vb, tok0, o_t, m_t, i_hv, i_hv,
                            HV, HV, V, BV, WRITE, DECAY_NONE, DOT_PRECISION, False)


# ----------------------------------------------------------------------------------------------
# 2. sequential state pass fused with the output
# ----------------------------------------------------------------------------------------------
@triton.jit
def _decayed_q(q, gcum, tok0, o_t, m, b_gs, b_rq, i_h, i_hv, o_k, scale,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, DECAY: tl.constexpr, L2NORM: tl.constexpr):
    """scale * Q * exp(G) for the key columns ``o_k`` of a chunk (fp32): what reads the chunk-start state;
    with ``L2NORM`` each row times its inverse norm ``b_rq``."""
    b_q = tl.load(_row_ptrs(q, tok0, o_t, i_h, H, K, o_k), mask=m, other=0.0).to(tl.float32) * scale
    if L2NORM:
        b_q = b_q * b_rq[:, None]
    if DECAY == DECAY_SCALAR:
        b_q = b_q * tl.exp(b_gs)[:, None]
    if DECAY == DECAY_CHANNEL:
        b_q = b_q * tl.exp(tl.load(_row_ptrs(gcum, tok0, o_t, i_hv, HV, K, o_k), mask=m, other=0.0))
    return b_q


@triton.jit
def _scan_read(acc_v, acc_o, b_s, q, gcum, wy, tok0, o_t, m_t, b_gs, b_rq, i_h, i_hv, kb, scale,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
               DECAY: tl.constexpr, DOT_PRECISION: tl.constexpr, READ_O: tl.constexpr, L2NORM: tl.constexpr):
    """acc_v += Y_kb S_kb and (``READ_O``) acc_o += scale * (Q_kb * exp(G_kb)) S_kb for one K block."""
    DT = wy.dtype.element_ty
    o_k = kb * BK + tl.arange(0, BK)
    m = m_t[:, None] & (o_k < K)[None, :]
    b_y = tl.load(_row_ptrs(wy, tok0, o_t, i_hv, HV, K, o_k), mask=m, other=0.0)
    if READ_O:  # both loads before both products (the order the register allocation was measured with)
        b_q = _decayed_q(q, gcum, tok0, o_t, m, b_gs, b_rq, i_h, i_hv, o_k, scale, H, HV, K, DECAY, L2NORM)
    b_sd = b_s.to(DT)
    acc_v += tl.dot(b_y, b_sd, input_precision=DOT_PRECISION)
    if READ_O:
        acc_o += tl.dot(b_q.to(DT), b_sd, input_precision=DOT_PRECISION)
    return acc_v, acc_o


@triton.jit
def _scan_write(b_s, b_vnew, k, gcum, tok0, o_t, m_t, tok_last, b_gs, g_last, b_rk, i_h, i_hv, kb,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                DECAY: tl.constexpr, DOT_PRECISION: tl.constexpr, L2NORM: tl.constexpr):
    """S_kb <- Diag(exp(G_last)) S_kb + (K_kb * exp(G_last - G))^T V_new (with ``L2NORM`` the keys times their
    inverse norms ``b_rk``)."""
    DT = b_vnew.dtype
    o_k = kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    mT = m_k[:, None] & m_t[None, :]
    p_kT = _col_ptrs(k, tok0, o_t, i_h, H, K, o_k)
    b_kT = tl.load(p_kT, mask=mT, other=0.0).to(tl.float32)
    if L2NORM:
        b_kT = b_kT * b_rk[None, :]
    if DECAY == DECAY_SCALAR:
        b_kT = b_kT * _masked_exp(g_last - b_gs, m_t)[None, :]
        b_s = b_s * tl.exp(g_last)
    if DECAY == DECAY_CHANNEL:
        b_GT = tl.load(_col_ptrs(gcum, tok0, o_t, i_hv, HV, K, o_k), mask=mT, other=0.0)
        b_Gl = tl.load(gcum + (tok_last * HV + i_hv) * K + o_k, mask=m_k, other=0.0)
        b_kT = b_kT * _masked_exp(b_Gl[:, None] - b_GT, mT)
        b_s = b_s * tl.exp(b_Gl)[:, None]
    b_s += tl.dot(b_kT.to(DT), b_vnew, input_precision=DOT_PRECISION)
    return b_s


@triton.jit(do_not_specialize=["T", "NT"])
def _delta_chunk_scan_fwd_kernel(
    q, k, gcum, wy, u, aqk, rq, rk,
    h0, o, ht, h, vnew,
    cu_seqlens, chunk_offsets,
    scale, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, SAVE_STATES: tl.constexpr,
    STORE_V_NEW: tl.constexpr, DOT_PRECISION: tl.constexpr, STORE_O: tl.constexpr,
    STATE_IN_MEMORY: tl.constexpr, L2NORM: tl.constexpr,
):
    # The state is held as a tuple of NK (at most four) [BK, BV] row blocks of the [K, BV] column block,
    # each chunk's loops over it unrolled (static_range), so every block stays in registers.
    # STATE_IN_MEMORY (fp32, and 16-bit past K = 256 without warpgroup products; see ``scan_tiles``): it
    # lives in ``ht`` instead (float32 [N, HV, K, V], holding the initial state or zeros from the launcher,
    # the final state at the end), and each chunk loops over its key blocks twice, reading S for the output
    # and the writes, then updating it; what this program stores there only it reads back (its V columns).
    # USE_INITIAL_STATE and STORE_FINAL_STATE then have no effect.
    tl.static_assert(STATE_IN_MEMORY or NK <= 4, "the state pass holds at most four key blocks in registers")
    DT = wy.dtype.element_ty
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0).to(tl.int64)
    i_v, i_nh = pid % NV, pid // NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    seqlen = eos - bos
    c0 = first_chunk(chunk_offsets, i_n, NT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    if not STATE_IN_MEMORY:
        s_blocks = ()
        for kb in tl.static_range(NK):
            s_blocks = s_blocks + (_load_state(h0, i_n, i_hv, kb, o_v, HV, K, V, BK, BV, USE_INITIAL_STATE),)

    for i_t in range(0, tl.cdiv(seqlen, BT)):
        t0 = i_t * BT
        m_t = (t0 + o_t) < seqlen
        tok0 = bos + t0
        tok_last = bos + tl.minimum(t0 + BT, seqlen) - 1
        if SAVE_STATES and not STATE_IN_MEMORY:
            for kb in tl.static_range(NK):
                _store_state(h, c0 + i_t, s_blocks[kb], i_hv, kb, o_v, HV, K, V, BK)
        b_gs = tl.zeros([BT], dtype=tl.float32)
        g_last = 0.0
        if DECAY == DECAY_SCALAR:
            b_gs = tl.load(_vec_ptrs(gcum, tok0, o_t, i_hv, HV), mask=m_t, other=0.0)
            g_last = tl.load(gcum + tok_last * HV + i_hv)
        b_rq = 1.0
        b_rk = 1.0
        if L2NORM:  # the inverse norms of the rows of q and k (the preparation kernel's)
            b_rk = tl.load(_vec_ptrs(rk, tok0, o_t, i_h, H), mask=m_t, other=0.0)
            if STORE_O:
                b_rq = tl.load(_vec_ptrs(rq, tok0, o_t, i_h, H), mask=m_t, other=0.0)
        acc_v = tl.zeros([BT, BV], dtype=tl.float32)
        acc_o = tl.zeros([BT, BV], dtype=tl.float32)
        if STATE_IN_MEMORY:
            for kb in range(NK):
                b_s = _load_state(ht, i_n, i_hv, kb, o_v, HV, K, V, BK, BV, True)
                if SAVE_STATES:
                    _store_state(h, c0 + i_t, b_s, i_hv, kb, o_v, HV, K, V, BK)
                acc_v, acc_o = _scan_read(acc_v, acc_o, b_s, q, gcum, wy, tok0, o_t, m_t, b_gs, b_rq, i_h, i_hv, kb,
                                          scale, H, HV, K, BK, DECAY, DOT_PRECISION, STORE_O, L2NORM)
        else:
            for kb in tl.static_range(NK):
                acc_v, acc_o = _scan_read(acc_v, acc_o, s_blocks[kb], q, gcum, wy, tok0, o_t, m_t, b_gs, b_rq, i_h,
                                          i_hv, kb, scale, H, HV, K, BK, DECAY, DOT_PRECISION, STORE_O, L2NORM)
        m_tv = m_t[:, None] & m_v[None, :]
        b_u = tl.load(_row_ptrs(u, tok0, o_t, i_hv, HV, V, o_v), mask=m_tv, other=0.0).to(tl.float32)
        b_vnew = (b_u - acc_v).to(DT)
        if STORE_O:  # else the output kernel computes o from the saved states and writes
            b_aqk = tl.load(_row_ptrs(aqk, tok0, o_t, i_hv, HV, BT, o_t), mask=m_t[:, None], other=0.0)
            b_o = acc_o + tl.dot(b_aqk, b_vnew, input_precision=DOT_PRECISION)
            tl.store(_row_ptrs(o, tok0, o_t, i_hv, HV, V, o_v), b_o.to(o.dtype.element_ty), mask=m_tv)
        if STORE_V_NEW:  # the writes, for cross-layer error routing (from registers: no extra pass)
            tl.store(_row_ptrs(vnew, tok0, o_t, i_hv, HV, V, o_v), b_vnew.to(vnew.dtype.element_ty), mask=m_tv)
        if STATE_IN_MEMORY:
            for kb in range(NK):
                b_s = _load_state(ht, i_n, i_hv, kb, o_v, HV, K, V, BK, BV, True)
                b_s = _scan_write(b_s, b_vnew, k, gcum, tok0, o_t, m_t, tok_last, b_gs, g_last, b_rk, i_h, i_hv, kb,
                                  H, HV, K, BK, DECAY, DOT_PRECISION, L2NORM)
                # every thread has read the block before any overwrites it (the store's layout may give an
                # element to another thread)
                tl.debug_barrier()
                _store_state(ht, i_n, b_s, i_hv, kb, o_v, HV, K, V, BK)
            tl.debug_barrier()  # the next chunk's reads see these stores
        else:
            updated = ()
            for kb in tl.static_range(NK):
                updated = updated + (_scan_write(s_blocks[kb], b_vnew, k, gcum, tok0, o_t, m_t, tok_last, b_gs,
                                                 g_last, b_rk, i_h, i_hv, kb, H, HV, K, BK, DECAY, DOT_PRECISION,
                                                 L2NORM),)
            s_blocks = updated

    if STORE_FINAL_STATE and not STATE_IN_MEMORY:
        for kb in tl.static_range(NK):
            _store_state(ht, i_n, s_blocks[kb], i_hv, kb, o_v, HV, K, V, BK)


@triton.jit(do_not_specialize=["T", "NT"])
def _delta_chunk_out_fwd_kernel(
    q, gcum, h, vnew, aqk, o, rq,
    cu_seqlens, chunk_indices,
    scale, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, L2NORM: tl.constexpr,
):
    """The output as a separate pass, one program per (chunk, value head, V block), all in parallel:
    ``O = scale * (Q * exp(G)) S_c + Aqk V_new`` from the chunk-start states ``h`` and the writes ``vnew``
    the state pass saved (``delta_tuning(output_kernel=True)``; the state pass then skips its output)."""
    DT = vnew.dtype.element_ty
    pid = tl.program_id(0).to(tl.int64)
    i_c, i_hv = pid // HV, pid % HV
    i_h = i_hv // (HV // H)
    tok0, n_rows = chunk_rows(i_c, cu_seqlens, chunk_indices, T, NT, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    o_v = tl.program_id(1) * BV + tl.arange(0, BV)
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    b_gs = tl.zeros([BT], dtype=tl.float32)
    if DECAY == DECAY_SCALAR:
        b_gs = tl.load(_vec_ptrs(gcum, tok0, o_t, i_hv, HV), mask=m_t, other=0.0)
    b_rq = 1.0
    if L2NORM:
        b_rq = tl.load(_vec_ptrs(rq, tok0, o_t, i_h, H), mask=m_t, other=0.0)
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    for kb in range(NK):
        o_k = kb * BK + tl.arange(0, BK)
        b_q = _decayed_q(q, gcum, tok0, o_t, m_t[:, None] & (o_k < K)[None, :], b_gs, b_rq, i_h, i_hv, o_k, scale,
                         H, HV, K, DECAY, L2NORM)
        p_s, m_s = _state_ptrs(h, i_c, i_hv, kb, o_v, HV, K, V, BK)
        b_s = tl.load(p_s, mask=m_s, other=0.0)
        acc += tl.dot(b_q.to(DT), b_s.to(DT), input_precision=DOT_PRECISION)
    b_aqk = tl.load(_row_ptrs(aqk, tok0, o_t, i_hv, HV, BT, o_t), mask=m_t[:, None], other=0.0)
    b_vnew = tl.load(_row_ptrs(vnew, tok0, o_t, i_hv, HV, V, o_v), mask=m_tv, other=0.0)
    acc += tl.dot(b_aqk, b_vnew, input_precision=DOT_PRECISION)
    tl.store(_row_ptrs(o, tok0, o_t, i_hv, HV, V, o_v), acc.to(o.dtype.element_ty), mask=m_tv)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------
def _warps_stages(warps: tuple[int, ...], stages: tuple[int, ...]) -> list[triton.Config]:
    return [triton.Config({}, num_warps=nw, num_stages=ns) for nw in warps for ns in stages]


def _configs_of_warps(launch_warps):
    """An autotuner's ``early_config_prune``: the configs whose warps are among ``launch_warps(args)`` (the
    launch's arguments by name): the warps follow from the launch's blocks (``prep_warps``, ``scan_warps``), as the
    static report compiles them."""
    def prune(configs, named_args, **kwargs):
        allowed = launch_warps({**named_args, **kwargs})
        return [c for c in configs if c.num_warps in allowed]
    return prune


def _launch_target(args: dict) -> tuple[bool, bool]:
    """(fp32 activations, warpgroup products) of a launch: from its q."""
    return args["q"].dtype == torch.float32, has_warpgroup_mma(args["q"].device)


def _prep_launch_warps(args: dict) -> tuple[int, ...]:
    return (prep_warps(args["BKY"], args["BV"], *_launch_target(args)),)


def _scan_launch_warps(args: dict) -> tuple[int, ...]:
    return scan_warps(args["BK"], args["BV"], *_launch_target(args))


# Autotune keys name dims, variant flags, chunk size and the speed alternatives' constexprs (each
# alternative gets its own tuning; tensor dtypes are added by the autotuner): never T or the number of
# sequences, so a new varlen batch does not retune.
# The preparation kernel runs with 8 warps only: on an H200 (Triton 3.6) its 4-warp configs ended DeltaNet and
# Gated DeltaNet bf16 at K = 128 in an illegal memory access while the autotuner timed them, and with 8 warps
# alone both matched float64, forward and backward (benchmarks/results/2026-12-04-nvidia-h200/README.md).
# fp32 with a 16-column product runs 4 warps instead (prep_warps, through the pruning).
_prep_fwd = autotune(_warps_stages((MATRIX_WARPS, FP32_NARROW_WARPS), (1, 2)),
                     key=["H", "HV", "K", "V", "BT", "DECAY", "ERASE", "WRITE", "GATE_ACT", "IS_VARLEN",
                          "SOLVE_BLOCK", "STORE_A", "L2NORM", "BETA_ACT"],
                     prune_configs_by={"early_config_prune": _configs_of_warps(_prep_launch_warps)})(
    _delta_chunk_prep_fwd_kernel)
def _restore_state_hooks() -> tuple:
    """Autotuner hooks for the state pass: with the state in memory it updates ``ht`` in place, so every timed
    run starts from a copy of the state the call was given (else the runs that pick a config would advance
    it several times). Triton's ``restore_value`` fails on a None ``ht`` under Triton 3.6 (the register
    pass without a final state)."""
    saved = {}

    def pre_hook(kwargs, reset_only=False):
        if not reset_only and kwargs.get("STATE_IN_MEMORY") and kwargs["ht"] is not None:
            saved["ht"] = kwargs["ht"].clone()

    def post_hook(kwargs, exception):
        if "ht" in saved:
            kwargs["ht"].copy_(saved.pop("ht"))

    return pre_hook, post_hook


_scan_pre_hook, _scan_post_hook = _restore_state_hooks()
_scan_fwd = autotune(_warps_stages(SCAN_WARPS, (1, 2)),
                     key=["H", "HV", "K", "V", "BT", "BV", "DECAY", "IS_VARLEN", "SAVE_STATES", "STORE_O",
                          "STATE_IN_MEMORY", "L2NORM"], pre_hook=_scan_pre_hook, post_hook=_scan_post_hook,
                     prune_configs_by={"early_config_prune": _configs_of_warps(_scan_launch_warps)})(
    _delta_chunk_scan_fwd_kernel)
_out_fwd = autotune(_warps_stages((4, 8), (1, 2)), key=["H", "HV", "K", "V", "BT", "BV", "DECAY", "IS_VARLEN", "L2NORM"])(
    _delta_chunk_out_fwd_kernel)
# V block of the separate output kernel (``delta_tuning(output_kernel=True)``): a [BT, 64] fp32 accumulator,
# the tile of the backward's per-chunk kernels (CHUNK_BLOCK); its key blocks are ``memory_key_blocks``. At
# K = 128 it compiles to 118-140 registers (bf16) and 174 (fp32) without spills on sm_90 (static report).
OUT_BLOCK_V = 64


def state_pass_programs(sequences: int, HV: int, V: int, tiles: ScanTiles) -> int:
    """The state pass's programs: one per sequence, value head and V block (each runs its chunks in order)."""
    return sequences * HV * cdiv(V, tiles.bv)


def separate_output(choice: bool | None, programs: int, device: torch.device) -> bool:
    """Whether the forward computes its output in the separate kernel: ``DeltaTuning.output_kernel`` where it is
    a bool; where it is None, by the state pass's ``programs``: separate when they fill less than one wave of
    ``device`` (fewer than its multiprocessors: the sequential pass leaves some idle, and the separate kernel
    has a program per chunk). Off CUDA (the interpreter) None keeps the output in the state pass."""
    if choice is not None:
        return choice
    sms = multiprocessors(device)
    return sms is not None and programs < sms


def _flags(g: torch.Tensor | None, b: torch.Tensor, w: torch.Tensor) -> dict[str, int]:
    return {"DECAY": decay_kind(g), "ERASE": gate_kind(b), "WRITE": gate_kind(w)}


def _contig(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.contiguous()


def delta_chunk_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    b: torch.Tensor,
    w: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    save_states: bool = True,
    output_v_new: bool = False,
    gate: GateInput | None = None,
    l2norm_qk: bool = False,
    beta_act: int = BetaAct.NONE,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Chunked forward of the delta-rule family on already transformed inputs.

    Inputs (with ``beta_act`` a ``BetaAct`` the preparation kernel applies to a scalar ``b`` and ``w`` where it
    loads them, fla's ``use_beta_sigmoid_in_kernel``; with ``l2norm_qk`` the kernels l2-normalise the rows of
    q and k, fla's ``use_qk_l2norm_in_kernel``, without a pass of their own: the preparation kernel takes the
    rows' inverse norms first and every kernel scales the rows of q and k it loads by them. The ops ask for it
    where ``delta_chunk_common.l2norm_in_kernels``: compiled for sm_80 these kernels spill):
    ``q, k: [B, T, H, K]``; ``v: [B, T, HV, V]`` with ``HV % H == 0``;
    ``g``: ``None`` | ``[B, T, HV]`` | ``[B, T, HV, K]``, per-token log decay (not cumulated), or with
    ``gate`` the raw gate input the prep kernel activates (``GateInput``: fla's ``use_gate_in_kernel``);
    ``b: [B, T, HV] | [B, T, HV, K]`` erase gate; ``w: [B, T, HV] | [B, T, HV, V]`` write gate
    (DeltaNet, GDN and KDA pass their beta as both); ``initial_state: [N, HV, K, V]`` float32;
    ``cu_seqlens: [N + 1]`` int32/int64 with ``B == 1`` (validated by the caller).

    Returns ``(o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32 or None, h or None, v_new or
    None, A or None)``. ``v_new`` (with ``output_v_new``): the writes ``w_t * v_t - (D_t S_{t-1})^T (b_t k_t)``,
    ``[B, T, HV, V]`` in v.dtype, the ``U - Y S`` the state pass forms (stored from registers).
    ``h``: chunk-start states, float32 ``[total_chunks, HV, K, V]``; chunks are numbered per
    sequence as in ``delta_chunk_common.chunk_indices`` (``sum_n ceil(T_n / chunk_size)``, or
    ``B * ceil(T / chunk_size)`` ordered b-major); ``h[c]`` is the state before chunk ``c``.
    ``A`` (with ``save_states``, for the backward): each chunk's ``(I + L)^-1``, float32
    ``[B, T, HV, chunk_size]``, row ``t`` of a chunk at token ``t`` (the layout of ``Aqk``).
    q, k, v share one dtype (fp32, fp16, bf16); accumulation is fp32.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    q, k, v, g, b, w = (_contig(x) for x in (q, k, v, g, b, w))
    initial_state = _contig(initial_state)
    index = chunk_indices(cu_seqlens, B, T, BT)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    flags = _flags(g, b, w)
    check_beta_act(beta_act, flags)
    fp32 = q.dtype == torch.float32
    common = {"H": H, "HV": HV, "K": K, "V": V, "BT": BT, "IS_VARLEN": cu_seqlens is not None,
              "DOT_PRECISION": DOT_PRECISION}
    gcum = None if g is None else torch.empty(g.shape, dtype=torch.float32, device=q.device)
    wy = q.new_empty(B, T, HV, K)
    u = q.new_empty(B, T, HV, V)
    aqk = q.new_empty(B, T, HV, BT)
    solve = q.new_empty(B, T, HV, BT, dtype=torch.float32) if save_states else None
    # the inverse norms of the rows of q and k (l2norm_qk), from the preparation kernel
    rq, rk = (q.new_empty(B, T, H, dtype=torch.float32) for _ in range(2)) if l2norm_qk else (None, None)
    if index.total > 0:
        warpgroup_mma = has_warpgroup_mma(q.device)
        BKP, NKP = prep_key_blocks(K, flags["DECAY"], fp32=fp32)
        BKY, NKY = prep_store_key_blocks(K, flags["DECAY"], fp32, warpgroup_mma)
        _prep_fwd[(index.total * HV,)](
            q, k, v, g, b, w, gcum, wy, u, aqk, aqk if solve is None else solve, rq, rk, cu_seqlens, index.indices,
            scale=scale, T=T, NT=index.per_sequence, STORE_A=solve is not None, L2NORM=l2norm_qk, BETA_ACT=beta_act,
            **gate_kernel_args(gate, HV, K if flags["DECAY"] == DecayKind.CHANNEL else 1, q),
            BV=prep_value_block(V, fp32=fp32, warpgroup_mma=warpgroup_mma),
            SOLVE_BLOCK=min(active_tuning().solve_block, BT), **flags,
            BK=BKP, NK=NKP, BKY=BKY, NKY=NKY, **common, enable_fp_fusion=fp_fusion())
    tiles = scan_tiles(K, V, fp32, has_warpgroup_mma(q.device), active_tuning())
    programs = state_pass_programs(N, HV, V, tiles)
    # The output in the state pass (default), or in a parallel pass over every chunk from the states and
    # writes the state pass saves (delta_tuning(output_kernel=True), or None: by the state pass's programs).
    separate = separate_output(active_tuning().output_kernel, programs, q.device)
    o = torch.empty_like(v)
    if tiles.state_in_memory:  # the state pass updates it in place: it starts as the initial state
        ht = (initial_state.to(torch.float32, copy=True) if initial_state is not None
              else q.new_zeros(N, HV, K, V, dtype=torch.float32))
    else:
        ht = q.new_empty(N, HV, K, V, dtype=torch.float32) if output_final_state else None
    h = q.new_empty(index.total, HV, K, V, dtype=torch.float32) if save_states or separate else None
    v_new = torch.empty_like(v) if output_v_new or separate else None
    if programs > 0:
        _scan_fwd[(programs,)](
            q, k, gcum, wy, u, aqk, rq, rk, initial_state, o, ht, h, v_new, cu_seqlens, index.offsets, scale, T,
            index.per_sequence, L2NORM=l2norm_qk,
            DECAY=flags["DECAY"], USE_INITIAL_STATE=initial_state is not None,
            STORE_FINAL_STATE=output_final_state, SAVE_STATES=save_states or separate,
            STORE_V_NEW=output_v_new or separate, STORE_O=not separate,
            BK=tiles.bk, NK=tiles.nk, BV=tiles.bv, STATE_IN_MEMORY=tiles.state_in_memory, **common,
            enable_fp_fusion=fp_fusion())
    if separate and index.total > 0:
        bv_out = min(OUT_BLOCK_V, max(next_power_of_2(V), MIN_BLOCK))
        bk_out, nk_out = memory_key_blocks(K, fp32)
        _out_fwd[(index.total * HV, cdiv(V, bv_out))](
            q, gcum, h, v_new, aqk, o, rq, cu_seqlens, index.indices, scale, T, index.per_sequence, BV=bv_out,
            L2NORM=l2norm_qk,
            DECAY=flags["DECAY"], BK=bk_out, NK=nk_out, **common, enable_fp_fusion=fp_fusion())
    return (o, (ht if output_final_state else None), (h if save_states else None), (v_new if output_v_new else None),
            solve)
