"""The short convolution: ``lamina.ops.short_conv.causal_conv1d`` and ``causal_conv1d_update``.

A depthwise causal conv1d over ``x: [B, T, D]`` with a window ``weight: [D, W]``, optional bias,
optional SiLU, optional residual added after the activation, and the window state of decoding
(``[N, D, W]``: the last W inputs of each sequence, column W - 1 the most recent). Names, argument
order and semantics are fla 0.6's (``fla.modules.causal_conv1d``), so an fla user changes only the
import; ``lamina.reference.short_conv`` states the math.

Paths (``backend=``, resolved as ``lamina._dispatch.select_backend`` does):

* Triton (``lamina.kernels.short_conv``): on CUDA tensors, and on CPU tensors under
  ``TRITON_INTERPRET=1``; forward and backward are ``torch.library.custom_op`` s with fake
  implementations, so ``torch.compile(fullgraph=True)`` traces through them.
* PyTorch: the CPU default (and float64): ``F.conv1d`` over the window-padded sequence, differentiated
  by autograd.

``backend``: "auto" (the table above), "torch" (always PyTorch), or one of fla's names "triton"
(fla's default), "cuda", "mix". fla's names choose between fla's GPU implementations; lamina has one,
its Triton kernels, so they all mean "auto": the Triton kernels where they run, PyTorch on CPU
tensors without the interpreter, so that code written for fla runs unchanged on a CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lamina._dispatch import select_backend
from lamina._validate import check_cu_seqlens, check_no_overlap, check_same_device, check_tensor

OP = "causal_conv1d"
OP_UPDATE = "causal_conv1d_update"
# Activations applied to the convolution output (fla's): None, or SiLU under either name.
ACTIVATIONS = (None, "silu", "swish")
# fla's backend names (choices among fla's GPU implementations), all served by lamina's Triton path.
FLA_BACKENDS = ("triton", "cuda", "mix")
BACKENDS = ("auto", "torch", *FLA_BACKENDS)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- PyTorch path ----------------------------------------------------------------------------------

def _torch_segment(x, weight, bias, initial_state, silu):
    """One batch of equal-length sequences: ``x [B, L, D]``, ``initial_state [B, D, W]`` or None ->
    (act(conv) [B, L, D] in the compute dtype, final window [B, D, W])."""
    compute = _compute_dtype(x.dtype)
    B, L, D = x.shape
    W = weight.shape[1]
    if initial_state is not None:
        prev = initial_state.to(compute)
    else:
        prev = torch.zeros((B, D, W), device=x.device, dtype=compute)
    xx = torch.cat([prev, x.to(compute).transpose(1, 2)], dim=2)  # [B, D, W + L]: input s at column W + s
    if L == 0:
        return xx.new_zeros((B, 0, D)), xx[:, :, -W:]
    # output t reads inputs t - W + 1 .. t, columns t + 1 .. t + W of xx
    pre = F.conv1d(xx[:, :, 1:], weight.to(compute).unsqueeze(1), None if bias is None else bias.to(compute),
                   groups=D)
    out = F.silu(pre) if silu else pre
    return out.transpose(1, 2), xx[:, :, -W:]


def _torch_conv(x, weight, bias, residual, initial_state, silu, output_final_state, lengths):
    if lengths is None:
        out, final = _torch_segment(x, weight, bias, initial_state, silu)
    else:
        outs, finals, bos = [], [], 0
        for n, length in enumerate(lengths):
            state = None if initial_state is None else initial_state[n:n + 1]
            o, f = _torch_segment(x[:, bos:bos + length], weight, bias, state, silu)
            outs.append(o)
            finals.append(f)
            bos += length
        out = torch.cat(outs, dim=1)
        final = torch.cat(finals, dim=0) if finals else x.new_zeros((0, *weight.shape))
    if residual is not None:
        out = out + residual.to(out.dtype)
    return out.to(x.dtype), (final.to(x.dtype) if output_final_state else None)


def _torch_step(x, cache, weight, bias, residual, silu):
    compute = _compute_dtype(x.dtype)
    window = torch.cat([cache[:, :, 1:].to(compute), x.to(compute).unsqueeze(2)], dim=2)
    y = (window * weight.to(compute)).sum(dim=2)
    if bias is not None:
        y = y + bias.to(compute)
    if silu:
        y = F.silu(y)
    if residual is not None:
        y = y + residual.to(compute)
    cache.copy_(window)
    return y.to(x.dtype)


# --- Triton path: custom ops ---------------------------------------------------------------------

def _none_if_empty(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None or (t.dim() == 1 and t.numel() == 0) else t


def _n_sequences(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    return x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


@torch.library.custom_op(
    "lamina::causal_conv1d_fwd", mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, Tensor? initial_state, Tensor? cu_seqlens, "
           "Tensor? tiles, bool silu, bool output_final_state) -> (Tensor, Tensor)")
def _fwd_op(x, weight, bias, residual, initial_state, cu_seqlens, tiles, silu, output_final_state):
    """(y, final_state or [0]): an empty 1-d tensor stands for None (ops return tensors)."""
    from lamina.kernels.short_conv import causal_conv1d_fwd

    y, final = causal_conv1d_fwd(x, weight, bias, residual, initial_state, silu, output_final_state, cu_seqlens,
                                 tiles)
    return y, (x.new_zeros(0) if final is None else final)


@_fwd_op.register_fake
def _fwd_fake(x, weight, bias, residual, initial_state, cu_seqlens, tiles, silu, output_final_state):
    y = x.new_empty(x.shape)
    if not output_final_state:
        return y, x.new_empty(0)
    return y, x.new_empty((_n_sequences(x, cu_seqlens), *weight.shape))


@torch.library.custom_op(
    "lamina::causal_conv1d_bwd", mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor? bias, Tensor? initial_state, Tensor dy, Tensor? dht, "
           "Tensor? cu_seqlens, Tensor? tiles, bool silu) -> (Tensor, Tensor, Tensor, Tensor)")
def _bwd_op(x, weight, bias, initial_state, dy, dht, cu_seqlens, tiles, silu):
    """(dx, dweight, dbias or [0], dinitial_state or [0])."""
    from lamina.kernels.short_conv import causal_conv1d_bwd

    dx, dw, db, ds = causal_conv1d_bwd(x, weight, bias, initial_state, dy, dht, silu, cu_seqlens, tiles)
    return dx, dw, (x.new_zeros(0) if db is None else db), (x.new_zeros(0) if ds is None else ds)


@_bwd_op.register_fake
def _bwd_fake(x, weight, bias, initial_state, dy, dht, cu_seqlens, tiles, silu):
    return (x.new_empty(x.shape), torch.empty_like(weight),
            x.new_empty(0) if bias is None else torch.empty_like(bias),
            x.new_empty(0) if initial_state is None else torch.empty_like(initial_state))


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, initial_state, cu_seqlens, tiles, silu, _ = inputs
    ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens, tiles)
    ctx.silu = silu
    ctx.residual_dtype = None if residual is None else residual.dtype


def _backward(ctx, dy, dfinal):
    # one gradient per input of lamina::causal_conv1d_fwd:
    # x, weight, bias, residual, initial_state, cu_seqlens, tiles, silu, output_final_state
    x, weight, bias, initial_state, cu_seqlens, tiles = ctx.saved_tensors
    dy = torch.zeros(x.shape, device=x.device, dtype=x.dtype) if dy is None else dy.contiguous()
    dht = _none_if_empty(dfinal)
    dht = None if dht is None else dht.contiguous()
    dx, dw, db, ds = _bwd_op(x, weight, bias, initial_state, dy, dht, cu_seqlens, tiles, ctx.silu)
    dres = None if ctx.residual_dtype is None else dy.to(ctx.residual_dtype)
    return (dx, dw, _none_if_empty(db) if bias is not None else None, dres,
            _none_if_empty(ds) if initial_state is not None else None, None, None, None, None)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("lamina::causal_conv1d_update", mutates_args=("cache",))
def _step_op(x: torch.Tensor, cache: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             residual: torch.Tensor | None, silu: bool) -> torch.Tensor:
    from lamina.kernels.short_conv import causal_conv1d_step

    return causal_conv1d_step(x, cache, weight, bias, residual, silu)


@_step_op.register_fake
def _(x, cache, weight, bias, residual, silu):
    return x.new_empty(x.shape)


# --- validation and dispatch ---------------------------------------------------------------------

def _check_activation(activation: object) -> bool:
    """True for SiLU; raises for anything but fla's activations."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation is not None


