"""PyTorch CPU path of the delta-rule ops (``backend="torch"``): the chunked WY/UT form, vectorised.

``delta_rule_core`` calls this module on the torch path (CPU by default, any device with
``backend="torch"``); autograd differentiates it, so it is also the CPU backward. It is tuned for
speed (sequences, heads and chunks batched together, one sequential pass over chunk states,
cache-sized groups for the channel-decay scores) and is tested against the naive token loop
``lamina.reference.delta_rule_family_recurrent_ref`` (tests/test_delta_rule_cpu.py), never used as it.
Without a graph (inference: no input requires grad, or grad mode is off) it takes a path that
autograd could not follow: the chunk's inverse built in place and the sequential pass writing into
preallocated buffers (``out=`` and in-place products), the same map with fewer passes over memory; and on
CPU it runs the steps in blocks (``STEP_BLOCK_ELEMENTS``), each taking its chunks from the inputs and writing its
outputs, so that a call's temporaries stay a few MB whatever the sequence length (a block holds at
least one step: the chunks of every sequence still running).

Per sequence and value head the state ``S`` is ``[K, V]``; for each token ``t``::

    S   <- Diag(exp(g_t)) S;   S <- S + k_t (w_t * v_t - S^T (b_t * k_t))^T;   o_t = S^T (scale * q_t)

Inputs are trusted: the ops validate them once (``delta_rule_core.validate_inputs``). The
computation is in float64 when any input is float64, else float32; outputs take ``v.dtype`` and
final states the compute dtype. Every decay factor formed is ``exp(x)`` with ``x <= 0`` (for
``g <= 0``), so channel-wise decay cannot overflow.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from lamina._delta_spec import CPU_CHUNK_SIZE, DEFAULT_CHUNK_SIZE, LOG_DECAY_FLOOR

# Elements per [chunks, C, K] temporary in the channel-decay scores (512 KB in float32): keeps the
# dozen temporaries of a group in a 2 MB L2. Groups of 32 chunk-heads at C = K = 64 cut that step
# from ~40 ms to ~24 ms (one thread, T = 4096, H = 4) against one pass over all chunks.
CACHE_BLOCK_ELEMENTS = 1 << 17
# Elements per [chunks, HV, C, max(K, V)] temporary of one block of steps on the path without a graph
# (inference), 1 MB in float32. Run in such blocks, a call's temporaries take a few MB instead of tens, which
# glibc's default malloc more often keeps between calls instead of returning them and faulting them back in
# (benchmarks/cpu_diag/page_faults.py, fresh processes, forward through the ops: a median of 0 faults per call
# in 10 of 18 runs, 2 of 18 before). With freed memory kept (thresholds raised), blocks of 2^18 are as fast as
# one block or faster (minimum DeltaNet 1x4096, C = 64: 15.2 -> 13.7 ms); 2^16 is slower (17.8 ms, more calls).
STEP_BLOCK_ELEMENTS = 1 << 18
# Rows per diagonal block of the chunk's unit lower-triangular inverse (``_unit_lower_chunk_inverse``).
# Batched [16, 16] inverses and products are contiguous bmm calls at 110-190 GFLOP/s; the batched LAPACK
# solve (torch.linalg.solve_triangular) runs one small trsm per matrix: 2.1 ms against 0.8-1.1 ms for a
# blocked substitution at 128-256 chunk-heads, C = 32-64, 128 right-hand sides (2 threads). Blocks of 32
# are slower (1.9-4.5x: four squarings of 32 x 32 instead of three of 16 x 16).
SOLVE_BLOCK = 16


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _per_head(x: torch.Tensor | None) -> torch.Tensor | None:
    """A gate as a [B, T, HV, 1] view (one per head) or [B, T, HV, width] (per channel), or None."""
    return x if x is None or x.dim() == 4 else x.unsqueeze(-1)


class _ChunkLayout:
    """Packed tokens cut into chunks of ``C`` that never straddle two sequences.

    Sequences are ranked by chunk count (descending) and chunks stored step-major: all first
    chunks, then all second chunks, ... so that the sequences still running at step j are the
    first ``active[j]`` ranks and their chunks the ``active[j]`` from ``starts[j]`` in storage order.
    ``to_chunks`` and ``to_tokens`` move any run of steps between the token and chunk layouts.
    """

    def __init__(self, offsets: list[int], chunk_size: int, heads: int, device: torch.device) -> None:
        self.heads = heads
        lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        counts = [math.ceil(n / chunk_size) for n in lengths]
        self.size = chunk_size
        self.sequences = len(lengths)
        self.order = sorted(range(len(lengths)), key=lambda n: -counts[n])
        self.reordered = self.order != list(range(len(lengths)))
        # Equal lengths that are multiples of C (the usual non-varlen batch): steps are strided views.
        self.uniform = len(set(lengths)) == 1 and lengths[0] % chunk_size == 0
        bos, lens, self.active = [], [], []
        for j in range(max(counts, default=0)):
            running = [n for n in self.order if counts[n] > j]
            self.active.append(len(running))
            bos += [offsets[n] + j * chunk_size for n in running]
            lens += [min(chunk_size, lengths[n] - j * chunk_size) for n in running]
        self.starts = [0, *itertools.accumulate(self.active)]
        if self.uniform:
            return
        pos = torch.arange(chunk_size, device=device)
        bos_t = torch.tensor(bos, dtype=torch.long, device=device).reshape(-1, 1)
        self.valid = pos < torch.tensor(lens, dtype=torch.long, device=device).reshape(-1, 1)  # [NC, C]
        # Padding slots read the chunk's first token; ``to_chunks`` zeroes them.
        self.gather = torch.where(self.valid, bos_t + pos, bos_t)
        # The valid slots (chunk * C + position) in storage order, their token rows, and where each chunk's
        # start in them: fixed shapes per block, so that compiled graphs hold no data-dependent size.
        self.slot_starts = [0, *itertools.accumulate(lens)]
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)
        chunk = torch.repeat_interleave(torch.arange(len(bos), device=device), lens_t, output_size=offsets[-1])
        within = torch.arange(offsets[-1], device=device) - (lens_t.cumsum(0) - lens_t)[chunk]
        self.slots, self.tokens = chunk * chunk_size + within, bos_t.flatten()[chunk] + within

    def to_chunks(
        self, x: torch.Tensor, steps: range, dtype: torch.dtype, gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Steps ``steps`` of ``x`` [B, T, Hx, D] as [chunks, HV, C, D] in ``dtype``, zero-padded, contiguous.

        ``HV`` is a multiple of ``Hx`` fixed by ``self.heads``: each of the ``Hx`` heads serves
        ``HV // Hx`` value heads (GVA). Layout, cast and head repeat are one copy. With ``gate``
        ([B, T, HV, 1 or D], all three tensors in ``dtype``), the chunks of ``gate * x`` in that same pass
        (``out=``: no graph).
        """
        C, Hx, D = self.size, x.shape[2], x.shape[3]
        first, stop = self.starts[steps.start], self.starts[steps.stop]
        out = torch.empty(stop - first, self.heads, C, D, dtype=dtype, device=x.device)

        def source(t: torch.Tensor) -> torch.Tensor:
            """``t`` [B, T, H', D'] -> the steps' chunks, a view [steps, sequences | chunks, H', C, D']."""
            if self.uniform:
                shape = (self.sequences, -1, C, *t.shape[2:])
                return t.reshape(shape)[:, steps.start : steps.stop].permute(1, 0, 3, 2, 4)
            return t.reshape(-1, *t.shape[2:])[self.gather[first:stop]].transpose(1, 2)

        src = source(x).unsqueeze(-3)  # [..., Hx, 1, C, D]
        target = out.view(*src.shape[:-4], Hx, self.heads // Hx, C, D)
        if gate is None:
            target.copy_(src.expand_as(target))
        else:
            torch.mul(src, source(gate).unflatten(-3, (Hx, -1)), out=target)
        if not self.uniform:
            out.masked_fill_(~self.valid[first:stop, None, :, None], 0)
        return out

    def to_tokens(self, out: torch.Tensor, x: torch.Tensor, steps: range) -> None:
        """Writes the chunks of steps ``steps``, ``x`` [chunks, HV, C, D], into their rows of ``out`` [B * T, HV, D]."""
        if self.uniform:
            C, HV, D = self.size, x.shape[1], x.shape[3]
            rows = out.view(self.sequences, -1, C, HV, D)[:, steps.start : steps.stop]
            rows.copy_(x.view(len(steps), self.sequences, HV, C, D).permute(1, 0, 3, 2, 4))
            return
        first, stop = self.starts[steps.start], self.starts[steps.stop]
        valid = slice(self.slot_starts[first], self.slot_starts[stop])
        rows = x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])  # [chunks * C, HV, D]
        rows = rows.index_select(0, self.slots[valid] - first * self.size)
        out.index_copy_(0, self.tokens[valid], rows.to(out.dtype))


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
        decay = (G - G.transpose(-1, -2)).to(y.dtype).masked_fill_(above, -math.inf).exp_()
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
        row_decay = (Gb[..., 1, :, :] - ref).to(y.dtype).exp_()
        # For s = 1 the top block is its own reference row: its factor is exp(0) = 1.
        cols = yb[..., 0, :, :] if s == 1 else yb[..., 0, :, :] * (ref - Gb[..., 0, :, :]).to(y.dtype).exp_()
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


