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

from lamina.kernels._utils import AotSpec, autotune, cdiv, fp_fusion, next_power_of_2, register_aot
from lamina.kernels.delta_chunk_common import (
    DECAY_CHANNEL,
    DECAY_SCALAR,
    GATE_SCALAR,
    L2NORM_EPS_C,
    MIN_BLOCK,
    STATE_TILE_ELEMS,
    VARIANT_FLAGS,
    DecayKind,
    activated_beta,
    aligned_attrs,
    seq_bounds,
)
from lamina.kernels.delta_chunk_fwd import _contig, _flags, _warps_stages


@triton.jit
def _state_offsets(o_k, o_v, K: tl.constexpr, V: tl.constexpr, V_FIRST: tl.constexpr):
    """Offsets of the ``[BK, BV]`` tile in one head's state, ``[K, V]`` or ``[V, K]`` (``V_FIRST``)."""
    if V_FIRST:
        return o_k[:, None] + o_v[None, :] * K
    return o_k[:, None] * V + o_v[None, :]


@triton.jit
def _gate(x, A_log, dt_bias, i_hv, o_k, m_k, lower_bound, K: tl.constexpr, DECAY: tl.constexpr,
          GATE_ACT: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr):
    """fla's gate activation of the raw gate ``x`` (scalar, or per key channel): GATE_ACT 1 is
    ``-exp(A_log) * softplus(x + dt_bias)``, 2 is ``lower_bound * sigmoid(exp(A_log) * (x + dt_bias))``."""
    if HAS_DT:
        if DECAY == DECAY_SCALAR:
            x += tl.load(dt_bias + i_hv).to(tl.float32)
        else:
            x += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    if HAS_A:
        a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    else:
        a = 1.0
    if GATE_ACT == 1:
        # softplus with PyTorch's threshold: x itself above 20
        return -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return lower_bound * tl.sigmoid(a * x)


@triton.jit
def _lanes(flag, BV: tl.constexpr):
    """A scalar condition as a ``[BV]`` mask (the interpreter does not broadcast scalar masks)."""
    return (tl.zeros([BV], dtype=tl.int32) + flag.to(tl.int32)) > 0