def _check_weight(weight: object, bias: object) -> tuple[int, int]:
    """(D, W) of ``weight: [D, W]``; checks ``bias: [D]``."""
    if weight is None:
        raise TypeError("weight must be a torch.Tensor of shape [D, W] (the depthwise window), got None")
    check_tensor("weight", weight, ndim=2)
    D, W = weight.shape
    if D < 1 or W < 1:
        raise ValueError(f"weight must have shape [D, W] with D >= 1 and W >= 1, got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if tuple(bias.shape) != (D,):
            raise ValueError(f"bias must have shape ({D},) to match weight {tuple(weight.shape)}, "
                             f"got {tuple(bias.shape)}")
    return D, W


def _flat_channels(name: str, x: torch.Tensor, lead: int, D: int) -> tuple[int, ...]:
    """The leading ``lead`` dims of x; its remaining dims must hold D channels ([.., D] or [.., H, K])."""
    rest = x.shape[lead:]
    if len(rest) < 1 or math.prod(rest) != D:
        layout = "[B, T, D]" if lead == 2 else "[N, D]"
        raise ValueError(f"{name} must have shape {layout} with D = {D} (weight.shape[0]) channels in its trailing "
                         f"dims, got {tuple(x.shape)}")
    return tuple(x.shape[:lead])


def _resolve(op: str, backend: object, x: torch.Tensor, W: int, tensors) -> str:
    """"triton" or "torch" for ``backend`` on the device and dtype of ``x``."""
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    requested = "auto" if backend in FLA_BACKENDS else backend
    path = select_backend(op, requested, tensors)
    if path == "triton" and x.dtype not in KERNEL_DTYPES:
        return "torch"  # the kernels compute in float32; float64 keeps its precision on the PyTorch path
    if path == "triton":
        from lamina.kernels.short_conv import MAX_WIDTH

        if W > MAX_WIDTH:
            raise ValueError(f"{op}: the Triton kernels take windows of at most {MAX_WIDTH} taps, got weight with "
                             f"W = {W}; use backend='torch'")
    return path


def _host_lengths(cu_seqlens, cu_seqlens_cpu, batch: int, total: int) -> list[int] | None:
    """Sequence lengths read on the host once (from ``cu_seqlens_cpu`` when given: no device sync)."""
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("cu_seqlens_cpu was given without cu_seqlens; pass both (cu_seqlens_cpu is its host copy)")
        return None
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64))
    if cu_seqlens_cpu is not None:
        check_tensor("cu_seqlens_cpu", cu_seqlens_cpu, ndim=1, dtypes=(torch.int32, torch.int64))
        if cu_seqlens_cpu.shape != cu_seqlens.shape or cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"cu_seqlens_cpu must be a CPU copy of cu_seqlens {tuple(cu_seqlens.shape)}, got shape "
                             f"{tuple(cu_seqlens_cpu.shape)} on {cu_seqlens_cpu.device}")
        host = cu_seqlens_cpu
    else:
        host = cu_seqlens.cpu()
    check_cu_seqlens(host, batch, total, name="cu_seqlens")
    return host.diff().tolist()


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool | None = False,
    activation: str | None = None,
    backend: str | None = "auto",
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv1d with optional bias, SiLU and residual, and the decoding window state.

    ``y[t] = act(bias + sum_k weight[:, k] * x[t - W + 1 + k]) + residual[t]``, where inputs before
    the sequence start come from ``initial_state`` (zeros without it).

    Args:
        x: [B, T, D] (or [B, T, H, K] with H * K = D); B == 1 with ``cu_seqlens``. Any strides
            along B and T (e.g. a slice of a fused projection).
        weight: [D, W], the window of each channel (required; None only keeps fla's order).
        bias: [D].
        residual: [B, T, D] like x, added after the activation.
        initial_state: [N, D, W], the previous W inputs of each sequence (column W - 1 the most
            recent; only columns 1..W-1 reach the output).
        output_final_state: also return the last W inputs of each sequence, [N, D, W] in x's dtype
            (state columns where a sequence is shorter than W).
        activation: None, "silu" or "swish".
        backend: "auto", "torch", or fla's "triton" / "cuda" / "mix" (module docstring).
        cu_seqlens: [N + 1] int offsets of packed sequences (read on the host once per call).
        cu_seqlens_cpu: a CPU copy of ``cu_seqlens``, read instead of it (saves a device sync).
        chunk_indices: accepted for fla's signature; lamina builds its tiles from the lengths.

    Returns:
        (y with x's shape and dtype, final_state [N, D, W] or None). Low-precision inputs are
        computed in float32.
    """
    check_tensor("x", x)
    if x.dim() < 3:
        raise ValueError(f"x must have shape [B, T, D], got {tuple(x.shape)}")
    D, W = _check_weight(weight, bias)
    B, T = _flat_channels("x", x, 2, D)
    if residual is not None:
        check_tensor("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    silu = _check_activation(activation)
    if output_final_state is None:
        output_final_state = False
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state must be a bool, got {type(output_final_state).__name__}")
    if chunk_indices is not None and not isinstance(chunk_indices, torch.Tensor):
        raise TypeError(f"chunk_indices must be a torch.Tensor or None, got {type(chunk_indices).__name__}")
    lengths = _host_lengths(cu_seqlens, cu_seqlens_cpu, B, T)
    N = B if lengths is None else len(lengths)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, ndim=3)
        if tuple(initial_state.shape) != (N, D, W):
            raise ValueError(f"initial_state must have shape [N, D, W] = {(N, D, W)}, got {tuple(initial_state.shape)}")
    check_same_device(x=x, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
                      cu_seqlens=cu_seqlens)
    path = _resolve(OP, backend, x, W, (x, weight, bias, residual, initial_state))

    x3 = x.reshape(B, T, D)
    res3 = None if residual is None else residual.reshape(B, T, D)
    if path == "torch":
        y, final = _torch_conv(x3, weight, bias, res3, initial_state, silu, output_final_state, lengths)
        return y.view(x.shape), final
    if x3.stride(2) != 1:
        x3 = x3.contiguous()
    tiles = None
    if lengths is not None:
        from lamina.kernels.short_conv import tile_table

        tiles = tile_table(lengths, x.device)
    y, final = _fwd_op(x3, weight.contiguous(), None if bias is None else bias.contiguous(),
                       None if res3 is None else res3.contiguous(),
                       None if initial_state is None else initial_state.contiguous(),
                       cu_seqlens, tiles, silu, output_final_state)
    return y.view(x.shape), (final if output_final_state else None)


def causal_conv1d_update(
    x: torch.Tensor,
    cache: torch.Tensor,
    residual: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of the short convolution; updates ``cache`` in place (fla's semantics).

    The window of each sequence moves left by one, ``x`` enters column W - 1, and
    ``y = act(bias + sum_k weight[:, k] * cache[:, :, k]) + residual``.

    Args:
        x: one token per sequence: [N, D], [N, 1, D] or [1, N, D] (trailing dims may be [H, K]).
        cache: [N, D, W], contiguous; updated in place (any float dtype).
        residual: like x, added after the activation.
        weight: [D, W] (required; None only keeps fla's order). bias: [D].
        activation: None, "silu" or "swish".
        backend: as for ``causal_conv1d``.

    Returns:
        (y with x's shape and dtype, cache). Not differentiable: a decoding step.
    """
    check_tensor("x", x)
    D, W = _check_weight(weight, bias)
    check_tensor("cache", cache, ndim=3)
    N = cache.shape[0]
    if tuple(cache.shape[1:]) != (D, W):
        raise ValueError(f"cache must have shape [N, D, W] with (D, W) = {(D, W)} from weight, "
                         f"got {tuple(cache.shape)}")
    if x.dim() < 2:
        raise ValueError(f"x must have shape [N, D] or [N, 1, D] / [1, N, D], got {tuple(x.shape)}")
    lead = (x.shape[0],) if x.dim() == 2 else _flat_channels("x", x, 2, D)
    if x.dim() == 2:
        _flat_channels("x", x, 1, D)
    if len(lead) == 2 and 1 not in lead:
        raise ValueError(f"x must hold one token per sequence ([N, 1, D] or [1, N, D]), got {tuple(x.shape)}")
    if math.prod(lead) != N:
        raise ValueError(f"x must hold one token for each of the N = {N} sequences of cache, got {tuple(x.shape)}")
    if residual is not None:
        check_tensor("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    silu = _check_activation(activation)
    check_same_device(x=x, cache=cache, weight=weight, bias=bias, residual=residual)
    check_no_overlap("cache", cache, x=x, residual=residual, weight=weight, bias=bias)
    path = _resolve(OP_UPDATE, backend, x, W, (x, cache, weight, bias, residual))

    x2 = x.reshape(N, D)
    res2 = None if residual is None else residual.reshape(N, D)
    with torch.no_grad():
        if path == "torch":
            y = _torch_step(x2, cache, weight, bias, res2, silu)
        else:
            if not cache.is_contiguous():
                raise ValueError(f"cache must be contiguous (it is updated in place), got strides {cache.stride()}")
            if x2.stride(1) != 1:
                x2 = x2.contiguous()
            y = _step_op(x2, cache, weight.contiguous(), None if bias is None else bias.contiguous(),
                         None if res2 is None else res2.contiguous(), silu)
    return y.view(x.shape), cache


__all__ = ["ACTIVATIONS", "BACKENDS", "causal_conv1d", "causal_conv1d_update"]