def _unit_lower_inverse(M: torch.Tensor) -> torch.Tensor:
    """``(I + M)^-1`` for ``M`` [n, b, b] strictly lower triangular, ``b`` a power of two.

    ``M`` is nilpotent (``M^b = 0``), so ``(I + M)^-1 = (I - M)(I + M^2)(I + M^4)...(I + M^(b/2))``:
    ``log2(b) - 1`` squarings and as many products, all batched matrix products.
    """
    b = M.shape[-1]
    power = -M
    inverse = power + torch.eye(b, dtype=M.dtype, device=M.device)
    for _ in range(b.bit_length() - 2):
        power = power @ power
        inverse = torch.baddbmm(inverse, inverse, power)
    return inverse


def _diagonal_block_inverses(L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``L`` [n, C, C] zero-padded to whole ``SOLVE_BLOCK``-row blocks ([n, W, W]), and the inverses
    ``(I + tril(L_jj, -1))^-1`` of its diagonal blocks ([n, blocks, b, b]), computed together."""
    C = L.shape[-1]
    b = min(SOLVE_BLOCK, 1 << (C - 1).bit_length())
    blocks = -(-C // b)
    width = blocks * b
    # Zero padding to whole blocks adds identity rows to the last diagonal block's inverse.
    padded = F.pad(L, (0, width - C, 0, width - C)) if width != C else L
    diagonal = padded.unflatten(-2, (blocks, b)).unflatten(-1, (blocks, b)).diagonal(dim1=-4, dim2=-2)
    inverses = _unit_lower_inverse(diagonal.permute(0, 3, 1, 2).tril(-1).reshape(-1, b, b))
    return padded, inverses.view(-1, blocks, b, b)


def _unit_lower_solve(L: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """``X`` with ``(I + tril(L, -1)) X = R``, for ``L`` [..., C, C] and ``R`` [..., C, N]; differentiable.

    Reads only the strictly lower part of ``L`` (its diagonal and upper part get zero gradient).
    Blocked by ``SOLVE_BLOCK`` rows: each block of ``X`` is its diagonal block's inverse times the
    right-hand side, which the later rows then subtract. Every step is a batched product on contiguous
    or row-sliced operands.
    """
    lead, C, N = L.shape[:-2], L.shape[-1], R.shape[-1]
    L, R = L.reshape(-1, C, C), R.reshape(-1, C, N)
    _, inverses = _diagonal_block_inverses(L)
    b = inverses.shape[-1]
    pieces, rest = [], R
    for j in range(inverses.shape[1]):
        start, n = j * b, min(b, C - j * b)
        x = inverses[:, j, :n, :n] @ rest[:, :n]
        pieces.append(x)
        if start + n < C:
            rest = torch.baddbmm(rest[:, n:], L[:, start + n :, start : start + n], x, alpha=-1)
    return torch.cat(pieces, dim=1).reshape(*lead, C, N)


def _unit_lower_chunk_inverse(L: torch.Tensor) -> torch.Tensor:
    """``(I + tril(L, -1))^-1`` for ``L`` [..., C, C], built in place: not differentiable (for inference).

    Reads only the strictly lower part of ``L``. Block row ``j`` of the inverse is
    ``-A_jj L[j, :j] A[:j, :j]``. Applying the whole inverse to the chunk's right-hand sides is one
    contiguous product each, faster than ``_unit_lower_solve``'s block substitution (T = 4096, H = 4,
    C = 64, 2 threads: 256 chunk-heads, two 64-column right-hand sides, 3.1 -> 2.2 ms); with a graph,
    where the substitution stays, fp32 gradients through this form were less accurate (a fuzz case's
    dA_log RMS error ratio 1.7e-5 -> 2.0e-5).
    """
    lead, C = L.shape[:-2], L.shape[-1]
    padded, inverses = _diagonal_block_inverses(L.reshape(-1, C, C))
    blocks, b = inverses.shape[1], inverses.shape[-1]
    A = padded.new_empty(padded.shape)
    for j in range(blocks):
        rows = slice(j * b, (j + 1) * b)
        A[:, rows, rows] = inverses[:, j]
        A[:, rows, (j + 1) * b :] = 0
        if j:  # the whole [b, j b] block of L left of the diagonal block is below the diagonal
            A[:, rows, : j * b] = -(inverses[:, j] @ (padded[:, rows, : j * b] @ A[:, : j * b, : j * b]))
    return A[:, :C, :C].reshape(*lead, C, C)


def delta_rule_family_chunk_torch(
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
    chunk_size: int = CPU_CHUNK_SIZE,
    output_v_new: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The delta-rule family in the chunked (WY/UT) form, vectorised; differentiable.

    Same map and argument order as ``lamina.reference.delta_rule_family_recurrent_ref``, plus
    ``chunk_size``. Inputs are not validated here (the ops do it once).

    Args:
        q: [B, T, H, K]; k: [B, T, H, K]; v: [B, T, HV, V], ``HV % H == 0``.
        g: None, [B, T, HV] or [B, T, HV, K] log decay. erase: None, [B, T, HV] or [B, T, HV, K].
        write: None, [B, T, HV] or [B, T, HV, V]. scale: query scale, default ``K ** -0.5``.
        initial_state: [N, HV, K, V] or None (zeros). output_final_state: return the final states.
        cu_seqlens: [N + 1] offsets (B == 1); sequences never share a chunk.
        chunk_size: tokens per chunk C (any positive int; T need not be a multiple).
        output_v_new: also return the writes ``V_new`` (below) per token.

    Per chunk, with G the in-chunk cumulative log decay and ``S`` the incoming state::

        A = (I + tril(E_bar K_bar^T, -1))^-1,  E_bar_i = b_i k_i exp(G_i), K_bar_j = k_j exp(-G_j)
        Y = A E_bar,  U = A (w * v),  V_new = U - Y S
        O = Q exp(G) S + tril(Q K^T with pairwise decay exp(G_i - G_j)) V_new
        S <- exp(G_C) S + (K exp(G_C - G))^T V_new

    where ``E_bar K_bar^T`` is formed from the pairwise decays, never from ``exp(-G)``.

    Returns:
        o: [B, T, HV, V] in ``v.dtype``; final_state: [N, HV, K, V] in the compute dtype, or None; with
        ``output_v_new`` a third item, ``V_new`` as [B, T, HV, V] in ``v.dtype`` (per token
        ``w_t * v_t - (D_t S_{t-1})^T (b_t k_t)``, what the token writes into the state).
    """
    out_dtype = v.dtype
    B, T, HV, V = v.shape
    K = q.shape[3]
    offsets = cu_seqlens.tolist() if cu_seqlens is not None else [b * T for b in range(B + 1)]
    N = len(offsets) - 1
    dtype = _compute_dtype(q, k, v, g, erase, write, initial_state)
    scale = K**-0.5 if scale is None else scale
    # Each block reads its steps through views of the inputs: contiguous ones keep those views free of copies.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, erase, write = (None if x is None else _per_head(x.contiguous()) for x in (g, erase, write))
    h0 = torch.zeros(N, HV, K, V, dtype=dtype, device=q.device) if initial_state is None else initial_state.to(dtype)
    # A chunk longer than every sequence only adds zero padding: the same chunks with less work
    # (T = 1, C = 64 fwd+bwd, B = 2, H = 4, K = V = 64: 26 ms -> 3.3 ms, one thread).
    longest = max([0] + [b - a for a, b in zip(offsets[:-1], offsets[1:])])
    layout = _ChunkLayout(offsets, max(1, min(chunk_size, longest)), HV, q.device)
    o = torch.empty(B * T, HV, V, dtype=out_dtype, device=v.device)
    writes = torch.empty(B * T, HV, V, dtype=out_dtype, device=v.device) if output_v_new else None
    # A graph is built when any input needs a gradient. Without one (inference) the steps take forms autograd
    # could not follow (in-place and out= products, below), and on CPU they run in blocks whose temporaries stay
    # small (``STEP_BLOCK_ELEMENTS``). With a graph, or on a GPU (where every product is a kernel launch and
    # memory is not returned to the OS between calls), they run in one block.
    graph = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, erase, write, initial_state)
    )
    order = torch.tensor(layout.order, dtype=torch.long, device=h0.device)
    state = (h0.index_select(0, order) if layout.reordered else h0).flatten(0, 1)  # [N * HV, K, V], ranked
    if not graph and not layout.reordered:
        state = state.clone()  # the path without a graph updates it in place
    if not layout.active:
        blocks = []
    else:
        one_block = graph or q.device.type != "cpu"
        blocks = [range(len(layout.active))] if one_block else _step_blocks(layout, max(K, V))
    for steps in blocks:
        state = _chunk_steps(layout, steps, q, k, v, g, erase, write, state, scale, dtype, graph, o, writes)
    final = None
    if output_final_state:
        final = state.unflatten(0, (N, HV))
        if layout.reordered:
            rank = torch.zeros(N, dtype=torch.long, device=h0.device)
            rank[order] = torch.arange(N, device=h0.device)
            final = final.index_select(0, rank)
    return (o.view(B, T, HV, V), final, *(() if writes is None else (writes.view(B, T, HV, V),)))


