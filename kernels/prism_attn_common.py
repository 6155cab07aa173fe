"""Head-dim pieces, tile configurations and shared ``@triton.jit`` helpers of the Prism attention kernels.

Head dims run from 16 to 512 in steps of 8. ``tl.arange`` needs power-of-two lengths, and a
512-wide fp32 accumulator does not fit one program's registers, so the head dim is cut into at
most two power-of-two output *pieces*:

* columns ``[0, next_pow2(D))`` when ``D <= PIECE_MAX`` (256);
* otherwise ``[0, 256)`` and ``[256, 256 + next_pow2(D - 256))``.

Reductions over the head dim (``Q K^T``, ``dO V^T``) run over chunks of ``BLOCK_DC`` columns
(``reduction_chunk``), masked past D. Outputs
(``O``, ``dQ``, ``dK``, ``dV``) are produced one piece per launch (``OUT_OFFSET``, ``BLOCK_DO``), so a
program holds one accumulator of at most 256 columns. D = 320 is 256 + 64 (not padded to 512),
D = 384 is 256 + 128, D = 512 is 256 + 256; D = 96 is one 128-wide piece with masked columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels._utils import INTERPRET, next_power_of_2

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 512
HEAD_DIM_MULTIPLE = 8
# Widest output piece: a [64, 256] fp32 accumulator over 8 warps is 64 registers a thread; the whole
# 512 columns in one program spill (TRITON_ON_CPU.md section 2: 57 STL with 8 warps at BM=64).
PIECE_MAX = 256
# Smallest piece: tl.dot needs every operand dimension >= 16.
PIECE_MIN = 16
# Widest head dim whose query tile stays resident in a program (FlashAttention-2's regime).
RESIDENT_MAX = 128
# Chunk of the head dim for the Q K^T reduction above RESIDENT_MAX. Measured on sm_90 for a
# minimal forward compiled without argument specialisation (bf16, BLOCK_M = BLOCK_N = 64, 8 warps,
# D = 512, 256 output columns): the query held whole spilled (44 STL); 256- and 128-wide reloaded
# chunks spilled (63 and 18 STL); 64-wide chunks used 230 registers and no spills.
REDUCTION_CHUNK = 64
# Under the interpreter every chunk costs a Python-level round of numpy calls: wider chunks keep the
# tests fast and still cover full and masked chunks (D = 320 is 128 + 128 + a masked 64 of 128).
INTERPRET_REDUCTION_CHUNK = 128

LOG2E = 1.4426950408889634
# The same constants as values a @triton.jit function can read.
LOG2E_C = tl.constexpr(1.4426950408889634)
LN2_C = tl.constexpr(0.6931471805599453)


def output_pieces(head_dim: int, piece_max: int = PIECE_MAX) -> tuple[tuple[int, int], ...]:
    """(column offset, BLOCK_DO) of every output piece; one launch writes each piece.

    Pieces are ``piece_max`` wide, the last one the next power of two of what remains.
    """
    pieces = []
    offset = 0
    while head_dim - offset > piece_max:
        pieces.append((offset, piece_max))
        offset += piece_max
    pieces.append((offset, max(PIECE_MIN, next_power_of_2(head_dim - offset))))
    return tuple(pieces)


def reduction_chunk(head_dim: int) -> int:
    """BLOCK_DC: width of the head-dim chunks that ``Q K^T`` and ``dO V^T`` are summed over.

    Up to ``RESIDENT_MAX`` the whole (padded) head dim is one chunk and the query tile stays
    resident in the program; wider heads are reduced in ``REDUCTION_CHUNK``-wide chunks reloaded
    (from L1/L2) every key block, which keeps them out of the register file.
    """
    if head_dim <= RESIDENT_MAX:
        return max(PIECE_MIN, next_power_of_2(head_dim))
    return INTERPRET_REDUCTION_CHUNK if INTERPRET else REDUCTION_CHUNK


def head_dim_bucket(head_dim: int) -> int:
    """Tile-configuration bucket: 64, 128, 256 or 512 (the smallest of those >= D)."""
    for bucket in (64, 128, 256):
        if head_dim <= bucket:
            return bucket
    return 512


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get full-precision products (a GPU would otherwise round them to TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def uses_options(causal: bool, window_left: bool, window_right: bool, softcap: bool) -> bool:
    """Whether a launch's flags ask for a window or softcapping (causal alone sets ``WINDOW_RIGHT``)."""
    return bool(window_left or softcap or (window_right and not causal))


