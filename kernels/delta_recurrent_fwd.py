"""Token-by-token forward of the delta-rule family (decoding).

Same recurrence and inputs as the chunked forward (kernels/delta_chunk_fwd.py), one token at a time::

    S <- Diag(exp(g_t)) S;  r_t = S^T (b_t * k_t);  S <- S + k_t (w_t * v_t - r_t)^T;  o_t = S^T (scale q_t)

``_delta_recurrent_fwd_kernel``: one program per (sequence, value head, V tile) with the whole
``[K, BV]`` float32 state in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels._utils import AotSpec, autotune, cdiv, next_power_of_2, register_aot
from lamina.kernels.delta_chunk_common import (
    MIN_BLOCK,
    STATE_TILE_ELEMS,
    VARIANT_FLAGS,
    DecayKind,
    _load_state,
    _seq_bounds,
    _store_state,
    aligned_attrs,
)
from lamina.kernels.delta_chunk_fwd import _AOT_DIMS, _contig, _flags, _warps_stages


@triton.jit
def _delta_recurrent_fwd_kernel(
    q, k, v, g, b, w,
    h0, o, ht,
    cu_seqlens,
    scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, ERASE: tl.constexpr, WRITE: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
):
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0).to(tl.int64)
    i_v, i_nh = pid % NV, pid // NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = _seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    b_s = _load_state(h0, i_n, i_hv, 0, o_v, HV, K, V, BK, BV, USE_INITIAL_STATE)
    for t in range(0, eos - bos):
        tok = bos + t
        b_q = tl.load(q + (tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + (tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        if DECAY == 1:
            b_s = b_s * tl.exp(tl.load(g + tok * HV + i_hv).to(tl.float32))
        if DECAY == 2:
            b_gk = tl.load(g + (tok * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_s = b_s * tl.exp(b_gk)[:, None]
        if ERASE == 0:
            b_e = b_k * tl.load(b + tok * HV + i_hv).to(tl.float32)
        else:
            b_e = b_k * tl.load(b + (tok * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        if WRITE == 0:
            b_z = b_v * tl.load(w + tok * HV + i_hv).to(tl.float32)
        else:
            b_z = b_v * tl.load(w + (tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_r = tl.sum(b_s * b_e[:, None], 0)
        b_s += b_k[:, None] * (b_z - b_r)[None, :]
        b_o = tl.sum(b_s * b_q[:, None], 0)
        tl.store(o + (tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_FINAL_STATE:
        _store_state(ht, i_n, b_s, i_hv, 0, o_v, HV, K, V, BK)


# Autotune keys as in kernels/delta_chunk_fwd.py: dims and variant flags, never T.
_recurrent_fwd = autotune(_warps_stages((1, 2, 4), (1,)),
                          key=["H", "HV", "K", "V", "BV", "DECAY", "ERASE", "WRITE", "IS_VARLEN"])(
    _delta_recurrent_fwd_kernel)


def delta_recurrent_fwd(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token forward (decoding); same inputs as ``delta_chunk_fwd``.

    One program per (sequence, value head, V tile) with the whole ``[K, BV]`` state in
    registers. Returns ``(o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32 or None)``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v, g, b, w = (_contig(x) for x in (q, k, v, g, b, w))
    initial_state = _contig(initial_state)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    BK = max(next_power_of_2(K), MIN_BLOCK)
    BV = max(MIN_BLOCK, min(next_power_of_2(V), STATE_TILE_ELEMS // BK))
    o = torch.empty_like(v)
    ht = q.new_empty(N, HV, K, V, dtype=torch.float32) if output_final_state else None
    if N * HV > 0:
        _recurrent_fwd[(N * HV * cdiv(V, BV),)](
            q, k, v, g, b, w, initial_state, o, ht, cu_seqlens, scale, T,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, **_flags(g, b, w), IS_VARLEN=cu_seqlens is not None,
            USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=output_final_state)
    return o, ht


# ----------------------------------------------------------------------------------------------
# static report: default configurations compiled ahead of time (lamina info --kernels)
# ----------------------------------------------------------------------------------------------
def _register_aot_specs() -> None:
    io = "*bf16"
    for variant, (decay, erase, write) in VARIANT_FLAGS.items():
        g_ty = "constexpr" if decay == DecayKind.NONE else "*fp32"
        for K, V in _AOT_DIMS:
            base = {"H": 4, "HV": 4, "K": K, "V": V, "IS_VARLEN": False}
            label = f"{variant} bf16 K={K} V={V}"
            BKr = max(next_power_of_2(K), MIN_BLOCK)
            BVr = max(MIN_BLOCK, min(next_power_of_2(V), STATE_TILE_ELEMS // BKr))
            rec_c = {**base, "BK": BKr, "BV": BVr, "DECAY": decay, "ERASE": erase, "WRITE": write,
                     "USE_INITIAL_STATE": True, "STORE_FINAL_STATE": True, "cu_seqlens": None}
            if decay == DecayKind.NONE:
                rec_c["g"] = None
            rec_sig = {"q": io, "k": io, "v": io, "g": g_ty, "b": io, "w": io, "h0": "*fp32", "o": io,
                       "ht": "*fp32", "cu_seqlens": "constexpr", "scale": "fp32", "T": "i32"}
            rec_sig.update({c: "constexpr" for c in rec_c if c not in rec_sig})
            register_aot(AotSpec("delta_recurrent_fwd", f"{label} BV={BVr}", _delta_recurrent_fwd_kernel,
                                 rec_sig, rec_c, num_warps=4, num_stages=1, uses_dot=False,
                                 meta={"attrs": aligned_attrs(_delta_recurrent_fwd_kernel, rec_sig)}))


_register_aot_specs()
