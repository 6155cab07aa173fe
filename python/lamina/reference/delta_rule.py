"""Naive PyTorch references for the delta-rule family (DeltaNet, Gated DeltaNet, KDA, GDN-2).

Per sequence and value head the state ``S`` is ``[K, V]``. For each token ``t``::

    S   <- Diag(exp(g_t)) S          # g_t: absent, scalar per head, or per K channel
    r_t  = S^T (b_t * k_t)           # erase gate b_t: scalar or per K channel
    S   <- S + k_t (w_t * v_t - r_t)^T   # write gate w_t: scalar or per V channel
    o_t  = S^T (scale * q_t)

Two naive implementations of the same map, written to be checked by eye against the papers:

* ``delta_rule_family_recurrent_ref``: the token loop above, the ground truth.
* ``delta_rule_family_chunk_ref``: the chunked WY/UT form in plain matrices, one sequence and
  chunk at a time (value heads as a batch dimension). It checks the chunked algebra the kernels
  implement against the token loop. Every decay factor it forms is ``exp(x)`` with ``x <= 0``
  (for ``g <= 0``).

Neither is a fast path: the ops' PyTorch path is ``lamina.ops.delta_rule_cpu`` (vectorised, tested
against these).

Both compute in float64 when any input is float64, else in float32; outputs take
``v.dtype`` and final states the compute dtype.
"""

from __future__ import annotations

import math

import torch

from lamina._validate import check_cu_seqlens, check_shape, check_tensor

# fla's default chunk length, also the ops' default.
DEFAULT_CHUNK_SIZE = 64


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_gate(name: str, x: torch.Tensor | None, lead: tuple[int, int, int], width: int, what: str) -> None:
    """A gate is ``[B, T, HV]`` (scalar per head) or ``[B, T, HV, width]`` (per channel)."""
    if x is None:
        return
    check_tensor(name, x)
    if tuple(x.shape) not in (lead, (*lead, width)):
        raise ValueError(f"{name} must have shape {lead} or {(*lead, width)} ({what}), got {tuple(x.shape)}")


def _validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    erase: torch.Tensor | None,
    write: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> int:
    """Shape checks shared by both references; returns N, the number of sequences."""
    check_tensor("q", q, ndim=4)
    check_tensor("k", k, ndim=4)
    check_tensor("v", v, ndim=4)
    check_shape("k", k, q.shape, "same as q")
    B, T, H, K = q.shape
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must have batch and length {(B, T)} like q, got shape {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"v's head count must be a multiple of q's ({H}), got {HV}")
    lead = (B, T, HV)
    _check_gate("g", g, lead, K, "log decay per head or per K channel")
    _check_gate("erase", erase, lead, K, "erase gate per head or per K channel")
    _check_gate("write", write, lead, V, "write gate per head or per V channel")
    N = check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        check_tensor("initial_state", initial_state)
        check_shape("initial_state", initial_state, (N, HV, K, V), "[N, HV, K, V]")
    return N


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    erase: torch.Tensor | None,
    write: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    scale: float | None,
    N: int,
) -> tuple[torch.Tensor, ...]:
    """Cast to the compute dtype and bring everything to value heads.

    Returns ``q * scale, k, z = w * v, e = b * k`` as ``[B, T, HV, K|V]``, the log decay as
    ``[B, T, HV, 1|K]`` or None, and the initial state ``[N, HV, K, V]``.
    """
    dtype = _compute_dtype(q, k, v, g, erase, write, initial_state)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K**-0.5
    group = HV // H
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    q, k = q.to(dtype) * scale, k.to(dtype)
    v = v.to(dtype)
    per_head = lambda x: None if x is None else (x.to(dtype) if x.dim() == 4 else x.to(dtype).unsqueeze(-1))
    g, erase, write = per_head(g), per_head(erase), per_head(write)
    e = k if erase is None else erase * k
    z = v if write is None else write * v
    if initial_state is None:
        h0 = torch.zeros(N, HV, K, V, dtype=dtype, device=q.device)
    else:
        h0 = initial_state.to(dtype)
    return q, k, z, e, g, h0


