"""The HRM gated update: ``lamina.hrm_gated_update`` (DESIGN.md, "HRM").

``z = sigmoid(gate_logits + bias)``, ``y = z * h + (1 - z) * c``, then optionally RMSNorm
``y / sqrt(mean(y^2) + eps) * norm_weight``, fused into one pass forward (reads h, c and
the gate once, writes y and the per-row rstd) and one pass backward.

Four implementations of one contract, chosen by ``backend=``:

* ``"triton"``: ``lamina.kernels.hrm_update`` (CUDA tensors, or CPU under the interpreter);
* ``"cuda"``: the CUDA C++ kernel of ``lamina._C`` (``csrc/hrm_update_kernel.cu``);
* ``"cpu-ext"``: the CPU C++ kernel of ``lamina._C`` (``csrc/hrm_update_cpu.cpp``);
* ``"torch"``: the same formulas in PyTorch (the CPU default without the extension).

``"auto"``: on CUDA the CUDA C++ kernel when ``lamina._C`` has CUDA and it measured faster
than Triton for this width and dtype (timed once per configuration), else Triton; on CPU
Triton under ``TRITON_INTERPRET=1``, else the C++ CPU kernel when built, else PyTorch.

The forward and backward are ``torch.library.custom_op`` s with fake implementations, so
``torch.compile(fullgraph=True)`` traces through ``HrmGatedUpdateFunction``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lamina._dispatch import interpreter_enabled, select_backend
from lamina._optional import compiled_extension
from lamina._validate import FLOAT_DTYPES, check_same_device, check_tensor, overlaps

OP = "hrm_gated_update"
BACKENDS = ("auto", "triton", "cuda", "torch", "cpu-ext")
# Gate projections per channel [..., D] or per token [..., 1].
GATES = ("channel", "token")


# --- the four implementations ------------------------------------------------------------------

def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _torch_mix(h, c, gate, bias):
    acc = _compute_dtype(h.dtype)
    logits = gate.to(acc) if bias is None else gate.to(acc) + bias.to(acc)
    z = torch.sigmoid(logits)
    return h.to(acc), c.to(acc), z, z * h.to(acc) + (1 - z) * c.to(acc)


def _torch_fwd(h, c, gate, bias, weight, eps, y):
    _, _, _, mix = _torch_mix(h, c, gate, bias)
    rstd = None
    if weight is not None:
        rstd = torch.rsqrt(mix.pow(2).mean(dim=1) + eps)
        mix = mix * rstd[:, None] * weight.to(mix.dtype)
    y.copy_(mix)
    return rstd


def _torch_bwd(dy, h, c, gate, bias, weight, rstd):
    h_, c_, z, mix = _torch_mix(h, c, gate, bias)
    dy_ = dy.to(mix.dtype)
    dweight = None
    if weight is not None:
        yn = mix * rstd[:, None]
        dweight = (dy_ * yn).sum(dim=0).to(weight.dtype)
        dyn = dy_ * weight.to(mix.dtype)
        dmix = (dyn - yn * (dyn * yn).mean(dim=1, keepdim=True)) * rstd[:, None]
    else:
        dmix = dy_
    dgate = dmix * (h_ - c_) * z * (1 - z)
    if gate.shape[1] != h.shape[1]:
        dgate = dgate.sum(dim=1, keepdim=True)
    dbias = dgate.sum(dim=0).to(bias.dtype) if bias is not None else None
    return (dmix * z).to(h.dtype), (dmix * (1 - z)).to(c.dtype), dgate.to(gate.dtype), dbias, dweight


def _ext_fwd(h, c, gate, bias, weight, eps, y):
    rstd = torch.ops.lamina_C.hrm_update_fwd(h, c, gate, bias, weight, eps, y)
    return rstd if weight is not None else None


def _ext_bwd(dy, h, c, gate, bias, weight, rstd):
    dh, dc, dg, db, dw = torch.ops.lamina_C.hrm_update_bwd(dy, h, c, gate, bias, weight, rstd)
    return dh, dc, dg, (db if bias is not None else None), (dw if weight is not None else None)


def _triton_fwd(*args):
    from lamina.kernels.hrm_update import hrm_update_fwd

    return hrm_update_fwd(*args)


def _triton_bwd(*args):
    from lamina.kernels.hrm_update import hrm_update_bwd

    return hrm_update_bwd(*args)


_FWD = {"torch": _torch_fwd, "triton": _triton_fwd, "cuda": _ext_fwd, "cpu-ext": _ext_fwd}
_BWD = {"torch": _torch_bwd, "triton": _triton_bwd, "cuda": _ext_bwd, "cpu-ext": _ext_bwd}

# Timing runs per candidate when "auto" chooses between the CUDA C++ and Triton kernels.
_CHOICE_REPEATS = 5
_CUDA_CHOICE: dict[tuple, str] = {}


def _time_ms(fn) -> float:
    fn()  # warm-up: compiles the Triton kernel on first use
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(_CHOICE_REPEATS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / _CHOICE_REPEATS


def _resolve_cuda_auto(direction: str, h: torch.Tensor, gate: torch.Tensor, bias, weight, run) -> str:
    """Which of "cuda" and "triton" runs ``run(backend)`` faster, measured once per configuration."""
    key = (direction, h.dtype, h.shape[1], gate.shape[1], bias is not None, weight is not None)
    if key not in _CUDA_CHOICE:
        if torch.cuda.is_current_stream_capturing():
            return "triton"  # no timing inside a CUDA graph capture
        _CUDA_CHOICE[key] = min(("cuda", "triton"), key=lambda b: _time_ms(lambda: run(b)))
    return _CUDA_CHOICE[key]


# --- custom ops: what torch.compile sees ---------------------------------------------------------

def _no_rstd(h: torch.Tensor) -> torch.Tensor:
    return h.new_empty((0,), dtype=_compute_dtype(h.dtype))


def _fwd_into(h, c, gate, bias, weight, eps, backend, y) -> torch.Tensor:
    if backend == "auto":  # only reaches here for CUDA tensors with a CUDA-built extension
        backend = _resolve_cuda_auto("fwd", h, gate, bias, weight,
                                     lambda b: _FWD[b](h, c, gate, bias, weight, eps, torch.empty_like(y)))
    rstd = _FWD[backend](h, c, gate, bias, weight, eps, y)
    return rstd if rstd is not None else _no_rstd(h)


@torch.library.custom_op("lamina::hrm_gated_update_fwd", mutates_args=())
def _fwd_op(h: torch.Tensor, c: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
            weight: torch.Tensor | None, eps: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty_like(h)
    return y, _fwd_into(h, c, gate, bias, weight, eps, backend, y)


@_fwd_op.register_fake
def _(h, c, gate, bias, weight, eps, backend):
    n = h.shape[0] if weight is not None else 0
    return torch.empty_like(h), h.new_empty((n,), dtype=_compute_dtype(h.dtype))


@torch.library.custom_op("lamina::hrm_gated_update_fwd_out", mutates_args=("out",))
def _fwd_out_op(h: torch.Tensor, c: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                weight: torch.Tensor | None, eps: float, backend: str, out: torch.Tensor) -> torch.Tensor:
    return _fwd_into(h, c, gate, bias, weight, eps, backend, out)


@_fwd_out_op.register_fake
def _(h, c, gate, bias, weight, eps, backend, out):
    n = h.shape[0] if weight is not None else 0
    return h.new_empty((n,), dtype=_compute_dtype(h.dtype))


@torch.library.custom_op("lamina::hrm_gated_update_bwd", mutates_args=())
def _bwd_op(dy: torch.Tensor, h: torch.Tensor, c: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
            weight: torch.Tensor | None, rstd: torch.Tensor, backend: str) -> list[torch.Tensor]:
    rstd_ = rstd if weight is not None else None
    if backend == "auto":
        backend = _resolve_cuda_auto("bwd", h, gate, bias, weight,
                                     lambda b: _BWD[b](dy, h, c, gate, bias, weight, rstd_))
    dh, dc, dg, db, dw = _BWD[backend](dy, h, c, gate, bias, weight, rstd_)
    # custom ops return tensors only: an absent parameter's gradient travels as an empty tensor
    db = db if db is not None else h.new_empty((0,))
    dw = dw if dw is not None else h.new_empty((0,))
    return [dh, dc, dg, db, dw]


@_bwd_op.register_fake
def _(dy, h, c, gate, bias, weight, rstd, backend):
    db = torch.empty_like(bias) if bias is not None else h.new_empty((0,))
    dw = torch.empty_like(weight) if weight is not None else h.new_empty((0,))
    return [torch.empty_like(h), torch.empty_like(c), torch.empty_like(gate), db, dw]


class HrmGatedUpdateFunction(torch.autograd.Function):
    """Autograd over the fused op. Inputs keep their shapes; rows are flattened inside."""

    @staticmethod
    def forward(ctx, h, c, gate_logits, bias, norm_weight, eps, backend, out):
        d = h.shape[-1]
        h2, c2 = h.reshape(-1, d).contiguous(), c.reshape(-1, d).contiguous()
        g2 = gate_logits.reshape(h2.shape[0], gate_logits.shape[-1]).contiguous()
        if out is None:
            y2, rstd = torch.ops.lamina.hrm_gated_update_fwd(h2, c2, g2, bias, norm_weight, eps, backend)
            y = y2.view(h.shape)
        else:
            rstd = torch.ops.lamina.hrm_gated_update_fwd_out(h2, c2, g2, bias, norm_weight, eps, backend,
                                                             out.view(-1, d))
            ctx.mark_dirty(out)
            y = out
        ctx.save_for_backward(h2, c2, g2, bias, norm_weight, rstd)
        ctx.backend = backend
        ctx.shapes = (h.shape, c.shape, gate_logits.shape)
        return y

    @staticmethod
    def backward(ctx, dy):
        h2, c2, g2, bias, weight, rstd = ctx.saved_tensors
        h_shape, c_shape, g_shape = ctx.shapes
        dh, dc, dg, db, dw = torch.ops.lamina.hrm_gated_update_bwd(
            dy.reshape(h2.shape).contiguous(), h2, c2, g2, bias, weight, rstd, ctx.backend)
        # one gradient per input: h, c, gate_logits, bias, norm_weight, eps, backend, out
        return (dh.view(h_shape), dc.view(c_shape), dg.view(g_shape),
                db if bias is not None else None, dw if weight is not None else None, None, None, None)


# --- validation and the functional API -----------------------------------------------------------

def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _validate(h, c, gate_logits, bias, norm_weight, eps, out, backend) -> None:
    check_tensor("h", h, dtypes=FLOAT_DTYPES)
    check_tensor("c", c, dtypes=FLOAT_DTYPES)
    check_tensor("gate_logits", gate_logits, dtypes=FLOAT_DTYPES)
    if h.dim() < 1 or h.shape[-1] == 0:
        raise ValueError(f"h must have shape [..., D] with D >= 1, got {tuple(h.shape)}")
    d = h.shape[-1]
    if c.shape != h.shape:
        raise ValueError(f"c must have the shape of h {tuple(h.shape)} (no broadcasting), got {tuple(c.shape)}")
    lead = tuple(h.shape[:-1])
    if gate_logits.shape not in ((*lead, d), (*lead, 1)):
        raise ValueError(
            f"gate_logits must have shape {(*lead, d)} (per channel) or {(*lead, 1)} (per token), "
            f"got {tuple(gate_logits.shape)}"
        )
    for name, t in (("c", c), ("gate_logits", gate_logits)):
        if t.dtype != h.dtype:
            raise ValueError(f"{name} must have the dtype of h ({h.dtype}), got {t.dtype}")
    g = gate_logits.shape[-1]
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != g:
            raise ValueError(
                f"bias must have shape ({g},) to match the last dim of gate_logits {tuple(gate_logits.shape)}, "
                f"got {tuple(bias.shape)}"
            )
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, ndim=1)
        if norm_weight.shape[0] != d:
            raise ValueError(f"norm_weight must have shape ({d},), got {tuple(norm_weight.shape)}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0 or not math.isfinite(eps):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    if backend not in BACKENDS:
        raise ValueError(f"{OP}: backend must be one of {BACKENDS}, got {backend!r}")
    if out is not None:
        check_tensor("out", out, dtypes=None)
    check_same_device(h=h, c=c, gate_logits=gate_logits, bias=bias, norm_weight=norm_weight, out=out)
    if out is not None:
        _validate_out(out, h, c, gate_logits, bias, norm_weight)


def _validate_out(out, h, c, gate_logits, bias, norm_weight) -> None:
    if out.shape != h.shape:
        raise ValueError(f"out must have the shape of h {tuple(h.shape)}, got {tuple(out.shape)}")
    if out.dtype != h.dtype:
        raise ValueError(f"out must have the dtype of h ({h.dtype}), got {out.dtype}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()} for shape {tuple(out.shape)}")
    if out.requires_grad:
        raise ValueError("out must not require grad: it is overwritten; pass out=None to get a new tensor")
    inputs = (("h", h), ("c", c), ("gate_logits", gate_logits), ("bias", bias), ("norm_weight", norm_weight))
    records_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for _, t in inputs)
    for name, t in inputs:
        if t is None or not overlaps(out, t):
            continue
        if records_grad:
            raise ValueError(
                f"out overlaps {name}, which the backward needs (it recomputes the mix from h, c and the gate); "
                "pass out=None, or run under torch.no_grad()"
            )
        if name in ("bias", "norm_weight") or not _same_view(out, t):
            raise ValueError(
                f"out partially overlaps {name}: it may only be exactly the same tensor as h, c or gate_logits"
            )


def _ext_has_op() -> bool:
    return compiled_extension() is not None and hasattr(torch.ops.lamina_C, "hrm_update_fwd")


def resolve_backend(backend: str, tensors: Sequence[torch.Tensor | None]) -> str:
    """The implementation ``hrm_gated_update`` runs for ``backend`` on the device of ``tensors``
    (``h, c, gate_logits, ...``).

    Returns one of "triton", "cuda", "torch", "cpu-ext", or "auto" when the choice between
    the CUDA C++ and Triton kernels is left to a one-time measurement.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{OP}: backend must be one of {BACKENDS}, got {backend!r}")
    on_cuda = any(t is not None and t.is_cuda for t in tensors)
    if backend == "cpu-ext":
        if on_cuda:
            raise ValueError(f"{OP}: backend='cpu-ext' needs CPU tensors, got CUDA tensors")
        if not _ext_has_op():
            from lamina._optional import require_compiled_extension

            require_compiled_extension()
            raise ValueError(f"{OP}: lamina._C was built without the hrm_update ops; rebuild the extension")
        return "cpu-ext"
    # the CUDA C++ kernel covers float32, float16 and bfloat16; float64 runs on Triton
    dtypes = {t.dtype for t in tensors[:3] if t is not None}
    has_cuda_kernel = torch.float64 not in dtypes
    if backend == "cuda" and not has_cuda_kernel:
        raise ValueError(f"{OP}: backend='cuda' supports float32, float16 and bfloat16 inputs, got float64")
    resolved = select_backend(OP, backend, tensors, has_cuda_kernel=has_cuda_kernel)
    if backend == "auto" and resolved == "cuda":
        return "auto"
    if backend == "auto" and resolved == "torch" and not interpreter_enabled() and _ext_has_op():
        return "cpu-ext"
    return resolved


