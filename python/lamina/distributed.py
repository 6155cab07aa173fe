"""Context parallelism: one sequence (or one pack of sequences) split along time across the ranks of a
``torch.distributed`` process group (NCCL on GPUs, gloo on CPU).

``ContextParallel(group=None, cu_seqlens=None, layout="contiguous")`` describes the split: the process
group, this rank's position, and the packed-sequence layout (``cu_seqlens``: global offsets of the
sequences packed along T, the same on every rank; None for ``B`` rows of one sequence each). The
sequence is cut into segments of equal length: ``"contiguous"``, one per rank, rank ``r`` of ``R``
holding segment ``r``; ``"zigzag"``, two per rank, rank ``r`` holding segments ``r`` and ``2R - 1 - r``
(so every rank has the same share of causal attention's work). ``cp.shard`` cuts a rank's segments out
of a full tensor (concatenated in that order), ``cp.gather`` joins every rank's again.

The delta-rule ops take it as ``cp_context=``. The recurrence is affine in the state: a segment of
tokens maps a start state ``S`` to ``M S + C``, where ``M`` (``[K, K]``) is the segment run on the
identity with zero values and ``C`` the segment run from a zero state. Each rank computes ``(M, C)`` of
each local sequence of each of its segments, the ranks exchange them (one all-gather), each rank folds
those of the segments before each of its own into its start states and runs its tokens from them:
outputs and writes are those of the whole sequences. Final states are folded from the exchanged maps,
the same on every rank. Backward is autograd through the same steps: the exchange's backward is one
all-reduce, which every rank runs (the start states depend on the exchange on every rank).

Bad input: a call whose shapes, options or layout differ between ranks raises the same ValueError on
every rank (the ranks exchange a description of the call first), never a hang. A rank that does not
reach the call at all leaves the others waiting until the process group's timeout
(``init_process_group(timeout=...)``), which then raises there.
"""

from __future__ import annotations

