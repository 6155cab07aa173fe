"""Triton kernels of the HRM gated update (DESIGN.md, "HRM").

Forward, one pass over the rows of ``[N, D]``::

    z = sigmoid(gate + bias)          # gate [N, D] (per channel) or [N, 1] (per token)
    y = z * h + (1 - z) * c
    y = y * rstd * w                  # when normalising: rstd = 1 / sqrt(mean(y^2) + eps), saved per row

Backward, one pass, recomputing the mix from h, c and the gate (nothing but rstd is saved)::

    yn = mix * rstd;  dw += dy * yn;  dyn = dy * w
    dmix = rstd * (dyn - yn * mean(dyn * yn))          # RMSNorm backward
    dh = dmix * z;  dc = dmix * (1 - z);  dgate = dmix * (h - c) * z * (1 - z)

The bias and norm-weight gradients are reduced in two stages without atomics: every
program of a persistent grid accumulates its rows into one row of a partial buffer
``[P, D]``, then ``_column_sum_kernel`` adds the P rows in a fixed order. The result
does not depend on scheduling, so it is bitwise reproducible for a given grid.

Rows up to ``MAX_BLOCK_D_FWD`` (forward) / ``MAX_BLOCK_D_BWD`` (backward) wide are held whole in registers (one read of every input);
wider rows are processed in column tiles, which re-reads the row once more when
normalising (the second read of a row just read hits L2 on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels._utils import INTERPRET, AotSpec, cdiv, fp_fusion, multiprocessors, next_power_of_2, register_aot

# Widest row kept whole in one program. Forward (16 warps, at most 128 registers a thread): 8192
# columns compile to <= 103 registers on sm_90 without spills. Backward (32 warps, at most 64
# registers a thread) holds h, c, z, dy, yn, w and two column accumulators: 4096 columns fit, 8192
# spilled (a 312-byte stack at 16 warps, bf16, per-channel gate). Wider rows are processed in
# column tiles.
MAX_BLOCK_D_FWD = 8192
MAX_BLOCK_D_BWD = 4096
# Bytes each thread should load per tensor per row: one 16-byte vector load (LDG.128).
VECTOR_BYTES = 16
# The backward keeps about eight row tiles live at once (h, c, z, dy, yn, w and the two column
# accumulators), so a thread takes at most 4 columns of each: at D = 4096 (bf16) 8 columns a thread
# over 16 warps needed the whole 128-register budget and spilled on sm_90 with Triton 3.9 (1 STL);
# 4 columns over 32 warps compile to 54-64 registers without spills on sm_90 and sm_80 under
# Triton 3.6 and 3.9 (static report).
BWD_MAX_COLUMNS_PER_THREAD = 4
# A program covers at least this many elements, so that narrow rows (D = 64) are batched
# several per program instead of launching one tiny program per row.
MIN_TILE_ELEMS = 2048
# Warps per program: the forward stops at 16 (512 threads), more gains nothing for a streaming
# kernel; the backward goes to 32 (1024 threads, the CUDA limit) to spread its live tiles.
MAX_WARPS = 16
MAX_WARPS_BWD = 32
# Resident warps per SM on sm_80/sm_90 (2048 threads): sizes the persistent backward grid.
MAX_WARPS_PER_SM = 64
# Programs of the backward grid under the interpreter: more than one, so that the second
# reduction stage is exercised, few enough to stay fast.
INTERPRET_BWD_PROGRAMS = 3
# Rows of the partial buffer summed per step of the second reduction stage.
REDUCE_BLOCK_P = 32
REDUCE_BLOCK_D = 256


def launch_config(d: int, elem_size: int, backward: bool) -> tuple[int, int, int]:
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


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tl_compute(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


@triton.jit
def _load_mix(h_ptr, c_ptr, g_ptr, bias_ptr, rows, cols, rmask, cmask, D,
              GATE_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, COMPUTE: tl.constexpr):
    """Load one [ROWS, BLOCK_D] tile of h and c and the gate; return h, c, z and the tile offsets/mask."""
    offs = rows[:, None] * D + cols[None, :]
    mask = rmask[:, None] & cmask[None, :]
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    c = tl.load(c_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    if GATE_PER_CHANNEL:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
        if HAS_BIAS:
            g += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)[None, :]
    else:
        g = tl.load(g_ptr + rows, mask=rmask, other=0.0).to(COMPUTE)[:, None]
        if HAS_BIAS:
            g += tl.load(bias_ptr).to(COMPUTE)
    z = 1.0 / (1.0 + tl.exp(-g))
    return h, c, z, offs, mask


@triton.jit
def _hrm_update_fwd_kernel(
    h_ptr, c_ptr, g_ptr, bias_ptr, w_ptr, y_ptr, rstd_ptr,
    n_rows, D, eps,
    GATE_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
    COMPUTE: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, SINGLE_TILE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    rmask = rows < n_rows
    if SINGLE_TILE:
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        h, c, z, offs, mask = _load_mix(h_ptr, c_ptr, g_ptr, bias_ptr, rows, cols, rmask, cmask, D,
                                        GATE_PER_CHANNEL, HAS_BIAS, COMPUTE)
        y = z * h + (1.0 - z) * c
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(y * y, axis=1) / D + eps)
            tl.store(rstd_ptr + rows, rstd, mask=rmask)
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)
            y = y * rstd[:, None] * w[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        if HAS_NORM:
            sq = tl.zeros([ROWS], dtype=COMPUTE)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                cmask = cols < D
                h, c, z, offs, mask = _load_mix(h_ptr, c_ptr, g_ptr, bias_ptr, rows, cols, rmask, cmask, D,
                                                GATE_PER_CHANNEL, HAS_BIAS, COMPUTE)
                y = z * h + (1.0 - z) * c
                sq += tl.sum(y * y, axis=1)
            rstd = 1.0 / tl.sqrt(sq / D + eps)
            tl.store(rstd_ptr + rows, rstd, mask=rmask)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            cmask = cols < D
            h, c, z, offs, mask = _load_mix(h_ptr, c_ptr, g_ptr, bias_ptr, rows, cols, rmask, cmask, D,
                                            GATE_PER_CHANNEL, HAS_BIAS, COMPUTE)
            y = z * h + (1.0 - z) * c
            if HAS_NORM:
                w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)
                y = y * rstd[:, None] * w[None, :]
            tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grad_tile(h, c, z, dy, yn, w, rstd, dot, HAS_NORM: tl.constexpr):
    """d(loss)/d(mix) for one tile, given the row statistic ``dot = mean(dy * w * yn)``."""
    if HAS_NORM:
        return (dy * w[None, :] - yn * dot[:, None]) * rstd[:, None]
    else:
        return dy


@triton.jit
def _hrm_update_bwd_kernel(
    h_ptr, c_ptr, g_ptr, bias_ptr, w_ptr, rstd_ptr, dy_ptr,
    dh_ptr, dc_ptr, dg_ptr, dw_part_ptr, db_part_ptr,
    n_rows, D, n_blocks,
    GATE_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
    COMPUTE: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, SINGLE_TILE: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    part_row = pid.to(tl.int64) * D
    # Per-token gates reduce to one bias gradient: accumulate it per row slot, sum at the end.
    acc_db_tok = tl.zeros([ROWS], dtype=COMPUTE)
    if SINGLE_TILE:
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        w = None
        if HAS_NORM:
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)
        acc_dw = tl.zeros([BLOCK_D], dtype=COMPUTE)
        acc_db = tl.zeros([BLOCK_D], dtype=COMPUTE)
        for blk in range(pid, n_blocks, nprog):
            rows = (blk * ROWS + tl.arange(0, ROWS)).to(tl.int64)
            rmask = rows < n_rows
            h, c, z, offs, mask = _load_mix(h_ptr, c_ptr, g_ptr, bias_ptr, rows, cols, rmask, cmask, D,
                                            GATE_PER_CHANNEL, HAS_BIAS, COMPUTE)
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
            yn = None
            rstd = None
            dot = None
            if HAS_NORM:
                rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0).to(COMPUTE)
                yn = (z * h + (1.0 - z) * c) * rstd[:, None]
                acc_dw += tl.sum(dy * yn, axis=0)
                dot = tl.sum(dy * w[None, :] * yn, axis=1) / D
            dmix = _grad_tile(h, c, z, dy, yn, w, rstd, dot, HAS_NORM)
            tl.store(dh_ptr + offs, (dmix * z).to(dh_ptr.dtype.element_ty), mask=mask)
            tl.store(dc_ptr + offs, (dmix * (1.0 - z)).to(dc_ptr.dtype.element_ty), mask=mask)
            dgate = dmix * (h - c) * (z * (1.0 - z))
            if GATE_PER_CHANNEL:
                tl.store(dg_ptr + offs, dgate.to(dg_ptr.dtype.element_ty), mask=mask)
                if HAS_BIAS:
                    acc_db += tl.sum(dgate, axis=0)
            else:
                dgate_row = tl.sum(dgate, axis=1)
                tl.store(dg_ptr + rows, dgate_row.to(dg_ptr.dtype.element_ty), mask=rmask)
                acc_db_tok += dgate_row
        if HAS_NORM:
            tl.store(dw_part_ptr + part_row + cols, acc_dw, mask=cmask)
        if HAS_BIAS and GATE_PER_CHANNEL:
            tl.store(db_part_ptr + part_row + cols, acc_db, mask=cmask)
    else:
        # Wide rows: column tiles; partial rows are private to this program, so updating
        # them in place (read, add, write) needs no atomics. The launcher zero-fills them.
        for blk in range(pid, n_blocks, nprog):
            rows = (blk * ROWS + tl.arange(0, ROWS)).to(tl.int64)
            rmask = rows < n_rows
            rstd = None
            dot = None
            if HAS_NORM:
                rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0).to(COMPUTE)
                dot = tl.zeros([ROWS], dtype=COMPUTE)
                for d0 in range(0, D, BLOCK_D):
                    cols = d0 + tl.arange(0, BLOCK_D)
                    cmask = cols < D
                    h, c, z, offs, mask = _load_mix(h_ptr, c_ptr, g_ptr, bias_ptr, rows, cols, rmask, cmask, D,
                                                    GATE_PER_CHANNEL, HAS_BIAS, COMPUTE)
                    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
                    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)
                    dot += tl.sum(dy * w[None, :] * (z * h + (1.0 - z) * c) * rstd[:, None], axis=1)
                dot = dot / D
            dgate_row = tl.zeros([ROWS], dtype=COMPUTE)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                cmask = cols < D
                h, c, z, offs, mask = _load_mix(h_ptr, c_ptr, g_ptr, bias_ptr, rows, cols, rmask, cmask, D,
                                                GATE_PER_CHANNEL, HAS_BIAS, COMPUTE)
                dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
                w = None
                yn = None
                if HAS_NORM:
                    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)
                    yn = (z * h + (1.0 - z) * c) * rstd[:, None]
                    part = tl.load(dw_part_ptr + part_row + cols, mask=cmask, other=0.0)
                    tl.store(dw_part_ptr + part_row + cols, part + tl.sum(dy * yn, axis=0), mask=cmask)
                dmix = _grad_tile(h, c, z, dy, yn, w, rstd, dot, HAS_NORM)
                tl.store(dh_ptr + offs, (dmix * z).to(dh_ptr.dtype.element_ty), mask=mask)
                tl.store(dc_ptr + offs, (dmix * (1.0 - z)).to(dc_ptr.dtype.element_ty), mask=mask)
                dgate = dmix * (h - c) * (z * (1.0 - z))
                if GATE_PER_CHANNEL:
                    tl.store(dg_ptr + offs, dgate.to(dg_ptr.dtype.element_ty), mask=mask)
                    if HAS_BIAS:
                        part = tl.load(db_part_ptr + part_row + cols, mask=cmask, other=0.0)
                        tl.store(db_part_ptr + part_row + cols, part + tl.sum(dgate, axis=0), mask=cmask)
                else:
                    dgate_row += tl.sum(dgate, axis=1)
            if not GATE_PER_CHANNEL:
                tl.store(dg_ptr + rows, dgate_row.to(dg_ptr.dtype.element_ty), mask=rmask)
                acc_db_tok += dgate_row
    if HAS_BIAS and not GATE_PER_CHANNEL:
        tl.store(db_part_ptr + pid, tl.sum(acc_db_tok, axis=0))


@triton.jit
def _column_sum_kernel(part_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[d] = sum_p part[p, d], summed in a fixed order (second stage of the reductions)."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    acc = tl.zeros([BLOCK_D], dtype=part_ptr.dtype.element_ty)
    for p0 in range(0, P, BLOCK_P):
        prow = (p0 + tl.arange(0, BLOCK_P)).to(tl.int64)
        mask = (prow < P)[:, None] & cmask[None, :]
        acc += tl.sum(tl.load(part_ptr + prow[:, None] * D + cols[None, :], mask=mask, other=0.0), axis=0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def _column_sum(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[P, D] -> [D] in ``dtype``."""
    p, d = part.shape
    out = torch.empty(d, device=part.device, dtype=dtype)
    _column_sum_kernel[(cdiv(d, REDUCE_BLOCK_D),)](part, out, p, d, BLOCK_P=REDUCE_BLOCK_P, BLOCK_D=REDUCE_BLOCK_D,
                                                   enable_fp_fusion=fp_fusion())
    return out