# ------------------------------------------------------------------------------------------
# Token loop
# ------------------------------------------------------------------------------------------


def _scan(
    q: torch.Tensor,
    k: torch.Tensor,
    z: torch.Tensor,
    e: torch.Tensor,
    g: torch.Tensor | None,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token loop over ``[b, L, HV, *]`` inputs from ``state [b, HV, K, V]``: outputs, final state, writes."""
    outputs, writes = [], []
    for t in range(q.shape[1]):
        if g is not None:
            state = state * g[:, t].exp().unsqueeze(-1)
        read = torch.einsum("bhk,bhkv->bhv", e[:, t], state)
        writes.append(z[:, t] - read)
        state = state + k[:, t].unsqueeze(-1) * writes[-1].unsqueeze(-2)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    if not outputs:
        return z.new_zeros(z.shape), state, z.new_zeros(z.shape)
    return torch.stack(outputs, dim=1), state, torch.stack(writes, dim=1)


def delta_rule_family_recurrent_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    erase: torch.Tensor | None = None,
    write: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    output_writes: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Token-by-token reference of the whole delta-rule family.

    Args:
        q: [B, T, H, K] queries.
        k: [B, T, H, K] keys.
        v: [B, T, HV, V] values, ``HV % H == 0``; value head j reads q/k head ``j // (HV // H)``.
        g: None (no decay), [B, T, HV] (log decay per head) or [B, T, HV, K] (per K channel).
        erase: None (1), [B, T, HV] or [B, T, HV, K]: the gate b of the read ``S^T (b * k)``.
        write: None (1), [B, T, HV] or [B, T, HV, V]: the gate w of the written value ``w * v``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: [N, HV, K, V], N = B, or the number of sequences with ``cu_seqlens``.
        output_final_state: return the final states.
        cu_seqlens: [N + 1] int offsets of packed sequences (B == 1).
        output_writes: also return what each token writes, ``w_t * v_t - (D_t S_{t-1})^T (b_t k_t)``.

    Returns:
        o: [B, T, HV, V] in ``v.dtype``; final_state: [N, HV, K, V] in the compute dtype
        (float64 if any input is float64, else float32), or None; with ``output_writes`` a third
        item, the writes [B, T, HV, V] in ``v.dtype``.
    """
    N = _validate(q, k, v, g, erase, write, initial_state, cu_seqlens)
    q, k, z, e, g, h0 = _prepare(q, k, v, g, erase, write, initial_state, scale, N)
    if cu_seqlens is None:
        o, final, writes = _scan(q, k, z, e, g, h0)
    else:
        offsets = cu_seqlens.tolist()
        pieces, finals, written = [], [], []
        for n in range(N):
            span = slice(offsets[n], offsets[n + 1])
            o_n, s_n, w_n = _scan(q[:, span], k[:, span], z[:, span], e[:, span],
                                  None if g is None else g[:, span], h0[n : n + 1])
            pieces.append(o_n)
            finals.append(s_n)
            written.append(w_n)
        o, final, writes = torch.cat(pieces, dim=1), torch.cat(finals, dim=0), torch.cat(written, dim=1)
    extra = (writes.to(v.dtype),) if output_writes else ()
    return (o.to(v.dtype), (final if output_final_state else None), *extra)


# ------------------------------------------------------------------------------------------
# Chunked WY/UT form
# ------------------------------------------------------------------------------------------


def _decayed_scores(x: torch.Tensor, y: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``P[h, i, j] = sum_c x[h, i, c] y[h, j, c] exp(G[h, i, c] - G[h, j, c])`` for ``i >= j``, 0 above.

    ``x``, ``y``: [HV, C, K]; ``G``: [HV, C, 1] or [HV, C, K], the in-chunk cumulative log decay.
    The exponent is set to -inf above the diagonal before ``exp``, so every decay formed is ``exp(<= 0)``.
    """
    C = x.shape[1]
    exponent = G[:, :, None, :] - G[:, None, :, :]  # [HV, C, C, 1|K]
    lower = torch.ones(C, C, dtype=torch.bool, device=x.device).tril()
    decay = exponent.masked_fill(~lower[:, :, None], -math.inf).exp()
    return (x[:, :, None, :] * y[:, None, :, :] * decay).sum(dim=-1)


def _chunk_step(
    q: torch.Tensor, k: torch.Tensor, z: torch.Tensor, e: torch.Tensor, g: torch.Tensor, S: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of one sequence, every value head at once, from the incoming state ``S [HV, K, V]``.

    ``q`` (scaled), ``k``, ``e = b * k``: [HV, C, K]; ``z = w * v``: [HV, C, V]; ``g``: [HV, C, 1|K]
    log decay. Returns the chunk's outputs [HV, C, V] and the outgoing state [HV, K, V].
    """
    C = q.shape[1]
    G = g.cumsum(dim=1)
    gamma = G.exp()
    G_last = G[:, -1:]  # [HV, 1, 1|K]
    # WY/UT transform: A = (I + strictly lower part of the decayed E K^T)^-1.
    A = torch.linalg.inv(torch.eye(C, dtype=q.dtype, device=q.device) + _decayed_scores(e, k, G).tril(-1))
    Y = A @ (e * gamma)
    U = A @ z
    v_new = U - Y @ S
    o = (q * gamma) @ S + _decayed_scores(q, k, G) @ v_new
    S = G_last.exp().transpose(1, 2) * S + (k * (G_last - G).exp()).transpose(1, 2) @ v_new
    return o, S


def _chunk_scan(
    q: torch.Tensor, k: torch.Tensor, z: torch.Tensor, e: torch.Tensor, g: torch.Tensor, S: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunk after chunk: ``[L, HV, *]`` inputs, state ``S [HV, K, V]``; o is [L, HV, V]."""
    outputs = []
    for start in range(0, q.shape[0], chunk_size):
        piece = slice(start, start + chunk_size)
        heads_first = [x[piece].transpose(0, 1) for x in (q, k, z, e, g)]  # [HV, C, *]
        o, S = _chunk_step(*heads_first, S)
        outputs.append(o.transpose(0, 1))
    if not outputs:
        return z.new_zeros(z.shape), S
    return torch.cat(outputs, dim=0), S


def delta_rule_family_chunk_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    erase: torch.Tensor | None = None,
    write: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked (WY/UT) reference of the delta-rule family; same arguments and results as
    ``delta_rule_family_recurrent_ref`` plus ``chunk_size``. Plain loops over sequences and chunks
    (value heads batched); differentiable.

    Args:
        q: [B, T, H, K]; k: [B, T, H, K]; v: [B, T, HV, V].
        g: None, [B, T, HV] or [B, T, HV, K] log decay. erase: None, [B, T, HV] or [B, T, HV, K].
        write: None, [B, T, HV] or [B, T, HV, V]. initial_state: [N, HV, K, V].
        cu_seqlens: [N + 1] offsets (B == 1); sequences never share a chunk.
        chunk_size: tokens per chunk C (any positive int; T need not be a multiple).

    Per chunk, with G the in-chunk cumulative log decay (0 without decay) and ``S`` the incoming state::

        A = (I + tril(E_bar K_bar^T, -1))^-1,  E_bar_i = b_i k_i exp(G_i), K_bar_j = k_j exp(-G_j)
        Y = A E_bar,  U = A (w * v),  V_new = U - Y S
        O = Q exp(G) S + tril(Q K^T with pairwise decay exp(G_i - G_j)) V_new
        S <- exp(G_C) S + (K exp(G_C - G))^T V_new

    where ``E_bar K_bar^T`` is formed from the pairwise decays, never from ``exp(-G)``.

    Returns:
        o: [B, T, HV, V] in ``v.dtype``; final_state: [N, HV, K, V] in the compute dtype, or None.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    N = _validate(q, k, v, g, erase, write, initial_state, cu_seqlens)
    B, T, HV, V = v.shape
    out_dtype = v.dtype
    q, k, z, e, g, h0 = _prepare(q, k, v, g, erase, write, initial_state, scale, N)
    if g is None:
        g = z.new_zeros(B, T, HV, 1)  # no decay: log decay 0
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        offsets = cu_seqlens.tolist()
        spans = [(0, offsets[n], offsets[n + 1]) for n in range(N)]
    outputs, finals = [], []
    for n, (b, bos, eos) in enumerate(spans):
        o_n, s_n = _chunk_scan(q[b, bos:eos], k[b, bos:eos], z[b, bos:eos], e[b, bos:eos], g[b, bos:eos],
                               h0[n], chunk_size)
        outputs.append(o_n)  # [L, HV, V]
        finals.append(s_n)  # [HV, K, V]
    if not spans:
        o = z.new_zeros(B, T, HV, V)
    elif cu_seqlens is None:
        o = torch.stack(outputs, dim=0)
    else:
        o = torch.cat(outputs, dim=0).unsqueeze(0)
    final = torch.stack(finals, dim=0) if spans else h0
    return o.to(out_dtype), (final if output_final_state else None)


# ------------------------------------------------------------------------------------------
# Named variants (fla argument order)
# ------------------------------------------------------------------------------------------


def _family(chunked: bool):
    return delta_rule_family_chunk_ref if chunked else delta_rule_family_recurrent_ref


def _check_ndim(name: str, x: torch.Tensor, ndim: int, what: str) -> None:
    check_tensor(name, x)
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {what}, got shape {tuple(x.shape)}")


def delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeltaNet: no decay, erase = write = beta.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; beta: [B, T, HV]; initial_state: [N, HV, K, V].
    Returns o [B, T, HV, V] and the final state [N, HV, K, V] (or None).
    ``chunked`` selects the chunked form instead of the token loop.
    """
    _check_ndim("beta", beta, 3, "[B, T, HV]")
    return _family(chunked)(q, k, v, None, beta, beta, scale, initial_state, output_final_state, cu_seqlens)


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet: log decay per head, erase = write = beta.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV]; beta: [B, T, HV];
    initial_state: [N, HV, K, V]. Returns o [B, T, HV, V] and the final state (or None).
    """
    _check_ndim("g", g, 3, "[B, T, HV] (one log decay per head)")
    _check_ndim("beta", beta, 3, "[B, T, HV]")
    return _family(chunked)(q, k, v, g, beta, beta, scale, initial_state, output_final_state, cu_seqlens)


def kda_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention: log decay per K channel, erase = write = beta.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV];
    initial_state: [N, HV, K, V]. Returns o [B, T, HV, V] and the final state (or None).
    """
    _check_ndim("g", g, 4, "[B, T, HV, K] (log decay per K channel)")
    _check_ndim("beta", beta, 3, "[B, T, HV]")
    return _family(chunked)(q, k, v, g, beta, beta, scale, initial_state, output_final_state, cu_seqlens)


def gdn2_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet-2: log decay per K channel, erase gate b per K channel, write gate w per V channel.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; b: [B, T, HV, K] (or [B, T, HV]);
    w: [B, T, HV, V] (or [B, T, HV]); initial_state: [N, HV, K, V].
    Returns o [B, T, HV, V] and the final state (or None).
    """
    _check_ndim("g", g, 4, "[B, T, HV, K] (log decay per K channel)")
    return _family(chunked)(q, k, v, g, b, w, scale, initial_state, output_final_state, cu_seqlens)