def launch_configs(tables: tuple[dict[int, list[triton.Config]], dict[int, list[triton.Config]]], head_dim: int,
                   with_options: bool) -> list[triton.Config]:
    """The configs a launch may take: ``tables`` = (plain calls, calls with a window or softcapping), per
    head-dim bucket. The launchers' autotune pruning and the static report's registrations both read this."""
    return tables[bool(with_options)][head_dim_bucket(head_dim)]


def keep_bucket_configs(tables: tuple[dict[int, list[triton.Config]], dict[int, list[triton.Config]]]):
    """Autotune ``early_config_prune``: keep the configs ``launch_configs`` lists for the launch."""

    def prune(configs, named_args, **kwargs):
        if INTERPRET:
            return list(configs)
        flag = lambda name: kwargs.get(name, named_args.get(name))  # noqa: E731
        options = uses_options(flag("CAUSAL"), flag("WINDOW_LEFT"), flag("WINDOW_RIGHT"), flag("SOFTCAP"))
        allowed = {id(c) for c in launch_configs(tables, flag("HEAD_DIM"), options)}
        return [c for c in configs if id(c) in allowed]

    return prune


def aot_launches(tables: tuple[dict[int, list[triton.Config]], dict[int, list[triton.Config]]], head_dim: int):
    """``(label suffix, call options, config, output piece)`` of each launch the static report compiles at
    ``head_dim``: every ``AOT_OPTIONS`` entry, with the configs ``launch_configs`` gives its flags."""
    for suffix, options in AOT_OPTIONS.items():
        flags = window_args(*options)[1]
        with_options = uses_options(options[0], flags["WINDOW_LEFT"], flags["WINDOW_RIGHT"], flags["SOFTCAP"])
        for config in launch_configs(tables, head_dim, with_options):
            for piece in output_pieces(head_dim):
                yield suffix, options, config, piece


def all_configs(tables: tuple[dict[int, list[triton.Config]], ...]) -> list[triton.Config]:
    """Every config of ``tables``, each once (a table may share configs with another)."""
    unique = {id(c): c for table in tables for bucket in sorted(table) for c in table[bucket]}
    return list(unique.values())


def config_label(head_dim: int, piece: tuple[int, int], config: triton.Config) -> str:
    tiles = "x".join(f"{k[6:]}{v}" for k, v in sorted(config.kwargs.items()))
    return f"D{head_dim}-cols{piece[0]}+{piece[1]}-{tiles}-w{config.num_warps}-s{config.num_stages}"


def aot_attrs(fn, signature: dict[str, str]) -> dict:
    """Specialisations the launcher's arguments get at run time, for the static report.

    Triton specialises pointer and integer arguments divisible by 16 (``tt.divisibility``); the
    report must compile that variant, because it decides vectorised and asynchronous copies and so
    registers and shared memory. Contiguous inputs have 16-divisible strides when H * D % 16 == 0.
    """
    names = [n for n, t in signature.items() if t.startswith("*") or n.startswith("stride")]
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


# Head dims registered with the static report: one per bucket, plus the non-power-of-two splits.
AOT_HEAD_DIMS = (64, 128, 192, 256, 320, 512)
# Call options registered with the static report, by label suffix: (causal, window_size, softcap). The
# plain causal call, and the one that turns every flag on (both window bounds and softcapping), whose code
# holds every other combination's.
AOT_OPTIONS = {"": (True, (-1, -1), 0.0), "-window-softcap": (False, (128, 64), 30.0)}


