"""The chunked delta-rule backward, on paper: float64 PyTorch transcriptions checked against autograd.

Shared by the kernel tests (tests/test_delta_bwd.py, tests/test_delta_bwd_gpu.py):

* ``recurrent_ref``: the token-by-token recurrence in float64 (DESIGN.md, "The delta-rule family"),
  which also records the chunk-start states ``h`` the forward hands to the backward.
* ``chunk_inverse`` / ``chunk_inverses``: a chunk's ``A = (I + M)^-1``, and all of them laid out as the
  forward stores them for the backward.
* ``chunk_forward``: one chunk as closed-form matrix equations (A, U, O, S_C).
* ``chunk_backward``: the hand-derived gradients of ``chunk_forward`` that the Triton kernels implement
  (kernels/delta_chunk_bwd.py module docstring).

The tests here need no Triton: they check that the chunk equations reproduce the recurrence and that
the hand-derived gradients equal autograd's, for every decay, erase and write kind.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close

F64 = torch.float64


def make_inputs(B, T, H, HV, K, V, decay, erase, write, dtype=torch.float32, device="cpu",
                gate_scale=1.0, beta_lo=0.0, beta_hi=1.0, generator=None):
    """Random inputs of the family. decay: 0 none, 1 scalar, 2 per-K; erase/write: 0 scalar, 1 per-channel.

    q, k are L2-normalised as the layers feed them; gates are float32 like fla's; b, w in ``dtype``.
    """
    kw = dict(device=device, generator=generator)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, **kw), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, **kw), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, **kw).to(dtype)
    g = None
    if decay == 1:
        g = -gate_scale * torch.rand(B, T, HV, **kw)
    elif decay == 2:
        g = -gate_scale * torch.rand(B, T, HV, K, **kw)
    b = beta_lo + (beta_hi - beta_lo) * torch.rand(*((B, T, HV, K) if erase else (B, T, HV)), **kw)
    w = beta_lo + (beta_hi - beta_lo) * torch.rand(*((B, T, HV, V) if write else (B, T, HV)), **kw)
    return q, k, v, g, b.to(dtype), w.to(dtype)


def _sequences(B, T, cu_seqlens):
    if cu_seqlens is None:
        return [(i, 0, T) for i in range(B)]
    offs = cu_seqlens.tolist()
    return [(0, offs[n], offs[n + 1]) for n in range(len(offs) - 1)]


def recurrent_ref(q, k, v, g, b, w, scale, initial_state=None, cu_seqlens=None, chunk_size=None):
    """Token loop in float64. Returns ``(o [B, T, HV, V], final [N, HV, K, V], h)``; ``h`` is the list of
    states before each chunk of ``chunk_size`` tokens (per sequence, in order), or None."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    rep = HV // H
    q, k = (x.to(F64).repeat_interleave(rep, dim=2) for x in (q, k))
    v = v.to(F64)
    g = None if g is None else g.to(F64)
    b = torch.ones(B, T, HV, dtype=F64, device=q.device) if b is None else b.to(F64)
    w = torch.ones(B, T, HV, dtype=F64, device=q.device) if w is None else w.to(F64)
    outs, finals, states = [], [], []
    for n, (i_b, bos, eos) in enumerate(_sequences(B, T, cu_seqlens)):
        S = torch.zeros(HV, K, V, dtype=F64, device=q.device)
        if initial_state is not None:
            S = S + initial_state[n].to(F64)
        rows = []
        for t in range(bos, eos):
            if chunk_size is not None and (t - bos) % chunk_size == 0:
                states.append(S.detach().clone())
            if g is not None:
                gt = g[i_b, t]
                S = S * torch.exp(gt)[..., None] if gt.dim() == 2 else S * torch.exp(gt)[:, None, None]
            bt, wt = b[i_b, t], w[i_b, t]
            e = k[i_b, t] * (bt if bt.dim() == 2 else bt[:, None])
            z = v[i_b, t] * (wt if wt.dim() == 2 else wt[:, None])
            r = torch.einsum("hkv,hk->hv", S, e)
            S = S + k[i_b, t][..., None] * (z - r)[:, None, :]
            rows.append(torch.einsum("hkv,hk->hv", S, scale * q[i_b, t]))
        outs.append(torch.stack(rows) if rows else v.new_zeros(0, HV, V))
        finals.append(S)
    # dense: one [T, HV, V] block per batch row; varlen: the sequences concatenated along T (B == 1)
    o = torch.stack(outs) if cu_seqlens is None else torch.cat(outs)[None]
    h = torch.stack(states) if chunk_size is not None and states else None
    return o, torch.stack(finals), h


