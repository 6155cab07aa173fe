"""Triton kernels of RMSNorm with an optional residual input and an optional output gate (fla's
``rms_norm`` / ``RMSNorm`` and ``rms_norm_gated`` / ``FusedRMSNormGated``), and of the L2 norm (fla's
``l2_norm``, which the delta-rule ops apply to q and k with ``use_qk_l2norm_in_kernel``).

Forward, one pass over the rows of ``[N, D]``::

    s    = x + residual                              # residual optional; s is stored when asked (prenorm)
    rstd = 1 / sqrt(mean(s^2) + eps)                 # saved per row; NORM="l2": 1 / sqrt(sum(s^2) + eps)
    y    = (s * rstd * weight + bias) * act(g)       # weight, bias optional; gate optional, after the norm

``act``: ``swish`` (``g * sigmoid(g)``) or ``sigmoid``. Backward, one pass, recomputing ``s`` from
x and the residual (nothing but rstd is saved)::

    yn = s * rstd;  y0 = yn * weight + bias
    dg = dy * y0 * act'(g);  dy <- dy * act(g)
    dweight += dy * yn;  dbias += dy
    ds = rstd * (dy * weight - yn * mean(dy * weight * yn)) + dresidual_out    # NORM="l2": sum, not mean
    dx = ds (x's dtype);  dresidual = ds (the residual's dtype)

The weight and bias gradients are reduced without atomics: every program of a persistent grid
accumulates its rows into one row of a partial buffer ``[P, D]`` and the launcher sums the P rows
in a fixed order, so the result is reproducible. Rows up to ``MAX_BLOCK_D_FWD`` /
``MAX_BLOCK_D_BWD`` wide are held whole in registers; wider rows are processed in column tiles
(one more read of the row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels._utils import INTERPRET, AotSpec, cdiv, fp_fusion, multiprocessors, next_power_of_2, register_aot

# Gates after the norm (fla's names); "none" for plain RMSNorm. "silu" is accepted by the ops as
# another name of "swish".
GATES = ("none", "swish", "sigmoid")
# The row statistic: "rms" divides the sum of squares by D (RMSNorm), "l2" does not (the L2 norm).
NORMS = ("rms", "l2")
# Widest row kept whole in one program. The forward holds s, g and w: 8192 columns over 16 warps
# take 56-63 registers a thread on sm_90/sm_80 (static report). The backward holds x, g, dy, yn, w
# and two column accumulators: 4096 columns over 16 warps take 43-63 registers. Wider rows are
# processed in column tiles.
MAX_BLOCK_D_FWD = 8192
MAX_BLOCK_D_BWD = 4096
# Bytes each thread should load per tensor per row: one 16-byte vector load (LDG.128).
VECTOR_BYTES = 16
# The backward keeps about eight row tiles live at once, so a thread takes at most 4 columns of each
# where the warp limit allows.
BWD_MAX_COLUMNS_PER_THREAD = 4
# A program covers at least this many elements, so that narrow rows (a head dim of 64..256, the
# gated norm's usual width) are batched several per program.
MIN_TILE_ELEMS = 2048
# Warps per program: 16 (512 threads); more gains nothing for a streaming kernel, and the backward
# at 32 warps (at most 64 registers a thread) spilled under Triton 3.6 (D = 4096 bf16: 32
# registers, 1 STL on sm_90), where 16 warps take 55-63 registers without spills under 3.6 and 3.9.
MAX_WARPS = 16
MAX_WARPS_BWD = 16
# Resident warps per SM on sm_80/sm_90 (2048 threads): sizes the persistent backward grid.
MAX_WARPS_PER_SM = 64
# Programs of the backward grid under the interpreter: more than one, so that the partial sums are
# exercised, few enough to stay fast.
INTERPRET_BWD_PROGRAMS = 3


def norm_tiles(d: int, elem_size: int, backward: bool) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps) of the forward or backward kernel for rows of ``d`` elements of
    ``elem_size`` bytes."""
    max_block_d, max_warps = (MAX_BLOCK_D_BWD, MAX_WARPS_BWD) if backward else (MAX_BLOCK_D_FWD, MAX_WARPS)
    block_d = min(next_power_of_2(d), max_block_d)
    rows = max(1, MIN_TILE_ELEMS // block_d)
    per_thread = max(1, VECTOR_BYTES // elem_size)
    if backward:
        per_thread = min(per_thread, BWD_MAX_COLUMNS_PER_THREAD)
    num_warps = max(1, min(max_warps, (rows * block_d) // (32 * per_thread)))
    return block_d, rows, num_warps


# --- building blocks ------------------------------------------------------------------------------

@triton.jit
def _tile(rows, cols, n_rows, D):
    """Offsets and mask of a [ROWS, BLOCK_D] tile of a contiguous [n_rows, D] tensor."""
    return rows[:, None] * D + cols[None, :], (rows < n_rows)[:, None] & (cols < D)[None, :]


@triton.jit
def _load_sum(x_ptr, res_ptr, offs, mask, HAS_RES: tl.constexpr):
    """s = x (+ residual) in fp32."""
    s = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        s += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return s


@triton.jit
def _row_mean(sums, D, NORM: tl.constexpr):
    """A per-row sum over the D columns, as the norm's statistic takes it: over D for "rms", whole for "l2"."""
    if NORM == "rms":
        return sums / D
    else:
        return sums


@triton.jit
def _gate(g, GATE: tl.constexpr):
    """(act(g), act'(g)) for the swish or sigmoid gate."""
    sig = tl.sigmoid(g)
    if GATE == "swish":
        return g * sig, sig * (1.0 + g * (1.0 - sig))
    else:
        return sig, sig * (1.0 - sig)


@triton.jit
def _output(s, rstd, g_ptr, w_ptr, b_ptr, offs, mask, cols, D,
            GATE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """y of one tile, given its rows' rstd."""
    cmask = cols < D
    y = s * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if GATE != "none":
        act, _ = _gate(tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32), GATE)
        y = y * act
    return y


@triton.jit
def _grad_terms(x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, dy_ptr, rstd, rows, cols, n_rows, D,
                GATE: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """Per tile: (offs, mask, yn, dy after the gate, dy * weight, dg); dg is unused without a gate."""
    offs, mask = _tile(rows, cols, n_rows, D)
    cmask = cols < D
    yn = _load_sum(x_ptr, res_ptr, offs, mask, HAS_RES) * rstd[:, None]
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.full([1, 1], 1.0, tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    dg = dy
    if GATE != "none":
        y0 = yn * w
        if HAS_B:
            y0 += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        act, dact = _gate(tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32), GATE)
        dg = dy * y0 * dact
        dy = dy * act
    return offs, mask, yn, dy, dy * w, dg


# --- kernels ----------------------------------------------------------------------------------

@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, y_ptr, res_out_ptr, rstd_ptr,
    n_rows, D, eps,
    GATE: tl.constexpr, HAS_RES: tl.constexpr, STORE_RES: tl.constexpr, HAS_W: tl.constexpr,
    HAS_B: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, SINGLE_TILE: tl.constexpr, NORM: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    if SINGLE_TILE:
        cols = tl.arange(0, BLOCK_D)
        offs, mask = _tile(rows, cols, n_rows, D)
        s = _load_sum(x_ptr, res_ptr, offs, mask, HAS_RES)
        if STORE_RES:
            tl.store(res_out_ptr + offs, s.to(res_out_ptr.dtype.element_ty), mask=mask)
        rstd = 1.0 / tl.sqrt(_row_mean(tl.sum(s * s, axis=1), D, NORM) + eps)
        y = _output(s, rstd, g_ptr, w_ptr, b_ptr, offs, mask, cols, D, GATE, HAS_W, HAS_B)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        sq = tl.zeros([ROWS], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            offs, mask = _tile(rows, cols, n_rows, D)
            s = _load_sum(x_ptr, res_ptr, offs, mask, HAS_RES)
            if STORE_RES:
                tl.store(res_out_ptr + offs, s.to(res_out_ptr.dtype.element_ty), mask=mask)
            sq += tl.sum(s * s, axis=1)
        rstd = 1.0 / tl.sqrt(_row_mean(sq, D, NORM) + eps)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            offs, mask = _tile(rows, cols, n_rows, D)
            s = _load_sum(x_ptr, res_ptr, offs, mask, HAS_RES)
            y = _output(s, rstd, g_ptr, w_ptr, b_ptr, offs, mask, cols, D, GATE, HAS_W, HAS_B)
            tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, rstd_ptr, dy_ptr, dres_out_ptr,
    dx_ptr, dres_ptr, dg_ptr, dw_part_ptr, db_part_ptr,
    n_rows, D, n_blocks,
    GATE: tl.constexpr, HAS_RES: tl.constexpr, HAS_DRES_OUT: tl.constexpr, HAS_W: tl.constexpr,
    HAS_B: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, SINGLE_TILE: tl.constexpr, NORM: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    part_row = pid.to(tl.int64) * D
    if SINGLE_TILE:
        cols = tl.arange(0, BLOCK_D)
        acc_dw = tl.zeros([BLOCK_D], dtype=tl.float32)
        acc_db = tl.zeros([BLOCK_D], dtype=tl.float32)
    for blk in range(pid, n_blocks, nprog):
        rows = (blk * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
        if SINGLE_TILE:
            offs, mask, yn, dy, wdy, dg = _grad_terms(x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, dy_ptr, rstd, rows, cols,
                                                      n_rows, D, GATE, HAS_RES, HAS_W, HAS_B)
            c1 = _row_mean(tl.sum(yn * wdy, axis=1), D, NORM)
        else:
            # Wide rows: a first pass over the column tiles for the row statistic.
            c1 = tl.zeros([ROWS], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                offs, mask, yn, dy, wdy, dg = _grad_terms(x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, dy_ptr, rstd, rows,
                                                          cols, n_rows, D, GATE, HAS_RES, HAS_W, HAS_B)
                c1 += tl.sum(yn * wdy, axis=1)
            c1 = _row_mean(c1, D, NORM)
        for d0 in range(0, D, BLOCK_D):  # one iteration for a single tile
            if not SINGLE_TILE:
                cols = d0 + tl.arange(0, BLOCK_D)
                offs, mask, yn, dy, wdy, dg = _grad_terms(x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, dy_ptr, rstd, rows,
                                                          cols, n_rows, D, GATE, HAS_RES, HAS_W, HAS_B)
            ds = (wdy - yn * c1[:, None]) * rstd[:, None]
            if HAS_DRES_OUT:
                ds += tl.load(dres_out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + offs, ds.to(dx_ptr.dtype.element_ty), mask=mask)
            if HAS_RES:
                tl.store(dres_ptr + offs, ds.to(dres_ptr.dtype.element_ty), mask=mask)
            if GATE != "none":
                tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)
            if SINGLE_TILE:
                acc_dw += tl.sum(dy * yn, axis=0)
                acc_db += tl.sum(dy, axis=0)
            else:
                # partial rows are private to this program: read, add, write needs no atomics
                cmask = cols < D
                if HAS_W:
                    part = tl.load(dw_part_ptr + part_row + cols, mask=cmask, other=0.0)
                    tl.store(dw_part_ptr + part_row + cols, part + tl.sum(dy * yn, axis=0), mask=cmask)
                if HAS_B:
                    part = tl.load(db_part_ptr + part_row + cols, mask=cmask, other=0.0)
                    tl.store(db_part_ptr + part_row + cols, part + tl.sum(dy, axis=0), mask=cmask)
    if SINGLE_TILE:
        if HAS_W:
            tl.store(dw_part_ptr + part_row + cols, acc_dw, mask=cols < D)
        if HAS_B:
            tl.store(db_part_ptr + part_row + cols, acc_db, mask=cols < D)


# --- launchers --------------------------------------------------------------------------------

def rms_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    g: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    gate: str,
    residual_out_dtype: torch.dtype | None,
    norm: str = "rms",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(y [N, D] in x's dtype, rstd [N] fp32, residual_out = x + residual [N, D] or None).

    ``x, residual, g: [N, D]`` contiguous; ``weight, bias: [D]``; ``gate`` one of ``GATES`` ("none"
    when g is None); ``norm`` one of ``NORMS``. ``residual_out`` is written, in ``residual_out_dtype``,
    when that is not None.
    """
    n, d = x.shape
    block_d, rows, num_warps = norm_tiles(d, x.element_size(), backward=False)
    y = torch.empty_like(x)
    rstd = torch.empty(n, device=x.device, dtype=torch.float32)
    res_out = None
    if residual_out_dtype is not None:
        res_out = torch.empty((n, d), device=x.device, dtype=residual_out_dtype)
    if n > 0:
        _rms_norm_fwd_kernel[(cdiv(n, rows),)](
            x, residual, g, weight, bias, y, res_out, rstd, n, d, eps,
            GATE=gate, HAS_RES=residual is not None, STORE_RES=res_out is not None, HAS_W=weight is not None,
            HAS_B=bias is not None, BLOCK_D=block_d, ROWS=rows, SINGLE_TILE=d <= block_d, NORM=norm,
            num_warps=num_warps, enable_fp_fusion=fp_fusion(),
        )
    return y, rstd, res_out


def _bwd_programs(n_blocks: int, num_warps: int, device: torch.device) -> int:
    if INTERPRET or device.type != "cuda":
        return max(1, min(n_blocks, INTERPRET_BWD_PROGRAMS))
    sms = multiprocessors(device)
    return max(1, min(n_blocks, sms * max(1, MAX_WARPS_PER_SM // num_warps)))


def rms_norm_bwd(
    dy: torch.Tensor,
    dresidual_out: torch.Tensor | None,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    g: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rstd: torch.Tensor,
    gate: str,
    norm: str = "rms",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``rms_norm_fwd``: (dx, dresidual, dg, dweight, dbias), each in its input's dtype,
    None where the input is None. ``dy`` and ``dresidual_out`` (the gradient of residual_out, or None)
    are contiguous ``[N, D]``."""
    n, d = x.shape
    block_d, rows, num_warps = norm_tiles(d, x.element_size(), backward=True)
    n_blocks = cdiv(n, rows)
    programs = _bwd_programs(n_blocks, num_warps, x.device)
    dx = torch.empty_like(x)
    dres = torch.empty_like(residual) if residual is not None else None
    dg = torch.empty_like(g) if g is not None else None
    # multi-tile programs add into their partial rows in place, and an empty batch launches nothing
    dw_part = torch.zeros((programs, d), device=x.device, dtype=torch.float32) if weight is not None else None
    db_part = torch.zeros((programs, d), device=x.device, dtype=torch.float32) if bias is not None else None
    if n > 0:
        _rms_norm_bwd_kernel[(programs,)](
            x, residual, g, weight, bias, rstd, dy, dresidual_out, dx, dres, dg, dw_part, db_part, n, d, n_blocks,
            GATE=gate, HAS_RES=residual is not None, HAS_DRES_OUT=dresidual_out is not None,
            HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_D=block_d, ROWS=rows,
            SINGLE_TILE=d <= block_d, NORM=norm, num_warps=num_warps, enable_fp_fusion=fp_fusion(),
        )
    # second stage of the reductions: the partial rows summed in a fixed order
    dweight = dw_part.sum(0).to(weight.dtype) if weight is not None else None
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dres, dg, dweight, dbias


# --- static report: representative configurations on a GPU ----------------------------------------

# (D, dtype, gate, residual, norm): a model width with a residual stream (RMSNorm before a block), a wide
# row in column tiles, a gated head-dim norm (FusedRMSNormGated over V = 128), and the delta-rule ops' L2
# norm of q and k (K = 128, no weight).
_AOT_CASES = ((4096, torch.bfloat16, "none", True, "rms"), (16384, torch.bfloat16, "none", True, "rms"),
              (128, torch.bfloat16, "swish", False, "rms"), (128, torch.bfloat16, "none", False, "l2"))
_TRITON_TYPE = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def _aligned_attrs(fn, signature: dict[str, str]) -> dict:
    """The specialisations Triton gives the launchers' arguments at run time (``tt.divisibility`` 16
    for pointers and for D when it is a multiple of 16), which decide vectorised loads."""
    names = [n for n, t in signature.items() if t.startswith("*") or n == "D"]
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def _register_default_configs() -> None:
    for d, dtype, gate, has_res, norm in _AOT_CASES:
        dt = _TRITON_TYPE[dtype]
        fwd_sig = {"x_ptr": dt, "res_ptr": dt, "g_ptr": dt, "w_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": dt,
                   "res_out_ptr": dt, "rstd_ptr": "*fp32", "n_rows": "i32", "D": "i32", "eps": "fp32"}
        bwd_sig = {"x_ptr": dt, "res_ptr": dt, "g_ptr": dt, "w_ptr": "*fp32", "b_ptr": "*fp32", "rstd_ptr": "*fp32",
                   "dy_ptr": dt, "dres_out_ptr": dt, "dx_ptr": dt, "dres_ptr": dt, "dg_ptr": dt,
                   "dw_part_ptr": "*fp32", "db_part_ptr": "*fp32", "n_rows": "i32", "D": "i32", "n_blocks": "i32"}
        for kind, fn, signature, extra in (
            ("fwd", _rms_norm_fwd_kernel, fwd_sig, {"STORE_RES": has_res}),
            ("bwd", _rms_norm_bwd_kernel, bwd_sig, {"HAS_DRES_OUT": has_res}),
        ):
            block_d, rows, num_warps = norm_tiles(d, dtype.itemsize, backward=kind == "bwd")
            constexprs = {"GATE": gate, "HAS_RES": has_res, "HAS_W": norm == "rms", "HAS_B": False,
                          "BLOCK_D": block_d, "ROWS": rows, "SINGLE_TILE": d <= block_d, "NORM": norm, **extra}
            register_aot(AotSpec(
                name=f"_rms_norm_{kind}_kernel",
                config=(f"D={d} {dt[1:]} gate={gate}{' residual' if has_res else ''} BLOCK_D={block_d} ROWS={rows} "
                        f"warps={num_warps}{' norm=l2' if norm == 'l2' else ''}"),
                fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs,
                num_warps=num_warps, uses_dot=False, meta={"attrs": _aligned_attrs(fn, signature), "D": d},
            ))


_register_default_configs()
