"""Triton kernels of the short convolution: a depthwise causal conv1d with optional SiLU (fla's
``causal_conv1d`` / ``ShortConvolution``).

For one sequence of ``x: [T, D]`` with window ``weight: [D, W]`` and the previous segment's inputs
``state: [D, W]`` (column ``W - 1`` the most recent; ``xx[s] = state[:, W + s]`` for ``s < 0``)::

    pre[t] = bias + sum_k weight[:, k] * xx[t - (W - 1) + k]
    y[t]   = act(pre[t]) + residual[t]                          # act: identity or SiLU
    final  = xx[T - W : T]                                      # [D, W], the last W inputs

Backward, recomputing ``pre`` where SiLU needs it (nothing but the inputs is saved)::

    dpre[t]  = dy[t] * act'(pre[t])
    dxx[s]   = sum_j weight[:, W - 1 - j] * dpre[s + j]  (+ dfinal[:, s - T + W] for s >= T - W)
    dx = dxx[0 : T];  dstate = dxx[-W : 0];  dweight[:, k] = sum_t dpre[t] * xx[t - (W - 1) + k]

Programs cover tiles of ``BLOCK_T`` tokens x ``BLOCK_D`` channels that never straddle two
sequences: a batch ``[B, T, D]`` has ``cdiv(T, BLOCK_T)`` tiles a sequence; a packed varlen batch
(``cu_seqlens``) lists its tiles as ``(sequence, tile)`` rows of a table built on the host
(``tile_table``). The backward is a persistent grid: each program accumulates the weight and bias
gradients of its tiles in registers and writes one partial row, which the launcher sums in a fixed
order, so the result is deterministic and needs no atomics.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lamina.kernels._utils import INTERPRET, AotSpec, cdiv, fp_fusion, multiprocessors, next_power_of_2, register_aot

# Tokens a program covers: fla's chunk size for this op (its ``chunk_indices`` use 64 too).
BLOCK_T = 64
# Under the interpreter: small tiles, so that test sequences of a few dozen tokens span several
# tiles and every tile edge (window reaching into the previous tile) is exercised.
INTERPRET_BLOCK_T = 16
# The window W is a run-time argument of the kernels that loop over its taps (not specialised), so
# their loops stay rolled and one compiled kernel serves every W. With W a constexpr the loops were
# unrolled and the compiler issued all W (backward: 2W-3W) shifted loads of a tile at once, so
# registers grew with W and spilled at some W under every Triton from 3.6 to 3.9 (static report,
# sm_90 and sm_80, W = 2..16: the forward at W = 5-8, the backward at W = 3-16; Triton 3.8.0 also
# at the reported W = 8 fp32).
# Channels a program covers and warps: chosen with the static report, not yet timed on a GPU. Rolled,
# the forward's [64, 64] tile over 8 warps took 175-184 registers and [64, 32] takes 80-121 (Triton 3.6
# to 3.9, sm_90 and sm_80). The backward's [64, 16] over 8 warps takes 92-125 at every
# next_power_of_2(W) and dtype under Triton 3.6, 3.7 and 3.9; under 3.8 (whose sm_90 ptxas is CUDA
# 12.9's), ptxas capped the 16-bit ones with W <= 4 at 80 registers on its own, with 4 spill stores.
# [64, 32] tiles took 164-221 and spilled in fp32 under 3.7 and 3.8 (capped at 128), and [64, 16] over
# 4 warps spilled under 3.6 and 3.7.
BLOCK_D = 32
NUM_WARPS = 8
BLOCK_D_BWD = 16
NUM_WARPS_BWD = 8
# The backward's register budget, given to ptxas (``maxnreg``, PTX ``.maxnreg``) in place of its own
# choice: with it the [64, 16] tile takes 108-128 registers and spills nowhere under Triton 3.6 to 3.9
# (sm_90 and sm_80, every next_power_of_2(W) and dtype). 128 x 256 threads leaves 2 programs per SM,
# as the uncapped 92-125 did.
BWD_MAX_REGISTERS = 128
# Software pipelining stages of every kernel here (launch and static report alike): their loops'
# loads feed no matrix product.
NUM_STAGES = 1
# The decoding step reads and writes a [D, W] window per sequence: 128 channels (x 4 taps, 512
# values) over 4 warps.
STEP_BLOCK_D = 128
STEP_NUM_WARPS = 4
# Widest window: the backward holds a [BLOCK_D, next_power_of_2(W)] tile of weight gradients.
MAX_WIDTH = 16
# Resident warps per SM on sm_80/sm_90 (2048 threads): sizes the persistent backward grid.
MAX_WARPS_PER_SM = 64
# Programs of the backward grid under the interpreter: more than one, so that the partial sums
# are exercised, few enough to stay fast.
INTERPRET_BWD_PROGRAMS = 3


def conv_tiles(backward: bool = False) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps) of the forward or backward kernel (BLOCK_T is shared: one tile table)."""
    block_t = INTERPRET_BLOCK_T if INTERPRET else BLOCK_T
    if backward:
        return block_t, BLOCK_D_BWD, NUM_WARPS_BWD
    return block_t, BLOCK_D, NUM_WARPS


