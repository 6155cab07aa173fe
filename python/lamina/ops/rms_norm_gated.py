"""RMSNorm with an optional residual input and an optional output gate: ``rms_norm`` and
``rms_norm_gated`` (fla 0.6's ``fla.modules.norm.layernorm.rms_norm`` and
``fla.modules.norm.fused_norm_gate.rms_norm_gated``: same names, argument order and semantics).

For rows of ``x: [..., D]``::

    s = x + residual                                      # when a residual is given
    y = (s / sqrt(mean(s^2) + eps) * weight + bias) * act(g)

The gate multiplies after the norm (fla's ``FusedRMSNormGated``; fla's other gated norm,
``RMSNormGated`` with ``norm_before_gate`` and groups, is a different op). ``act``: "swish" / "silu"
(``g * sigmoid(g)``) or "sigmoid". With ``prenorm=True`` the ops also return ``residual_out``, the
stream to carry to the next block: ``x + residual`` in the residual's dtype, or, without a
residual, x itself (float32 with ``residual_in_fp32=True``), as fla does.

``l2_norm`` is the same kernel with the sum of squares in place of their mean (``x / sqrt(sum(x^2) +
eps)``, fla's ``l2_norm``): the delta-rule ops' ``use_qk_l2norm_in_kernel`` runs it on q and k, one
pass each way instead of PyTorch's several float32 passes.

Paths (``backend=``, ``lamina._dispatch.select_backend``): Triton kernels
(``lamina.kernels.rms_norm_gated``; CUDA tensors, or CPU under ``TRITON_INTERPRET=1``) as
``torch.library.custom_op`` s with fake implementations; PyTorch (the CPU default, and float64),
differentiated by autograd. Low-precision inputs are computed in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lamina._dispatch import BACKENDS, select_backend
from lamina._validate import FLOAT_DTYPES, check_same_device, check_tensor

# Gate activations (fla's names); "silu" is another name of "swish".
ACTIVATIONS = ("swish", "silu", "sigmoid")
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The kernels' name of each activation; "none" marks plain RMSNorm.
_KERNEL_GATE = {None: "none", "swish": "swish", "silu": "swish", "sigmoid": "sigmoid"}


# --- PyTorch path ----------------------------------------------------------------------------------

def _torch_norm(x, residual, g, weight, bias, eps, gate, residual_out_dtype, norm="rms"):
    """(y, residual_out or None) on [N, D] rows, differentiable by autograd."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = x.to(compute) if residual is None else x.to(compute) + residual.to(compute)
    squares = s.pow(2)
    y = s * torch.rsqrt((squares.mean if norm == "rms" else squares.sum)(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    if gate == "swish":
        y = y * F.silu(g.to(compute))
    elif gate == "sigmoid":
        y = y * torch.sigmoid(g.to(compute))
    res_out = None if residual_out_dtype is None else s.to(residual_out_dtype)
    return y.to(x.dtype), res_out


# --- Triton path: custom ops ---------------------------------------------------------------------

def _none_if_empty(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None or (t.dim() == 1 and t.numel() == 0) else t


@torch.library.custom_op(
    "lamina::rms_norm_fwd", mutates_args=(),
    schema="(Tensor x, Tensor? residual, Tensor? g, Tensor? weight, Tensor? bias, float eps, str gate, "
           "ScalarType? residual_out_dtype, str norm) -> (Tensor, Tensor, Tensor)")
def _fwd_op(x, residual, g, weight, bias, eps, gate, residual_out_dtype, norm):
    """(y, rstd, residual_out or [0]); residual_out (x + residual) is written when its dtype is given."""
    from lamina.kernels.rms_norm_gated import rms_norm_fwd

    y, rstd, res_out = rms_norm_fwd(x, residual, g, weight, bias, eps, gate, residual_out_dtype, norm)
    return y, rstd, (x.new_zeros(0) if res_out is None else res_out)


@_fwd_op.register_fake
def _fwd_fake(x, residual, g, weight, bias, eps, gate, residual_out_dtype, norm):
    res_out = x.new_empty(0) if residual_out_dtype is None else x.new_empty(x.shape, dtype=residual_out_dtype)
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32), res_out


@torch.library.custom_op(
    "lamina::rms_norm_bwd", mutates_args=(),
    schema="(Tensor dy, Tensor? dresidual_out, Tensor x, Tensor? residual, Tensor? g, Tensor? weight, "
           "Tensor? bias, Tensor rstd, str gate, str norm) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def _bwd_op(dy, dresidual_out, x, residual, g, weight, bias, rstd, gate, norm):
    """(dx, dresidual, dg, dweight, dbias), ``[0]`` where the input is None."""
    from lamina.kernels.rms_norm_gated import rms_norm_bwd

    grads = rms_norm_bwd(dy, dresidual_out, x, residual, g, weight, bias, rstd, gate, norm)
    return tuple(x.new_zeros(0) if t is None else t for t in grads)


@_bwd_op.register_fake
def _bwd_fake(dy, dresidual_out, x, residual, g, weight, bias, rstd, gate, norm):
    return tuple(x.new_empty(0) if t is None else torch.empty_like(t) for t in (x, residual, g, weight, bias))


def _setup_context(ctx, inputs, output):
    x, residual, g, weight, bias, _, gate, _, norm = inputs
    ctx.save_for_backward(x, residual, g, weight, bias, output[1])
    ctx.gate, ctx.norm = gate, norm


def _backward(ctx, dy, _drstd, dres_out):
    # one gradient per input of lamina::rms_norm_fwd: x, residual, g, weight, bias, eps, gate, residual_out_dtype,
    # norm
    x, residual, g, weight, bias, rstd = ctx.saved_tensors
    dy = torch.zeros_like(x) if dy is None else dy.contiguous()
    dres_out = _none_if_empty(dres_out)
    dres_out = None if dres_out is None else dres_out.contiguous()
    dx, dres, dg, dw, db = _bwd_op(dy, dres_out, x, residual, g, weight, bias, rstd, ctx.gate, ctx.norm)

    def present(grad, inp):
        return None if inp is None else grad

    return dx, present(dres, residual), present(dg, g), present(dw, weight), present(db, bias), None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# --- validation and the functional API -----------------------------------------------------------

def _validate(op, x, g, weight, bias, residual, eps, prenorm, residual_in_fp32, backend) -> None:
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have shape [..., D] with D >= 1, got {tuple(x.shape)}")
    D = x.shape[-1]
    if g is not None:
        check_tensor("g", g, dtypes=FLOAT_DTYPES)
        if g.shape != x.shape:
            raise ValueError(f"g must have the shape of x {tuple(x.shape)} (no broadcasting), got {tuple(g.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(name, t, ndim=1)
            if t.shape[0] != D:
                raise ValueError(f"{name} must have shape ({D},) to match the last dim of x, got {tuple(t.shape)}")
    if residual is not None:
        check_tensor("residual", residual, dtypes=FLOAT_DTYPES)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0 or not math.isfinite(eps):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    for name, flag in (("prenorm", prenorm), ("residual_in_fp32", residual_in_fp32)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    check_same_device(x=x, g=g, weight=weight, bias=bias, residual=residual)


def _run(op, x, g, weight, bias, gate, residual, eps, prenorm, residual_in_fp32, backend, norm="rms"):
    _validate(op, x, g, weight, bias, residual, eps, prenorm, residual_in_fp32, backend)
    path = select_backend(op, backend, (x, g, weight, bias, residual))
    if path == "triton" and any(t is not None and t.dtype not in KERNEL_DTYPES for t in (x, g, residual)):
        if backend == "triton":
            got = ", ".join(f"{n} {str(t.dtype).replace('torch.', '')}"
                            for n, t in (("x", x), ("g", g), ("residual", residual)) if t is not None)
            raise ValueError(f"{op}: the Triton kernels take float32/float16/bfloat16 x, g and residual, got {got}; "
                             "use backend='torch' (or 'auto') for float64")
        path = "torch"  # float64 keeps its precision on the PyTorch path
    D = x.shape[-1]
    # the stream carried to the next block: fused into the kernel when there is a residual to add
    res_dtype = residual.dtype if residual is not None and prenorm else None
    x2 = x.reshape(-1, D)
    r2 = None if residual is None else residual.reshape(-1, D)
    g2 = None if g is None else g.reshape(-1, D)
    if path == "torch":
        y, res_out = _torch_norm(x2, r2, g2, weight, bias, float(eps), gate, res_dtype, norm)
    else:
        x2, r2, g2, weight, bias = (None if t is None else t.contiguous() for t in (x2, r2, g2, weight, bias))
        y, _, res_out = _fwd_op(x2, r2, g2, weight, bias, float(eps), gate, res_dtype, norm)
    y = y.view(x.shape)
    if not prenorm:
        return y
    if residual is not None:
        return y, res_out.view(x.shape)
    return y, (x.float() if residual_in_fp32 else x)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the rows of ``x (+ residual)``: ``s / sqrt(mean(s^2) + eps) * weight + bias``.

    Args:
        x: [..., D].
        weight: [D] or None (no scale). bias: [D] or None.
        residual: [..., D] like x, added before the norm.
        eps: added to the mean square.
        prenorm: also return ``residual_out`` (module docstring).
        residual_in_fp32: without a residual, return ``residual_out`` in float32.
        backend: "auto", "triton" or "torch" (``lamina._dispatch``).

    Returns:
        y [..., D] in x's dtype, or (y, residual_out) with ``prenorm``.
    """
    return _run("rms_norm", x, None, weight, bias, "none", residual, eps, prenorm, residual_in_fp32, backend)


def rms_norm_gated(
    x: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    activation: str = "swish",
    residual: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    eps: float = 1e-6,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gated RMSNorm: ``(s / sqrt(mean(s^2) + eps) * weight + bias) * act(g)`` with ``s = x (+ residual)``.

    Args:
        x: [..., D].
        g: [..., D] like x, the gate (its own dtype; dg comes back in it).
        weight: [D] or None. bias: [D] or None.
        activation: "swish" / "silu" (``g * sigmoid(g)``) or "sigmoid".
        residual, prenorm, residual_in_fp32, eps, backend: as for ``rms_norm`` (fla's default eps
            for this function is 1e-6; its module ``FusedRMSNormGated`` uses 1e-5).

    Returns:
        y [..., D] in x's dtype, or (y, residual_out) with ``prenorm``.
    """
    check_tensor("g", g, dtypes=FLOAT_DTYPES)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return _run("rms_norm_gated", x, g, weight, bias, _KERNEL_GATE[activation], residual, eps, prenorm,
                residual_in_fp32, backend)


def l2_norm(x: torch.Tensor, eps: float = 1e-6, backend: str = "auto") -> torch.Tensor:
    """The L2 norm of the rows of ``x``: ``x / sqrt(sum(x^2) + eps)`` (fla's ``l2_norm``), in x's dtype.

    Args:
        x: [..., D].
        eps: added to the sum of squares.
        backend: "auto", "triton" or "torch" (``lamina._dispatch``); float64 runs on the PyTorch path.

    Returns:
        [..., D] in x's dtype (computed in float32 for lower precisions).
    """
    return _run("l2_norm", x, None, None, None, "none", None, eps, False, False, backend, norm="l2")


__all__ = ["ACTIVATIONS", "l2_norm", "rms_norm", "rms_norm_gated"]
