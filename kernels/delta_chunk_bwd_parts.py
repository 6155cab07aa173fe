"""``@triton.jit`` building blocks of the chunked delta-rule backward (kernels/delta_chunk_bwd.py).

Everything here works on one chunk of ``BT`` tokens held in registers:

* ``rows_gram``: ``X Y^T`` of two ``[BT, C]`` row blocks, over column blocks.
* ``gated_gram``: ``X_i . (Y_j * exp(G_i - G_j))`` for ``j <= i`` with per-channel ``G``.
* ``gated_intra_grads``: the three products that back-propagate through ``gated_gram``.
* ``gated_gram_t_dots``, ``gated_row_grads_dots``, ``gated_col_grads_dots``: the same with tensor-core
  products between ``SUB``-row sub-blocks (``DeltaTuning.channel_dots``).
* ``state_tile_ptrs`` / ``load_state_tile``: a ``[BK, BV]`` block of a ``[K, V]`` state.
* ``scan_operands``, ``swap_state_block``, ``chunk_dh_block``, ``dh_chunk_products``, ``state_block_io``:
  per-key-block pieces of the reverse scan.

The chunk's tiles (``load_tile``, ``load_rows``, ``load_vec``) and its cumulative log decay (``load_gate``)
come from kernels/delta_chunk_common.py, which the forward shares.

Per-channel decay is handled one key column ``j`` at a time, so every exponent is ``G_i - G_j``
with ``i >= j``, which is ``<= 0`` for log decays ``g <= 0``: nothing overflows, and an exponent
that underflows stands for a weight that is truly below float32's range. The ``_dots`` forms keep that
bound: between sub-blocks the weight ``exp(G_i - G_j)`` is split at a row ``r`` with ``j <= r < i`` (the
last row before row ``i``'s sub-block) into ``exp(G_i - G_r)`` and ``exp(G_r - G_j)``, each ``<= 1``, which
go into the product's operands; inside a sub-block they take exact exponents, one column of every
sub-block at a time (``block_sums``), as the forward's gram does (kernels/delta_chunk_fwd.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lamina.kernels.delta_chunk_common import (
    DECAY_CHANNEL,
    DECAY_NONE,
    DECAY_SCALAR,
    GATE_CHANNEL,
    _masked_exp,
    activated_beta,
    load_gate,
    load_rows,
    load_tile,
    load_vec,
    store_tile,
)


@triton.jit
def row_of(X, o_t, j):
    """Row ``j`` of a ``[BT, C]`` register tile."""
    return tl.sum(tl.where((o_t == j)[:, None], X, 0.0), 0)


@triton.jit
def col_of(X, o_t, j):
    """Column ``j`` of a ``[R, BT]`` register tile."""
    return tl.sum(tl.where((o_t == j)[None, :], X, 0.0), 1)


@triton.jit
def rows_gram(x, y, t0, L, row_stride, head_off, o_t, o_c, N_COLS, DT: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """``X Y^T`` (``[BT, BT]`` fp32) for the ``[BT, N_COLS]`` row blocks of one head of two
    ``[tokens, row_stride]`` tensors, over column blocks of ``o_c.shape[0]``, operands in ``DT``."""
    BC: tl.constexpr = o_c.shape[0]
    R = tl.zeros([o_t.shape[0], o_t.shape[0]], dtype=tl.float32)
    for c0 in range(0, N_COLS, BC):
        x_t = load_tile(x, t0, L, row_stride, head_off, c0, o_t, o_c, N_COLS).to(DT)
        y_t = load_tile(y, t0, L, row_stride, head_off, c0, o_t, o_c, N_COLS).to(DT)
        R = tl.dot(x_t, tl.trans(y_t), R, input_precision=DOT_PRECISION)
    return R


@triton.jit
def masked_rows_gram(x, y, t0, L, row_stride, head_off, o_t, o_c, N_COLS, G, mask, DECAY: tl.constexpr,
                     DT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``rows_gram(x, y)`` where ``mask`` holds and 0 elsewhere, each entry ``(i, j)`` times
    ``exp(G_i - G_j)`` for a scalar decay (DECAY_SCALAR; ``G`` is ``[BT]``, unused otherwise). Called with
    the operands swapped and ``-G``, it gives the transpose of the call with them in order."""
    R = rows_gram(x, y, t0, L, row_stride, head_off, o_t, o_c, N_COLS, DT, DOT_PRECISION)
    if DECAY == DECAY_SCALAR:
        R = R * tl.exp(tl.where(mask, G[:, None] - G[None, :], float("-inf")))
    return tl.where(mask, R, 0.0)


