"""Input validation at the public boundary: every failure is a sentence naming the argument.

Malformed calls (wrong type, rank, shape, dtype or device, bad offsets, out-of-range indices,
outputs that overlap inputs) raise ``TypeError`` (not a tensor, not a number) or ``ValueError``
(everything else), and the message names the argument. The checks read only tensor metadata,
except where the op reads values to the host anyway (``cu_seqlens``, cache lengths, slot tables)
or where the tensor lives on the CPU (``check_nonpositive``): no device synchronisation is added
to a CUDA call.

NaN and infinity policy: values are not checked; they propagate. Every output element that the
float64 reference (``lamina.reference``) makes NaN or infinite is NaN or infinite on every path
(PyTorch, Triton, the Triton interpreter, the C++ extensions): a NaN input is never turned into a
finite number (e.g. the 0 that PyTorch's fused attention gives a NaN query row). Paths that work
on blocks may spread a NaN further than the reference (the chunked delta-rule forms over the whole of
its chunk: ``0 * NaN`` in a masked matrix product). The one range that is checked is the log decay
``g <= 0`` of the delta-rule ops, and only where it can be read without a device sync (CPU
tensors); on CUDA the caller must keep ``g <= 0``, as with fla. A log decay of -inf is in range (a decay
of 0: the state forgotten at that token); the chunked forms take it, as any log decay below
``LOG_DECAY_FLOOR`` (-40), at the floor, so it stays finite where the reference is.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_tensor(
    name: str,
    x: object,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = FLOAT_DTYPES,
) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}), got {str(x.dtype).replace('torch.', '')}")
    return x


def check_shape(name: str, x: torch.Tensor, expected: Sequence[int], what: str = "") -> None:
    if tuple(x.shape) != tuple(expected):
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {tuple(expected)}{extra}, got {tuple(x.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise ValueError(f"all tensors must be on the same device, got {where}")
    return devices.pop() if devices else torch.device("cpu")


def check_cu_seqlens(cu_seqlens: torch.Tensor | None, batch: int, total: int, name: str = "cu_seqlens") -> int:
    """Validate varlen offsets ``[N + 1]`` (int32/int64, starts at 0, non-decreasing, ends at ``total``).

    Returns N, the number of sequences. ``batch`` must be 1 when offsets are given.
    Reads the offsets on the host (one sync), as every varlen kernel needs N.
    """
    if cu_seqlens is None:
        return batch
    return len(read_offsets(batch, {name: (cu_seqlens, total)})[name]) - 1


def read_offsets(batch: int, offsets: dict[str, tuple[torch.Tensor, int]]) -> dict[str, list[int]]:
    """Validate several varlen offsets at once and return their values, read in one host transfer.

    ``offsets`` maps each argument name to ``(cu_seqlens, total)``: int32/int64 ``[N + 1]`` offsets that
    start at 0, never decrease and end at ``total``. ``batch`` must be 1.
    """
    for name, (cu, _) in offsets.items():
        check_tensor(name, cu, ndim=1, dtypes=(torch.int32, torch.int64))
        if batch != 1:
            raise ValueError(f"{name} needs batch size 1 (sequences packed along T), got batch size {batch}")
        if cu.numel() < 2:
            raise ValueError(f"{name} must hold at least 2 offsets [0, ..., T], got {cu.numel()}")
    tensors = [cu for cu, _ in offsets.values()]
    flat = (tensors[0] if len(tensors) == 1 else torch.cat([t.to(torch.int64) for t in tensors])).tolist()
    values, start = {}, 0
    for name, (cu, total) in offsets.items():
        offs = flat[start:start + cu.numel()]
        start += cu.numel()
        if offs[0] != 0:
            raise ValueError(f"{name} must start at 0, got {offs[0]}")
        if any(b < a for a, b in zip(offs[:-1], offs[1:])):
            raise ValueError(f"{name} must be non-decreasing, got {offs}")
        if offs[-1] != total:
            raise ValueError(f"{name} must end at the packed length T={total}, got {offs[-1]}")
        values[name] = offs
    return values


def check_scale(name: str, scale: object) -> float | None:
    """A score scale: None (the op's default) or a finite real number (not a bool)."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a float or None, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}")
    return float(scale)


def check_bool(name: str, value: object) -> bool:
    """A flag: a Python bool (or 0/1 int); strings and tensors are refused instead of read as truthy."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    shown = f" {value!r}" if isinstance(value, (str, int, float)) else ""
    raise TypeError(f"{name} must be a bool, got {type(value).__name__}{shown}")


def check_positive_int(name: str, value: object) -> int:
    """An int >= 1 (any integer type: numpy ints pass, bools and floats do not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def check_token_ids(
    name: str,
    ids: object,
    vocab_size: int,
    device: torch.device,
    dtypes: tuple[torch.dtype, ...] = (torch.int32, torch.int64),
    ignore_index: int | None = None,
) -> None:
    """``[B, T]`` integer ids on ``device`` in ``[0, vocab_size)`` (or ``ignore_index``). The range is
    read on CPU only: on CUDA the embedding and loss kernels assert, and a check would sync."""
    check_tensor(name, ids, ndim=2, dtypes=dtypes)
    if ids.device != device:
        raise ValueError(f"{name} must be on the model's device ({device}), got {ids.device}")
    if ids.device.type == "cpu" and ids.numel() and not torch.compiler.is_compiling():
        kept = ids if ignore_index is None else ids[ids != ignore_index]
        if kept.numel():
            lo, hi = int(kept.min()), int(kept.max())
            if lo < 0 or hi >= vocab_size:
                allowed = "" if ignore_index is None else f" (or {ignore_index})"
                raise ValueError(f"{name} must be token ids in [0, vocab_size={vocab_size}){allowed}, "
                                 f"got values in [{lo}, {hi}]")


def check_gate_dtype(name: str, x: torch.Tensor, ref: torch.dtype, ref_name: str = "q") -> None:
    """A gate of the delta-rule ops is in the dtype of ``ref_name`` or in float32 (fla's gates are often float32)."""
    if x.dtype != ref and x.dtype != torch.float32:
        raise ValueError(f"{name} must have the dtype of {ref_name} ({str(ref).replace('torch.', '')}) or float32, "
                         f"got {str(x.dtype).replace('torch.', '')}")


def check_nonpositive(name: str, x: torch.Tensor | None, what: str = "a log decay") -> None:
    """Raise when ``x`` has an element > 0, for CPU tensors only (no device sync; NaN passes and propagates)."""
    if x is None or x.device.type != "cpu" or x.numel() == 0 or torch.compiler.is_compiling():
        return
    if bool((x.detach() > 0).any()):
        raise ValueError(f"{name} must be <= 0 ({what}: exp({name}) is the decay in [0, 1]), got a maximum of "
                         f"{float(x.detach().max())}")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the memory of ``a`` and ``b`` intersects (conservative for strided tensors).

    False while tracing (``torch.compile``): fake tensors have no memory to compare.
    """
    if torch.compiler.is_compiling():
        return False
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        start = t.storage_offset() * t.element_size()
        last = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) * t.element_size()
        return start, start + last + t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def check_no_overlap(out_name: str, out: torch.Tensor | None, **inputs: torch.Tensor | None) -> None:
    """An output written in place must not share memory with the inputs the op still reads."""
    if out is None:
        return
    for name, x in inputs.items():
        if isinstance(x, torch.Tensor) and overlaps(out, x):
            raise ValueError(f"{out_name} must not share memory with {name}: it is written while {name} is read")


def module_params(module: torch.nn.Module) -> torch.Tensor | None:
    return next(iter(module.parameters()), None)


def check_layer_input(
    name: str,
    x: object,
    module: torch.nn.Module,
    width: int | None = None,
    ndim: int | None = 3,
    match_dtype: bool = True,
    width_name: str = "D",
) -> torch.Tensor:
    """An activation entering a layer: a float tensor ``[B, T, width]`` (``[..., width]`` with
    ``ndim=None``) on the parameters' device.

    ``match_dtype``: also in the parameters' dtype (layers whose projections would fail otherwise;
    skipped under autocast, which casts for them). ``width_name`` names the width in messages.
    """
    last = width_name if width is None else f"{width_name}={width}"
    layout = f"[B, T, {last}]" if ndim == 3 else f"[..., {last}]"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {tuple(x.shape)}")
    if x.dim() < 1 or (width is not None and x.shape[-1] != width):
        raise ValueError(f"{name} must have shape {layout}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {str(x.dtype).replace('torch.', '')}")
    p = module_params(module)
    if p is None:
        return x
    if x.device != p.device:
        raise ValueError(f"{name} must be on the device of the layer's parameters ({p.device}), got {x.device}")
    if match_dtype and x.dtype != p.dtype and not torch.is_autocast_enabled(x.device.type):
        raise ValueError(f"{name} must have the dtype of the layer's parameters ({str(p.dtype).replace('torch.', '')})"
                         f", got {str(x.dtype).replace('torch.', '')}; convert the layer (.to(dtype)) or the input")
    return x


def check_eps(name: str, eps: object) -> float:
    """An epsilon: a finite real number >= 0."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(eps).__name__} {eps!r}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{name} must be a finite float >= 0, got {eps!r}")
    return eps