def _step_blocks(layout: _ChunkLayout, width: int) -> list[range]:
    """Runs of whole steps whose [chunks, HV, C, max(K, V)] temporaries hold about ``STEP_BLOCK_ELEMENTS``."""
    per_chunk = layout.heads * layout.size * width
    blocks, first = [], 0
    for j in range(1, len(layout.active) + 1):
        if j == len(layout.active) or (layout.starts[j + 1] - layout.starts[first]) * per_chunk > STEP_BLOCK_ELEMENTS:
            blocks.append(range(first, j))
            first = j
    return blocks


def _chunk_steps(
    layout: _ChunkLayout,
    steps: range,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    erase: torch.Tensor | None,
    write: torch.Tensor | None,
    state: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
    graph: bool,
    o: torch.Tensor,
    writes: torch.Tensor | None,
) -> torch.Tensor:
    """Steps ``steps`` of the chunked form: writes their outputs (and writes) into the token rows of ``o``
    (and ``writes``), [B * T, HV, V], and returns the state after them, [N * HV, K, V] in rank order."""
    chunks = lambda x, dtype=dtype: None if x is None else layout.to_chunks(x, steps, dtype)
    k_tokens = k
    q, k = chunks(q), chunks(k)  # [chunks, HV, C, K]

    def gated(x: torch.Tensor, x_chunks: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
        """The chunks of ``gate * x``: without a graph, formed in the chunks' copy when the dtypes allow."""
        if gate is None:
            return chunks(x) if x_chunks is None else x_chunks
        if not graph and x.dtype == gate.dtype == dtype:
            return layout.to_chunks(x, steps, dtype, gate=gate)
        return chunks(gate) * (chunks(x) if x_chunks is None else x_chunks)

    e, z = gated(k_tokens, k, erase), gated(v, None, write)  # [chunks, HV, C, K | V]
    V = z.shape[-1]
    # The in-chunk cumulative log decay in float64: at strong decay it reaches hundreds within a chunk,
    # where float32 rounds it to ~1e-5 absolute, and every exp(G_i - G_j) would carry that as relative
    # error (dg at g ~ -U(0, 20): RMS error ratio 1.4e-5 with float32 sums, 2.3e-7 with these).
    # Decays exp(G_i - G_j) take the float64 difference, rounded to the compute dtype before exp: a
    # relative error of 6e-8 |G_i - G_j| on a factor exp(G_i - G_j), and half the cost of a float64 exp.
    # Each log decay floored at LOG_DECAY_FLOOR first (a decay of 0, g = -inf, included), in the chunks' copy.
    # [chunks, HV, C, 1|K], padding: no decay.
    G = None if g is None else chunks(g, torch.float64).clamp_(min=LOG_DECAY_FLOOR).cumsum(dim=-2)

    qk, ek = _causal_decayed_scores((q, e), k, G)
    if G is None:
        e_gamma, q_gamma, k_tail, gamma_last = e, q, k, None
    else:
        gamma = G.exp().to(q.dtype)
        e_gamma, q_gamma = e * gamma, q * gamma
        G_last = G[..., -1:, :]
        k_tail = k * (G_last - G).to(k.dtype).exp_()
        gamma_last = G_last.exp().to(q.dtype).transpose(-1, -2)  # [chunks, HV, 1|K, 1]
    # The chunk's unit lower-triangular solve for both right-hand sides: with a graph by substitution, else
    # (inference) as products with the explicit inverse. Either reads only the strictly lower part of ek (its
    # diagonal is the b_i k_i . k_i of the scores and is ignored, and so is its gradient).
    if graph:
        U, Y = _unit_lower_solve(ek, torch.cat([z, e_gamma], dim=-1)).split([V, e.shape[-1]], dim=-1)
    else:
        A = _unit_lower_chunk_inverse(ek)
        U, Y = A @ z, A @ e_gamma

    # The sequential pass on [sequences * HV, *, *] batches (baddbmm fuses each product with its sum). Step j
    # reads the rows of its active sequences, each operand split into its steps by one call.
    HV = layout.heads
    rows = [active * HV for active in layout.active[steps.start : steps.stop]]
    flat_steps = lambda x: x.flatten(0, 1).split(rows)
    decays = [None] * len(rows) if gamma_last is None else flat_steps(gamma_last)
    steps_ops = zip(rows, flat_steps(U), flat_steps(Y), flat_steps(k_tail.transpose(-1, -2)), decays)
    if graph:
        # Each step's entering state and writes are new tensors, joined after the pass.
        entering, new_values = [], []
        for n, u, y, k_t, decay in steps_ops:
            s = state[:n]
            entering.append(s)
            new_values.append(torch.baddbmm(u, y, s, alpha=-1))
            s = torch.baddbmm(s if decay is None else decay * s, k_t, new_values[-1])
            state = s if n == state.shape[0] else torch.cat([s, state[n:]], dim=0)
        v_new_t = torch.cat(new_values, dim=0).unflatten(0, (-1, HV))
        inter = q_gamma.flatten(0, 1) @ torch.cat(entering, dim=0)
    else:
        # Inference: the state is updated in place (``state`` is the caller's own copy, its active rows first),
        # each step's writes go over U (a fresh product, not needed after) and the output's inter-chunk term
        # Q exp(G) S is taken per step from the entering state, so that no state is copied or joined:
        # with the gates multiplied in the chunks' copy, DeltaNet forward 2x1024x4x64 fp32, C = 32, 2 threads, 20
        # interleaved calls: minimum 5.85 -> 5.44 ms (1x4096: 20.1 -> 18.2 ms; GDN 2x1024 7.7 -> 7.1 ms).
        v_new_t, inter = U, torch.empty_like(U).flatten(0, 1)
        for (n, u, y, k_t, decay), q_j, o_j in zip(steps_ops, flat_steps(q_gamma), inter.split(rows)):
            s = state[:n]
            u.baddbmm_(y, s, alpha=-1)
            torch.bmm(q_j, s, out=o_j)
            if decay is not None:
                s.mul_(decay)
            s.baddbmm_(k_t, u)
    # O = scale * (Q exp(G) S + P V_new): the scale and the sum are the product's alpha and beta (no extra pass)
    o_chunks = inter.baddbmm_(qk.flatten(0, 1), v_new_t.flatten(0, 1), beta=scale, alpha=scale).unflatten(
        0, qk.shape[:2]
    )
    layout.to_tokens(o, o_chunks, steps)
    if writes is not None:
        layout.to_tokens(writes, v_new_t, steps)
    return state


def delta_rule_family_recurrent_torch(
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
    output_v_new: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The torch path of the token-by-token ops (``fused_recurrent_*`` with gradients).

    The same map as the token loop, computed in the chunked form (``delta_rule_family_chunk_torch``
    with ``CPU_CHUNK_SIZE`` on CPU and ``DEFAULT_CHUNK_SIZE`` elsewhere, or one chunk per sequence when
    sequences are shorter): the result
    differs from a token loop only by rounding, and no chunk size is part of the op's arguments.
    Autograd through the chunked form is faster than through a token loop from T = 4 on (fwd+bwd,
    B = 2, H = 4, K = V = 64, one thread, chunks of 64: GDN T = 64 181 ms -> 23 ms, T = 256 857 ms ->
    65 ms) and within 2 ms of it at T = 1-2.

    Shapes as in ``delta_rule_family_chunk_torch``; returns ``o [B, T, HV, V]`` in ``v.dtype`` and
    the final state ``[N, HV, K, V]`` in the compute dtype, or None.
    """
    size = CPU_CHUNK_SIZE if q.device.type == "cpu" else DEFAULT_CHUNK_SIZE
    return delta_rule_family_chunk_torch(q, k, v, g, erase, write, scale, initial_state, output_final_state,
                                         cu_seqlens, chunk_size=size, output_v_new=output_v_new)


__all__ = [
    "CACHE_BLOCK_ELEMENTS",
    "STEP_BLOCK_ELEMENTS",
    "delta_rule_family_chunk_torch",
    "delta_rule_family_recurrent_torch",
]
