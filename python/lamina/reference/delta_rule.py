"""Naive PyTorch references for the delta-rule family (DeltaNet, Gated DeltaNet, KDA, GDN-2).

Per sequence and value head the state ``S`` is ``[K, V]``. For each token ``t``::

    S   <- Diag(exp(g_t)) S          # g_t: absent, scalar per head, or per K channel
    r_t  = S^T (b_t * k_t)           # erase gate b_t: scalar or per K channel
    S   <- S + k_t (w_t * v_t - r_t)^T   # write gate w_t: scalar or per V channel
    o_t  = S^T (scale * q_t)

Two implementations of the same map:

* ``delta_rule_family_recurrent_ref``: the token loop above, the ground truth.
* ``delta_rule_family_chunk_ref``: the chunked WY/UT form, vectorised over sequences,
  heads and chunks, with a sequential pass over chunk states only. It is differentiable
  and is the default CPU path of the ops. Every decay factor it forms is ``exp(x)`` with
  ``x <= 0`` (for ``g <= 0``), so channel-wise decay cannot overflow.

Both compute in float64 when any input is float64, else in float32; outputs take
``v.dtype`` and final states the compute dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange

from lamina._validate import check_cu_seqlens, check_shape, check_tensor

# fla's default chunk length; the ops use the same, so the CPU path matches the kernels' blocking.
DEFAULT_CHUNK_SIZE = 64
# Elements per [chunks, C, K] temporary in the channel-decay scores (512 KB in float32): keeps the
# dozen temporaries of a group in a 2 MB L2. Groups of 32 chunk-heads at C = K = 64 cut that step
# from ~40 ms to ~24 ms (one thread, T = 4096, H = 4) against one pass over all chunks.
CACHE_BLOCK_ELEMENTS = 1 << 17


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token loop over ``[b, L, HV, *]`` inputs from ``state [b, HV, K, V]``."""
    outputs = []
    for t in range(q.shape[1]):
        if g is not None:
            state = state * g[:, t].exp().unsqueeze(-1)
        read = torch.einsum("bhk,bhkv->bhv", e[:, t], state)
        state = state + k[:, t].unsqueeze(-1) * (z[:, t] - read).unsqueeze(-2)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    if not outputs:
        return z.new_zeros(z.shape), state
    return torch.stack(outputs, dim=1), state


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
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

    Returns:
        o: [B, T, HV, V] in ``v.dtype``; final_state: [N, HV, K, V] in the compute dtype
        (float64 if any input is float64, else float32), or None.
    """
    N = _validate(q, k, v, g, erase, write, initial_state, cu_seqlens)
    q, k, z, e, g, h0 = _prepare(q, k, v, g, erase, write, initial_state, scale, N)
    if cu_seqlens is None:
        o, final = _scan(q, k, z, e, g, h0)
    else:
        offsets = cu_seqlens.tolist()
        pieces, finals = [], []
        for n in range(N):
            span = slice(offsets[n], offsets[n + 1])
            o_n, s_n = _scan(q[:, span], k[:, span], z[:, span], e[:, span],
                             None if g is None else g[:, span], h0[n : n + 1])
            pieces.append(o_n)
            finals.append(s_n)
        o, final = torch.cat(pieces, dim=1), torch.cat(finals, dim=0)
    return o.to(v.dtype), (final if output_final_state else None)


# ------------------------------------------------------------------------------------------
# Chunked WY/UT form
# ------------------------------------------------------------------------------------------


class _ChunkLayout:
    """Packed tokens cut into chunks of ``C`` that never straddle two sequences.

    Sequences are ranked by chunk count (descending) and chunks stored step-major: all first
    chunks, then all second chunks, ... so that the sequences still running at step j are the
    first ``active[j]`` ranks and their chunks one contiguous slice starting at ``start[j]``.
    """

    def __init__(self, offsets: list[int], chunk_size: int, device: torch.device) -> None:
        total = offsets[-1]
        lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        counts = [math.ceil(n / chunk_size) for n in lengths]
        self.size = chunk_size
        self.sequences = len(lengths)
        self.order = sorted(range(len(lengths)), key=lambda n: -counts[n])
        self.reordered = self.order != list(range(len(lengths)))
        # Equal lengths that are multiples of C (the usual non-varlen batch): a permutation suffices.
        self.uniform = len(set(lengths)) == 1 and lengths[0] % chunk_size == 0
        bos, lens, self.start, self.active = [], [], [], []
        for j in range(max(counts, default=0)):
            running = [n for n in self.order if counts[n] > j]
            self.start.append(len(bos))
            self.active.append(len(running))
            bos += [offsets[n] + j * chunk_size for n in running]
            lens += [min(chunk_size, lengths[n] - j * chunk_size) for n in running]
        self.chunks = len(bos)
        if self.uniform:
            return
        pos = torch.arange(chunk_size, device=device)
        bos_t = torch.tensor(bos, dtype=torch.long, device=device).reshape(-1, 1)
        valid = pos < torch.tensor(lens, dtype=torch.long, device=device).reshape(-1, 1)
        # Padding slots read row `total`, a zero row appended to every input.
        self.gather = torch.where(valid, bos_t + pos, torch.full_like(bos_t, total))
        self.scatter = torch.zeros(total, dtype=torch.long, device=device)
        self.scatter[self.gather[valid]] = torch.arange(valid.numel(), device=device)[valid.flatten()]

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[T, HV, D] tokens -> [NC, HV, C, D] chunks, zero-padded, contiguous (every later op is faster)."""
        if self.uniform:
            return rearrange(x, "(n j c) h d -> (j n) h c d", n=self.sequences, c=self.size).contiguous()
        padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])], dim=0)
        return rearrange(padded[self.gather], "n c h d -> n h c d").contiguous()

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[NC, HV, C, D] chunks -> [T, HV, D] tokens."""
        if self.uniform:
            return rearrange(x, "(j n) h c d -> (n j c) h d", n=self.sequences)
        return rearrange(x, "n h c d -> (n c) h d")[self.scatter]


def _causal_decayed_scores(
    xs: tuple[torch.Tensor, ...], y: torch.Tensor, G: torch.Tensor | None
) -> list[torch.Tensor]:
    """``P[i, j] = sum_c x[i, c] y[j, c] exp(G[i, c] - G[j, c])`` for ``i >= j``, 0 above the diagonal.

    ``xs``, ``y``: [..., C, K]; ``G``: None, [..., C, 1] or [..., C, K], non-increasing along C.
    Every exponent formed is ``<= 0``: masked to -inf before ``exp`` where it would be positive.
    (In-place ops below act only on fresh temporaries whose old values autograd does not keep.)
    """
    C = y.shape[-2]
    if G is None:
        return [(x @ y.transpose(-1, -2)).tril_() for x in xs]
    if G.shape[-1] == 1:
        above = torch.ones(C, C, dtype=torch.bool, device=y.device).triu(1)
        decay = (G - G.transpose(-1, -2)).masked_fill_(above, -math.inf).exp_()
        return [(x @ y.transpose(-1, -2)) * decay for x in xs]
    # Channel-wise decay: many passes over [chunks, C, K] temporaries, so work on cache-sized groups,
    # each writing its rows of fresh output buffers (every entry is written once, so autograd sees copies).
    lead = y.shape[:-2]
    flat = lambda t: t.reshape(-1, *t.shape[-2:])
    xs, y, G = tuple(flat(x) for x in xs), flat(y), flat(G)
    outs = [x.new_zeros(y.shape[0], C, C) for x in xs]
    group = max(1, CACHE_BLOCK_ELEMENTS // (C * y.shape[-1]))
    for i in range(0, y.shape[0], group):
        rows = slice(i, i + group)
        _channel_decayed_scores(tuple(x[rows] for x in xs), y[rows], G[rows], [out[rows] for out in outs])
    return [out.reshape(*lead, C, C) for out in outs]


def _channel_decayed_scores(
    xs: tuple[torch.Tensor, ...], y: torch.Tensor, G: torch.Tensor, outs: list[torch.Tensor]
) -> None:
    """Per-channel decay: writes the scores of each ``x`` into the zero-filled ``out`` [..., C, C].

    Built over a binary split of the chunk. At split size s, each pair of neighbouring blocks
    (top, bottom) contributes the bottom-left s x s block: with r the last row of the top block,
    ``exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j)`` for i in bottom and j in top, so both
    factors have exponents <= 0 and the block is one rank-K product. The diagonal needs no decay.
    This forms O(C K log C) exponentials instead of the O(C^2 K) of the direct pairwise form.
    """
    C = y.shape[-2]
    width = 1 << (C - 1).bit_length()
    scores = outs
    if width != C:
        # Pad to a power of two: zero x and y, G held at its last value (no decay, exponents stay <= 0).
        xs = tuple(F.pad(x, (0, 0, 0, width - C)) for x in xs)
        y = F.pad(y, (0, 0, 0, width - C))
        G = torch.cat([G, G[..., -1:, :].expand(*G.shape[:-2], width - C, G.shape[-1])], dim=-2)
        scores = [x.new_zeros(*x.shape[:-1], width) for x in xs]
    for out, x in zip(scores, xs):
        out.diagonal(dim1=-2, dim2=-1).copy_((x * y).sum(-1))
    s = 1
    while s < width:
        nb = width // (2 * s)
        Gb, yb = G.unflatten(-2, (nb, 2, s)), y.unflatten(-2, (nb, 2, s))
        ref = Gb[..., 0, s - 1 : s, :]  # last row of each top block: [..., nb, 1, K]
        row_decay = (Gb[..., 1, :, :] - ref).exp_()
        # For s = 1 the top block is its own reference row: its factor is exp(0) = 1.
        cols = yb[..., 0, :, :] if s == 1 else yb[..., 0, :, :] * (ref - Gb[..., 0, :, :]).exp_()
        for out, x in zip(scores, xs):
            rows = x.unflatten(-2, (nb, 2, s))[..., 1, :, :] * row_decay
            low = (rows * cols).sum(-1, keepdim=True) if s == 1 else rows @ cols.transpose(-1, -2)
            blocks = out.unflatten(-2, (nb, 2, s)).unflatten(-1, (nb, 2, s))  # [..., nb, 2, s, nb, 2, s]
            pairs = blocks.diagonal(dim1=-6, dim2=-3)  # [..., 2, s, 2, s, nb]
            pairs[..., 1, :, 0, :, :].copy_(low.movedim(-3, -1))
        s *= 2
    if width != C:
        for out, padded in zip(outs, scores):
            out.copy_(padded[..., :C, :C])


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
    ``delta_rule_family_recurrent_ref`` plus ``chunk_size``. Differentiable.

    Args:
        q: [B, T, H, K]; k: [B, T, H, K]; v: [B, T, HV, V].
        g: None, [B, T, HV] or [B, T, HV, K] log decay. erase: None, [B, T, HV] or [B, T, HV, K].
        write: None, [B, T, HV] or [B, T, HV, V]. initial_state: [N, HV, K, V].
        cu_seqlens: [N + 1] offsets (B == 1); sequences never share a chunk.
        chunk_size: tokens per chunk C (any positive int; T need not be a multiple).

    Per chunk, with G the in-chunk cumulative log decay and ``S`` the incoming state::

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
    out_dtype = v.dtype
    B, T, HV, V = v.shape
    q, k, z, e, g, h0 = _prepare(q, k, v, g, erase, write, initial_state, scale, N)
    offsets = cu_seqlens.tolist() if cu_seqlens is not None else [b * T for b in range(B + 1)]
    layout = _ChunkLayout(offsets, chunk_size, q.device)
    if layout.chunks == 0:
        o = z.new_zeros(B, T, HV, V)
        return o.to(out_dtype), (h0 if output_final_state else None)

    flat = lambda x: layout.to_chunks(rearrange(x, "b t h d -> (b t) h d"))
    q, k, z, e = flat(q), flat(k), flat(z), flat(e)  # [NC, HV, C, *]
    G = None if g is None else flat(g).cumsum(dim=-2)  # [NC, HV, C, 1|K], padding adds no decay

    qk, ek = _causal_decayed_scores((q, e), k, G)
    # Unit lower-triangular solves read only the strictly lower part of ek (its diagonal is the
    # b_i k_i . k_i of the scores and is ignored, and so is its gradient).
    U = torch.linalg.solve_triangular(ek, z, upper=False, unitriangular=True)
    if G is None:
        Y = torch.linalg.solve_triangular(ek, e, upper=False, unitriangular=True)
        q_gamma, k_tail, gamma_last = q, k, None
    else:
        gamma = G.exp()
        Y = torch.linalg.solve_triangular(ek, e * gamma, upper=False, unitriangular=True)
        G_last = G[..., -1:, :]
        q_gamma = q * gamma
        k_tail = k * (G_last - G).exp_()
        gamma_last = G_last.exp().transpose(-1, -2)  # [NC, HV, 1|K, 1]

    order = torch.tensor(layout.order, dtype=torch.long, device=h0.device)
    state = h0.index_select(0, order) if layout.reordered else h0
    entering, new_values = [], []
    # The sequential pass, on [chunks * HV, *, *] batches (baddbmm fuses each product with its sum).
    U, Y, k_tail_t = U.flatten(0, 1), Y.flatten(0, 1), k_tail.transpose(-1, -2).flatten(0, 1)
    for start, active in zip(layout.start, layout.active):
        rows = slice(start * HV, (start + active) * HV)
        s = state[:active]
        v_new = torch.baddbmm(U[rows], Y[rows], s.flatten(0, 1), alpha=-1)
        entering.append(s)
        new_values.append(v_new.unflatten(0, (active, HV)))
        decayed = s if gamma_last is None else gamma_last[start : start + active] * s
        s = torch.baddbmm(decayed.flatten(0, 1), k_tail_t[rows], v_new).unflatten(0, (active, HV))
        state = s if active == state.shape[0] else torch.cat([s, state[active:]], dim=0)
    entering_t, v_new_t = torch.cat(entering, dim=0), torch.cat(new_values, dim=0)
    o = torch.matmul(q_gamma, entering_t).add_(qk @ v_new_t)
    o = rearrange(layout.to_tokens(o), "(b t) h d -> b t h d", b=B)

    final = None
    if output_final_state:
        final = state
        if layout.reordered:
            rank = torch.zeros(N, dtype=torch.long, device=h0.device)
            rank[order] = torch.arange(N, device=h0.device)
            final = state.index_select(0, rank)
    return o.to(out_dtype), final


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