def chunk_start_states(q, k, v, g, b, w, scale, initial_state, cu_seqlens, chunk_size):
    """``h`` as the forward stores it: float32 ``[total_chunks, HV, K, V]``, state before each chunk."""
    with torch.no_grad():
        _, _, h = recurrent_ref(q, k, v, g, b, w, scale, initial_state, cu_seqlens, chunk_size)
    return h.float()


# ------------------------------------------------------------------------------------------------
# one chunk as matrix equations (rows = tokens of the chunk, one value head)
# ------------------------------------------------------------------------------------------------

def _expand(x, width):
    """Scalar gates [C] -> [C, width]; per-channel gates pass through."""
    return x[:, None].expand(-1, width) if x.dim() == 1 else x


def chunk_inverse(k, g, b):
    """``A = (I + M)^-1`` of one chunk, ``M_ij = sum_c b_ic k_ic k_jc exp(G_ic - G_jc)`` for ``j < i``
    (k [C, K], g [C] / [C, K] / None, b [C] / [C, K]; ``G`` the cumulative sum of ``g``)."""
    C, K = k.shape
    G = torch.zeros(C, K, dtype=k.dtype, device=k.device) if g is None else torch.cumsum(_expand(g, K), 0)
    gate = torch.exp(G[:, None, :] - G[None, :, :])  # [i, j, c]; only j < i is used
    M = torch.tril(torch.einsum("ic,jc,ijc->ij", k * _expand(b, K), k, gate), -1)
    return torch.linalg.inv(torch.eye(C, dtype=k.dtype, device=k.device) + M)


