"""Prism attention forward: online-softmax tiling (FlashAttention-2) for head dims 16..512.

One program owns ``BLOCK_M`` query rows of one (sequence, head) and one output piece of the
head dim (see ``prism_attn_common``). It keeps the query rows of both head-dim pieces, walks the
visible key blocks, and keeps the running row maximum and row sum in fp32 (base-2 exponents).
Causal masking is aligned bottom-right: query ``i`` of a sequence with ``Tq`` queries and ``Tk``
keys sees keys ``j <= i + Tk - Tq``. Key blocks that every row of the tile sees completely are
visited first without masks; the remaining (diagonal and ragged) blocks apply the mask.

A row that sees no key (causal with ``Tq > Tk``) gets output 0 and log-sum-exp ``-inf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels._utils import MAX_GRID_YZ, AotSpec, autotune, cdiv, fp_fusion, raw_jit, register_aot
from lamina.kernels.prism_attn_common import (
    AOT_HEAD_DIMS,
    AOT_OPTIONS,
    LN2_C,
    LOG2E,
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
    reduction_chunk,
    sequence_bounds,
    store_tile,
    tanh,
    window_args,
    window_visible,
)

# Tile configurations per head-dim bucket (checked by the static report: 0 spills, HGMMA, shared
# memory within sm_90 and sm_80 limits). Measured with 16-divisible strides, bf16, causal:
# D <= 128 keeps FlashAttention-2's 128 x 64 tiles (<= 240 registers, <= 128 KB shared) over 8 warps
# (D = 64 with 4 warps used 255 registers on sm_80 and spilled 2 STL under Triton 3.9; 8 warps compile
# to <= 191 registers on sm_90 and sm_80 under Triton 3.6 and 3.9); at 256,
# BLOCK_M = 128 spills (8 STL, 192 KB), 64 x 64 does not (160 KB on sm_90); above 256 the
# pipelined query and key chunks need BLOCK_N = 32 (64 x 64: 3 STL and 256 KB, over sm_90's 227 KB).
FWD_CONFIGS: dict[int, list[triton.Config]] = {
    64: [triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3)],
    128: [triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3)],
    256: [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=2)],
    512: [triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=8, num_stages=2)],
}
# With a window or softcapping (their masks and tanh hold more registers): where the plain tile spilled
# in the static report (Triton 3.9, every flag on), a smaller one. D <= 128: 128 x 64 spilled 1 STL on
# sm_80 (255 registers), 64 x 64 over 8 warps uses 179 (sm_80) / 210 (sm_90); D <= 256: 64 x 64 spilled
# 18 STL on sm_90, 64 x 32 does not (229 / 254 registers).
FWD_OPTION_CONFIGS: dict[int, list[triton.Config]] = {
    64: FWD_CONFIGS[64],
    128: [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=3)],
    256: [triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=8, num_stages=2)],
    512: FWD_CONFIGS[512],
}
FWD_TABLES = (FWD_CONFIGS, FWD_OPTION_CONFIGS)
# Under the interpreter: small tiles so that the short test sequences span several blocks, with
# BLOCK_M != BLOCK_N so that block-boundary arithmetic is exercised.
FWD_INTERPRET_CONFIG = triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)


@triton.jit
def _fwd_key_block(acc, m_i, l_i, q_res, q_blk, stride_qt, rows_q, offs_m, k_base, v_base, stride_kt,
                   stride_vt, start_n, offs_out, len_k, diag, qk_scale, win_left, win_right, cap2,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_DC: tl.constexpr, BLOCK_DO: tl.constexpr, OUT_OFFSET: tl.constexpr,
                   Q_RESIDENT: tl.constexpr, MASKED: tl.constexpr, BOUND_LEFT: tl.constexpr,
                   BOUND_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold key block ``[start_n, start_n + BLOCK_N)`` into the running (acc, m, l) of the query tile."""
    k_blk = k_base + start_n * stride_kt.to(tl.int64)
    v_blk = v_base + start_n * stride_vt.to(tl.int64)
    rows_k = len_k - start_n
    s = head_dot(q_res, q_blk, stride_qt, rows_q, k_blk, stride_kt, rows_k,
                 BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_DC, Q_RESIDENT, MASKED, DOT_PRECISION) * qk_scale
    if SOFTCAP:  # cap * tanh(s / cap), in the base-2 units of s (cap2 = cap * log2(e))
        s = cap2 * tanh(s / cap2)
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        visible = (offs_n[None, :] < len_k) & window_visible(offs_m[:, None], offs_n[None, :], diag, win_left,
                                                              win_right, BOUND_LEFT, BOUND_RIGHT)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no visible key so far keeps m = -inf; shift by 0 there so that exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_tile(v_blk, stride_vt, offs_out, rows_k, BLOCK_N, HEAD_DIM, MASKED, OUT_OFFSET + BLOCK_DO > HEAD_DIM)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prism_attn_fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, num_heads, group_size, qk_scale, win_left, win_right, cap2,
    HEAD_DIM: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DO: tl.constexpr, OUT_OFFSET: tl.constexpr,
    CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid: (query blocks, sequences, heads). Writes O[..., OUT_OFFSET : OUT_OFFSET + BLOCK_DO].

    ``WINDOW_LEFT``/``WINDOW_RIGHT``: the window bounds ``win_left``/``win_right`` apply (causal is the right
    bound 0: ``WINDOW_RIGHT`` with ``win_right = 0``; ``CAUSAL`` itself only names the case); ``SOFTCAP``:
    scores are capped at ``cap2`` (base-2 units).
    """
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    kv_head = head // group_size
    batch, bos_q, len_q = sequence_bounds(CU_Q, seq, seqlen_q, IS_VARLEN)
    _, bos_k, len_k = sequence_bounds(CU_K, seq, seqlen_k, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= len_q:
        return
    Q_RESIDENT: tl.constexpr = BLOCK_DC >= HEAD_DIM

    row_q = bos_q + m0
    q_blk = Q + batch * stride_qb + row_q * stride_qt + head * stride_qh
    o_blk = O + batch * stride_ob + row_q * stride_ot + head * stride_oh
    k_base = K + batch * stride_kb + bos_k * stride_kt + kv_head * stride_kh
    v_base = V + batch * stride_vb + bos_k * stride_vt + kv_head * stride_vh
    rows_q = len_q - m0

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_out = OUT_OFFSET + tl.arange(0, BLOCK_DO)
    if Q_RESIDENT:
        q_res = load_tile(q_blk, stride_qt, tl.arange(0, BLOCK_DC), rows_q, BLOCK_M, HEAD_DIM)
    else:
        q_res = offs_m  # unused: Q is reloaded chunk by chunk
    acc = tl.zeros([BLOCK_M, BLOCK_DO], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    diag = len_k - len_q
    # Only the key blocks the window cuts (diagonal, left edge, ragged end) pay for the mask.
    start, full_lo, full_hi, end = key_range(m0, BLOCK_M, len_k, diag, win_left, win_right, BLOCK_N,
                                             WINDOW_LEFT, WINDOW_RIGHT)
    for start_n in range(start, tl.minimum(full_lo, end), BLOCK_N):
        acc, m_i, l_i = _fwd_key_block(
            acc, m_i, l_i, q_res, q_blk, stride_qt, rows_q, offs_m, k_base, v_base, stride_kt, stride_vt,
            start_n, offs_out, len_k, diag, qk_scale, win_left, win_right, cap2,
            HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_DC, BLOCK_DO, OUT_OFFSET, Q_RESIDENT, True, WINDOW_LEFT, WINDOW_RIGHT,
            SOFTCAP, DOT_PRECISION)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _fwd_key_block(
            acc, m_i, l_i, q_res, q_blk, stride_qt, rows_q, offs_m, k_base, v_base, stride_kt, stride_vt,
            start_n, offs_out, len_k, diag, qk_scale, win_left, win_right, cap2,
            HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_DC, BLOCK_DO, OUT_OFFSET, Q_RESIDENT, False, WINDOW_LEFT, WINDOW_RIGHT,
            SOFTCAP, DOT_PRECISION)
    for start_n in range(full_hi, end, BLOCK_N):
        acc, m_i, l_i = _fwd_key_block(
            acc, m_i, l_i, q_res, q_blk, stride_qt, rows_q, offs_m, k_base, v_base, stride_kt, stride_vt,
            start_n, offs_out, len_k, diag, qk_scale, win_left, win_right, cap2,
            HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_DC, BLOCK_DO, OUT_OFFSET, Q_RESIDENT, True, WINDOW_LEFT, WINDOW_RIGHT,
            SOFTCAP, DOT_PRECISION)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    store_tile(o_blk, acc / l_safe[:, None], stride_ot, offs_out, rows_q, BLOCK_M, HEAD_DIM)
    if WRITE_LSE:
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2_C)
        lse_ptr = LSE + batch * stride_lb + head * stride_lh + row_q + tl.arange(0, BLOCK_M)
        tl.store(lse_ptr, lse, mask=tl.arange(0, BLOCK_M) < rows_q)


_KEY = ["HEAD_DIM", "BLOCK_DO", "OUT_OFFSET", "CAUSAL", "IS_VARLEN", "WINDOW_LEFT", "WINDOW_RIGHT", "SOFTCAP"]
_prism_attn_fwd_tuned = autotune(
    all_configs(FWD_TABLES), key=_KEY, interpret_config=FWD_INTERPRET_CONFIG,
    prune_configs_by={"early_config_prune": keep_bucket_configs(FWD_TABLES)},
)(_prism_attn_fwd_kernel)


def _strides3(x: torch.Tensor) -> tuple[int, int, int]:
    if x.stride(-1) != 1:
        raise ValueError(f"the head dim must be contiguous, got strides {tuple(x.stride())}")
    return x.stride(0), x.stride(1), x.stride(2)


def prism_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs.

    q: [B, T, H, D], k and v: [B, S, HKV, D] (B == 1 with cu_seqlens_q/k: [N + 1]).
    window_size: (left, right), -1 for no bound (with causal the right bound is 0); softcap: 0 for none.
    Returns o: [B, T, H, D] in q's dtype and lse: [B, H, T] float32 (natural log; -inf where a
    row sees no key).
    """
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    is_varlen = cu_seqlens_q is not None
    if is_varlen:
        n_seq = cu_seqlens_q.numel() - 1
        max_q = int(max_seqlen_q) if max_seqlen_q is not None else int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    else:
        n_seq, max_q = batch, seqlen_q
    if n_seq > MAX_GRID_YZ or num_heads > MAX_GRID_YZ:
        raise ValueError(f"sequences and heads must each be <= {MAX_GRID_YZ} (grid axes 1 and 2), "
                         f"got {n_seq} and {num_heads}")
    o = torch.empty_like(q)
    lse = torch.empty((batch, num_heads, seqlen_q), device=q.device, dtype=torch.float32)
    block_dc = reduction_chunk(head_dim)
    window, window_flags = window_args(causal, window_size, softcap)
    for out_offset, block_do in output_pieces(head_dim):
        _prism_attn_fwd_tuned[lambda meta: (cdiv(max_q, meta["BLOCK_M"]), n_seq, num_heads)](
            q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
            *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(o),
            lse.stride(0), lse.stride(1),
            seqlen_q, seqlen_k, num_heads, num_heads // num_kv_heads, scale * LOG2E, *window,
            HEAD_DIM=head_dim, BLOCK_DC=block_dc, BLOCK_DO=block_do, OUT_OFFSET=out_offset,
            CAUSAL=bool(causal), IS_VARLEN=is_varlen, WRITE_LSE=out_offset == 0,
            DOT_PRECISION=dot_precision(q.dtype), **window_flags, enable_fp_fusion=fp_fusion(),
        )
    return o, lse



