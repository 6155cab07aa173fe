"""The dq/dk/db/dg kernel of the chunked delta-rule backward (kernel 3 of kernels/delta_chunk_bwd.py).

One program per (chunk, qk head, K block): per value head, first the products with ``S0`` and ``dH`` over
V blocks of ``BV`` (the inter-chunk parts of ``dq``, ``dE``, ``dk``), then ``dP`` and ``dM`` over V blocks of
``GRAM_BV`` with their intra-chunk products added on, then ``db`` and ``dg``. The math is in the docstring of
kernels/delta_chunk_bwd.py; the launcher and the static-report registration live there too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lamina.kernels.delta_chunk_bwd_parts import (
    gated_col_grads_dots,
    gated_intra_grads,
    gated_row_grads_dots,
    load_state_tile,
    masked_rows_gram,
    row_of,
    rows_gram,
)
from lamina.kernels.delta_chunk_bwd_tiles import DQK_GRAM_BLOCK_V
from lamina.kernels.delta_chunk_common import (
    ACT_NONE,
    BETA_NONE,
    DECAY_CHANNEL,
    DECAY_NONE,
    DECAY_SCALAR,
    GATE_CHANNEL,
    SUB_BLOCK_C,
    activated_beta,
    beta_grad_factor,
    chunk_rows,
    floor_grad,
    gate_input_grads,
    gate_params,
    load_gate,
    load_rows,
    load_tile,
    load_vec,
)

# the column step of the [BT, BT] grams over V (see DQK_GRAM_BLOCK_V)
GRAM_BV = tl.constexpr(DQK_GRAM_BLOCK_V)


@triton.jit(do_not_specialize=["T", "NT", "NTOK", "NV"])
def _delta_chunk_bwd_dqk_kernel(
    q, k, g, b, h, do, dh_buf, U_buf, dR_buf, dq, dk, dg, db, dkh_part, dgc_part,
    cu_seqlens, chunk_indices, A_log, dt_bias, lower_bound, dg_a, scale, T, NT, NTOK, NV,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, ERASE: tl.constexpr, WRITE: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, REGRAM: tl.constexpr, BY_COLUMN: tl.constexpr, GATE_ACT: tl.constexpr,
    BETA_ACT: tl.constexpr, CHANNEL_DOTS: tl.constexpr, STORE_DH: tl.constexpr,
):
    # Three passes per value head, so that at most three [BT, BK] accumulators and two [BT, BT]
    # tiles are live at once: (1) the products with S0 and dH over V blocks, folded at once into the
    # gradients' inter-chunk parts; (2) dP and dM over V blocks; (3) the intra-chunk products, added
    # onto the results of (1). Without STORE_DH the scan left dH's products with the chunk (U dH^T and
    # rowsum(dH * S0)) as NV partial sums, one per V block of its own (dh_chunk_products), which (1) adds up.
    i_ch = tl.program_id(0)
    i_k = tl.program_id(1)
    i_c = i_ch // H
    i_h = i_ch % H
    GROUP: tl.constexpr = HV // H
    t0, L = chunk_rows(i_c, cu_seqlens, chunk_indices, T, NT, BT, IS_VARLEN)
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_bv = tl.arange(0, BV)
    o_gv = tl.arange(0, GRAM_BV)
    k0 = i_k * BK
    lower = o_t[:, None] >= o_t[None, :]
    strict = o_t[:, None] > o_t[None, :]
    upper = o_t[:, None] <= o_t[None, :]
    strict_upper = o_t[:, None] < o_t[None, :]
    rows64 = t0 + o_t.to(tl.int64)
    row_mask = o_t < L
    tile_mask = row_mask[:, None] & ((k0 + o_k) < K)[None, :]

    dq_acc = tl.zeros([BT, BK], dtype=tl.float32)
    dk_acc = tl.zeros([BT, BK], dtype=tl.float32)
    for i_g in range(GROUP):
        i_hv = i_h * GROUP + i_g
        chunk_state = (i_c.to(tl.int64) * HV + i_hv) * (K * V)

        # (1) dO S0^T, dR S0^T, U dH^T and rowsum(dH * S0)
        dq_h = tl.zeros([BT, BK], dtype=tl.float32)
        de_h = tl.zeros([BT, BK], dtype=tl.float32)
        dk_h = tl.zeros([BT, BK], dtype=tl.float32)
        dgc = tl.zeros([BK], dtype=tl.float32)
        for v0 in range(0, V, BV):
            do_t = load_tile(do, t0, L, HV * V, i_hv * V, v0, o_t, o_bv, V).to(DT)
            if STORE_DH:
                U_t = load_tile(U_buf, t0, L, HV * V, i_hv * V, v0, o_t, o_bv, V).to(DT)
            dR_t = load_tile(dR_buf, t0, L, HV * V, i_hv * V, v0, o_t, o_bv, V).to(DT)
            S0 = load_state_tile(h, chunk_state, k0, o_k, v0 + o_bv, K, V)
            if STORE_DH:
                dH = load_state_tile(dh_buf, chunk_state, k0, o_k, v0 + o_bv, K, V)
            S0_T = tl.trans(S0.to(DT))
            dq_h = tl.dot(do_t, S0_T, dq_h, input_precision=DOT_PRECISION)
            de_h = tl.dot(dR_t, S0_T, de_h, input_precision=DOT_PRECISION)
            if STORE_DH:
                dk_h = tl.dot(U_t, tl.trans(dH.to(DT)), dk_h, input_precision=DOT_PRECISION)
                dgc += tl.sum(dH * S0, 1)
        if not STORE_DH:
            chunk_head = i_c.to(tl.int64) * HV + i_hv
            for i_v in range(NV):
                dk_h += load_tile(dkh_part, t0, L, HV * NV * K, (i_hv * NV + i_v) * K, k0, o_t, o_k, K)
                if DECAY != DECAY_NONE:
                    dgc += tl.load(dgc_part + (chunk_head * NV + i_v) * K + k0 + o_k, mask=(k0 + o_k) < K, other=0.0)
        if DECAY == DECAY_CHANNEL:
            G = load_gate(g, t0, L, i_hv, HV, K, k0, o_t, o_k, DECAY, A_log, dt_bias, lower_bound, GATE_ACT)
            g_last = row_of(G, o_t, BT - 1)
            gamma = tl.exp(G)
            tail = tl.exp(g_last[None, :] - G)
        elif DECAY == DECAY_SCALAR:
            G = load_gate(g, t0, L, i_hv, HV, K, 0, o_t, o_k, DECAY, A_log, dt_bias, lower_bound, GATE_ACT)
            g_last = tl.sum(tl.where(o_t == BT - 1, G, 0.0), 0)
            gamma = tl.exp(G)[:, None]
            tail = tl.exp(g_last - G)[:, None]
        else:
            G = 0.0
            gamma = 1.0
            tail = 1.0
        dq_h = dq_h * (gamma * scale)
        de_h = -(de_h * gamma)
        dk_h = dk_h * tail
        if DECAY != DECAY_NONE:
            k_t = load_rows(k, t0, L, H * K, i_h * K, k0, o_t, o_k, K)
            # the chunk's total decay enters S_C through Kt and Diag(gamma_C)
            last = tl.sum(k_t * dk_h, 0) + tl.exp(g_last) * dgc

        # (2) dP = scale dO U^T (j <= i) and dM = -dR U^T (j < i), then their intra-chunk products
        if ERASE == GATE_CHANNEL:
            b_t = load_rows(b, t0, L, HV * K, i_hv * K, k0, o_t, o_k, K)
        else:
            b_t = activated_beta(load_vec(b + i_hv, t0, L, HV, o_t), BETA_ACT)[:, None]
        val_head = i_hv * V
        if DECAY == DECAY_CHANNEL or BY_COLUMN:
            # the two [BT, BT] grams before the chunk's q and k tiles are loaded: with the tiles loaded
            # first, KDA and GDN-2 fp32 spilled 2 and 4 STL on sm_80 under Triton 3.6 (static report)
            dP = rows_gram(do, U_buf, t0, L, HV * V, val_head, o_t, o_gv, V, DT, DOT_PRECISION)
            dM = rows_gram(dR_buf, U_buf, t0, L, HV * V, val_head, o_t, o_gv, V, DT, DOT_PRECISION)
        q_in = load_tile(q, t0, L, H * K, i_h * K, k0, o_t, o_k, K)
        k_in = load_tile(k, t0, L, H * K, i_h * K, k0, o_t, o_k, K)
        q_t = q_in.to(tl.float32)
        k_t = k_in.to(tl.float32)
        e_t = k_t * b_t
        if DECAY == DECAY_CHANNEL and CHANNEL_DOTS:
            # tensor-core products between 16-row sub-blocks (DeltaTuning.channel_dots); dk's take the transposes
            # of dP and dM, with REGRAM as grams of their own (U dO^T, U dR^T), else with tl.trans
            dP = tl.where(lower, dP * scale, 0.0)
            dM = tl.where(strict, -dM, 0.0)
            dq_h, de_h = gated_row_grads_dots(dP, dM, k_t, G, o_t, dq_h, de_h, SUB_BLOCK_C, DT, DOT_PRECISION)
            if REGRAM:
                dP = masked_rows_gram(U_buf, do, t0, L, HV * V, val_head, o_t, o_gv, V, G, upper, DECAY, DT,
                                      DOT_PRECISION) * scale
                dM = -masked_rows_gram(U_buf, dR_buf, t0, L, HV * V, val_head, o_t, o_gv, V, G, strict_upper, DECAY,
                                       DT, DOT_PRECISION)
            else:
                dP = tl.trans(dP)
                dM = tl.trans(dM)
            dk_h = gated_col_grads_dots(dP, dM, q_t, e_t, G, o_t, dk_h, SUB_BLOCK_C, DT, DOT_PRECISION)
        elif DECAY == DECAY_CHANNEL or BY_COLUMN:
            # key column by key column on CUDA cores (per-channel decay; BY_COLUMN: a dense decay as its
            # per-channel form, every column with the same G)
            if DECAY == DECAY_CHANNEL:
                G_cols = G
            elif DECAY == DECAY_SCALAR:
                G_cols = G[:, None] + tl.zeros([BT, BK], dtype=tl.float32)
            else:
                G_cols = tl.zeros([BT, BK], dtype=tl.float32)
            dP = tl.where(lower, dP * scale, 0.0)
            dM = tl.where(strict, -dM, 0.0)
            dq_h, de_h, dk_h = gated_intra_grads(dP, dM, q_t, e_t, k_t, G_cols, o_t, L, dq_h, de_h, dk_h, BT)
        else:
            # one [BT, BT] tile at a time: dP's products are done before dM is formed. With REGRAM the
            # transposes that dk takes are grams of their own, U dO^T and U dR^T (masked above the diagonal),
            # formed after dq's and dE's products, instead of tl.trans of dP and dM.
            k_c = k_in.to(DT)
            dP = masked_rows_gram(do, U_buf, t0, L, HV * V, val_head, o_t, o_gv, V, G, lower, DECAY, DT,
                                  DOT_PRECISION) * scale
            dq_h = tl.dot(dP.to(DT), k_c, dq_h, input_precision=DOT_PRECISION)
            if not REGRAM:
                dk_h = tl.dot(tl.trans(dP.to(DT)), q_in.to(DT), dk_h, input_precision=DOT_PRECISION)
            dM = -masked_rows_gram(dR_buf, U_buf, t0, L, HV * V, val_head, o_t, o_gv, V, G, strict, DECAY, DT,
                                   DOT_PRECISION)
            de_h = tl.dot(dM.to(DT), k_c, de_h, input_precision=DOT_PRECISION)
            if REGRAM:
                dP_T = masked_rows_gram(U_buf, do, t0, L, HV * V, val_head, o_t, o_gv, V, -G, upper, DECAY, DT,
                                        DOT_PRECISION) * scale
                dk_h = tl.dot(dP_T.to(DT), q_in.to(DT), dk_h, input_precision=DOT_PRECISION)
                dM_T = -masked_rows_gram(U_buf, dR_buf, t0, L, HV * V, val_head, o_t, o_gv, V, -G, strict_upper,
                                         DECAY, DT, DOT_PRECISION)
                dk_h = tl.dot(dM_T.to(DT), e_t.to(DT), dk_h, input_precision=DOT_PRECISION)
            else:
                dk_h = tl.dot(tl.trans(dM.to(DT)), e_t.to(DT), dk_h, input_precision=DOT_PRECISION)
        dq_acc += dq_h
        dk_acc += dk_h + b_t * de_h

        if ERASE == GATE_CHANNEL:
            b_offs = (rows64 * (HV * K) + i_hv * K)[:, None] + (k0 + o_k)[None, :]
            tl.store(db + b_offs, (de_h * k_t).to(db.dtype.element_ty), mask=tile_mask)
        else:
            # (with BETA_ACT of the raw input's, its value loaded again rather than kept live)
            part = i_k.to(tl.int64) * NTOK * HV + rows64 * HV + i_hv
            db_t = tl.sum(de_h * k_t, 1)
            if BETA_ACT != BETA_NONE:
                db_t = db_t * beta_grad_factor(load_vec(b + i_hv, t0, L, HV, o_t), BETA_ACT)
            tl.store(db + part, db_t, mask=row_mask)
        if DECAY != DECAY_NONE:
            # dk_h is dk without the erase term b*dE: the gradient through the gates' exponents.
            # Rows past L repeat G[BT - 1], so adding ``last`` on row BT - 1 reaches every valid row
            # in the reverse cumulative sum.
            dG = q_t * dq_h + e_t * de_h - k_t * dk_h
            dG += tl.where((o_t == BT - 1)[:, None], last[None, :], 0.0)
            # the gradient of the log decay (none below the floor: floor_grad); of a raw gate input (GATE_ACT)
            # through the activation, with the activation's A_log term in dg_a (the launcher sums it)
            if DECAY == DECAY_CHANNEL:
                g_offs = (rows64 * (HV * K) + i_hv * K)[:, None] + (k0 + o_k)[None, :]
                dg_t = tl.cumsum(dG, 0, reverse=True)
                if GATE_ACT != ACT_NONE:
                    g_t = load_rows(g, t0, L, HV * K, i_hv * K, k0, o_t, o_k, K)
                    a, bias = gate_params(A_log, dt_bias, i_hv, i_hv * K + k0 + o_k[None, :],
                                          ((k0 + o_k) < K)[None, :])
                    dg_t, dg_at = gate_input_grads(dg_t, g_t, a, bias, lower_bound, GATE_ACT)
                    tl.store(dg_a + g_offs, dg_at, mask=tile_mask)
                else:
                    # the log decay read through dg's offsets (g is shaped as dg here): with load_rows' pointers
                    # the fp32 GDN-2 kernel spilled on sm_90 under Triton 3.6 (1 STL, K = 64 to 512)
                    dg_t = floor_grad(dg_t, tl.load(g + g_offs, mask=tile_mask, other=0.0))
                tl.store(dg + g_offs, dg_t.to(dg.dtype.element_ty), mask=tile_mask)
            else:
                part = i_k.to(tl.int64) * NTOK * HV + rows64 * HV + i_hv
                dg_t = tl.cumsum(tl.sum(dG, 1), 0, reverse=True)
                g_t = load_vec(g + i_hv, t0, L, HV, o_t)
                if GATE_ACT != ACT_NONE:
                    a, bias = gate_params(A_log, dt_bias, i_hv, i_hv, True)
                    dg_t, dg_at = gate_input_grads(dg_t, g_t, a, bias, lower_bound, GATE_ACT)
                    tl.store(dg_a + part, dg_at, mask=row_mask)
                else:
                    dg_t = floor_grad(dg_t, g_t)
                tl.store(dg + part, dg_t, mask=row_mask)

    qk_offs = (rows64 * (H * K) + i_h * K)[:, None] + (k0 + o_k)[None, :]
    tl.store(dq + qk_offs, dq_acc.to(dq.dtype.element_ty), mask=tile_mask)
    tl.store(dk + qk_offs, dk_acc.to(dk.dtype.element_ty), mask=tile_mask)