def tile_table(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[n_tiles, 2]`` int32 rows ``(sequence, tile within it)`` for packed sequences of ``lengths``."""
    block_t = conv_tiles()[0]
    rows = [(n, i) for n, length in enumerate(lengths) for i in range(cdiv(length, block_t))]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 2).to(device)


# --- building blocks ------------------------------------------------------------------------------

@triton.jit
def _seq_coords(i_n, cu_ptr, T, D, stride_xb, stride_xt, IS_VARLEN: tl.constexpr):
    """(offset of the sequence's first token in x, in the contiguous outputs, its length)."""
    if IS_VARLEN:
        bos = tl.load(cu_ptr + i_n).to(tl.int64)
        seq_len = tl.load(cu_ptr + i_n + 1).to(tl.int64) - bos
        x_off = bos * stride_xt
        o_off = bos * D
    else:
        seq_len = T
        x_off = i_n * stride_xb
        o_off = i_n * T * D
    return x_off, o_off, seq_len


@triton.jit
def _tile_coords(tile, tiles_ptr, cu_ptr, T, D, stride_xb, stride_xt, n_t_tiles, IS_VARLEN: tl.constexpr):
    """(sequence, tile index within it, x offset, output offset, sequence length) of a tile."""
    if IS_VARLEN:
        i_n = tl.load(tiles_ptr + 2 * tile).to(tl.int64)
        i_t = tl.load(tiles_ptr + 2 * tile + 1).to(tl.int64)
    else:
        i_n = tile // n_t_tiles
        i_t = tile % n_t_tiles
    x_off, o_off, seq_len = _seq_coords(i_n, cu_ptr, T, D, stride_xb, stride_xt, IS_VARLEN)
    return i_n, i_t, x_off, o_off, seq_len


@triton.jit
def _load_inputs(x_ptr, s_ptr, s_off, rows, cols, cmask, seq_len, stride_xt, W, HAS_STATE: tl.constexpr):
    """xx[rows] as fp32 [R, BLOCK_D]: x for 0 <= row < seq_len, state column W + row for -W <= row < 0,
    zero elsewhere. ``x_ptr`` points at the sequence's first token, ``s_ptr + s_off`` at its state."""
    in_x = (rows >= 0) & (rows < seq_len)
    v = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :], mask=in_x[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    if HAS_STATE:
        in_s = (rows < 0) & (rows >= -W)
        v += tl.load(s_ptr + s_off + cols[None, :] * W + (rows + W)[:, None], mask=in_s[:, None] & cmask[None, :],
                     other=0.0).to(tl.float32)
    return v


@triton.jit
def _preact(x_ptr, s_ptr, s_off, w_ptr, b_ptr, rows, cols, cmask, seq_len, stride_xt,
            W, HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """pre[rows] = bias + sum_k weight[:, k] * xx[rows - (W - 1) + k], fp32 [R, BLOCK_D]."""
    acc = _load_inputs(x_ptr, s_ptr, s_off, rows - (W - 1), cols, cmask, seq_len, stride_xt, W, HAS_STATE) \
        * tl.load(w_ptr + cols * W, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for k in range(1, W):
        acc += _load_inputs(x_ptr, s_ptr, s_off, rows - (W - 1) + k, cols, cmask, seq_len, stride_xt, W, HAS_STATE) \
            * tl.load(w_ptr + cols * W + k, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _load_rows(ptr, rows, cols, cmask, seq_len, D):
    """ptr[rows] of a contiguous [seq_len, D] sequence as fp32 [R, BLOCK_D]; zero outside [0, seq_len)."""
    valid = (rows >= 0) & (rows < seq_len)
    return tl.load(ptr + rows[:, None] * D + cols[None, :], mask=valid[:, None] & cmask[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _dinputs(dpre0, dpre_ptr, w_ptr, dht_ptr, s_off, rows, cols, cmask, seq_len, D, W, HAS_DHT: tl.constexpr):
    """d loss / d xx[rows] (rows < 0: state columns W + row), given ``dpre0 = dpre[rows]``.

    Output t = row + j reads xx[row] through weight column W - 1 - j; the final state holds xx[row]
    in column row - seq_len + W when that lies in [0, W).
    """
    acc = dpre0 * tl.load(w_ptr + cols * W + (W - 1), mask=cmask, other=0.0).to(tl.float32)[None, :]
    for j in range(1, W):
        w_j = tl.load(w_ptr + cols * W + (W - 1 - j), mask=cmask, other=0.0).to(tl.float32)[None, :]
        acc += w_j * _load_rows(dpre_ptr, rows + j, cols, cmask, seq_len, D)
    if HAS_DHT:
        c = rows - seq_len + W
        in_final = (c >= 0) & (c < W)
        acc += tl.load(dht_ptr + s_off + cols[None, :] * W + c[:, None], mask=in_final[:, None] & cmask[None, :],
                       other=0.0).to(tl.float32)
    return acc


# --- kernels ----------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["W"])
def _causal_conv1d_fwd_kernel(
    x_ptr, w_ptr, b_ptr, res_ptr, s_ptr, dy_ptr, y_ptr, tiles_ptr, cu_ptr,
    T, D, stride_xb, stride_xt, n_t_tiles, W,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
    DPRE: tl.constexpr,
):
    """y = act(pre) + residual. With DPRE (the backward's first pass, SiLU only) it writes
    dpre = dy * silu'(pre) instead, in fp32."""
    tile = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    i_n, i_t, x_off, o_off, seq_len = _tile_coords(tile, tiles_ptr, cu_ptr, T, D, stride_xb, stride_xt, n_t_tiles,
                                                   IS_VARLEN)
    rows = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    mask = (rows < seq_len)[:, None] & cmask[None, :]
    offs = o_off + rows[:, None] * D + cols[None, :]
    pre = _preact(x_ptr + x_off, s_ptr, i_n * D * W, w_ptr, b_ptr, rows, cols, cmask, seq_len, stride_xt, W,
                  HAS_STATE, HAS_BIAS)
    if DPRE:
        sig = tl.sigmoid(pre)
        y = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32) * sig * (1.0 + pre * (1.0 - sig))
    else:
        y = pre
        if SILU:
            y = y * tl.sigmoid(y)
        if HAS_RES:
            y += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _causal_conv1d_final_state_kernel(
    x_ptr, s_ptr, f_ptr, cu_ptr,
    T, D, stride_xb, stride_xt,
    W: tl.constexpr, BW: tl.constexpr, BLOCK_D: tl.constexpr, HAS_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """final[n, :, w] = xx[seq_len - W + w]: the last W inputs, state columns where the sequence is shorter."""
    i_n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    x_off, o_off, seq_len = _seq_coords(i_n, cu_ptr, T, D, stride_xb, stride_xt, IS_VARLEN)
    o_w = tl.arange(0, BW)
    rows = (seq_len - W + o_w).to(tl.int64)
    v = _load_inputs(x_ptr + x_off, s_ptr, i_n * D * W, rows, cols, cmask, seq_len, stride_xt, W, HAS_STATE)
    tl.store(f_ptr + i_n * D * W + cols[None, :] * W + o_w[:, None], v.to(f_ptr.dtype.element_ty),
             mask=(o_w < W)[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["W"])
def _causal_conv1d_bwd_kernel(
    x_ptr, w_ptr, s_ptr, dpre_ptr, dht_ptr, dx_ptr, dw_part_ptr, db_part_ptr, tiles_ptr, cu_ptr,
    T, D, stride_xb, stride_xt, n_t_tiles, n_tiles, W,
    BW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, HAS_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """dx of every tile of this program and its partial sums of dweight and dbias, from ``dpre``
    ([B, T, D] contiguous: dy itself without an activation, else the first pass's fp32 output)."""
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    o_w = tl.arange(0, BW)
    acc_dw = tl.zeros([BLOCK_D, BW], dtype=tl.float32)
    acc_db = tl.zeros([BLOCK_D], dtype=tl.float32)
    for tile in range(pid, n_tiles, nprog):
        i_n, i_t, x_off, o_off, seq_len = _tile_coords(tile, tiles_ptr, cu_ptr, T, D, stride_xb, stride_xt,
                                                       n_t_tiles, IS_VARLEN)
        s_off = i_n * D * W
        rows = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        dpre0 = _load_rows(dpre_ptr + o_off, rows, cols, cmask, seq_len, D)
        dx = _dinputs(dpre0, dpre_ptr + o_off, w_ptr, dht_ptr, s_off, rows, cols, cmask, seq_len, D, W, HAS_DHT)
        mask = (rows < seq_len)[:, None] & cmask[None, :]
        tl.store(dx_ptr + o_off + rows[:, None] * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        acc_db += tl.sum(dpre0, axis=0)
        for k in range(W):
            xk = _load_inputs(x_ptr + x_off, s_ptr, s_off, rows - (W - 1) + k, cols, cmask, seq_len, stride_xt, W,
                              HAS_STATE)
            acc_dw += tl.where((o_w == k)[None, :], tl.sum(dpre0 * xk, axis=0)[:, None], 0.0)
    part = pid * D + cols
    tl.store(dw_part_ptr + part[:, None] * W + o_w[None, :], acc_dw, mask=cmask[:, None] & (o_w < W)[None, :])
    if HAS_BIAS:
        tl.store(db_part_ptr + part, acc_db, mask=cmask)


@triton.jit(do_not_specialize=["W"])
def _causal_conv1d_bwd_state_kernel(
    dpre_ptr, w_ptr, dht_ptr, ds_ptr, cu_ptr,
    T, D, W,
    BW: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """dstate[n, :, c] = dxx[c - W]: the gradient of dx, at the W rows before the sequence."""
    i_n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    _, o_off, seq_len = _seq_coords(i_n, cu_ptr, T, D, 0, 0, IS_VARLEN)
    s_off = i_n * D * W
    o_w = tl.arange(0, BW)
    rows = o_w.to(tl.int64) - W
    no_dpre = tl.zeros([BW, BLOCK_D], dtype=tl.float32)  # outputs exist only at rows >= 0
    ds = _dinputs(no_dpre, dpre_ptr + o_off, w_ptr, dht_ptr, s_off, rows, cols, cmask, seq_len, D, W, HAS_DHT)
    tl.store(ds_ptr + s_off + cols[None, :] * W + o_w[:, None], ds.to(ds_ptr.dtype.element_ty),
             mask=(o_w < W)[:, None] & cmask[None, :])


@triton.jit
def _causal_conv1d_step_kernel(
    x_ptr, cache_ptr, w_ptr, b_ptr, res_ptr, y_ptr,
    D, stride_xn,
    W: tl.constexpr, BW: tl.constexpr, BLOCK_D: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    """One decoding step of every sequence: shift the window ``cache[n]: [D, W]`` left by one, put
    ``x[n]`` in column W - 1 (in place), and write ``y[n] = act(sum_k weight[:, k] * cache[n, :, k] + bias)
    + residual[n]``."""
    i_n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    o_w = tl.arange(0, BW)
    in_w = o_w < W
    c_offs = i_n * D * W + cols[:, None] * W + o_w[None, :]
    window = tl.load(cache_ptr + c_offs + 1, mask=cmask[:, None] & (o_w + 1 < W)[None, :], other=0.0).to(tl.float32)
    xv = tl.load(x_ptr + i_n * stride_xn + cols, mask=cmask, other=0.0).to(tl.float32)
    window = tl.where((o_w == W - 1)[None, :], xv[:, None], window)
    wt = tl.load(w_ptr + cols[:, None] * W + o_w[None, :], mask=cmask[:, None] & in_w[None, :], other=0.0)
    y = tl.sum(window * wt.to(tl.float32), axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    if HAS_RES:
        y += tl.load(res_ptr + i_n * D + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + i_n * D + cols, y.to(y_ptr.dtype.element_ty), mask=cmask)
    tl.store(cache_ptr + c_offs, window.to(cache_ptr.dtype.element_ty), mask=cmask[:, None] & in_w[None, :])


# --- launchers --------------------------------------------------------------------------------

def _x_strides(x: torch.Tensor) -> tuple[int, int]:
    return x.stride(0), x.stride(1)


def _launch_fwd(x, weight, bias, residual, initial_state, dy, out, silu, cu_seqlens, tiles) -> None:
    """The forward kernel over every tile: y into ``out``, or with ``dy`` the backward's dpre."""
    B, T, D = x.shape
    block_t, block_d, num_warps = conv_tiles()
    n_t_tiles = cdiv(T, block_t)
    n_tiles = B * n_t_tiles if cu_seqlens is None else tiles.shape[0]
    if n_tiles == 0:
        return
    stride_xb, stride_xt = _x_strides(x)
    _causal_conv1d_fwd_kernel[(n_tiles, cdiv(D, block_d))](
        x, weight, bias, residual, initial_state, dy, out, tiles, cu_seqlens,
        T, D, stride_xb, stride_xt, n_t_tiles,
        W=weight.shape[1], BLOCK_T=block_t, BLOCK_D=block_d, SILU=silu, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, HAS_STATE=initial_state is not None, IS_VARLEN=cu_seqlens is not None,
        DPRE=dy is not None, num_warps=num_warps, num_stages=NUM_STAGES, enable_fp_fusion=fp_fusion(),
    )


def causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    silu: bool,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    tiles: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``y: [B, T, D]`` (contiguous, x's dtype) and ``final_state: [N, D, W]`` (x's dtype) or None.

    ``x: [B, T, D]`` with unit channel stride; ``weight: [D, W]``, ``bias: [D]``, ``residual: [B, T, D]``,
    ``initial_state: [N, D, W]`` contiguous; ``cu_seqlens: [N + 1]`` with ``tiles = tile_table(...)``
    for packed sequences (B == 1), else both None.
    """
    B, T, D = x.shape
    W = weight.shape[1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    y = torch.empty((B, T, D), device=x.device, dtype=x.dtype)
    _launch_fwd(x, weight, bias, residual, initial_state, None, y, silu, cu_seqlens, tiles)
    final_state = None
    if output_final_state:
        final_state = torch.empty((N, D, W), device=x.device, dtype=x.dtype)
        _, block_d, num_warps = conv_tiles()
        if N > 0:
            stride_xb, stride_xt = _x_strides(x)
            _causal_conv1d_final_state_kernel[(N, cdiv(D, block_d))](
                x, initial_state, final_state, cu_seqlens, T, D, stride_xb, stride_xt,
                W=W, BW=next_power_of_2(W), BLOCK_D=block_d, HAS_STATE=initial_state is not None,
                IS_VARLEN=cu_seqlens is not None, num_warps=num_warps, num_stages=NUM_STAGES, enable_fp_fusion=fp_fusion(),
            )
    return y, final_state


def _bwd_programs(n_tiles: int, n_dblocks: int, num_warps: int, device: torch.device) -> int:
    if INTERPRET or device.type != "cuda":
        return max(1, min(n_tiles, INTERPRET_BWD_PROGRAMS))
    sms = multiprocessors(device)
    resident = sms * max(1, MAX_WARPS_PER_SM // num_warps)
    return max(1, min(n_tiles, cdiv(resident, n_dblocks)))


def causal_conv1d_bwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    dy: torch.Tensor,
    dht: torch.Tensor | None,
    silu: bool,
    cu_seqlens: torch.Tensor | None,
    tiles: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``causal_conv1d_fwd``: (dx, dweight, dbias, dinitial_state).

    ``dy: [B, T, D]`` and ``dht: [N, D, W]`` (gradient of the final state, or None) contiguous. dx has
    x's shape and dtype (contiguous); dweight, dbias and dinitial_state the dtypes of their inputs
    (None where the input is None). The residual's gradient is ``dy`` itself.
    """
    B, T, D = x.shape
    W = weight.shape[1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    block_t, block_d, num_warps = conv_tiles(backward=True)
    n_t_tiles = cdiv(T, block_t)
    n_tiles = B * n_t_tiles if cu_seqlens is None else tiles.shape[0]
    n_dblocks = cdiv(D, block_d)
    # first pass: the gradient at the activation's input (fp32); without an activation it is dy
    dpre = dy
    if silu:
        dpre = torch.empty((B, T, D), device=x.device, dtype=torch.float32)
        _launch_fwd(x, weight, bias, None, initial_state, dy, dpre, silu, cu_seqlens, tiles)
    programs = _bwd_programs(n_tiles, n_dblocks, num_warps, x.device)
    stride_xb, stride_xt = _x_strides(x)
    dx = torch.empty((B, T, D), device=x.device, dtype=x.dtype)
    dw_part = torch.zeros((programs, D, W), device=x.device, dtype=torch.float32)
    db_part = torch.zeros((programs, D), device=x.device, dtype=torch.float32) if bias is not None else None
    if n_tiles > 0:
        _causal_conv1d_bwd_kernel[(programs, n_dblocks)](
            x, weight, initial_state, dpre, dht, dx, dw_part, db_part, tiles, cu_seqlens,
            T, D, stride_xb, stride_xt, n_t_tiles, n_tiles,
            W=W, BW=next_power_of_2(W), BLOCK_T=block_t, BLOCK_D=block_d, HAS_BIAS=bias is not None,
            HAS_STATE=initial_state is not None, HAS_DHT=dht is not None, IS_VARLEN=cu_seqlens is not None,
            num_warps=num_warps, num_stages=NUM_STAGES, maxnreg=BWD_MAX_REGISTERS, enable_fp_fusion=fp_fusion(),
        )
    dinitial_state = None
    if initial_state is not None:
        dinitial_state = torch.empty_like(initial_state)
        if N > 0:
            _causal_conv1d_bwd_state_kernel[(N, n_dblocks)](
                dpre, weight, dht, dinitial_state, cu_seqlens, T, D,
                W=W, BW=next_power_of_2(W), BLOCK_D=block_d, HAS_DHT=dht is not None,
                IS_VARLEN=cu_seqlens is not None, num_warps=num_warps, num_stages=NUM_STAGES, enable_fp_fusion=fp_fusion(),
            )
    # second stage of the reductions: the partial rows summed in a fixed order
    dweight = dw_part.sum(0).to(weight.dtype)
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias, dinitial_state


def causal_conv1d_step(
    x: torch.Tensor,
    cache: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    """One decoding step: ``x: [N, D]`` (unit channel stride), ``cache: [N, D, W]`` contiguous, updated in
    place; ``residual: [N, D]`` contiguous. Returns ``y: [N, D]`` contiguous in x's dtype."""
    N, D = x.shape
    W = weight.shape[1]
    y = torch.empty((N, D), device=x.device, dtype=x.dtype)
    if N > 0:
        _causal_conv1d_step_kernel[(N, cdiv(D, STEP_BLOCK_D))](
            x, cache, weight, bias, residual, y, D, x.stride(0),
            W=W, BW=next_power_of_2(W), BLOCK_D=STEP_BLOCK_D, SILU=silu, HAS_BIAS=bias is not None,
            HAS_RES=residual is not None, num_warps=STEP_NUM_WARPS, num_stages=NUM_STAGES,
            enable_fp_fusion=fp_fusion(),
        )
    return y


# --- static report: representative configurations on a GPU ----------------------------------------

# (D, W, dtype): a typical DeltaNet/GDN projection width with fla's default window (bf16), and the
# widest window at fp32. W is a run-time argument of the forward (one kernel for every W); the backward
# holds a [BLOCK_D, next_power_of_2(W)] tile of weight gradients, which is widest at MAX_WIDTH.
_AOT_CASES = ((2048, 4, torch.bfloat16), (512, MAX_WIDTH, torch.float32))
_TRITON_TYPE = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def _aligned_attrs(fn, signature: dict[str, str]) -> dict:
    """The specialisations Triton gives the launchers' arguments at run time (``tt.divisibility`` 16
    for pointers, strides and D when they are multiples of 16), which decide vectorised loads."""
    names = [n for n, t in signature.items() if t.startswith("*") or n.startswith("stride") or n == "D"]
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def _register(name: str, config: str, fn, signature: dict[str, str], constexprs: dict, num_warps: int,
              d: int, maxnreg: int | None = None) -> None:
    register_aot(AotSpec(
        name=name, config=config, fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}},
        constexprs=constexprs, num_warps=num_warps, num_stages=NUM_STAGES, maxnreg=maxnreg, uses_dot=False,
        meta={"attrs": _aligned_attrs(fn, signature), "D": d},
    ))


def _register_default_configs() -> None:
    dims = {"T": "i32", "D": "i32", "stride_xb": "i32", "stride_xt": "i32"}
    for d, w, dtype in _AOT_CASES:
        dt = _TRITON_TYPE[dtype]
        case = f"D={d} {dt[1:]} varlen silu state"
        # forward, and the same kernel as the backward's first pass (dpre = dy * silu'(pre), fp32)
        for dpre in (False, True):
            _, block_d, num_warps = conv_tiles()
            signature = {"x_ptr": dt, "w_ptr": "*fp32", "b_ptr": "*fp32", "res_ptr": dt, "s_ptr": dt, "dy_ptr": dt,
                         "y_ptr": "*fp32" if dpre else dt, "tiles_ptr": "*i32", "cu_ptr": "*i32", **dims,
                         "n_t_tiles": "i32", "W": "i32"}
            constexprs = {"BLOCK_T": BLOCK_T, "BLOCK_D": block_d, "SILU": True, "HAS_BIAS": True,
                          "HAS_RES": not dpre, "HAS_STATE": True, "IS_VARLEN": True, "DPRE": dpre}
            _register("_causal_conv1d_fwd_kernel",
                      f"{case}{' DPRE' if dpre else ''} BLOCK_T={BLOCK_T} BLOCK_D={block_d} warps={num_warps}",
                      _causal_conv1d_fwd_kernel, signature, constexprs, num_warps, d)
        _, block_d, num_warps = conv_tiles(backward=True)
        signature = {"x_ptr": dt, "w_ptr": "*fp32", "s_ptr": dt, "dpre_ptr": "*fp32", "dht_ptr": dt, "dx_ptr": dt,
                     "dw_part_ptr": "*fp32", "db_part_ptr": "*fp32", "tiles_ptr": "*i32", "cu_ptr": "*i32", **dims,
                     "n_t_tiles": "i32", "n_tiles": "i32", "W": "i32"}
        constexprs = {"BW": next_power_of_2(w), "BLOCK_T": BLOCK_T, "BLOCK_D": block_d, "HAS_BIAS": True,
                      "HAS_STATE": True, "HAS_DHT": True, "IS_VARLEN": True}
        _register("_causal_conv1d_bwd_kernel", f"{case} W<={next_power_of_2(w)} BLOCK_T={BLOCK_T} BLOCK_D={block_d} warps={num_warps} maxnreg={BWD_MAX_REGISTERS}",
                  _causal_conv1d_bwd_kernel, signature, constexprs, num_warps, d, BWD_MAX_REGISTERS)
        # the initial state's gradient (backward tiles) and the final state (forward tiles)
        signature = {"dpre_ptr": "*fp32", "w_ptr": "*fp32", "dht_ptr": dt, "ds_ptr": dt, "cu_ptr": "*i32",
                     "T": "i32", "D": "i32", "W": "i32"}
        constexprs = {"BW": next_power_of_2(w), "BLOCK_D": block_d, "HAS_DHT": True, "IS_VARLEN": True}
        _register("_causal_conv1d_bwd_state_kernel", f"{case} W<={next_power_of_2(w)} BLOCK_D={block_d} warps={num_warps}",
                  _causal_conv1d_bwd_state_kernel, signature, constexprs, num_warps, d)
        _, block_d, num_warps = conv_tiles()
        signature = {"x_ptr": dt, "s_ptr": dt, "f_ptr": dt, "cu_ptr": "*i32", **dims}
        constexprs = {"W": w, "BW": next_power_of_2(w), "BLOCK_D": block_d, "HAS_STATE": True, "IS_VARLEN": True}
        _register("_causal_conv1d_final_state_kernel", f"{case} W={w} BLOCK_D={block_d} warps={num_warps}",
                  _causal_conv1d_final_state_kernel, signature, constexprs, num_warps, d)
    d, w, dt = 2048, 4, "*bf16"
    constexprs = {"W": w, "BW": next_power_of_2(w), "BLOCK_D": STEP_BLOCK_D, "SILU": True, "HAS_BIAS": True,
                  "HAS_RES": True}
    signature = {"x_ptr": dt, "cache_ptr": dt, "w_ptr": "*fp32", "b_ptr": "*fp32", "res_ptr": dt, "y_ptr": dt,
                 "D": "i32", "stride_xn": "i32"}
    _register("_causal_conv1d_step_kernel", f"D={d} W={w} bf16 silu BLOCK_D={STEP_BLOCK_D} warps={STEP_NUM_WARPS}",
              _causal_conv1d_step_kernel, signature, constexprs, STEP_NUM_WARPS, d)


_register_default_configs()