@triton.jit
def load_tile(base, stride_r, offs_d, n_rows, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
              MASK_ROWS: tl.constexpr = True, MASK_COLS: tl.constexpr = True):
    """Load rows ``[0, BLOCK_R)`` x columns ``offs_d`` of a row-major view starting at ``base``.

    Rows ``>= n_rows`` and columns ``>= HEAD_DIM`` read as 0. ``base`` carries the int64 offset of
    the tile; offsets inside a tile are int32 (a tile spans < 2**31 elements), which keeps the
    address arithmetic out of the register budget. A mask known (constexpr) to be all-true is
    dropped by the caller.
    """
    offs_r = tl.arange(0, BLOCK_R)
    ptrs = base + (offs_r[:, None] * stride_r + offs_d[None, :])
    if MASK_ROWS and MASK_COLS:
        return tl.load(ptrs, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif MASK_ROWS:
        return tl.load(ptrs, mask=offs_r[:, None] < n_rows, other=0.0)
    elif MASK_COLS:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def store_tile(base, value, stride_r, offs_d, n_rows, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr):
    offs_r = tl.arange(0, BLOCK_R)
    ptrs = base + (offs_r[:, None] * stride_r + offs_d[None, :])
    mask = (offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def head_dot(a_res, a_blk, stride_a, n_a, b_blk, stride_b, n_b,
             BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DC: tl.constexpr,
             A_RESIDENT: tl.constexpr, MASK_B_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr,
             RUNTIME_CHUNKS: tl.constexpr = False):
    """``A B^T`` over the full head dim: fp32 [BLOCK_A, BLOCK_B].

    ``a_blk``/``b_blk`` point at the first row of each tile (``n_a``/``n_b`` rows valid; B's rows are
    masked only with ``MASK_B_ROWS``). With ``A_RESIDENT`` the head dim is one chunk and ``a_res`` is
    the A tile already loaded; otherwise both operands are loaded chunk by chunk, and only a chunk
    that reaches past ``HEAD_DIM`` masks its columns (``RUNTIME_CHUNKS``: a runtime loop over
    chunks, every chunk masked).
    """
    offs_c = tl.arange(0, BLOCK_DC)
    if A_RESIDENT:
        b = load_tile(b_blk, stride_b, offs_c, n_b, BLOCK_B, HEAD_DIM, MASK_B_ROWS, BLOCK_DC != HEAD_DIM)
        acc = tl.dot(a_res, tl.trans(b), input_precision=DOT_PRECISION)
    elif RUNTIME_CHUNKS:
        # A loop the compiler keeps: loads of a loop-invariant A are not hoisted into registers.
        acc = tl.zeros([BLOCK_A, BLOCK_B], dtype=tl.float32)
        for c in range(0, HEAD_DIM, BLOCK_DC):
            a = load_tile(a_blk, stride_a, c + offs_c, n_a, BLOCK_A, HEAD_DIM)
            b = load_tile(b_blk, stride_b, c + offs_c, n_b, BLOCK_B, HEAD_DIM, MASK_B_ROWS)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.zeros([BLOCK_A, BLOCK_B], dtype=tl.float32)
        for c in tl.static_range(0, HEAD_DIM, BLOCK_DC):
            a = load_tile(a_blk, stride_a, c + offs_c, n_a, BLOCK_A, HEAD_DIM, True, c + BLOCK_DC > HEAD_DIM)
            b = load_tile(b_blk, stride_b, c + offs_c, n_b, BLOCK_B, HEAD_DIM, MASK_B_ROWS,
                          c + BLOCK_DC > HEAD_DIM)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def sequence_bounds(CU, b, seqlen, IS_VARLEN: tl.constexpr):
    """(batch index, first row, length) of sequence ``b``, the first two as int64.

    Packed (varlen) sequences live in batch 0 from row ``CU[b]``; otherwise sequence ``b`` is
    batch ``b`` from row 0 with the fixed length ``seqlen``.
    """
    if IS_VARLEN:
        start = tl.load(CU + b)
        length = tl.load(CU + b + 1) - start
        return (b * 0).to(tl.int64), start.to(tl.int64), length.to(tl.int32)
    else:
        return b.to(tl.int64), (b * 0).to(tl.int64), (b * 0 + seqlen).to(tl.int32)


# --- sliding window and logit softcapping (FlashAttention's semantics) ---------------------------
# Query i of a sequence with Tq queries and Tk keys sits at key position c = i + Tk - Tq (bottom-right
# alignment); with window_size = (left, right) it sees keys c - left <= j <= c + right (a bound of -1 is
# none; causal is right = 0). Softcapping replaces a score s by cap * tanh(s / cap) before the softmax.


def window_args(causal: bool, window_size: tuple[int, int], softcap: float) -> tuple[tuple, dict]:
    """The kernels' runtime ``(win_left, win_right, cap2)`` and constexpr flags for a call's options."""
    left, right = window_size
    right = 0 if causal else right
    flags = dict(WINDOW_LEFT=left >= 0, WINDOW_RIGHT=right >= 0, SOFTCAP=softcap > 0)
    return (max(left, 0), max(right, 0), float(softcap) * LOG2E), flags


@triton.jit
def window_visible(offs_q, offs_k, diag, win_left, win_right, BOUND_LEFT: tl.constexpr,
                   BOUND_RIGHT: tl.constexpr):
    """Which (query, key) pairs the window admits, for broadcastable query and key positions."""
    visible = offs_k == offs_k  # all true, in the broadcast shape
    if BOUND_RIGHT:
        visible = visible & (offs_k <= offs_q + diag + win_right)
    if BOUND_LEFT:
        visible = visible & (offs_k >= offs_q + diag - win_left)
    return visible


@triton.jit
def key_range(m0, rows, len_k, diag, win_left, win_right, BLOCK_N: tl.constexpr, BOUND_LEFT: tl.constexpr,
              BOUND_RIGHT: tl.constexpr):
    """Key blocks of the query rows ``[m0, m0 + rows)``: ``[start, full_lo)`` and ``[full_hi, end)`` need the
    mask, ``[full_lo, full_hi)`` every row sees whole (block-aligned; ``start <= full_lo <= full_hi``)."""
    lo_any = m0 * 0
    lo_all = m0 * 0
    end = len_k + m0 * 0
    hi_all = len_k + m0 * 0
    if BOUND_RIGHT:  # the last row reaches furthest right, the first row least far
        end = tl.maximum(tl.minimum(m0 + rows + diag + win_right, len_k), 0)
        hi_all = tl.maximum(tl.minimum(m0 + diag + win_right + 1, len_k), 0)
    if BOUND_LEFT:  # the first row starts furthest left, the last row least far
        lo_any = tl.minimum(tl.maximum(m0 + diag - win_left, 0), len_k)
        lo_all = tl.minimum(tl.maximum(m0 + rows - 1 + diag - win_left, 0), len_k)
    start = (lo_any // BLOCK_N) * BLOCK_N
    full_lo = tl.maximum(((lo_all + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, start)
    full_hi = tl.maximum((hi_all // BLOCK_N) * BLOCK_N, full_lo)
    return start, full_lo, full_hi, end


@triton.jit
def query_range(n0, len_q, diag, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BOUND_LEFT: tl.constexpr, BOUND_RIGHT: tl.constexpr):
    """Query blocks that see a key of ``[n0, n0 + BLOCK_N)``: ``[start, full_lo)`` and ``[full_hi, end)``
    need the mask, the whole query blocks of ``[full_lo, full_hi)`` see every key of the block
    (``start <= full_lo <= full_hi``; ``end`` may be below ``full_lo`` when no block is whole)."""
    start = n0 * 0
    end = len_q + n0 * 0
    lo_all = n0 * 0
    hi_all = len_q + n0 * 0
    if BOUND_RIGHT:  # query m sees key n when n <= m + diag + win_right: the block's last key binds
        start = (tl.maximum(n0 - diag - win_right, 0) // BLOCK_M) * BLOCK_M
        lo_all = tl.maximum(n0 + BLOCK_N - 1 - diag - win_right, 0)
    if BOUND_LEFT:  # and when n >= m + diag - win_left: the block's first key binds
        end = tl.maximum(tl.minimum(n0 + BLOCK_N - diag + win_left, len_q), 0)
        hi_all = tl.maximum(tl.minimum(n0 - diag + win_left + 1, len_q), 0)
    full_lo = tl.maximum(((lo_all + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, start)
    full_hi = tl.maximum((hi_all // BLOCK_M) * BLOCK_M, full_lo)
    return start, full_lo, full_hi, end


@triton.jit
def tanh(x):
    """tanh from one exponential of a non-positive argument (finite everywhere)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)