import functools
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Bytes this process has exchanged through the collectives below (the size of each collective's result),
# for the scaling benchmark; ``traffic_bytes()`` reads it.
_TRAFFIC = [0]


def _eager(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)``, made at the first call under Dynamo: ``torch.compiler.disable`` imports
    ``torch._dynamo``, which made importing this module take about 2 s longer (on every rank, compiled or not).
    Without ``torch._dynamo`` loaded nothing is being compiled and ``fn`` runs as it is; with it, the disabled
    function is made on the first call, inside a compiled region too (Dynamo skips it as it skips a function
    decorated at import: one graph break, ``fn`` run eagerly; tests/test_distributed.py)."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call


def traffic_bytes(reset: bool = False) -> int:
    """Bytes this rank's collectives have produced since the last reset (all-gather: the gathered tensor;
    all-reduce: the reduced one)."""
    seen = _TRAFFIC[0]
    if reset:
        _TRAFFIC[0] = 0
    return seen


class _AllGather(torch.autograd.Function):
    """Every rank's ``x`` stacked along a new dim 0 ``[R, ...]``; backward: the all-reduced gradient's row."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        _TRAFFIC[0] += x.numel() * x.element_size() * len(parts)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        _TRAFFIC[0] += grad.numel() * grad.element_size()
        return grad[dist.get_rank(ctx.group)], None


@_eager
def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """``_AllGather`` outside torch.compile's graphs: the collective (and the traffic count) run eagerly
    between the compiled parts, and Dynamo does not retrace it for every shape and rank of ``x``."""
    return _AllGather.apply(x, group)


class _DependOn(torch.autograd.Function):
    """``x`` itself, made to depend on ``other`` with a zero gradient: every rank then runs the backward of
    the exchange that produced ``other``, whether or not its loss uses a result computed from it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        ctx.other_shape, ctx.other_dtype = other.shape, other.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_zeros(ctx.other_shape, dtype=ctx.other_dtype)


@dataclass(frozen=True)
class LocalLayout:
    """One segment's part of the packed layout: its global token range, its local sequences (offsets from the
    segment's start), the global sequence each belongs to, and whether it continues from the segment before
    or onto the segment after."""

    start: int
    stop: int
    cu_seqlens: tuple[int, ...] | None
    seq_ids: tuple[int, ...]
    from_prev: tuple[bool, ...]
    to_next: tuple[bool, ...]


LAYOUTS = ("contiguous", "zigzag")


class ContextParallel:
    """A sequence split along time across the ranks of ``group`` (default: the world group).

    Args:
        group: a ``torch.distributed`` process group; None for the default (world) group.
        cu_seqlens: ``[N + 1]`` global offsets of ``N`` sequences packed along T (int tensor or list, the
            same on every rank; each sequence at least one token). None: every row of ``B`` is one
            sequence.
        layout: ``"contiguous"`` (rank r holds segment r of R) or ``"zigzag"`` (rank r holds segments r and
            2R - 1 - r of 2R: causal attention's work balanced over the ranks). Every op takes either.
    """

    def __init__(self, group=None, cu_seqlens: torch.Tensor | list[int] | None = None, layout: str = "contiguous"):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ContextParallel: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group first (torchrun does it for you)")
        if layout not in LAYOUTS:
            raise ValueError(f"ContextParallel: layout must be one of {LAYOUTS}, got {layout!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.cu_seqlens = None if cu_seqlens is None else _offsets(cu_seqlens)
        self.layout = layout
        self.segments = self.segments_of(self.rank)  # the global segments this rank holds, in local order
        self.n_segments = self.world_size * len(self.segments)

    def __repr__(self) -> str:
        layout = "one sequence per row" if self.cu_seqlens is None else f"{len(self.cu_seqlens) - 1} packed sequences"
        return f"ContextParallel(rank {self.rank} of {self.world_size}, {self.layout}, {layout})"

    def segments_of(self, rank: int) -> tuple[int, ...]:
        """The global segments rank ``rank`` holds, in its local order."""
        return (rank,) if self.layout == "contiguous" else (rank, 2 * self.world_size - 1 - rank)

    def owner(self, segment: int) -> tuple[int, int]:
        """(rank, slot): where global segment ``segment`` is held, and its place among that rank's segments."""
        if self.layout == "contiguous" or segment < self.world_size:
            return segment, 0
        return self.n_segments - 1 - segment, 1

    def segment_length(self, t_local: int, what: str = "cp_context") -> int:
        """Tokens per segment of a rank holding ``t_local`` tokens of every row."""
        if t_local % len(self.segments):
            raise ValueError(f"{what}: with the zigzag layout every rank holds two segments of equal length, so "
                             f"its token count must be even, got {t_local}")
        return t_local // len(self.segments)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a full-sequence tensor along ``dim``: its segments, concatenated (a view with the
        contiguous layout)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"shard: x must be a tensor, got {type(x).__name__}")
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"shard: dim must be in [{-x.dim()}, {x.dim()}) for a {x.dim()}-d tensor, got {dim}")
        n = x.shape[dim]
        if n % self.n_segments:
            raise ValueError(f"shard: x has {n} positions along dim {dim}, not divisible by the context's "
                             f"{self.n_segments} segments ({self.world_size} ranks, {self.layout} layout)")
        part = n // self.n_segments
        pieces = [x.narrow(dim, g * part, part) for g in self.segments]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    def gather(self, y: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full tensor from every rank's part along ``dim`` (differentiable; every rank calls it)."""
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"gather: y must be a tensor, got {type(y).__name__}")
        if not -y.dim() <= dim < y.dim():
            raise ValueError(f"gather: dim must be in [{-y.dim()}, {y.dim()}) for a {y.dim()}-d tensor, got {dim}")
        agree(self, "gather", {"dim": dim % y.dim(), "ndim": y.dim(), **{f"size{i}": s for i, s in enumerate(y.shape)}})
        dim = dim % y.dim()
        every = _all_gather(y, self.group)
        part = self.segment_length(y.shape[dim], "gather")
        return torch.cat([every[r].narrow(dim, slot * part, part)
                          for r, slot in map(self.owner, range(self.n_segments))], dim=dim)

    def split_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` local rows as ``[S * B, T / S, ...]``, one row per (segment, row), segment-major: with
        one sequence per row and two segments per rank, the kernels see each segment as a sequence of its
        own. Unchanged otherwise (one segment, or packed sequences, which ``local_cu_seqlens`` separates)."""
        c = len(self.segments)
        if c == 1 or self.cu_seqlens is not None:
            return x
        B, T = x.shape[:2]
        L = self.segment_length(T)
        return x.reshape(B, c, L, *x.shape[2:]).transpose(0, 1).reshape(c * B, L, *x.shape[2:])

    def join_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of ``split_rows``."""
        c = len(self.segments)
        if c == 1 or self.cu_seqlens is not None:
            return x
        rows, L = x.shape[:2]
        return x.reshape(c, rows // c, L, *x.shape[2:]).transpose(0, 1).reshape(rows // c, c * L, *x.shape[2:])

    def segment_layouts(self, t_local: int) -> list[LocalLayout]:
        """The layout of each of this rank's segments (local order), for ``t_local`` tokens of every row."""
        L = self.segment_length(t_local)
        out = []
        for g in self.segments:
            start, stop = g * L, (g + 1) * L
            if self.cu_seqlens is None:
                out.append(LocalLayout(start, stop, None, (), (g > 0,), (g < self.n_segments - 1,)))
                continue
            cu = self.cu_seqlens
            points = [start, *(c for c in cu if start < c < stop), stop]
            seq_ids = tuple(_sequence_of(cu, p) for p in points[:-1])
            from_prev = tuple(i == 0 and cu[s] < start for i, s in enumerate(seq_ids))
            to_next = tuple(i == len(seq_ids) - 1 and cu[s + 1] > stop for i, s in enumerate(seq_ids))
            out.append(LocalLayout(start, stop, tuple(p - start for p in points), seq_ids, from_prev, to_next))
        return out


def _offsets(cu_seqlens) -> tuple[int, ...]:
    values = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if isinstance(cu_seqlens, torch.Tensor) and (cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point()):
        raise ValueError(f"cu_seqlens must be a 1-d integer tensor, got shape {tuple(cu_seqlens.shape)} "
                         f"and dtype {cu_seqlens.dtype}")
    if len(values) < 2 or values[0] != 0 or not all(isinstance(c, int) for c in values):
        raise ValueError(f"cu_seqlens must be integer offsets starting at 0 with at least 2 entries, got {values}")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing (every sequence at least one token), got {values}")
    return tuple(values)


def _sequence_of(cu: tuple[int, ...], token: int) -> int:
    lo, hi = 0, len(cu) - 2
    while lo < hi:  # the last sequence s with cu[s] <= token
        mid = (lo + hi + 1) // 2
        if cu[mid] <= token:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _layout_id(cp: ContextParallel) -> int:
    return -1 if cp.cu_seqlens is None else zlib.crc32(repr(cp.cu_seqlens).encode())


def _check_packed(cp: ContextParallel, what: str, batch: int, t_local: int) -> None:
    """With the context's packed layout: batch 1, and the ranks' tokens are the pack's."""
    if cp.cu_seqlens is None:
        return
    if batch != 1:
        raise ValueError(f"{what}: with packed sequences (the context's cu_seqlens) the batch size must be 1, "
                         f"got {batch}")
    if t_local * cp.world_size != cp.cu_seqlens[-1]:
        raise ValueError(f"{what}: the context's cu_seqlens pack {cp.cu_seqlens[-1]} tokens, but "
                         f"{cp.world_size} ranks x {t_local} local tokens = {t_local * cp.world_size}")


@_eager
def agree(cp: ContextParallel, what: str, fields: dict[str, int]) -> None:
    """Exchange ``fields`` (ints) between the ranks; the same ValueError on every rank where they differ."""
    values = torch.tensor([zlib.crc32(what.encode()), *fields.values()], dtype=torch.int64)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(cp.group) == "nccl" else None
    seen = _all_gather(values.to(device) if device else values, cp.group).cpu()
    if bool((seen == seen[0]).all()):
        return
    names = ["operation", *fields]
    diffs = [f"{name}: " + ", ".join(f"rank {r} {int(seen[r, i])}" for r in range(seen.shape[0]))
             for i, name in enumerate(names) if not bool((seen[:, i] == seen[0, i]).all())]
    raise ValueError(f"{what}: the ranks of the context disagree ({'; '.join(diffs)})"
                     + ("; the ranks are not running the same operation" if "operation" in diffs[0] else ""))


def delta_rule_context_parallel(
    cp: ContextParallel,
    core: Callable,
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    b: torch.Tensor,
    w: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    chunk_size: int,
    backend: str,
    output_v_new: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``core`` (``delta_rule_core``'s signature, transformed inputs, states ``[N, HV, K, V]``) on this rank's
    tokens of sequences split across ``cp``'s ranks, as if on the whole sequences (module docstring)."""
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"{op}: cp_context must be a lamina.distributed.ContextParallel, got {type(cp).__name__}")
    B, T, HV, V = v.shape
    K = q.shape[-1]
    n_global = B if cp.cu_seqlens is None else len(cp.cu_seqlens) - 1
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v, g, b, w, initial_state))
    agree(cp, op, {"B": B, "T (local)": T, "H": q.shape[2], "HV": HV, "K": K, "V": V,
                   "layout": LAYOUTS.index(cp.layout),
                   "dtype": list(_DTYPES).index(q.dtype) if q.dtype in _DTYPES else -1,
                   "cu_seqlens": _layout_id(cp), "initial_state": initial_state is not None,
                   "output_final_state": bool(output_final_state), "output_v_new": bool(output_v_new),
                   "chunk_size": chunk_size, "gradients": needs_grad})
    _check_packed(cp, op, B, T)
    if T == 0:
        raise ValueError(f"{op}: every rank needs at least one token with cp_context, got T = 0")
    L = cp.segment_length(T, op)
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    cu_local = local_cu_seqlens(cp, T, q.device)
    # the local sequences, as (slot, global sequence), in the order the kernels see them
    if cp.cu_seqlens is None:
        local = [(slot, row) for slot in range(len(cp.segments)) for row in range(B)]
    else:
        local = [(slot, s) for slot, lay in enumerate(cp.segment_layouts(T)) for s in lay.seq_ids]
    q, k, v, g, b, w = (None if x is None else cp.split_rows(x) for x in (q, k, v, g, b, w))
    run = lambda vv, ww, h0, writes=False: core(  # noqa: E731
        op, q, k, vv, g, b, ww, scale, h0, True, cu_local, chunk_size, False, backend, output_v_new=writes)

    # The affine map (M, C) of each local sequence, in the rows of its slot and global sequence; one exchange.
    eye = torch.eye(K, dtype=state_dtype, device=q.device).expand(len(local), HV, K, K)
    w_k = w if w.dim() == 3 else w.new_ones((*w.shape[:-1], K))  # a value-axis gate meets zero values
    maps = torch.cat([run(v.new_zeros((*v.shape[:-1], K)), w_k, eye)[1], run(v, w, None)[1]], dim=-1)
    rows = torch.tensor([slot * n_global + seq for slot, seq in local], device=q.device)
    mine = maps.new_zeros((len(cp.segments) * n_global, HV, K, K + V)).index_copy(0, rows, maps)
    if needs_grad and not mine.requires_grad:
        mine = mine.detach().requires_grad_()  # every rank takes part in the exchange's backward
    every = _all_gather(mine.view(len(cp.segments), n_global, HV, K, K + V), cp.group)  # [R, S, N, HV, K, K + V]

    def fold(seq: int, segments: range) -> torch.Tensor:
        state = q.new_zeros((HV, K, V), dtype=state_dtype) if initial_state is None else initial_state[seq].to(
            state_dtype)
        for segment in segments:
            rank, slot = cp.owner(segment)
            state = every[rank, slot, seq, ..., :K] @ state + every[rank, slot, seq, ..., K:]
        return state

    def first_segment(seq: int) -> int:
        return 0 if cp.cu_seqlens is None else cp.cu_seqlens[seq] // L

    start = torch.stack([fold(seq, range(first_segment(seq), cp.segments[slot])) for slot, seq in local])
    if needs_grad:
        start = _DependOn.apply(start, every)
    o, _, v_new = run(v, w, start, output_v_new)
    final = None
    if output_final_state:
        last = lambda seq: cp.n_segments - 1 if cp.cu_seqlens is None else (cp.cu_seqlens[seq + 1] - 1) // L  # noqa: E731
        final = torch.stack([fold(seq, range(first_segment(seq), last(seq) + 1)) for seq in range(n_global)])
    return cp.join_rows(o), final, None if v_new is None else cp.join_rows(v_new)


def context_halo(cp: ContextParallel, xs: list[torch.Tensor], width: int) -> list[torch.Tensor]:
    """For each ``[B, T, D_i]`` input of a causal convolution of ``width`` taps on this rank's tokens, the
    window of each local sequence (``cp.split_rows`` rows, or the packed ones of ``local_cu_seqlens``):
    ``[N, D_i, width]``, the ``width`` inputs before its first local token (from the segment before; zeros
    before the sequence's start and for sequences that start in the segment). One exchange for all of
    ``xs``; differentiable (gradients reach the rank the inputs came from)."""
    B, T = xs[0].shape[:2]
    L = cp.segment_length(T, "short convolution")
    if L < width:
        raise ValueError(f"short convolution: with cp_context every segment needs at least {width} tokens (the "
                         f"convolution's window), got {L}")
    tails = torch.stack([torch.cat([x[:, (j + 1) * L - width:(j + 1) * L] for x in xs], dim=-1)
                         for j in range(len(cp.segments))])  # [S, B, width, sum D]
    every = _all_gather(tails, cp.group)  # [R, S, B, width, sum D]

    def before(segment: int) -> torch.Tensor:  # the tail of the segment before ``segment``
        return every[cp.owner(segment - 1)] if segment > 0 else torch.zeros_like(every[0, 0])

    if cp.cu_seqlens is None:
        windows = torch.cat([before(segment) for segment in cp.segments])  # [S * B, width, sum D], split_rows order
    else:
        rows = []
        for segment, lay in zip(cp.segments, cp.segment_layouts(T)):
            part = every.new_zeros((len(lay.seq_ids), width, every.shape[-1]))
            if lay.from_prev[0]:
                positions = torch.arange(lay.start - width, lay.start, device=every.device)
                keep = (positions >= cp.cu_seqlens[lay.seq_ids[0]]).to(every.dtype)
                part = torch.cat([(before(segment)[0] * keep[:, None])[None], part[1:]])
            rows.append(part)
        windows = torch.cat(rows)
    if every.requires_grad:
        windows = _DependOn.apply(windows, every)
    return [w.transpose(1, 2) for w in windows.split([x.shape[-1] for x in xs], dim=-1)]


def _local_offsets(cp: ContextParallel, t_local: int) -> list[int]:
    L = cp.segment_length(t_local)
    offsets = [0]
    for slot, lay in enumerate(cp.segment_layouts(t_local)):
        offsets += [slot * L + c for c in lay.cu_seqlens[1:]]
    return offsets


def local_cu_seqlens(cp: ContextParallel, t_local: int, device: torch.device) -> torch.Tensor | None:
    """This rank's packed layout as ``cu_seqlens`` (int32 on ``device``; its segments' local sequences, one
    after the other); None for one sequence per row."""
    if cp.cu_seqlens is None:
        return None
    return torch.tensor(_local_offsets(cp, t_local), dtype=torch.int32, device=device)


def next_tokens(cp: ContextParallel, ids: torch.Tensor, fill: int) -> torch.Tensor:
    """``[B, T]`` ids shifted left by one across the ranks: position t holds the id of t + 1, a segment's last
    one the next segment's first (``fill`` after the last segment). Not differentiable (token ids)."""
    L = cp.segment_length(ids.shape[1], "labels")
    firsts = _all_gather(ids[:, ::L].contiguous(), cp.group)  # [R, B, S]: each segment's first id
    pieces = []
    for slot, segment in enumerate(cp.segments):
        if segment + 1 < cp.n_segments:
            rank, next_slot = cp.owner(segment + 1)
            after = firsts[rank, :, next_slot:next_slot + 1]
        else:
            after = torch.full_like(ids[:, :1], fill)
        pieces += [ids[:, slot * L + 1:(slot + 1) * L], after]
    return torch.cat(pieces, dim=1)


@_eager
def all_reduce_sum(cp: ContextParallel, x: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of ``x`` (not differentiable: counts and reported values)."""
    out = x.detach().clone()
    dist.all_reduce(out, group=cp.group)
    _TRAFFIC[0] += out.numel() * out.element_size()
    return out


def _ring_pass(cp: ContextParallel, x: torch.Tensor, tag: int = 0) -> tuple[list, torch.Tensor]:
    """Start sending ``x`` to the next rank of the ring (rank + 1) and receiving the previous rank's into a new
    buffer: (the requests to wait on, the buffer). ``tag`` tells two exchanges in flight apart (gloo)."""
    got = torch.empty_like(x)
    send_to = dist.get_global_rank(cp.group, (cp.rank + 1) % cp.world_size)
    take_from = dist.get_global_rank(cp.group, (cp.rank - 1) % cp.world_size)
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, send_to, cp.group, tag),
                                       dist.P2POp(dist.irecv, got, take_from, cp.group, tag)])
    _TRAFFIC[0] += got.numel() * got.element_size()
    return requests, got


def _ring_blocks(cp: ContextParallel, source: int, causal: bool) -> list[tuple[int, int, bool]]:
    """The blocks this rank computes with the keys of rank ``source``: (local query slot, source's key slot,
    diagonal). Causal: a query segment sees the key segments before it whole, its own one causally (equal
    lengths: the diagonal block), none after it."""
    blocks = []
    for a, query in enumerate(cp.segments):
        for b, key in enumerate(cp.segments_of(source)):
            if not causal or key <= query:
                blocks.append((a, b, causal and key == query))
    return blocks


def _merge(o: torch.Tensor | None, lse: torch.Tensor | None, o_blk: torch.Tensor, lse_blk: torch.Tensor):
    """Softmax over the union of two key sets from each one's output ([B, T, H, D]) and lse ([B, H, T]):
    float32 o, and lse. A row no key is visible to yet keeps lse = -inf and o = 0."""
    if o is None:
        return o_blk.float(), lse_blk
    merged = torch.logaddexp(lse, lse_blk)
    base = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
    weight = lambda x: torch.exp(x - base).transpose(1, 2)[..., None]  # noqa: E731  [B, T, H, 1]
    return o * weight(lse) + o_blk.float() * weight(lse_blk), merged


class _RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over the keys and values of the whole sequences, without gathering
    them: the keys and values pass once around the ring of ranks (rank r sends to r + 1), each rank attends
    to the blocks it holds while the next ones are in flight and merges them by their lse. Backward passes
    them around again, with float32 dk/dv accumulators that follow them one step behind (their transfer
    overlaps the next block's work) and return to their rank at the end; each block's gradients come from
    the whole rows' o and lse (nothing is saved per block). Memory: this rank's q, k, v, o, lse and two
    blocks of keys and values in flight."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, causal: bool, scale: float, softcap: float, path: str):
        from lamina.ops.prism_attention import attention_block

        L = q.shape[1] // len(cp.segments)
        part = lambda x, slot: x[:, slot * L:(slot + 1) * L]  # noqa: E731
        outs, lses = [None] * len(cp.segments), [None] * len(cp.segments)
        kv = torch.stack([k, v])
        for step in range(cp.world_size):
            if step + 1 < cp.world_size:
                requests, incoming = _ring_pass(cp, kv)
            for a, b, diagonal in _ring_blocks(cp, (cp.rank - step) % cp.world_size, causal):
                o_blk, lse_blk = attention_block(part(q, a), part(kv[0], b), part(kv[1], b), diagonal, scale,
                                                 softcap, path)
                outs[a], lses[a] = _merge(outs[a], lses[a], o_blk, lse_blk)
            if step + 1 < cp.world_size:
                for request in requests:
                    request.wait()
                kv = incoming
        o, lse = torch.cat(outs, dim=1).to(q.dtype), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.cp, ctx.causal, ctx.scale, ctx.softcap, ctx.path = cp, causal, scale, softcap, path
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        from lamina.ops.prism_attention import attention_block_backward

        q, k, v, o, lse = ctx.saved_tensors
        cp = ctx.cp
        L = q.shape[1] // len(cp.segments)
        part = lambda x, slot: x[:, slot * L:(slot + 1) * L]  # noqa: E731
        rows = lambda x, slot: x[:, :, slot * L:(slot + 1) * L]  # noqa: E731  lse-shaped [B, H, T]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        # The gradient accumulators of the keys held follow them one step behind: the previous rank's arrive
        # while this rank computes its share, which is then added and sent on (after the last step they
        # reach the rank the keys belong to).
        in_flight = None
        for step in range(cp.world_size):
            if step + 1 < cp.world_size:
                requests, incoming = _ring_pass(cp, kv)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            for a, b, diagonal in _ring_blocks(cp, (cp.rank - step) % cp.world_size, ctx.causal):
                dq_blk, dk_blk, dv_blk = attention_block_backward(
                    part(do, a), None if dlse is None else rows(dlse, a), part(q, a), part(kv[0], b),
                    part(kv[1], b), part(o, a), rows(lse, a), diagonal, ctx.scale, ctx.softcap, ctx.path)
                part(dq, a).add_(dq_blk)
                part(dkv[0], b).add_(dk_blk)
                part(dkv[1], b).add_(dv_blk)
            if in_flight is not None:
                for request in in_flight[0]:
                    request.wait()
                dkv.add_(in_flight[1])
            if cp.world_size > 1:
                in_flight = _ring_pass(cp, dkv, tag=1)
            if step + 1 < cp.world_size:
                for request in requests:
                    request.wait()
                kv = incoming
        if in_flight is not None:
            for request in in_flight[0]:
                request.wait()
            dkv = in_flight[1]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


@_eager
def _ring_attention(cp: ContextParallel, q, k, v, causal: bool, scale: float, softcap: float, path: str):
    """``_RingAttention`` outside torch.compile's graphs (its point-to-point exchanges run eagerly)."""
    return _RingAttention.apply(q, k, v, cp, causal, scale, softcap, path)


def attention_context_parallel(cp: ContextParallel, attention: Callable, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor, causal: bool, scale: float | None, return_lse: bool, backend: str,
                               window_size: tuple[int, int], softcap: float):
    """``attention`` (``prism_attention``'s signature) of this rank's queries over the keys and values of the
    whole sequences.

    One sequence per row, without a window: ring attention (``_RingAttention``), which never holds more than
    two segments' keys and values; with the zigzag layout every rank computes the same number of causal
    blocks. Packed sequences (the context's ``cu_seqlens``) or a sliding window: one differentiable
    all-gather of k and v, then each local sequence attends to its keys up to its last local query
    (``causal``: the bottom-right alignment then puts every query at its global position) or to all of
    them."""
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"prism_attention: cp_context must be a lamina.distributed.ContextParallel, "
                        f"got {type(cp).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"prism_attention: {name} must be a 4-d tensor [B, T, heads, D] with cp_context")
    B, T, H, D = q.shape
    if k.shape[:2] != (B, T) or v.shape != k.shape:
        raise ValueError(f"prism_attention: with cp_context k and v must be [B, T, HKV, D] with q's B and T "
                         f"(self-attention), got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    left, right = window_size if isinstance(window_size, (tuple, list)) and len(window_size) == 2 else (-1, -1)
    if not causal and (left, right) != (-1, -1):
        raise ValueError("prism_attention: with cp_context a sliding window needs causal=True")
    agree(cp, "prism_attention", {"B": B, "T (local)": T, "H": H, "HKV": k.shape[2], "D": D,
                                  "dtype": list(_DTYPES).index(q.dtype) if q.dtype in _DTYPES else -1,
                                  "causal": bool(causal), "return_lse": bool(return_lse),
                                  "layout": LAYOUTS.index(cp.layout),
                                  "cu_seqlens": _layout_id(cp),
                                  "gradients": torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))})
    _check_packed(cp, "prism_attention", B, T)
    L = cp.segment_length(T, "prism_attention")
    if cp.cu_seqlens is None and (left, right) == (-1, -1) and L > 0:
        from lamina._dispatch import select_backend
        from lamina.ops.prism_attention import KERNEL_DTYPES, _check_inputs, _check_window

        _check_inputs(q, k, v, scale, None, None, None, None, None)
        _, softcap = _check_window(window_size, softcap)
        scale = float(D ** -0.5 if scale is None else scale)
        path = select_backend("prism_attention", backend, [q, k, v])
        if path == "triton" and q.dtype not in KERNEL_DTYPES:
            raise ValueError(f"q: the triton backend takes dtypes float16, bfloat16, float32, got {q.dtype}")
        o, lse = _ring_attention(cp, q, k, v, bool(causal), scale, softcap, path)
        return (o, lse) if return_lse else o
    kv = _all_gather(torch.stack([k, v]), cp.group)  # [R, 2, B, T, HKV, D]
    keys, values = (torch.cat([kv[r, i, :, slot * L:(slot + 1) * L]
                               for r, slot in map(cp.owner, range(cp.n_segments))], dim=1)
                    for i in (0, 1))  # [B, R * T, HKV, D], in sequence order
    options = dict(causal=causal, scale=scale, return_lse=return_lse, backend=backend, window_size=window_size,
                   softcap=softcap)
    if cp.cu_seqlens is None:  # each segment's queries over the keys up to its end (causal) or all
        outs = [attention(q[:, slot * L:(slot + 1) * L], keys[:, :(segment + 1) * L if causal else None],
                          values[:, :(segment + 1) * L if causal else None], **options)
                for slot, segment in enumerate(cp.segments)]
        if len(outs) == 1:
            return outs[0]
        if return_lse:
            return torch.cat([o for o, _ in outs], dim=1), torch.cat([lse for _, lse in outs], dim=2)
        return torch.cat(outs, dim=1)
    cu = cp.cu_seqlens
    spans = [(cu[s], lay.start + lay.cu_seqlens[i + 1] if causal else cu[s + 1])
             for lay in cp.segment_layouts(T) for i, s in enumerate(lay.seq_ids)]
    index = torch.cat([torch.arange(lo, hi, device=q.device) for lo, hi in spans])
    lengths = torch.tensor([0] + [hi - lo for lo, hi in spans]).cumsum(0)
    cu_k = lengths.to(device=q.device, dtype=torch.int32)
    offsets = _local_offsets(cp, T)
    cu_q = torch.tensor(offsets, dtype=torch.int32, device=q.device)
    return attention(q, keys[:, index], values[:, index], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                     max_seqlen_q=max(b - a for a, b in zip(offsets, offsets[1:])),
                     max_seqlen_k=max(hi - lo for lo, hi in spans), **options)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

__all__ = ["LAYOUTS", "ContextParallel", "LocalLayout", "agree", "all_reduce_sum", "attention_context_parallel",
           "context_halo", "delta_rule_context_parallel", "local_cu_seqlens", "next_tokens", "traffic_bytes"]
