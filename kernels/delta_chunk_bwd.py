"""Chunked backward of the delta-rule family (DeltaNet, Gated DeltaNet, KDA, GDN-2): Triton kernels.

Forward, per token (DESIGN.md): ``S <- D_t S``, ``r = S^T (b_t k_t)``, ``S <- S + k_t (w_t v_t - r)^T``,
``o_t = S^T (scale q_t)``, with ``D_t = Diag(exp(g_t))``. One chunk of ``C`` tokens starting from the
state ``S0`` (``h[c]``, kept by the forward), with ``G`` the in-chunk cumulative sum of ``g`` (``G_C`` its
last row) and ``gamma = exp(G)``, is exactly:

    E = b*k, Z = w*v, Qg = scale*q*gamma, Eb = E*gamma, Kt = k*exp(G_C - G)      (rows i, channels)
    M_ij = sum_c E_ic k_jc exp(G_ic - G_jc)   (j < i)        A = (I + M)^-1
    P_ij = scale sum_c q_ic k_jc exp(G_ic - G_jc)   (j <= i)
    U = A (Z - Eb S0)                          (the new values, v_new)
    O = Qg S0 + P U,     S_C = Diag(gamma_C) S0 + Kt^T U

Backward, given dO and dH = dS_C (the gradient that the later chunks send back):

    dU = P^T dO + Kt dH,    dR = A^T dU        (dR is the gradient of Z - Eb S0)
    dS0 = Diag(gamma_C) dH + Qg^T dO - Eb^T dR (the reverse state scan: dH of the previous chunk)
    dZ = dR  ->  dv = w*dR,  dw = v*dR (summed over V for a scalar w)
    dP = dO U^T (j <= i),   dM = -A^T (dU (Z - Eb S0)^T) A^T = -dR U^T (j < i)
    dq = scale*gamma*(dO S0^T) + scale sum_j dP_ij k_j exp(G_i - G_j)
    dE = -gamma*(dR S0^T) + sum_j dM_ij k_j exp(G_i - G_j)
    dk = exp(G_C - G)*(U dH^T) + sum_i (scale dP_ij q_i + dM_ij E_i) exp(G_i - G_j) + b*dE
    db = k*dE (summed over K for a scalar b)

For the gate, every place ``G`` enters is a product of an original variable with ``exp(+-G)``, so the
gradient of the cumulative decay is read off the gradients above (``dk_G`` = dk without ``b*dE``):

    dG_i = q_i*dq_i + E_i*dE_i - k_i*dk_G_i,   plus on the last row  sum_j k_j*dKt_j + gamma_C*rowsum(dH*S0)

and ``dg`` is the reverse cumulative sum of ``dG`` inside the chunk (summed over K for a scalar gate).

A scalar beta given raw (``BETA_ACT``, fla's ``use_beta_sigmoid_in_kernel``) is activated where the kernels load
it, and each partial sum of ``db`` and ``dw`` (per key or value block) is multiplied by the activation's
derivative before it is stored: the launcher's sums are then the raw beta's gradients.

With the l2norm of q and k fused in (``L2NORM``, fla's ``use_qk_l2norm_in_kernel``) the prep kernel takes the
raw rows: it sums their squares on its way through them for ``P`` (formed from the raw rows, then each entry
times its row's and column's inverse norms), and stores the inverse norms (``rq``, ``rk``) and the normalised
rows in the activations' dtype, which the rest of it and the later kernels read as they read q and k
otherwise. (Scaling the raw rows where those kernels load them spilled on sm_90: GDN's 16-bit reverse scan at
K = 128 under Triton 3.9, 1-21 STL whichever tiles took the scale, and GDN-2's fp32 dq/dk kernel under 3.6,
2 STL: they have no register to spare.) The kernels' ``dq`` and ``dk`` are the normalised rows' gradients;
the launcher takes them to the raw rows with the L2-norm kernel's backward.

Kernels (no atomics anywhere, so two runs are bitwise equal):

1. ``_delta_chunk_bwd_prep_kernel`` (chunk x value head): ``P``, and everything that needs ``S0`` or
   ``dO`` but not ``dH``: ``U``, ``P^T dO`` and ``Qg^T dO``. ``A`` is not solved again: the forward's
   prep kernel stores it (fp32 ``[tokens, HV, BT]``) with the chunk-start states, so one solve serves both
   directions. It writes ``U`` and ``P^T dO`` (fp32,
   the size of ``v``) and ``Qg^T dO`` (fp32, into the ``dH`` buffer, the size of ``h``).
2. ``_delta_chunk_bwd_dh_kernel`` (sequence x value head x V block): the reverse scan over chunks,
   ``dU``, ``dR``, ``dv``, ``dw`` and ``dS0`` with ``dH`` in registers (up to four key blocks: 16-bit
   activations with K <= 128 by default, more on request) or in the float32 ``dinitial_state`` buffer,
   read and updated one key block at a time (``bwd_tiles``'s ``dh_in_memory``: wider keys, K = 512, and
   fp32 activations).
   It swaps ``Qg^T dO`` for ``dH`` in the chunk's slot, overwrites ``P^T dO`` with ``dR``, and
   writes ``dinitial_state`` at the end. Only three products per chunk stay on this sequential path.
   With ``bwd_tiles``'s ``store_dh`` off (``DeltaTuning.store_dh``) it leaves ``Qg^T dO`` in the slot and
   writes what kernel 3 needs of ``dH`` instead: its products with the chunk, ``U dH^T`` and
   ``rowsum(dH * S0)``, as partial sums over its V block (``dh_chunk_products``), two more products per chunk.
3. ``_delta_chunk_bwd_dqk_kernel`` (chunk x qk head x K block): per value head, first the products
   with ``S0`` and ``dH`` over V blocks (the inter-chunk parts of ``dq``, ``dE``, ``dk``; those with ``dH``
   the sum of kernel 2's partials without ``store_dh``), then ``dP``
   and ``dM`` over V blocks with their intra-chunk products added on (one ``[BT, BT]`` tile at a time
   without per-channel decay), then ``db`` and ``dg``. One program loops over the value heads sharing
   a qk head (GVA), so ``dq`` and ``dk`` are summed in registers.

All three run with ``NUM_STAGES`` stages and the blocks and warps of ``bwd_tiles`` (``NUM_WARPS``, but 4 for a
float32 kernel whose narrowest product has 16 columns on Hopper: ``matrix_warps``), which the static report
(``lamina info --kernels``, registered in kernels/delta_report.py) compiles too: what it reports is what runs.

Per-channel decay (DECAY_CHANNEL) is evaluated one key column at a time (kernels/delta_chunk_bwd_parts.py):
each exponent is ``G_i - G_j`` with ``i >= j``, never positive, so gates down to -20 per token stay
finite at any T. ``DeltaTuning.channel_dots`` forms the same intra-chunk products with tensor cores between
16-row sub-blocks, every factor's exponent still ``<= 0``. Scalar decay (DECAY_SCALAR) and none (DECAY_NONE)
use matrix products with a ``[BT, BT]`` decay mask. Log decays are assumed ``<= 0`` (decays in [0, 1]);
``load_gate`` floors them at ``LOG_DECAY_FLOOR`` (-inf included), and ``dg`` at a floored one is 0, as the
PyTorch path's clamp gives (``floor_grad``; the float64 token loop's is within ``exp(-40)`` of 0 there), also
through a raw gate's activation (``gate_input_grads``), where the rounding left in a floored token's ``dg``
would reach ``dA_log`` multiplied by the log decay itself (at a raw gate of 1e6, errors of about 1e-2 of
``dA_log``'s RMS against the float64 token loop).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina._validate import check_cu_seqlens, check_shape, check_tensor
from lamina.kernels._utils import cdiv, fp_fusion
from lamina.kernels.delta_chunk_bwd_dqk import _delta_chunk_bwd_dqk_kernel
from lamina.kernels.delta_chunk_bwd_parts import (
    chunk_dh_block,
    dh_chunk_products,
    gated_gram,
    gated_gram_t_dots,
    load_state_tile,
    scan_operands,
    state_block_io,
)
from lamina.kernels.delta_chunk_bwd_tiles import (
    NUM_STAGES,
    NUM_WARPS,
    BwdTiles,
    bwd_tiles,
    has_warpgroup_mma,
    scan_block_v,
)
from lamina.kernels.delta_chunk_common import (
    BETA_NONE,
    CHUNK_SIZES,
    DECAY_CHANNEL,
    DECAY_SCALAR,
    DEFAULT_CHUNK_SIZE,
    DOT_PRECISION,
    GATE_CHANNEL,
    GATE_SCALAR,
    MAX_K,
    SUB_BLOCK_C,
    BetaAct,
    DecayKind,
    GateInput,
    GateKind,
    activated_beta,
    beta_grad_factor,
    check_beta_act,
    chunk_indices,
    chunk_rows,
    first_chunk,
    gate_kernel_args,
    inverse_norm,
    load_gate,
    load_rows,
    load_tile,
    load_vec,
    seq_bounds,
    store_tile,
)
from lamina.kernels.delta_tuning import active_tuning

# Public names, including the configuration that lives in kernels/delta_chunk_bwd_tiles.py.
__all__ = ["CHUNK_SIZES", "DEFAULT_CHUNK_SIZE", "MAX_K", "NUM_STAGES", "NUM_WARPS", "BwdTiles",
           "bwd_tiles", "delta_chunk_bwd", "has_warpgroup_mma", "scan_block_v"]

# Rows of the chunk per product of the fp32 reverse scan's dR = A^T dU (the smallest tl.dot side). Static
# report, fp32, K = 128 and 512, STL with the whole chunk -> with 16-row pieces: sm_90, Triton 3.6: DeltaNet,
# KDA, GDN-2 17 / 34 / 26 -> 0 (184-230 registers); Triton 3.9 (no spills either way): 223-255 -> 180-216
# registers. 32-row pieces left KDA at 254 under 3.6.
FP32_DR_ROWS = tl.constexpr(16)


@triton.jit(do_not_specialize=["T", "NT"])
def _delta_chunk_bwd_prep_kernel(
    q, k, v, g, b, w, h, do, dv_new, A_buf, U_out, dU_out, dh_out, rq, rk, qn, kn, cu_seqlens, chunk_indices,
    A_log, dt_bias, lower_bound, scale, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr,
    DECAY: tl.constexpr, ERASE: tl.constexpr, WRITE: tl.constexpr, IS_VARLEN: tl.constexpr,
    ADD_DV_NEW: tl.constexpr, DOT_PRECISION: tl.constexpr, GATE_ACT: tl.constexpr, P_PRODUCT: tl.constexpr,
    BETA_ACT: tl.constexpr, L2NORM: tl.constexpr,
):
    i_ch = tl.program_id(0)
    i_c = i_ch // HV
    i_hv = i_ch % HV
    i_h = i_hv // (HV // H)
    t0, L = chunk_rows(i_c, cu_seqlens, chunk_indices, T, NT, BT, IS_VARLEN)
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    lower = o_t[:, None] >= o_t[None, :]

    # With L2NORM (fla's use_qk_l2norm_in_kernel) q and k are the raw rows: P is formed from them, with the sums
    # of their squares on the way, and each entry scaled by its row's and column's inverse norms after; the
    # norms go to rq and rk and the normalised rows to qn and kn (in the activations' dtype), which the rest of
    # this kernel and the later ones read. (Scaled as loaded in the loop over V blocks below, the rows kept their
    # inverse norms live across it: KDA's fp32 kernel spilled on sm_90 under Triton 3.6, 2 STL.)
    Pm = tl.zeros([BT, BT], dtype=tl.float32)
    ss_q = tl.zeros([BT], dtype=tl.float32)
    ss_k = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        q_t = load_rows(q, t0, L, H * K, i_h * K, k0, o_t, o_k, K)
        k_t = load_rows(k, t0, L, H * K, i_h * K, k0, o_t, o_k, K)
        if L2NORM:
            ss_q += tl.sum(q_t * q_t, 1)
            ss_k += tl.sum(k_t * k_t, 1)
        if DECAY == DECAY_CHANNEL:
            G = load_gate(g, t0, L, i_hv, HV, K, k0, o_t, o_k, DECAY, A_log, dt_bias, lower_bound, GATE_ACT)
            if P_PRODUCT:  # P^T, with tensor-core products between sub-blocks (DeltaTuning.channel_dots)
                Pm += gated_gram_t_dots(q_t, k_t, G, o_t, SUB_BLOCK_C, DT, DOT_PRECISION)
            else:
                Pm += gated_gram(q_t, k_t, G, o_t, L, BT)
        elif P_PRODUCT:  # P^T = K Q^T (see P_c below)
            Pm += tl.dot(k_t.to(DT), tl.trans(q_t.to(DT)), input_precision=DOT_PRECISION)
        else:
            Pm += tl.dot(q_t.to(DT), tl.trans(k_t.to(DT)), input_precision=DOT_PRECISION)
    upper = o_t[:, None] <= o_t[None, :]
    if DECAY == DECAY_SCALAR:
        G = load_gate(g, t0, L, i_hv, HV, K, 0, o_t, o_k, DECAY, A_log, dt_bias, lower_bound, GATE_ACT)
        if P_PRODUCT:
            Pm = Pm * tl.exp(tl.where(upper, G[None, :] - G[:, None], float("-inf")))
        else:
            Pm = Pm * tl.exp(tl.where(lower, G[:, None] - G[None, :], float("-inf")))
    Pm = tl.where(upper if P_PRODUCT else lower, Pm * scale, 0.0)
    if L2NORM:
        r_q = inverse_norm(ss_q)
        r_k = inverse_norm(ss_k)
        if P_PRODUCT:
            Pm = Pm * (r_k[:, None] * r_q[None, :])
        else:
            Pm = Pm * (r_q[:, None] * r_k[None, :])
        # every value head of a qk head stores the same values (the first to finish leaves them)
        norm_offs = (t0 + o_t.to(tl.int64)) * H + i_h
        tl.store(rq + norm_offs, r_q, mask=o_t < L)
        tl.store(rk + norm_offs, r_k, mask=o_t < L)
        for k0 in range(0, K, BK):
            store_tile(qn, t0, L, H * K, i_h * K, k0, o_t, o_k, K,
                       load_rows(q, t0, L, H * K, i_h * K, k0, o_t, o_k, K) * r_q[:, None])
            store_tile(kn, t0, L, H * K, i_h * K, k0, o_t, o_k, K,
                       load_rows(k, t0, L, H * K, i_h * K, k0, o_t, o_k, K) * r_k[:, None])
        tl.debug_barrier()  # the loads below read these rows back (another thread may have stored them)
        q_rows = qn
        k_rows = kn
    else:
        q_rows = q
        k_rows = k

    # Everything of the chunk that needs the forward's state S0 or dO but not the incoming dH is
    # formed here, in parallel over chunks, rather than in the sequential scan:
    #   U = A (Z - Eb S0),  dU0 = P^T dO (+ dV_new; the scan adds Kt dH),  Qg^T dO (the scan adds it to dS0)
    # A is the forward's inverse (its prep kernel stores it with the states): the backward does not solve.
    # 16-bit: read where each V block's U = A (Z - Eb S0) takes it (from L2 after the first); held across the
    # loop, sm_80 GDN bf16 K = 512 compiled to 128 registers and 1 STL (static report, Triton 3.9). fp32:
    # held; read per V block, KDA and GDN-2 fp32 use_gate_in_kernel spilled 5-9 STL on sm_90 (Triton 3.6).
    if DT == tl.float32:
        A_c = load_tile(A_buf, t0, L, HV * BT, i_hv * BT, 0, o_t, o_t, BT)
    if ERASE == GATE_SCALAR:
        b_s = activated_beta(load_vec(b + i_hv, t0, L, HV, o_t), BETA_ACT)
    # P^T: with P_PRODUCT (dense decays on Hopper) formed as a product of its own above, not with tl.trans
    # of the product P: the Triton 3.4-3.6 Hopper miscompile of the forward's solve (kernels/delta_chunk_fwd.py).
    # Elsewhere the transpose: on sm_80 the extra product's operand spilled GDN bf16 K = 512 (9 STL, Triton
    # 3.9), and the per-channel P is formed on CUDA cores (gated_gram), not by a product, unless its tensor-core
    # form (P_PRODUCT with per-channel decay) builds P^T directly.
    P_c = Pm.to(DT) if P_PRODUCT else tl.trans(Pm.to(DT))
    o_bv = tl.arange(0, BV)
    chunk_state = (i_c.to(tl.int64) * HV + i_hv) * (K * V)
    for v0 in range(0, V, BV):
        do_t = load_rows(do, t0, L, HV * V, i_hv * V, v0, o_t, o_bv, V).to(DT)
        dU0 = tl.dot(P_c, do_t, input_precision=DOT_PRECISION)
        if ADD_DV_NEW:  # the gradient of the returned writes U (cross-layer error routing) joins dU here
            dU0 += load_rows(dv_new, t0, L, HV * V, i_hv * V, v0, o_t, o_bv, V)
        store_tile(dU_out, t0, L, HV * V, i_hv * V, v0, o_t, o_bv, V, dU0)
        rhs = load_rows(v, t0, L, HV * V, i_hv * V, v0, o_t, o_bv, V)
        if WRITE == GATE_CHANNEL:
            rhs = rhs * load_rows(w, t0, L, HV * V, i_hv * V, v0, o_t, o_bv, V)
        else:
            rhs = rhs * activated_beta(load_vec(w + i_hv, t0, L, HV, o_t), BETA_ACT)[:, None]
        for k0 in range(0, K, BK):
            k_t = load_rows(k_rows, t0, L, H * K, i_h * K, k0, o_t, o_k, K)
            q_g = load_rows(q_rows, t0, L, H * K, i_h * K, k0, o_t, o_k, K) * scale
            if ERASE == GATE_CHANNEL:
                e_g = k_t * load_rows(b, t0, L, HV * K, i_hv * K, k0, o_t, o_k, K)
            else:
                e_g = k_t * b_s[:, None]
            if DECAY == DECAY_CHANNEL:
                gamma = tl.exp(load_gate(g, t0, L, i_hv, HV, K, k0, o_t, o_k, DECAY, A_log, dt_bias, lower_bound,
                                         GATE_ACT))
                e_g = e_g * gamma
                q_g = q_g * gamma
            elif DECAY == DECAY_SCALAR:
                e_g = e_g * tl.exp(G)[:, None]
                q_g = q_g * tl.exp(G)[:, None]
            S0 = load_state_tile(h, chunk_state, k0, o_k, v0 + o_bv, K, V).to(DT)
            rhs -= tl.dot(e_g.to(DT), S0, input_precision=DOT_PRECISION)
            dS_q = tl.dot(tl.trans(q_g.to(DT)), do_t, input_precision=DOT_PRECISION)
            state_block_io(dh_out, chunk_state, k0, o_k, v0 + o_bv, dS_q, K, V, False)
        if DT != tl.float32:
            A_c = load_tile(A_buf, t0, L, HV * BT, i_hv * BT, 0, o_t, o_t, BT).to(DT)
        U = tl.dot(A_c, rhs.to(DT), input_precision=DOT_PRECISION)
        store_tile(U_out, t0, L, HV * V, i_hv * V, v0, o_t, o_bv, V, U)


@triton.jit(do_not_specialize=["T", "NT", "NTOK"])
def _delta_chunk_bwd_dh_kernel(
    k, v, g, b, w, dht, A_buf, dh_buf, dR_buf, dv, dw, dh0, h, U_buf, dkh_part, dgc_part,
    cu_seqlens, chunk_offsets, A_log, dt_bias, lower_bound, T, NT, NTOK,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, ERASE: tl.constexpr, WRITE: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DH_IN_MEMORY: tl.constexpr, GATE_ACT: tl.constexpr, BETA_ACT: tl.constexpr, STORE_DH: tl.constexpr,
):
    # dH is held as a tuple of NKB (at most four) [BK, BV] row blocks of the [K, BV] column block, each
    # chunk's loops over it unrolled (static_range), so that every [BT, K] operand is formed BK columns at a
    # time (one [BT, K] tile spills at K = 128) and every block stays in registers.
    # DH_IN_MEMORY (K > 128 or fp32 by default): dH lives in ``dh0`` instead (float32 [N, HV, K, V], filled
    # with the final state's gradient by the launcher), and each chunk loops over its key blocks twice, reading dH for
    # dU and updating it after dR; what this program stores there only it reads back (its V columns).
    # Each chunk's dH goes to the dqk kernel through its dh_buf slot (STORE_DH), or as its products with the chunk,
    # partial sums over this program's V columns (dh_chunk_products).
    NKB: tl.constexpr = (K + BK - 1) // BK
    tl.static_assert(DH_IN_MEMORY or NKB <= 4, "the scan holds at most four key blocks in registers")
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    # Dense: the launcher's NT, not a count from eos - bos (which spilled the scan_bv=32 alternative at
    # K = 128 on sm_90: 6 STL).
    if IS_VARLEN:
        n_chunks = tl.cdiv(eos - bos, BT).to(tl.int32)
    else:
        n_chunks = NT
    c0 = first_chunk(chunk_offsets, i_n, NT, IS_VARLEN)
    DT = k.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_bv = tl.arange(0, BV)
    v0 = i_v * BV
    o_v = v0 + o_bv
    head_state = (i_n * HV + i_hv).to(tl.int64) * (K * V)

    if not DH_IN_MEMORY:
        dh_blocks = ()
        for kb in tl.static_range(NKB):
            dh = tl.zeros([BK, BV], dtype=tl.float32)
            if USE_FINAL_STATE_GRADIENT:
                dh = state_block_io(dht, head_state, kb * BK, o_k, o_v, dh, K, V, True)
            dh_blocks = dh_blocks + (dh,)

    for i_t in range(n_chunks - 1, -1, -1):
        chunk_head = (c0 + i_t) * HV + i_hv
        chunk_state = chunk_head * (K * V)
        t0 = bos + i_t * BT
        L = eos - t0
        if DH_IN_MEMORY and not STORE_DH:
            # a loop of their own: in the first loop below, next to its gate operands, KDA's (then in the transposed
            # form) spilled on sm_90 (16-bit K = 256 and 512: 5 STL; fp32 K = 64: 3 STL, Triton 3.9)
            for k0 in range(0, K, BK):
                dh_chunk_products(h, U_buf, dkh_part, dgc_part, chunk_head, i_hv, i_v, t0, L, k0, o_t, o_k, o_v,
                                  load_state_tile(dh0, head_state, k0, o_k, o_v, K, V), HV, K, V, DECAY, DT,
                                  DOT_PRECISION, False)
        # dU = P^T dO (left by the prep kernel in the dR slot, overwritten below) + Kt dH
        val_offs = ((t0 + o_t.to(tl.int64)) * (HV * V) + i_hv * V)[:, None] + o_v[None, :]
        val_mask = (o_t < L)[:, None] & (o_v < V)[None, :]
        dU = load_rows(dR_buf, t0, L, HV * V, i_hv * V, v0, o_t, o_bv, V)
        if DH_IN_MEMORY:
            for k0 in range(0, K, BK):
                kt, _, _ = scan_operands(k, b, g, t0, L, i_h, i_hv, k0, o_t, o_k, H, HV, K, BT, DECAY, ERASE,
                                         A_log, dt_bias, lower_bound, GATE_ACT, BETA_ACT)
                dh = load_state_tile(dh0, head_state, k0, o_k, o_v, K, V)
                dU += tl.dot(kt, dh.to(DT), input_precision=DOT_PRECISION)
        else:
            # per key block: Qg^T dO (out of dh_buf, for the chunk's dH or its products), E_bar and the decay
            qds, egs, dcs = (), (), ()
            for kb in tl.static_range(NKB):
                qds = qds + (chunk_dh_block(dh_buf, chunk_state, kb * BK, o_k, o_v, dh_blocks[kb], K, V, STORE_DH),)
                if not STORE_DH:
                    dh_chunk_products(h, U_buf, dkh_part, dgc_part, chunk_head, i_hv, i_v, t0, L, kb * BK, o_t, o_k,
                                      o_v, dh_blocks[kb], HV, K, V, DECAY, DT, DOT_PRECISION, True)
                kt, eg, dc = scan_operands(k, b, g, t0, L, i_h, i_hv, kb * BK, o_t, o_k, H, HV, K, BT, DECAY,
                                           ERASE, A_log, dt_bias, lower_bound, GATE_ACT, BETA_ACT)
                egs, dcs = egs + (eg,), dcs + (dc,)
                dU += tl.dot(kt, dh_blocks[kb].to(DT), input_precision=DOT_PRECISION)
        # A^T is read through transposed pointers (A_T[i, j] = A[token j, column i]), not formed with
        # tl.trans: on an H200 (triton 3.6, DeltaNet) tl.trans(A) as a warpgroup-product operand read
        # past the kernel's shared memory (compute-sanitizer: out-of-bounds __shared__ reads) and dR
        # came out NaN.
        a_base = A_buf + t0 * (HV * BT) + i_hv * BT
        if DT == tl.float32:
            # fp32: dR = A^T dU over FP32_DR_ROWS-row pieces of the chunk (A^T's columns, dU's rows). A whole
            # [BT, BT] A^T split into its tf32x3 halves spilled (Triton 3.6, sm_90: 17-34 STL); dU goes to
            # its dR_buf slot so that its rows can be read back piece by piece.
            tl.store(dR_buf + val_offs, dU, mask=val_mask)
            tl.debug_barrier()
            o_p = tl.arange(0, FP32_DR_ROWS)
            dR = tl.zeros([BT, BV], dtype=tl.float32)
            for j0 in range(0, BT, FP32_DR_ROWS):
                A_Tp = tl.load(a_base + o_t[:, None] + ((j0 + o_p) * (HV * BT))[None, :],
                               mask=((j0 + o_p) < L)[None, :], other=0.0)
                dU_p = load_rows(dR_buf, t0 + j0, L - j0, HV * V, i_hv * V, v0, o_p, o_bv, V)
                dR = tl.dot(A_Tp, dU_p, dR, input_precision=DOT_PRECISION)
            tl.debug_barrier()  # every piece is read before dR overwrites the slot
        else:
            A_T = tl.load(a_base + o_t[:, None] + (o_t * (HV * BT))[None, :], mask=(o_t < L)[None, :],
                          other=0.0).to(DT)
            dR = tl.dot(A_T, dU.to(DT), input_precision=DOT_PRECISION)

        v_t = load_rows(v, t0, L, HV * V, i_hv * V, v0, o_t, o_bv, V)
        if WRITE == GATE_CHANNEL:
            w_t = load_rows(w, t0, L, HV * V, i_hv * V, v0, o_t, o_bv, V)
        else:
            w_t = activated_beta(load_vec(w + i_hv, t0, L, HV, o_t), BETA_ACT)[:, None]
        tl.store(dR_buf + val_offs, dR, mask=val_mask)
        tl.store(dv + val_offs, (dR * w_t).to(dv.dtype.element_ty), mask=val_mask)
        if WRITE == GATE_CHANNEL:
            tl.store(dw + val_offs, (dR * v_t).to(dw.dtype.element_ty), mask=val_mask)
        else:
            # a partial sum per V block, reduced by the launcher (no atomics)
            # (with BETA_ACT of the raw input's: the partials are linear in dR)
            dw_offs = i_v.to(tl.int64) * NTOK * HV + (t0 + o_t.to(tl.int64)) * HV + i_hv
            dw_t = tl.sum(dR * v_t, 1)
            if BETA_ACT != BETA_NONE:
                dw_t = dw_t * beta_grad_factor(load_vec(w + i_hv, t0, L, HV, o_t), BETA_ACT)
            tl.store(dw + dw_offs, dw_t, mask=o_t < L)

        # dS0 = Diag(gamma_C) dH + Qg^T dO - Eb^T dR, block by block
        dR_c = dR.to(DT)
        if DH_IN_MEMORY:
            # the chunk's dH (or its products) goes to the dqk kernel (Qg^T dO comes out of dh_buf), and dS0
            # replaces it in dh0
            for k0 in range(0, K, BK):
                dh = load_state_tile(dh0, head_state, k0, o_k, o_v, K, V)
                qd = chunk_dh_block(dh_buf, chunk_state, k0, o_k, o_v, dh, K, V, STORE_DH)
                _, eg, dc = scan_operands(k, b, g, t0, L, i_h, i_hv, k0, o_t, o_k, H, HV, K, BT, DECAY, ERASE,
                                          A_log, dt_bias, lower_bound, GATE_ACT, BETA_ACT)
                dh = dh * dc + qd - tl.dot(tl.trans(eg), dR_c, input_precision=DOT_PRECISION)
                # every thread has read the block before any overwrites it (the store's layout may give
                # an element to another thread)
                tl.debug_barrier()
                state_block_io(dh0, head_state, k0, o_k, o_v, dh, K, V, False)
            tl.debug_barrier()  # the next chunk's reads see these stores
        else:
            updated = ()
            for kb in tl.static_range(NKB):
                updated = updated + (dh_blocks[kb] * dcs[kb] + qds[kb]
                                     - tl.dot(tl.trans(egs[kb]), dR_c, input_precision=DOT_PRECISION),)
            dh_blocks = updated

    if USE_INITIAL_STATE and not DH_IN_MEMORY:
        for kb in tl.static_range(NKB):
            state_block_io(dh0, head_state, kb * BK, o_k, o_v, dh_blocks[kb], K, V, False)


# ----------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------

def _gate_kind(name: str, x: torch.Tensor | None, lead: tuple[int, ...], width: int, wide: str) -> int:
    """``GateKind.SCALAR`` for a gate ``[B, T, HV]``, ``GateKind.CHANNEL`` for ``[B, T, HV, width]``."""
    check_tensor(name, x)
    if tuple(x.shape) == lead:
        return GateKind.SCALAR
    check_shape(name, x, (*lead, width), f"[B, T, HV] or [B, T, HV, {wide}]")
    return GateKind.CHANNEL


def _l2norm_rows_grad(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """The gradient of the raw rows ``x`` from that of their l2-normalised rows (inverse norms ``rstd``), by the
    L2-norm kernel's backward."""
    from lamina.kernels.rms_norm_gated import rms_norm_bwd

    width = x.shape[-1]
    dx = rms_norm_bwd(dy.reshape(-1, width), None, x.reshape(-1, width), None, None, None, None, rstd.reshape(-1),
                      "none", "l2")[0]
    return dx.view(x.shape)