def chunk_inverses(k, g, b, HV, cu_seqlens, chunk_size):
    """``A`` laid out as the forward stores it for the backward, ``[B, T, HV, chunk_size]`` (float64; the
    kernels' is float32), each chunk's ``chunk_inverse`` in the rows of its tokens (columns past a short last
    chunk are 0). ``b`` None: 1."""
    B, T, H, _ = k.shape
    A = torch.zeros(B, T, HV, chunk_size, dtype=F64, device=k.device)
    for i_b, bos, eos in _sequences(B, T, cu_seqlens):
        for t0 in range(bos, eos, chunk_size):
            t1 = min(t0 + chunk_size, eos)
            for hv in range(HV):
                k_c = k[i_b, t0:t1, hv // (HV // H)].to(F64)
                b_c = k_c.new_ones(t1 - t0) if b is None else b[i_b, t0:t1, hv].to(F64)
                g_c = None if g is None else g[i_b, t0:t1, hv].to(F64)
                A[i_b, t0:t1, hv, :t1 - t0] = chunk_inverse(k_c, g_c, b_c)
    return A


def chunk_forward(q, k, v, g, b, w, scale, S0):
    """q, k [C, K], v [C, V], g [C] / [C, K] / None, b [C] / [C, K], w [C] / [C, V], S0 [K, V] -> (O, S_C)."""
    C, K = q.shape
    V = v.shape[1]
    G = torch.zeros(C, K, dtype=q.dtype) if g is None else torch.cumsum(_expand(g, K), 0)
    E, Z = k * _expand(b, K), v * _expand(w, V)
    gate = torch.exp(G[:, None, :] - G[None, :, :])  # [i, j, c]; only j <= i is used
    P = torch.tril(scale * torch.einsum("ic,jc,ijc->ij", q, k, gate))
    A = chunk_inverse(k, g, b)
    U = A @ (Z - (E * torch.exp(G)) @ S0)
    O = (scale * q * torch.exp(G)) @ S0 + P @ U
    S_C = torch.exp(G[-1])[:, None] * S0 + (k * torch.exp(G[-1] - G)).T @ U
    return O, S_C


def chunk_backward(q, k, v, g, b, w, scale, S0, dO, dH):
    """The hand-derived gradients of ``chunk_forward``: (dq, dk, dv, dg, db, dw, dS0)."""
    C, K = q.shape
    V = v.shape[1]
    G = torch.zeros(C, K, dtype=q.dtype) if g is None else torch.cumsum(_expand(g, K), 0)
    bK, wV = _expand(b, K), _expand(w, V)
    E, Z = k * bK, v * wV
    gamma, tail = torch.exp(G), torch.exp(G[-1] - G)
    gate = torch.exp(G[:, None, :] - G[None, :, :])
    P = torch.tril(scale * torch.einsum("ic,jc,ijc->ij", q, k, gate))
    A = chunk_inverse(k, g, b)
    Qg, Eb, Kt = scale * q * gamma, E * gamma, k * tail
    U = A @ (Z - Eb @ S0)
    dU = P.T @ dO + Kt @ dH
    dR = A.T @ dU
    dS0 = gamma[-1][:, None] * dH + Qg.T @ dO - Eb.T @ dR
    dP = torch.tril(dO @ U.T) * scale
    dM = -torch.tril(dR @ U.T, -1)
    lowgate = torch.tril(torch.ones(C, C, dtype=q.dtype))[:, :, None] * gate
    dq = scale * gamma * (dO @ S0.T) + torch.einsum("ij,jc,ijc->ic", dP, k, lowgate)
    de = -gamma * (dR @ S0.T) + torch.einsum("ij,jc,ijc->ic", dM, k, lowgate)
    dk_tail = tail * (U @ dH.T)
    dk_gate = dk_tail + torch.einsum("ij,ic,ijc->jc", dP, q, lowgate) + torch.einsum("ij,ic,ijc->jc", dM, E, lowgate)
    dk = dk_gate + bK * de
    db = k * de if b.dim() == 2 else (k * de).sum(1)
    dv = wV * dR
    dw = v * dR if w.dim() == 2 else (v * dR).sum(1)
    dg = None
    if g is not None:
        dG = q * dq + E * de - k * dk_gate
        dG[-1] += (k * dk_tail).sum(0) + gamma[-1] * (dH * S0).sum(1)
        dg = torch.flip(torch.cumsum(torch.flip(dG, [0]), 0), [0])
        if g.dim() == 1:
            dg = dg.sum(1)
    return dq, dk, dv, dg, db, dw, dS0


def _chunk_case(C, K, V, decay, erase, write, gate_scale=1.0, generator=None):
    q, k, v, g, b, w = make_inputs(1, C, 1, 1, K, V, decay, erase, write, dtype=F64, gate_scale=gate_scale,
                                   generator=generator)
    pick = (lambda x: None if x is None else x[0, :, 0].to(F64))
    S0 = torch.randn(K, V, dtype=F64, generator=generator)
    return pick(q), pick(k), pick(v), pick(g), pick(b), pick(w), S0


KINDS = [(0, 0, 0), (1, 0, 0), (2, 0, 0), (2, 1, 1), (1, 1, 0), (0, 0, 1)]


@pytest.mark.parametrize("decay,erase,write", KINDS)
def test_chunk_forward_matches_recurrence(decay, erase, write):
    C, K, V, scale = 12, 6, 5, 0.7
    q, k, v, g, b, w, S0 = _chunk_case(C, K, V, decay, erase, write, gate_scale=3.0)
    O, S_C = chunk_forward(q, k, v, g, b, w, scale, S0)
    up = (lambda x: None if x is None else x[None, :, None])
    o_ref, s_ref, _ = recurrent_ref(up(q), up(k), up(v), up(g), up(b), up(w), scale, S0[None, None])
    assert_close("O", O, o_ref[0, :, 0], dtype=F64)
    assert_close("S_C", S_C, s_ref[0, 0], dtype=F64)


@pytest.mark.parametrize("decay,erase,write", KINDS)
def test_chunk_backward_matches_autograd(decay, erase, write):
    C, K, V, scale = 12, 6, 5, 0.7
    inputs = _chunk_case(C, K, V, decay, erase, write, gate_scale=3.0)
    leaves = [None if x is None else x.clone().requires_grad_() for x in inputs]
    q, k, v, g, b, w, S0 = leaves
    dO, dH = torch.randn(C, V, dtype=F64), torch.randn(K, V, dtype=F64)
    O, S_C = chunk_forward(q, k, v, g, b, w, scale, S0)
    torch.autograd.backward([O, S_C], [dO, dH])
    mine = chunk_backward(*inputs[:6], scale, inputs[6], dO, dH)
    names = ["dq", "dk", "dv", "dg", "db", "dw", "dS0"]
    for name, got, leaf in zip(names, mine, leaves):
        if leaf is None:
            assert got is None, name
            continue
        assert_close(name, got, leaf.grad, dtype=F64)