def _aot_signature(dtype: str, head_dim: int, piece: tuple[int, int], config: triton.Config,
                   options: tuple[bool, tuple[int, int], float] = AOT_OPTIONS[""]) -> tuple[dict, dict]:
    ptr = f"*{dtype}"
    sig = {"Q": ptr, "K": ptr, "V": ptr, "O": ptr, "LSE": "*fp32", "CU_Q": "*i32", "CU_K": "*i32"}
    for name in ("q", "k", "v", "o"):
        sig.update({f"stride_{name}b": "i32", f"stride_{name}t": "i32", f"stride_{name}h": "i32"})
    sig.update({"stride_lb": "i32", "stride_lh": "i32", "seqlen_q": "i32", "seqlen_k": "i32",
                "num_heads": "i32", "group_size": "i32", "qk_scale": "fp32", "win_left": "i32", "win_right": "i32",
                "cap2": "fp32"})
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_DC": reduction_chunk(head_dim), "BLOCK_DO": piece[1],
                  "OUT_OFFSET": piece[0], "CAUSAL": options[0], "IS_VARLEN": False, "WRITE_LSE": piece[0] == 0,
                  "DOT_PRECISION": "tf32", **window_args(*options)[1], **config.kwargs}
    sig.update({name: "constexpr" for name in constexprs})
    return sig, constexprs


def _register_static_report() -> None:
    fn = raw_jit(_prism_attn_fwd_kernel)
    for head_dim in AOT_HEAD_DIMS:
        for suffix, options, config, piece in aot_launches(FWD_TABLES, head_dim):
            sig, constexprs = _aot_signature("bf16", head_dim, piece, config, options)
            register_aot(AotSpec(
                name="prism_attn_fwd", config=config_label(head_dim, piece, config) + suffix,
                fn=fn, signature=sig, constexprs=constexprs,
                num_warps=config.num_warps, num_stages=config.num_stages, uses_dot=True,
                meta={"attrs": aot_attrs(fn, sig)},
            ))


_register_static_report()

__all__ = ["FWD_CONFIGS", "FWD_OPTION_CONFIGS", "LOG2E", "prism_attn_fwd"]