def delta_chunk_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    b: torch.Tensor | None,
    w: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None,
    h: torch.Tensor,
    A: torch.Tensor,
    do: torch.Tensor,
    dfinal_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    dv_new: torch.Tensor | None = None,
    gate: GateInput | None = None,
    beta_act: int = BetaAct.NONE,
    l2norm_qk: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Gradients of the chunked delta-rule family (module docstring) with respect to every input.

    Args:
        q, k: [B, T, H, K]. v: [B, T, HV, V], ``HV % H == 0`` (value head j reads qk head j // (HV // H)).
        g: log decay, None (DeltaNet), [B, T, HV] (scalar per head) or [B, T, HV, K] (per channel).
        b: erase gate [B, T, HV] or [B, T, HV, K]; w: write gate [B, T, HV] or [B, T, HV, V];
            None means a gate of 1. ``b`` and ``w`` may be the same tensor.
        scale: query scale. initial_state: [N, HV, K, V] float32 or None.
        h: chunk-start states of the forward, float32 [total_chunks, HV, K, V] (state before chunk c).
        A: the forward's inverses ``(I + M)^-1``, float32 [B, T, HV, chunk_size] (``delta_chunk_fwd`` with
            ``save_states``).
        do: [B, T, HV, V]. dfinal_state: [N, HV, K, V] or None (zero).
        cu_seqlens: [N + 1] int32/int64 sequence offsets (B == 1) or None.
        chunk_size: 16, 32 or 64.
        dv_new: [B, T, HV, V] or None: the gradient of the writes ``U`` when the forward returned them
            (``output_v_new``); it is added to ``dU`` before ``dR = A^T dU``, which carries it to every input.
        gate: with a ``GateInput``, ``g`` is the raw gate input, activated where the kernels load it (fla's
            ``use_gate_in_kernel``); ``dg`` is then its gradient, and two more results follow.
        beta_act: a ``BetaAct``: the scalar ``b`` and ``w`` are raw, activated where the kernels load them (fla's
            ``use_beta_sigmoid_in_kernel``); ``db`` and ``dw`` are then the raw inputs' gradients.
        l2norm_qk: ``q`` and ``k`` are the raw rows, l2-normalised inside the kernels (fla's
            ``use_qk_l2norm_in_kernel``; ``h`` and ``A`` are the forward's of the normalised rows): the prep
            kernel forms each row's inverse norm on its way through the rows and stores the normalised rows for
            the later kernels. ``dq`` and ``dk`` are the raw rows' gradients (the L2-norm kernel's backward takes
            the normalised rows' there, one pass).

    Returns:
        (dq, dk, dv, dg, db, dw, dinitial_state), shaped and typed as their inputs (dinitial_state is
        float32); dg/db/dw are None when that input is None, dinitial_state when initial_state is None.
        With ``gate``: then ``dA_log`` and ``ddt_bias`` (None for a parameter left out), shaped and typed as
        those parameters.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("do", do)):
        check_tensor(name, x, ndim=4)
    B, T, H, K = q.shape
    check_shape("k", k, q.shape, "like q")
    if v.shape[:2] != (B, T) or v.shape[2] % H != 0:
        raise ValueError(f"v must have shape [B={B}, T={T}, HV, V] with HV % H == 0 (H={H}), got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    check_shape("do", do, v.shape, "like v")
    if dv_new is not None:
        check_tensor("dv_new", dv_new, ndim=4)
        check_shape("dv_new", dv_new, v.shape, "like v")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
    if K > MAX_K:
        raise ValueError(f"q/k head dim K must be <= {MAX_K}, got {K}")
    N = check_cu_seqlens(cu_seqlens, B, T)
    lead = (B, T, HV)
    decay = DecayKind.NONE if g is None else DecayKind.SCALAR + _gate_kind("g", g, lead, K, "K")
    erase = GateKind.SCALAR if b is None else _gate_kind("b", b, lead, K, "K")
    write = GateKind.SCALAR if w is None else _gate_kind("w", w, lead, V, "V")
    check_beta_act(beta_act, {"ERASE": erase, "WRITE": write})
    if beta_act != BetaAct.NONE and (b is None or w is None):
        raise ValueError("beta_act needs the raw b and w (None stands for a gate of 1, not for a raw input)")
    BT = chunk_size
    index = chunk_indices(cu_seqlens, B, T, BT)
    n_chunks, nt = index.total, index.per_sequence
    check_tensor("h", h, dtypes=(torch.float32,))
    check_shape("h", h, (n_chunks, HV, K, V), "chunk-start states [total_chunks, HV, K, V]")
    check_tensor("A", A, dtypes=(torch.float32,))
    check_shape("A", A, (B, T, HV, BT), "the forward's inverses [B, T, HV, chunk_size]")
    state_shape = (N, HV, K, V)
    if initial_state is not None:
        check_tensor("initial_state", initial_state)
        check_shape("initial_state", initial_state, state_shape)
    if dfinal_state is not None:
        check_tensor("dfinal_state", dfinal_state)
        check_shape("dfinal_state", dfinal_state, state_shape)

    q, k, v, do, h, A = (x.contiguous() for x in (q, k, v, do, h, A))
    dv_new_in = dv_new.contiguous() if dv_new is not None else do
    b_in = b.contiguous() if b is not None else q.new_ones(lead)
    w_in = w.contiguous() if w is not None else q.new_ones(lead)
    g_in = g.contiguous() if g is not None else q
    dht = dfinal_state.contiguous() if dfinal_state is not None else h
    f32 = dict(dtype=torch.float32, device=q.device)
    ntok = B * T
    if gate is not None and g is None:
        raise ValueError("g (the raw gate input) is required with a gate activation")
    gate_kw = gate_kernel_args(gate, HV, K if decay == DecayKind.CHANNEL else 1, q)  # pointers, lower_bound
    flags = dict(DECAY=decay, ERASE=erase, WRITE=write, IS_VARLEN=cu_seqlens is not None,
                 DOT_PRECISION=DOT_PRECISION, GATE_ACT=gate_kw.pop("GATE_ACT"), BETA_ACT=beta_act)
    # with the l2norm fused in, the rows' inverse norms and the normalised rows (the prep kernel's), which the
    # later kernels read in place of q and k
    rq, rk = (torch.empty(ntok, H, **f32) for _ in range(2)) if l2norm_qk else (None, None)
    qn, kn = (torch.empty_like(q), torch.empty_like(k)) if l2norm_qk else (None, None)
    q_rows, k_rows = (qn, kn) if l2norm_qk else (q, k)
    dims = dict(H=H, HV=HV, K=K, V=V, BT=BT)
    cu, idx, offs = cu_seqlens, index.indices, index.offsets  # all None when dense

    U_buf = torch.empty(ntok, HV, V, **f32)
    dR_buf = torch.empty(ntok, HV, V, **f32)
    dh_buf = torch.empty(n_chunks, HV, K, V, **f32)
    tiles = bwd_tiles(K, V, decay, has_warpgroup_mma(q.device), active_tuning(), fp32=q.dtype == torch.float32)
    _delta_chunk_bwd_prep_kernel[(n_chunks * HV,)](
        q, k, v, g_in, b_in, w_in, h, do, dv_new_in, A, U_buf, dR_buf, dh_buf, rq, rk, qn, kn, cu, idx, **gate_kw,
        scale=scale, T=T, NT=nt, BK=tiles.prep_bk, BV=tiles.prep_bv, ADD_DV_NEW=dv_new is not None,
        P_PRODUCT=tiles.prep_p_product, L2NORM=l2norm_qk, **dims, **flags, num_warps=tiles.prep_warps,
        num_stages=NUM_STAGES, enable_fp_fusion=fp_fusion())

    nv = cdiv(V, tiles.scan_bv)
    dv = torch.empty_like(v)
    dw = torch.empty_like(w_in) if write == GateKind.CHANNEL else torch.empty(nv, ntok, HV, **f32)
    if tiles.dh_in_memory:  # the scan's dH, starting from the final state's gradient
        dh0 = dht.float().clone() if dfinal_state is not None else torch.zeros(state_shape, **f32)
    else:
        dh0 = torch.empty(state_shape, **f32) if initial_state is not None else h
    if tiles.store_dh:  # the dqk kernel reads each chunk's dH from dh_buf
        dkh_part = dgc_part = dR_buf
    else:  # the scan's partial sums per V block of dH's products with the chunk: U dH^T and rowsum(dH * S0)
        dkh_part = torch.empty(ntok, HV, nv, K, **f32)
        dgc_part = torch.empty(n_chunks, HV, nv, K, **f32) if decay != DecayKind.NONE else dkh_part
    _delta_chunk_bwd_dh_kernel[(N * HV, nv)](
        k_rows, v, g_in, b_in, w_in, dht, A, dh_buf, dR_buf, dv, dw, dh0, h, U_buf, dkh_part, dgc_part,
        cu, offs, **gate_kw, T=T, NT=nt, NTOK=ntok, BK=tiles.scan_bk, BV=tiles.scan_bv, DH_IN_MEMORY=tiles.dh_in_memory,
        USE_INITIAL_STATE=initial_state is not None, USE_FINAL_STATE_GRADIENT=dfinal_state is not None,
        STORE_DH=tiles.store_dh, **dims, **flags, num_warps=tiles.scan_warps, num_stages=NUM_STAGES,
        enable_fp_fusion=fp_fusion())

    nk = cdiv(K, tiles.dqk_bk)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    db = torch.empty_like(b_in) if erase == GateKind.CHANNEL else torch.empty(nk, ntok, HV, **f32)
    # a raw gate input's gradient is formed in fp32 (the sum over tokens that dt_bias's gradient is reads it)
    dg = (torch.empty(nk, ntok, HV, **f32) if decay != DecayKind.CHANNEL
          else torch.empty_like(g_in, dtype=torch.float32) if gate is not None else torch.empty_like(g_in))
    dg_a = torch.empty_like(dg) if gate is not None else dg  # the A_log term of each gate gradient
    _delta_chunk_bwd_dqk_kernel[(n_chunks * H, nk)](
        q_rows, k_rows, g_in, b_in, h, do, dh_buf, U_buf, dR_buf, dq, dk, dg, db, dkh_part, dgc_part, cu, idx,
        **gate_kw, dg_a=dg_a, scale=scale, T=T, NT=nt, NTOK=ntok, NV=nv,
        BK=tiles.dqk_bk, BV=tiles.dqk_bv, REGRAM=tiles.dqk_regram, BY_COLUMN=tiles.dqk_by_column,
        CHANNEL_DOTS=tiles.channel_dots, STORE_DH=tiles.store_dh, **dims, **flags, num_warps=tiles.dqk_warps,
        num_stages=NUM_STAGES, enable_fp_fusion=fp_fusion())

    if l2norm_qk:
        dq, dk = _l2norm_rows_grad(dq, q, rq), _l2norm_rows_grad(dk, k, rk)

    def reduce(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return part.sum(0).view(lead).to(like.dtype)

    # dg summed over its key-block partials once, in fp32 (a raw gate input's gradient also gives dt_bias's)
    dg_sum = None if g is None else (dg if decay == DecayKind.CHANNEL else dg.sum(0).view(lead))
    dg_out = None if g is None else dg_sum.to(g.dtype)
    db_out = None if b is None else (db if erase == GateKind.CHANNEL else reduce(db, b))
    dw_out = None if w is None else (dw if write == GateKind.CHANNEL else reduce(dw, w))
    dh0_out = dh0 if initial_state is not None else None
    if gate is None:
        return dq, dk, dv, dg_out, db_out, dw_out, dh0_out
    # dt_bias enters as g + dt_bias: its gradient is the raw gate's, summed over tokens; A_log's is the A_log
    # terms summed over tokens (and channels)
    dA_log = None if gate.A_log is None else dg_a.view(-1, HV, K if decay == DecayKind.CHANNEL else 1).sum((0, 2))
    ddt_bias = None if gate.dt_bias is None else dg_sum.view(g.shape).sum((0, 1)).reshape(-1)
    return (dq, dk, dv, dg_out, db_out, dw_out, dh0_out,
            None if dA_log is None else dA_log.view(gate.A_log.shape).to(gate.A_log.dtype),
            None if ddt_bias is None else ddt_bias.view(gate.dt_bias.shape).to(gate.dt_bias.dtype))