@triton.jit
def _delta_recurrent_fwd_kernel(
    q, k, v, g, b, w,
    h0, o, ht,
    cu_seqlens,
    scale, T,
    A_log, dt_bias, state_indices, num_accepted, lower_bound,
    n_slots, slot_stride, idx_stride, n_idx,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, ERASE: tl.constexpr, WRITE: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    GATE_ACT: tl.constexpr = 0, HAS_A: tl.constexpr = False, HAS_DT: tl.constexpr = False,
    BETA_ACT: tl.constexpr = 0, L2NORM: tl.constexpr = False, V_FIRST: tl.constexpr = False,
    POOL: tl.constexpr = False, SPEC: tl.constexpr = False, PER_TOKEN: tl.constexpr = False,
    INPLACE: tl.constexpr = False,
):
    """One program per (sequence, value head, V tile). Decode options (ops/delta_decode.py):
    ``POOL``: ``h0`` is a pool of ``n_slots`` states ``slot_stride`` elements apart, sequence n reads
    slot ``state_indices[n, a - 1]`` (``a = num_accepted[n]`` with ``SPEC``, else 1); a slot outside
    the pool skips the sequence (zero output, nothing written). ``INPLACE``: the final state goes
    back to the read slot, or with ``PER_TOKEN`` the state after token t to slot
    ``state_indices[n, t]``. ``ht`` (``STORE_FINAL_STATE``) is a separate ``[N, HV, ...]`` output."""
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0).to(tl.int64)
    i_v, i_nh = pid % NV, pid // NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    s_off = _state_offsets(o_k, o_v, K, V, V_FIRST)
    # which state this sequence starts from
    if POOL:  # slot from the index table; sequences with a bad slot are skipped
        if SPEC:
            acc = tl.load(num_accepted + i_n).to(tl.int64)
            acc_ok = (acc >= 1) & (acc <= n_idx)
            i_first = tl.where(acc_ok, acc - 1, 0)
        else:
            i_first = 0
        slot = tl.load(state_indices + i_n * idx_stride + i_first).to(tl.int64)
        ok = (slot >= 0) & (slot < n_slots)
        if SPEC:
            ok = ok & acc_ok
        active = _lanes(ok, BV)
        p_h0 = h0 + tl.where(ok, slot, 0) * slot_stride + i_hv * K * V + s_off
        m_h0 = m_s & active[None, :]
    elif USE_INITIAL_STATE or INPLACE:
        p_h0 = h0 + i_nh * K * V + s_off
        m_h0 = m_s
    if USE_INITIAL_STATE:
        b_s = tl.load(p_h0, mask=m_h0, other=0.0).to(tl.float32)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)
    for t in range(0, eos - bos):
        tok = bos + t
        b_q = tl.load(q + (tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + L2NORM_EPS_C)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + L2NORM_EPS_C)
        b_q = b_q * scale
        if DECAY == DECAY_SCALAR:
            b_g = tl.load(g + tok * HV + i_hv).to(tl.float32)
            if GATE_ACT != 0:
                b_g = _gate(b_g, A_log, dt_bias, i_hv, o_k, m_k, lower_bound, K, DECAY, GATE_ACT, HAS_A, HAS_DT)
            b_s = b_s * tl.exp(b_g)
        if DECAY == DECAY_CHANNEL:
            b_g = tl.load(g + (tok * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            if GATE_ACT != 0:
                b_g = _gate(b_g, A_log, dt_bias, i_hv, o_k, m_k, lower_bound, K, DECAY, GATE_ACT, HAS_A, HAS_DT)
            b_s = b_s * tl.exp(b_g)[:, None]
        if ERASE == GATE_SCALAR:
            b_e = b_k * activated_beta(tl.load(b + tok * HV + i_hv).to(tl.float32), BETA_ACT)
        else:
            b_e = b_k * activated_beta(
                tl.load(b + (tok * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32), BETA_ACT)
        if WRITE == GATE_SCALAR:
            b_z = b_v * activated_beta(tl.load(w + tok * HV + i_hv).to(tl.float32), BETA_ACT)
        else:
            b_z = b_v * activated_beta(
                tl.load(w + (tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32), BETA_ACT)
        b_r = tl.sum(b_s * b_e[:, None], 0)
        b_s += b_k[:, None] * (b_z - b_r)[None, :]
        b_o = tl.sum(b_s * b_q[:, None], 0)
        if POOL:
            b_o = tl.where(active, b_o, 0.0)
        tl.store(o + (tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if PER_TOKEN:
            dst = tl.load(state_indices + i_n * idx_stride + t, mask=t < n_idx, other=-1).to(tl.int64)
            dst_ok = (dst >= 0) & (dst < n_slots)
            m_dst = m_s & (active & _lanes(dst_ok, BV))[None, :]
            tl.store(h0 + tl.where(dst_ok, dst, 0) * slot_stride + i_hv * K * V + s_off, b_s, mask=m_dst)
    if INPLACE and not PER_TOKEN:
        tl.store(p_h0, b_s, mask=m_h0)
    if STORE_FINAL_STATE:
        if POOL:
            b_s = tl.where(active[None, :], b_s, 0.0)
        tl.store(ht + i_nh * K * V + s_off, b_s, mask=m_s)


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
    l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token forward (decoding); same inputs as ``delta_chunk_fwd``; ``l2norm``: q and k are the raw
    rows, each normalised in float32 as it is loaded (fla's ``use_qk_l2norm_in_kernel``).

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
            None, None, None, None, 0.0, N, HV * K * V, 1, 1,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, **_flags(g, b, w), IS_VARLEN=cu_seqlens is not None,
            USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=output_final_state, L2NORM=l2norm,
            enable_fp_fusion=fp_fusion())
    return o, ht


# Decode tiles: the [BK, BV] fp32 state of one program stays within 4096 elements (32 registers a
# thread at 4 warps); narrow V tiles give more programs when B x HV is small (one token per step).
DECODE_TILE_ELEMS = 4096
DECODE_MAX_BV = 32
DECODE_MIN_BV = 4


def decode_tiles(K: int, V: int) -> tuple[int, int, int]:
    """(BK, BV, num_warps) of the decode step."""
    BK = max(next_power_of_2(K), MIN_BLOCK)
    BV = max(DECODE_MIN_BV, min(next_power_of_2(V), DECODE_MAX_BV, DECODE_TILE_ELEMS // BK))
    return BK, BV, 4 if BK * BV >= 2048 else 2


def delta_decode_step(q, k, v, g, b, w, A_log, dt_bias, state, state_indices, num_accepted_tokens, cu_seqlens,
                      out, final_state, scale, lower_bound, gate_act, beta_act, l2norm, state_v_first,
                      inplace) -> None:
    """The decode step of ``lamina.ops.delta_decode`` (its docstring is the contract) in one launch.

    Inputs are validated by the op; ``out`` and ``final_state`` are written, ``state`` too with
    ``inplace``. ``w`` None means ``w = b``. Not autotuned: the step updates ``state`` in place,
    so it must run exactly once per call.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v, g, b = (_contig(x) for x in (q, k, v, g, b))
    w = b if w is None else w.contiguous()
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if N * HV == 0:
        return
    BK, BV, num_warps = decode_tiles(K, V)
    pool = state_indices is not None
    n_idx = state_indices.shape[1] if pool else 1
    _delta_recurrent_fwd_kernel[(N * HV * cdiv(V, BV),)](
        q, k, v, g, b, w, state, out, final_state, cu_seqlens, scale, T,
        A_log, dt_bias, state_indices, num_accepted_tokens, lower_bound,
        state.shape[0] if state is not None else 0, state.stride(0) if state is not None else 0,
        state_indices.stride(0) if pool else 0, n_idx,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, **_flags(g, b, w), IS_VARLEN=cu_seqlens is not None,
        USE_INITIAL_STATE=state is not None, STORE_FINAL_STATE=final_state is not None,
        GATE_ACT=gate_act if g is not None else 0, HAS_A=A_log is not None, HAS_DT=dt_bias is not None,
        BETA_ACT=beta_act, L2NORM=l2norm, V_FIRST=state_v_first, POOL=pool,
        SPEC=num_accepted_tokens is not None, PER_TOKEN=inplace and pool and n_idx > 1, INPLACE=inplace,
        num_warps=num_warps, num_stages=1, enable_fp_fusion=fp_fusion())


# ----------------------------------------------------------------------------------------------
# static report: default configurations compiled ahead of time (lamina info --kernels)
# ----------------------------------------------------------------------------------------------
# the decode options off (the differentiable token-by-token forward)
_TRAINING_FLAGS = {"GATE_ACT": 0, "HAS_A": False, "HAS_DT": False, "BETA_ACT": 0, "L2NORM": False, "V_FIRST": False,
                   "POOL": False, "SPEC": False, "PER_TOKEN": False, "INPLACE": False}
_RUNTIME_SIG = {"lower_bound": "fp32", "n_slots": "i32", "slot_stride": "i32", "idx_stride": "i32", "n_idx": "i32"}


# (K, V) of the registered shapes: the common 128 and the widest fla supports.
_AOT_DIMS = ((128, 128), (256, 256))


def training_spec(variant: str, K: int, V: int, l2norm: str = "", archs: list[int] | None = None) -> AotSpec:
    """The static report's row of the token-by-token training forward (``delta_recurrent_fwd``), bf16; with
    ``l2norm`` (the row's suffix) the rows normalised in the kernel, a non-default row for ``archs``
    (kernels/delta_report.py)."""
    io = "*bf16"
    decay, erase, write = VARIANT_FLAGS[variant]
    g_ty = "constexpr" if decay == DecayKind.NONE else "*fp32"
    BKr = max(next_power_of_2(K), MIN_BLOCK)
    BVr = max(MIN_BLOCK, min(next_power_of_2(V), STATE_TILE_ELEMS // BKr))
    rec_c = {"H": 4, "HV": 4, "K": K, "V": V, "IS_VARLEN": False, "BK": BKr, "BV": BVr, "DECAY": decay,
             "ERASE": erase, "WRITE": write, "USE_INITIAL_STATE": True, "STORE_FINAL_STATE": True,
             "cu_seqlens": None, "A_log": None, "dt_bias": None, "state_indices": None, "num_accepted": None,
             **_TRAINING_FLAGS, "L2NORM": bool(l2norm)}
    if decay == DecayKind.NONE:
        rec_c["g"] = None
    rec_sig = {"q": io, "k": io, "v": io, "g": g_ty, "b": io, "w": io, "h0": "*fp32", "o": io,
               "ht": "*fp32", "cu_seqlens": "constexpr", "scale": "fp32", "T": "i32", **_RUNTIME_SIG}
    rec_sig.update({c: "constexpr" for c in rec_c if c not in rec_sig})
    meta = {"attrs": aligned_attrs(_delta_recurrent_fwd_kernel, rec_sig)}
    if archs is not None:
        meta["archs"] = archs
    return AotSpec("delta_recurrent_fwd", f"{variant} bf16 K={K} V={V} BV={BVr}" + (f" {l2norm}" if l2norm else ""),
                   _delta_recurrent_fwd_kernel, rec_sig, rec_c, num_warps=4, num_stages=1, uses_dot=False,
                   default=not l2norm, meta=meta)


def _register_aot_specs() -> None:
    io = "*bf16"
    for variant in VARIANT_FLAGS:
        for K, V in _AOT_DIMS:
            register_aot(training_spec(variant, K, V))
    # the decode step as fla's layers call it: state pool in place, V-first states, gate, beta sigmoid
    # and l2norm fused, one token (GDN: scalar gate; KDA: per-channel gate)
    for variant in ("gdn", "kda"):
        decay, erase, write = VARIANT_FLAGS[variant]
        K = V = 128
        BK, BV, num_warps = decode_tiles(K, V)
        c = {"H": 16, "HV": 32, "K": K, "V": V, "BK": BK, "BV": BV, "DECAY": decay, "ERASE": erase,
             "WRITE": write, "IS_VARLEN": False, "USE_INITIAL_STATE": True, "STORE_FINAL_STATE": False,
             "GATE_ACT": 1, "HAS_A": True, "HAS_DT": True, "BETA_ACT": 1, "L2NORM": True, "V_FIRST": True,
             "POOL": True, "SPEC": False, "PER_TOKEN": False, "INPLACE": True, "ht": None, "cu_seqlens": None,
             "num_accepted": None}
        sig = {"q": io, "k": io, "v": io, "g": io, "b": io, "w": io, "h0": "*fp32", "o": io, "ht": "constexpr",
               "cu_seqlens": "constexpr", "scale": "fp32", "T": "i32", "A_log": "*fp32", "dt_bias": "*fp32",
               "state_indices": "*i32", "num_accepted": "constexpr", **_RUNTIME_SIG}
        sig.update({n: "constexpr" for n in c if n not in sig})
        register_aot(AotSpec("delta_decode_step", f"{variant} bf16 K={K} V={V} pool in place BV={BV}",
                             _delta_recurrent_fwd_kernel, sig, c, num_warps=num_warps, num_stages=1,
                             uses_dot=False, meta={"attrs": aligned_attrs(_delta_recurrent_fwd_kernel, sig)}))


_register_aot_specs()
