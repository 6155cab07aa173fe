"""Input validation at the public boundary: every failure is a sentence naming the argument."""

from __future__ import annotations

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
    check_tensor(name, cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64))
    if batch != 1:
        raise ValueError(f"{name} needs batch size 1 (sequences packed along T), got batch size {batch}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must hold at least 2 offsets [0, ..., T], got {cu_seqlens.numel()}")
    offs = cu_seqlens.tolist()
    if offs[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offs[0]}")
    if any(b < a for a, b in zip(offs[:-1], offs[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {offs}")
    if offs[-1] != total:
        raise ValueError(f"{name} must end at the packed length T={total}, got {offs[-1]}")
    return len(offs) - 1
