"""The decode step of the delta-rule family: in place, over a pool of states, forward only.

``fused_recurrent_*`` take this path whenever no gradient is needed; fla's decode keywords
(``inplace_final_state``, ``ssm_state_indices``, ``num_accepted_tokens``, ``out``) need it.
Every backend implements one contract, ``decode_step``:

Inputs (raw, before any transform; the transforms run inside the step):

* ``q, k [B, T, H, K]``, ``v [B, T, HV, V]`` (one float dtype), ``out [B, T, HV, V]`` (v's dtype,
  contiguous; written).
* ``g``: None | ``[B, T, HV]`` | ``[B, T, HV, K]``; with ``gate_act`` it is the raw gate input:
  ``GATE_SOFTPLUS``: ``-exp(A_log[h]) * softplus(g + dt_bias)``; ``GATE_LOWER_BOUND``:
  ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias))`` (``A_log`` None: factor 1).
  ``A_log [HV]``, ``dt_bias [HV]`` (scalar g) or ``[HV * K]`` (per-channel g), each optional.
* ``b``: ``[B, T, HV]`` or ``[B, T, HV, K]`` (erase strength); ``w``: None (``w = b``, one beta)
  or ``[B, T, HV]`` / ``[B, T, HV, V]`` (write strength). ``beta_act``: ``BETA_SIGMOID`` applies
  ``sigmoid`` to ``b`` (and so to ``w = b``), ``BETA_SIGMOID2`` ``2 * sigmoid``.
* ``l2norm``: q and k divided by ``sqrt(sum(x^2) + 1e-6)`` over K; then ``q *= scale``.
* ``state``: float32 pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` with ``state_v_first``), each slot
  contiguous (any slot stride). ``state_indices``: None (sequence n uses slot n, P >= N) or int
  ``[N, S]``. ``num_accepted_tokens``: None or int ``[N]`` (needs ``state_indices``).
* ``cu_seqlens``: None (N = B sequences of T tokens) or ``[N + 1]`` offsets (B == 1).

Per sequence n (tokens ``bos .. eos - 1``), per value head:

* read slot ``r = state_indices[n, a - 1]`` with ``a = num_accepted_tokens[n]`` (``a = 1``
  without it), ``r = n`` without ``state_indices``. ``r < 0`` or ``r >= P`` (or ``a`` outside
  ``1..S``): the sequence is *skipped*: its ``out`` rows are zero, no slot is read or written,
  ``final_state[n]`` (if given) is zero. Without ``state`` the sequence starts from zeros.
* each token: ``S <- diag(exp(g_t)) S``; ``r_t = S^T (b_t * k_t)``;
  ``S <- S + k_t (w_t * v_t - r_t)^T``; ``out_t = S^T (scale * q_t)`` (rows of K, columns of V).
* writes, with ``inplace``: ``S = 1``: the final S to slot ``r``; ``S > 1`` (speculative
  decoding): the S after token ``t`` of the sequence to slot ``state_indices[n, t]`` for every
  ``t < S`` whose slot is in ``0 .. P-1`` (others are not written). ``final_state [N, HV, ...]``
  (not None, a separate tensor) receives the final S of each sequence.

Backends: ``"torch"`` (PyTorch, vectorised over sequences and heads: ``_torch_step``),
``"triton"`` (``kernels/delta_recurrent_fwd.py``), ``"cuda"`` and ``"cpu-ext"`` (the C++ kernels
of ``lamina._C``: ``csrc/delta_decode*``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GATE_NONE, GATE_SOFTPLUS, GATE_LOWER_BOUND = 0, 1, 2
BETA_NONE, BETA_SIGMOID, BETA_SIGMOID2 = 0, 1, 2
L2NORM_EPS = 1e-6


def _per_sequence(x: torch.Tensor, cu_seqlens: torch.Tensor | None, lengths: list[int]) -> torch.Tensor:
    """``[B, T, ...]`` -> ``[N, Tmax, ...]`` (varlen packs gathered per sequence, zero padded)."""
    if cu_seqlens is None:
        return x
    tmax = max(lengths, default=0)
    out = x.new_zeros(len(lengths), tmax, *x.shape[2:])
    starts = cu_seqlens.tolist()
    for n, length in enumerate(lengths):
        out[n, :length] = x[0, starts[n]:starts[n] + length]
    return out


def _torch_step(q, k, v, g, b, w, A_log, dt_bias, state, state_indices, num_accepted_tokens, cu_seqlens, out,
                final_state, scale: float, lower_bound: float, gate_act: int, beta_act: int, l2norm: bool,
                state_v_first: bool, inplace: bool) -> None:
    """``decode_step`` in PyTorch (module docstring): a loop over token positions, vectorised over
    sequences and heads; float32 math (float64 for float64 inputs)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if cu_seqlens is None:
        N, lengths = B, [T] * B
    else:
        offsets = cu_seqlens.tolist()
        N, lengths = len(offsets) - 1, [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)]
    tmax = max(lengths, default=0)
    dev = q.device
    length_t = torch.tensor(lengths, device=dev)

    def seq(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else _per_sequence(x, cu_seqlens, lengths).to(acc)

    qs, ks, vs, gs, bs, ws = (seq(x) for x in (q, k, v, g, b, w))
    if HV != H:
        qs, ks = (x.repeat_interleave(HV // H, dim=2) for x in (qs, ks))
    if l2norm:
        qs, ks = (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS) for x in (qs, ks))
    qs = qs * scale
    if gs is not None and gate_act != GATE_NONE:
        shape = (1, 1, HV) + ((1,) if gs.dim() == 4 else ())
        x = gs if dt_bias is None else gs + dt_bias.to(acc).view(1, 1, *gs.shape[2:])
        a = None if A_log is None else A_log.to(acc).view(shape)
        if gate_act == GATE_SOFTPLUS:
            gs = -a.exp() * F.softplus(x)
        else:
            gs = lower_bound * torch.sigmoid(x if a is None else a.exp() * x)
    if beta_act != BETA_NONE:
        bs = torch.sigmoid(bs) * (2.0 if beta_act == BETA_SIGMOID2 else 1.0)
    if ws is None:
        ws = bs
    if bs.dim() == 3:
        bs = bs[..., None]
    if ws.dim() == 3:
        ws = ws[..., None]

    # read slots and which sequences run
    P = 0 if state is None else state.shape[0]
    if state_indices is None:
        slot = torch.arange(N, device=dev)
        active = slot < P if state is not None else torch.ones(N, dtype=torch.bool, device=dev)
    else:
        Sidx = state_indices.shape[1]
        a = (torch.ones(N, dtype=torch.long, device=dev) if num_accepted_tokens is None
             else num_accepted_tokens.long())
        a_ok = (a >= 1) & (a <= Sidx)
        slot = state_indices.long().gather(1, (a.clamp(1, Sidx) - 1)[:, None])[:, 0]
        active = a_ok & (slot >= 0) & (slot < P)
    if state is None:
        S = torch.zeros(N, HV, K, V, dtype=acc, device=dev)
    else:
        S = state[slot.clamp(0, max(P - 1, 0))].to(acc)
        if state_v_first:
            S = S.transpose(-1, -2)
        S = torch.where(active[:, None, None, None], S, torch.zeros_like(S))
    per_token = inplace and state_indices is not None and state_indices.shape[1] > 1
    o = torch.zeros(N, tmax, HV, V, dtype=acc, device=dev)
    for t in range(tmax):
        live = (t < length_t) & active
        m = live[:, None, None, None]
        if gs is not None:
            decay = gs[:, t].exp()
            S_dec = S * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        else:
            S_dec = S
        kt = ks[:, t]
        r = torch.einsum("nhk,nhkv->nhv", kt * bs[:, t], S_dec)
        S_new = S_dec + kt[..., None] * (vs[:, t] * ws[:, t] - r)[..., None, :]
        S = torch.where(m, S_new, S)
        o[:, t] = torch.where(live[:, None, None], torch.einsum("nhk,nhkv->nhv", qs[:, t], S), 0.0)
        if per_token and t < state_indices.shape[1]:
            dst = state_indices[:, t].long()
            ok = live & (dst >= 0) & (dst < P)
            if bool(ok.any()):
                St = S[ok].transpose(-1, -2) if state_v_first else S[ok]
                state[dst[ok]] = St.to(state.dtype)
    if inplace and not per_token and state is not None and bool(active.any()):
        St = S[active].transpose(-1, -2) if state_v_first else S[active]
        state[slot[active]] = St.to(state.dtype)
    if final_state is not None:
        St = S.transpose(-1, -2) if state_v_first else S
        final_state.copy_(torch.where(active[:, None, None, None], St, torch.zeros_like(St)).to(final_state.dtype))
    if cu_seqlens is None:
        out.copy_(o.to(out.dtype))
    else:
        offsets = cu_seqlens.tolist()
        for n, length in enumerate(lengths):
            out[0, offsets[n]:offsets[n] + length] = o[n, :length].to(out.dtype)


def _ext_step(*args) -> None:
    from lamina.ops.delta_decode_ext import ext_step

    ext_step(*args)


def _triton_step(*args) -> None:
    from lamina.kernels.delta_recurrent_fwd import delta_decode_step

    delta_decode_step(*args)


_STEPS = {"torch": _torch_step, "triton": _triton_step, "cuda": _ext_step, "cpu-ext": _ext_step}


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    b: torch.Tensor,
    w: torch.Tensor | None,
    *,
    scale: float,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    final_state: torch.Tensor | None = None,
    lower_bound: float = 0.0,
    gate_act: int = GATE_NONE,
    beta_act: int = BETA_NONE,
    l2norm: bool = False,
    state_v_first: bool = False,
    inplace: bool = False,
    backend: str = "torch",
) -> torch.Tensor:
    """Run ``decode_step`` (module docstring) on already validated inputs with a resolved backend
    ("torch", "triton", "cuda" or "cpu-ext"); ``state_indices`` is 2-d or None. Returns ``out``."""
    if out is None:
        out = torch.empty_like(v)
    _STEPS[backend](q, k, v, g, b, w, A_log, dt_bias, state, state_indices, num_accepted_tokens, cu_seqlens, out,
                    final_state, float(scale), float(lower_bound), int(gate_act), int(beta_act), bool(l2norm),
                    bool(state_v_first), bool(inplace))
    return out