@triton.jit
def gated_gram(X, Y, G, o_t, n_rows, BT: tl.constexpr):
    """``R_ij = sum_c X_ic Y_jc exp(G_ic - G_jc)`` for ``j <= i`` (0 above the diagonal), with the
    per-channel cumulative decay ``G`` (all ``[BT, BK]``). Only the first ``n_rows`` rows are valid (a
    chunk's tail); columns past them stay 0."""
    R = tl.zeros([BT, BT], dtype=tl.float32)
    for j in range(0, tl.minimum(n_rows, BT)):
        # rows extracted inline: a nested jit call per iteration is slow under the interpreter
        row_j = (o_t == j)[:, None]
        y_j = tl.sum(tl.where(row_j, Y, 0.0), 0)
        g_j = tl.sum(tl.where(row_j, G, 0.0), 0)
        # exponents G_i - G_j with i >= j only: each is <= 0
        gate = tl.exp(tl.where((o_t >= j)[:, None], G - g_j[None, :], float("-inf")))
        yg = gate * y_j[None, :]
        R = tl.where((o_t == j)[None, :], tl.sum(X * yg, 1)[:, None], R)
    return R


@triton.jit
def gated_intra_grads(dP, dM, Q, E, Kt, G, o_t, n_rows, dQ, dE, dK, BT: tl.constexpr):
    """Back-propagation through ``gated_gram`` for ``P = gram(Q, K)`` (lower incl. diagonal) and
    ``M = gram(E, K)`` (strictly lower), given their gradients ``dP`` and ``dM`` (``[BT, BT]``,
    already masked; rows from ``n_rows`` on are padding and stay 0). Adds onto ``dQ, dE, dK``
    (``[BT, BK]``) and returns them:

    ``dQ_i += sum_j dP_ij K_j e^(G_i - G_j)``, ``dE_i += sum_j dM_ij K_j e^(G_i - G_j)``,
    ``dK_j += sum_i (dP_ij Q_i + dM_ij E_i) e^(G_i - G_j)``.
    """
    for j in range(0, tl.minimum(n_rows, BT)):
        row_j = (o_t == j)[:, None]
        col_j = (o_t == j)[None, :]
        k_j = tl.sum(tl.where(row_j, Kt, 0.0), 0)
        g_j = tl.sum(tl.where(row_j, G, 0.0), 0)
        gate = tl.exp(tl.where((o_t >= j)[:, None], G - g_j[None, :], float("-inf")))
        p_j = tl.sum(tl.where(col_j, dP, 0.0), 1)
        m_j = tl.sum(tl.where(col_j, dM, 0.0), 1)
        kg = gate * k_j[None, :]
        dQ += p_j[:, None] * kg
        dE += m_j[:, None] * kg
        dk_j = tl.sum((p_j[:, None] * Q + m_j[:, None] * E) * gate, 0)
        dK = tl.where(row_j, dK + dk_j[None, :], dK)
    return dQ, dE, dK


@triton.jit
def block_sums(X, SUB: tl.constexpr):
    """Every row of the ``[BT, C]`` tile ``X`` replaced by the sum of the rows of its ``SUB``-row sub-block.
    Of a tile that is 0 outside one row per sub-block, it gives that row to every row of the sub-block."""
    BT: tl.constexpr = X.shape[0]
    C: tl.constexpr = X.shape[1]
    NB: tl.constexpr = BT // SUB
    sums = tl.sum(tl.reshape(X, (NB, SUB, C)), 1)
    return tl.reshape(tl.broadcast_to(sums[:, None, :], (NB, SUB, C)), (BT, C))


@triton.jit
def sub_block_column(X, G, at_j, SUB: tl.constexpr):
    """Row ``j`` of every ``SUB``-row sub-block of ``X`` and of ``G`` (``at_j``: the rows ``j`` of the
    sub-blocks), given to each row of that sub-block."""
    return block_sums(tl.where(at_j[:, None], X, 0.0), SUB), block_sums(tl.where(at_j[:, None], G, 0.0), SUB)