def hrm_gated_update(
    h: torch.Tensor,
    c: torch.Tensor,
    gate_logits: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Gated update of a state: ``y = z * h + (1 - z) * c`` with ``z = sigmoid(gate_logits + bias)``,
    then ``y / sqrt(mean(y ** 2, -1) + eps) * norm_weight`` when ``norm_weight`` is given.

    Args:
        h: [..., D] state kept with weight z.
        c: [..., D] candidate kept with weight 1 - z; same shape and dtype as h (no broadcasting).
        gate_logits: [..., D] (per-channel gate) or [..., 1] (per-token gate), dtype of h.
        bias: [D] for a per-channel gate, [1] for a per-token gate; any float dtype.
        norm_weight: [D] RMSNorm weight; None skips the normalisation.
        eps: added to the mean square.
        out: [..., D] contiguous tensor of h's dtype to write y into (returned). It must not require
            grad, and must not overlap an input when autograd records the op (the backward reads
            h, c and the gate); without autograd it may be exactly h, c or gate_logits (in place).
        backend: "auto", "triton", "cuda", "torch" or "cpu-ext" (see the module docstring).

    Returns:
        y: [..., D] in h's dtype. Low-precision inputs are computed in float32.
    """
    _validate(h, c, gate_logits, bias, norm_weight, eps, out, backend)
    resolved = resolve_backend(backend, (h, c, gate_logits, bias, norm_weight))
    return HrmGatedUpdateFunction.apply(h, c, gate_logits, bias, norm_weight, float(eps), resolved, out)


# --- performance model (imported by the benchmark suite) -----------------------------------------

# Floating-point operations per element, counted as in the kernels:
# gate: bias add, negate, exp, add, divide (5); mix: z*h, 1-z, (1-z)*c, add (4);
# norm: square and accumulate (2), scale by rstd and weight (2).
_FWD_FLOPS_GATE, _FWD_FLOPS_MIX, _FWD_FLOPS_NORM = 5, 4, 4
# backward: recompute gate and mix (9); norm: yn, dw accumulate, dy*w, row dot, dmix (8);
# dh, 1-z, dc, h-c, dz, z(1-z), dgate, bias accumulate (8).
_BWD_FLOPS_RECOMPUTE, _BWD_FLOPS_NORM, _BWD_FLOPS_GRADS = 9, 8, 8


def _rows_d(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) < 1:
        raise ValueError(f"shape must be [..., D], got {tuple(shape)}")
    return math.prod(shape[:-1]), shape[-1]


def hrm_update_bytes(
    shape: Sequence[int],
    dtype: torch.dtype,
    gate: str = "channel",
    bias: bool = True,
    norm: bool = True,
    mode: str = "fwd",
    param_dtype: torch.dtype = torch.float32,
) -> int:
    """The fewest bytes the fused op must move for ``h`` of ``shape`` ([..., D]) in ``dtype``.

    Forward: read h, c, gate (per channel N*D, per token N), bias, weight; write y and, when
    normalising, the float32 rstd [N]. Backward: read dy, h, c, gate, rstd, bias, weight; write
    dh, dc, dgate, dbias, dweight. Partial sums of the two-stage reductions are not counted.
    ``mode``: "fwd", "bwd" or "fwd+bwd".
    """
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    if mode not in ("fwd", "bwd", "fwd+bwd"):
        raise ValueError(f"mode must be 'fwd', 'bwd' or 'fwd+bwd', got {mode!r}")
    n, d = _rows_d(shape)
    e, pe = dtype.itemsize, param_dtype.itemsize
    rstd_e = 8 if dtype == torch.float64 else 4
    nd = n * d
    gate_elems = nd if gate == "channel" else n
    params = ((d if gate == "channel" else 1) if bias else 0) + (d if norm else 0)
    rstd = n * rstd_e if norm else 0
    fwd = (2 * nd + gate_elems) * e + params * pe + nd * e + rstd
    bwd = (3 * nd + gate_elems) * e + rstd + params * pe + (2 * nd + gate_elems) * e + params * pe
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def hrm_update_flops(shape: Sequence[int], norm: bool = True, mode: str = "fwd") -> int:
    """Floating-point operations of the fused op for ``h`` of ``shape`` ([..., D]); per-element counts above."""
    if mode not in ("fwd", "bwd", "fwd+bwd"):
        raise ValueError(f"mode must be 'fwd', 'bwd' or 'fwd+bwd', got {mode!r}")
    n, d = _rows_d(shape)
    fwd = (_FWD_FLOPS_GATE + _FWD_FLOPS_MIX + (_FWD_FLOPS_NORM if norm else 0)) * n * d
    bwd = (_BWD_FLOPS_RECOMPUTE + _BWD_FLOPS_GRADS + (_BWD_FLOPS_NORM if norm else 0)) * n * d
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]