def hrm_update_fwd(
    h: torch.Tensor,
    c: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    y: torch.Tensor,
) -> torch.Tensor | None:
    """Write the gated update of ``h, c: [N, D]`` (gate ``[N, D]`` or ``[N, 1]``) into ``y: [N, D]``.

    All tensors contiguous on one device. Returns ``rstd: [N]`` (float32, float64 for float64
    inputs) when ``weight`` is given, else None.
    """
    n, d = h.shape
    block_d, rows, num_warps = launch_config(d, h.element_size(), backward=False)
    rstd = None
    if weight is not None:
        rstd = torch.empty(n, device=h.device, dtype=_compute_dtype(h.dtype))
    if n == 0:
        return rstd
    _hrm_update_fwd_kernel[(cdiv(n, rows),)](
        h, c, gate, bias, weight, y, rstd, n, d, eps,
        GATE_PER_CHANNEL=gate.shape[1] == d,
        HAS_BIAS=bias is not None, HAS_NORM=weight is not None, COMPUTE=_tl_compute(h.dtype),
        BLOCK_D=block_d, ROWS=rows, SINGLE_TILE=d <= block_d, num_warps=num_warps, enable_fp_fusion=fp_fusion(),
    )
    return rstd


def _bwd_programs(n_blocks: int, num_warps: int, device: torch.device) -> int:
    if INTERPRET or device.type != "cuda":
        return max(1, min(n_blocks, INTERPRET_BWD_PROGRAMS))
    sms = multiprocessors(device)
    return max(1, min(n_blocks, sms * max(1, MAX_WARPS_PER_SM // num_warps)))


def hrm_update_bwd(
    dy: torch.Tensor,
    h: torch.Tensor,
    c: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    rstd: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of the gated update: (dh, dc, dgate, dbias, dweight).

    ``dy, h, c: [N, D]``, ``gate: [N, D]`` or ``[N, 1]``, ``rstd: [N]`` from the forward when
    normalising. dbias/dweight are None when bias/weight are None and have their dtypes otherwise.
    """
    n, d = h.shape
    per_channel = gate.shape[1] == d
    block_d, rows, num_warps = launch_config(d, h.element_size(), backward=True)
    n_blocks = cdiv(n, rows)
    programs = _bwd_programs(n_blocks, num_warps, h.device)
    single_tile = d <= block_d
    acc = _compute_dtype(h.dtype)
    dh = torch.empty_like(h)
    dc = torch.empty_like(c)
    dg = torch.empty_like(gate)
    # Multi-tile programs add into their partial rows in place, so those start at zero.
    alloc = torch.empty if single_tile else torch.zeros
    dw_part = alloc((programs, d), device=h.device, dtype=acc) if weight is not None else None
    db_part = None
    if bias is not None:
        db_part = alloc((programs, d if per_channel else 1), device=h.device, dtype=acc)
    if n > 0:
        _hrm_update_bwd_kernel[(programs,)](
            h, c, gate, bias, weight, rstd, dy, dh, dc, dg, dw_part, db_part, n, d, n_blocks,
            GATE_PER_CHANNEL=per_channel, HAS_BIAS=bias is not None, HAS_NORM=weight is not None,
            COMPUTE=_tl_compute(h.dtype), BLOCK_D=block_d, ROWS=rows, SINGLE_TILE=single_tile,
            num_warps=num_warps, enable_fp_fusion=fp_fusion(),
        )
    elif dw_part is not None or db_part is not None:
        dw_part = dw_part.zero_() if dw_part is not None else None
        db_part = db_part.zero_() if db_part is not None else None
    dweight = _column_sum(dw_part, weight.dtype) if weight is not None else None
    dbias = _column_sum(db_part, bias.dtype) if bias is not None else None
    return dh, dc, dg, dbias, dweight


# --- static report: the default configurations on a GPU -----------------------------------------

def _fwd_signature(dt: str) -> dict[str, str]:
    ptrs = {"h_ptr": dt, "c_ptr": dt, "g_ptr": dt, "bias_ptr": "*fp32", "w_ptr": "*fp32", "y_ptr": dt,
            "rstd_ptr": "*fp32"}
    return {**ptrs, "n_rows": "i32", "D": "i32", "eps": "fp32"}


def _bwd_signature(dt: str) -> dict[str, str]:
    ptrs = {"h_ptr": dt, "c_ptr": dt, "g_ptr": dt, "bias_ptr": "*fp32", "w_ptr": "*fp32", "rstd_ptr": "*fp32",
            "dy_ptr": dt, "dh_ptr": dt, "dc_ptr": dt, "dg_ptr": dt, "dw_part_ptr": "*fp32",
            "db_part_ptr": "*fp32"}
    return {**ptrs, "n_rows": "i32", "D": "i32", "n_blocks": "i32"}


# (D, dtype, per-channel gate): the target shape (4096, bf16) with both gate kinds, and a row wider than
# both tile limits with the token gate; then every launch configuration ``launch_config`` can choose.
_AOT_CASES = ((4096, torch.bfloat16, True), (4096, torch.bfloat16, False), (16384, torch.bfloat16, False))
_TRITON_TYPE = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
# Row widths up to this cover every launch configuration (the widest tiles, then the multi-tile loop).
_AOT_MAX_D = 2 * MAX_BLOCK_D_FWD


def every_launch_config(itemsize: int, backward: bool) -> dict[tuple[int, int, int, bool], int]:
    """Each distinct (BLOCK_D, ROWS, num_warps, single tile) of ``launch_config``, with the smallest row width
    that takes it: the configurations the kernels can run with at any row size (bf16/fp16 share them)."""
    configs: dict[tuple[int, int, int, bool], int] = {}
    d = 1
    while d <= _AOT_MAX_D:
        block_d, rows, warps = launch_config(d, itemsize, backward=backward)
        configs.setdefault((block_d, rows, warps, d <= block_d), d)
        # the configuration only changes where next_power_of_2(d) does, and past the tile limit
        d = d + 1 if d < 2 else next_power_of_2(d) + 1 if d != next_power_of_2(d) else d + 1
    return configs


def _register_default_configs() -> None:
    cases = [(d, dtype, per_channel, "target") for d, dtype, per_channel in _AOT_CASES]
    # every launch configuration, per-channel gate (it reads a gate row like h and c), 2- and 4-byte rows
    for dtype in (torch.bfloat16, torch.float32):
        for backward in (False, True):
            for d in every_launch_config(dtype.itemsize, backward).values():
                cases.append((d, dtype, True, "bwd" if backward else "fwd"))
    for d, dtype, per_channel, which in cases:
        dt = _TRITON_TYPE[dtype]
        gate = "channel" if per_channel else "token"
        for kind, fn, signature in (
            ("fwd", _hrm_update_fwd_kernel, _fwd_signature(dt)),
            ("bwd", _hrm_update_bwd_kernel, _bwd_signature(dt)),
        ):
            if which not in ("target", kind):
                continue
            block_d, rows, num_warps = launch_config(d, dtype.itemsize, backward=kind == "bwd")
            constexprs = {"GATE_PER_CHANNEL": per_channel, "HAS_BIAS": True, "HAS_NORM": True,
                          "COMPUTE": tl.float32, "BLOCK_D": block_d, "ROWS": rows, "SINGLE_TILE": d <= block_d}
            register_aot(AotSpec(
                name=f"_hrm_update_{kind}_kernel",
                config=f"D={d} {dt[1:]} gate={gate} BLOCK_D={block_d} ROWS={rows} warps={num_warps}",
                fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs,
                num_warps=num_warps, uses_dot=False, meta={"D": d},
            ))
    reduce_cx = {"BLOCK_P": REDUCE_BLOCK_P, "BLOCK_D": REDUCE_BLOCK_D}
    register_aot(AotSpec(
        name="_column_sum_kernel", config=f"BLOCK_P={REDUCE_BLOCK_P} BLOCK_D={REDUCE_BLOCK_D}",
        fn=_column_sum_kernel,
        signature={"part_ptr": "*fp32", "out_ptr": "*fp32", "P": "i32", "D": "i32", "BLOCK_P": "constexpr",
                   "BLOCK_D": "constexpr"},
        constexprs=reduce_cx, num_warps=4, uses_dot=False,
    ))


_register_default_configs()