@triton.jit
def gated_gram_t_dots(X, Y, G, o_t, SUB: tl.constexpr, DT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The transpose of ``gated_gram(X, Y, G)`` (``R^T``, upper triangle incl. the diagonal), with
    tensor-core products between ``SUB``-row sub-blocks (operands in ``DT``). Rows of ``X`` and ``Y`` past
    the chunk's end must be 0 and ``G``'s repeat its last valid row (``load_gate``)."""
    BT: tl.constexpr = X.shape[0]
    RT = tl.zeros([BT, BT], dtype=tl.float32)
    block = o_t // SUB
    for i in range(1, BT // SUB):
        r = i * SUB - 1
        g_r = row_of(G, o_t, r)[None, :]
        x_i = X * _masked_exp(G - g_r, (block == i)[:, None])
        y_r = Y * _masked_exp(g_r - G, (o_t <= r)[:, None])
        RT = tl.dot(y_r.to(DT), tl.trans(x_i.to(DT)), RT, input_precision=DOT_PRECISION)
    off = o_t % SUB
    for j in range(0, SUB):
        y_j, g_j = sub_block_column(Y, G, off == j, SUB)
        # R_ts for s = the row j of t's sub-block (exponents <= 0 where s <= t; 0 above)
        r_t = tl.sum(X * y_j * _masked_exp(G - g_j, (off >= j)[:, None]), 1)
        RT = tl.where(o_t[:, None] == (o_t - off + j)[None, :], r_t[None, :], RT)
    return RT


@triton.jit
def gated_row_grads_dots(dP, dM, Kt, G, o_t, dQ, dE, SUB: tl.constexpr, DT: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """The ``dQ`` and ``dE`` parts of ``gated_intra_grads`` (same arguments, ``dP``/``dM`` masked), with
    tensor-core products between ``SUB``-row sub-blocks: ``dQ_i += sum_j dP_ij K_j e^(G_i - G_j)``, the
    same for ``dE`` with ``dM``."""
    BT: tl.constexpr = Kt.shape[0]
    block = o_t // SUB
    for i in range(1, BT // SUB):
        # rows of sub-block i against every column before it
        r = i * SUB - 1
        g_r = row_of(G, o_t, r)[None, :]
        k_r = (Kt * _masked_exp(g_r - G, (o_t <= r)[:, None])).to(DT)
        pick = (block == i)[:, None] & (o_t <= r)[None, :]
        left = _masked_exp(G - g_r, (block == i)[:, None])
        dQ += left * tl.dot(tl.where(pick, dP, 0.0).to(DT), k_r, input_precision=DOT_PRECISION)
        dE += left * tl.dot(tl.where(pick, dM, 0.0).to(DT), k_r, input_precision=DOT_PRECISION)
    off = o_t % SUB
    for j in range(0, SUB):
        k_j, g_j = sub_block_column(Kt, G, off == j, SUB)
        kg = k_j * _masked_exp(G - g_j, (off >= j)[:, None])
        at_col = o_t[None, :] == (o_t - off + j)[:, None]
        dQ += tl.sum(tl.where(at_col, dP, 0.0), 1)[:, None] * kg
        dE += tl.sum(tl.where(at_col, dM, 0.0), 1)[:, None] * kg
    return dQ, dE


@triton.jit
def gated_col_grads_dots(dPT, dMT, Q, E, G, o_t, dK, SUB: tl.constexpr, DT: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """The ``dK`` part of ``gated_intra_grads`` from the transposes ``dPT``, ``dMT`` of its masked ``dP``,
    ``dM``, with tensor-core products between ``SUB``-row sub-blocks:
    ``dK_j += sum_i (dP_ij Q_i + dM_ij E_i) e^(G_i - G_j)``."""
    BT: tl.constexpr = Q.shape[0]
    block = o_t // SUB
    for i in range(1, BT // SUB):
        # rows of sub-block i - 1 against every row after it, split at its last row r
        r = i * SUB - 1
        g_r = row_of(G, o_t, r)[None, :]
        right = _masked_exp(G - g_r, (o_t > r)[:, None])
        q_r = (Q * right).to(DT)
        e_r = (E * right).to(DT)
        pick = (block == i - 1)[:, None] & (o_t > r)[None, :]
        part = tl.dot(tl.where(pick, dPT, 0.0).to(DT), q_r, input_precision=DOT_PRECISION)
        part = tl.dot(tl.where(pick, dMT, 0.0).to(DT), e_r, part, input_precision=DOT_PRECISION)
        dK += _masked_exp(g_r - G, (block == i - 1)[:, None]) * part
    off = o_t % SUB
    for j in range(0, SUB):
        g_j = block_sums(tl.where((off == j)[:, None], G, 0.0), SUB)
        gate = _masked_exp(G - g_j, (off >= j)[:, None])
        # dP_ts for s = the row j of t's sub-block: column t of dPT, row s
        at_row = o_t[:, None] == (o_t - off + j)[None, :]
        p_j = tl.sum(tl.where(at_row, dPT, 0.0), 0)
        m_j = tl.sum(tl.where(at_row, dMT, 0.0), 0)
        part = (p_j[:, None] * Q + m_j[:, None] * E) * gate
        dK += tl.where((off == j)[:, None], block_sums(part, SUB), 0.0)
    return dK


@triton.jit
def scan_operands(k, b, g, t0, L, i_h, i_hv, k0, o_t, o_k, H: tl.constexpr, HV: tl.constexpr,
                  K: tl.constexpr, BT: tl.constexpr, DECAY: tl.constexpr, ERASE: tl.constexpr, A_log, dt_bias,
                  lower_bound, GATE_ACT: tl.constexpr, BETA_ACT: tl.constexpr):
    """For key columns ``k0 + o_k`` of one chunk: ``Kt`` and ``Eb`` in the dot dtype, and the chunk's
    total decay of those rows of the state (``[BK, 1]``, a scalar, or 1)."""
    DT = k.dtype.element_ty
    k_t = load_rows(k, t0, L, H * K, i_h * K, k0, o_t, o_k, K)
    if ERASE == GATE_CHANNEL:
        e_t = k_t * load_rows(b, t0, L, HV * K, i_hv * K, k0, o_t, o_k, K)
    else:
        e_t = k_t * activated_beta(load_vec(b + i_hv, t0, L, HV, o_t), BETA_ACT)[:, None]
    if DECAY == DECAY_CHANNEL:
        G = load_gate(g, t0, L, i_hv, HV, K, k0, o_t, o_k, DECAY, A_log, dt_bias, lower_bound, GATE_ACT)
        g_last = row_of(G, o_t, BT - 1)
        k_tail = (k_t * tl.exp(g_last[None, :] - G)).to(DT)
        e_g = (e_t * tl.exp(G)).to(DT)
        decay_chunk = tl.exp(g_last)[:, None]
    elif DECAY == DECAY_SCALAR:
        G = load_gate(g, t0, L, i_hv, HV, K, 0, o_t, o_k, DECAY, A_log, dt_bias, lower_bound, GATE_ACT)
        g_last = tl.sum(tl.where(o_t == BT - 1, G, 0.0), 0)
        k_tail = (k_t * tl.exp(g_last - G)[:, None]).to(DT)
        e_g = (e_t * tl.exp(G)[:, None]).to(DT)
        decay_chunk = tl.exp(g_last)
    else:
        # Without decay these would be plain loads feeding the warpgroup products directly; on an
        # H200 (triton 3.6) that path gave wrong dR and dS0 (1e35 or NaN) while the gated variants,
        # whose operands pass through registers, were right. The row mask keeps them in registers too.
        keep = (o_t < L)[:, None]
        k_tail = tl.where(keep, k_t, 0.0).to(DT)
        e_g = tl.where(keep, e_t, 0.0).to(DT)
        decay_chunk = 1.0
    return k_tail, e_g, decay_chunk


@triton.jit
def swap_state_block(dh_buf, chunk_state, k0, o_k, o_v, dh, K: tl.constexpr, V: tl.constexpr):
    """Read ``Qg^T dO`` (left by the prep kernel) from rows ``k0 + o_k`` of the chunk's ``dh_buf`` slot
    and put ``dH`` there instead."""
    ptrs, mask = state_tile_ptrs(dh_buf, chunk_state, k0, o_k, o_v, K, V)
    dS_q = tl.load(ptrs, mask=mask, other=0.0)
    # another thread of the program may own the element in the store's layout
    tl.debug_barrier()
    tl.store(ptrs, dh, mask=mask)
    return dS_q


@triton.jit
def chunk_dh_block(dh_buf, chunk_state, k0, o_k, o_v, dh, K: tl.constexpr, V: tl.constexpr, STORE_DH: tl.constexpr):
    """Read ``Qg^T dO`` (left by the prep kernel) from rows ``k0 + o_k`` of the chunk's ``dh_buf`` slot, and
    with ``STORE_DH`` put ``dH``'s block ``dh`` there for the dqk kernel (``swap_state_block``); else the
    scan gives it dH's products with the chunk instead (``dh_chunk_products``)."""
    if STORE_DH:
        dS_q = swap_state_block(dh_buf, chunk_state, k0, o_k, o_v, dh, K, V)
    else:
        dS_q = load_state_tile(dh_buf, chunk_state, k0, o_k, o_v, K, V)
    return dS_q


@triton.jit
def dh_chunk_products(h, U_buf, dkh_part, dgc_part, chunk_head, i_hv, i_v, t0, L, k0, o_t, o_k, o_v, dh,
                      HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DECAY: tl.constexpr, DT: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, PRODUCT_RESULT: tl.constexpr):
    """What the dqk kernel needs of the chunk's ``dH`` (chunk ``chunk_head // HV``, value head ``i_hv``) where
    the scan does not store it, for ``dH``'s block ``dh`` (rows ``k0 + o_k``, V columns ``o_v``): its products
    with the chunk, this V block's (``i_v``) partial sums. ``U dH^T`` goes into ``dkh_part``, float32
    ``[tokens, HV, NV, K]``, and with a decay ``rowsum(dH * S0)`` into ``dgc_part``, ``[chunks, HV, NV, K]``
    (``NV`` the scan's V blocks).

    With ``PRODUCT_RESULT`` (``dh`` is a product's result, the register scan's) the product is formed
    transposed, ``dH U^T`` with ``U^T`` read through transposed pointers, so that ``dh`` is not transposed: a
    product's result through tl.trans into the next product is the Triton 3.4-3.6 Hopper miscompile of fla
    issue #640 (kernels/delta_chunk_fwd.py). ``dh`` loaded from memory takes ``tl.trans`` as the dqk kernel's
    does: in the transposed form the in-memory scans of KDA (16-bit K = 256 and 512: 5 STL; fp32 K = 64: 3 STL)
    or GDN-2 (16-bit K = 256 and 512: 4-5 STL) spilled on sm_90 (static report, Triton 3.9)."""
    NV = tl.num_programs(1)
    key_mask = (k0 + o_k) < K
    if PRODUCT_RESULT:
        rows = t0 + o_t.to(tl.int64)
        U_T = tl.load(U_buf + (rows * (HV * V) + i_hv * V)[None, :] + o_v[:, None],
                      mask=(o_t < L)[None, :] & (o_v < V)[:, None], other=0.0)
        part_t = tl.dot(dh.to(DT), U_T.to(DT), input_precision=DOT_PRECISION)
        part_offs = (rows * (HV * NV * K) + (i_hv * NV + i_v) * K)[None, :] + (k0 + o_k)[:, None]
        tl.store(dkh_part + part_offs, part_t, mask=(o_t < L)[None, :] & key_mask[:, None])
    else:
        U_t = load_tile(U_buf, t0, L, HV * V, i_hv * V, 0, o_t, o_v, V)
        part = tl.dot(U_t.to(DT), tl.trans(dh.to(DT)), input_precision=DOT_PRECISION)
        store_tile(dkh_part, t0, L, HV * NV * K, (i_hv * NV + i_v) * K, k0, o_t, o_k, K, part)
    if DECAY != DECAY_NONE:
        S0 = load_state_tile(h, chunk_head * (K * V), k0, o_k, o_v, K, V)
        tl.store(dgc_part + (chunk_head * NV + i_v) * K + k0 + o_k, tl.sum(dh * S0, 1), mask=key_mask)


@triton.jit
def state_tile_ptrs(ptr, head_state, k0, o_k, o_v, K: tl.constexpr, V: tl.constexpr):
    """Pointers and mask of rows ``k0 + o_k`` and columns ``o_v`` of the ``[K, V]`` state at
    ``ptr + head_state`` (an int64 element offset)."""
    ptrs = ptr + head_state + (k0 + o_k)[:, None] * V + o_v[None, :]
    mask = ((k0 + o_k) < K)[:, None] & (o_v < V)[None, :]
    return ptrs, mask


@triton.jit
def load_state_tile(ptr, head_state, k0, o_k, o_v, K: tl.constexpr, V: tl.constexpr):
    """The ``state_tile_ptrs`` block in the state's dtype, zero outside ``K x V``."""
    ptrs, mask = state_tile_ptrs(ptr, head_state, k0, o_k, o_v, K, V)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def state_block_io(ptr, head_state, k0, o_k, o_v, dh, K: tl.constexpr, V: tl.constexpr, LOAD: tl.constexpr):
    """Load (``LOAD``, in fp32) or store ``dh`` into rows ``k0 + o_k`` of a ``[K, V]`` state."""
    if LOAD:
        return load_state_tile(ptr, head_state, k0, o_k, o_v, K, V).to(tl.float32)
    else:
        ptrs, mask = state_tile_ptrs(ptr, head_state, k0, o_k, o_v, K, V)
        tl.store(ptrs, dh, mask=mask)
        return dh


__all__ = [
    "row_of", "col_of",
    "rows_gram", "gated_gram", "gated_intra_grads", "block_sums", "sub_block_column", "gated_gram_t_dots",
    "gated_row_grads_dots", "gated_col_grads_dots", "scan_operands", "chunk_dh_block", "dh_chunk_products",
    "state_tile_ptrs",
    "load_state_tile", "swap_state_block", "state_block_io",
]
