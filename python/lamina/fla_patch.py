"""``lamina.patch_fla()``: run an already imported fla (its layers and ``fla.models``) on lamina.

What is swapped, inside every loaded ``fla`` module that holds a reference to it:

- the eight delta-rule ops (``chunk_*``, ``fused_recurrent_*`` of DeltaNet, Gated DeltaNet, KDA and
  GDN-2) -> lamina's ops of the same name (fla's signatures, ``state_v_first`` included);
- the short convolution (``causal_conv1d``, ``causal_conv1d_update`` and the ``forward``/``step`` of
  ``ShortConvolution``) and the norms (``rms_norm``, ``rms_norm_gated``, ``RMSNorm.forward``,
  ``FusedRMSNormGated.forward``) -> lamina's;
- fla's Triton-only model pieces (``swiglu``, ``swiglu_linear``, ``FusedCrossEntropyLoss``) get a
  PyTorch path for CPU tensors and keep fla's kernels on GPUs, so an fla model runs on CPU.

Functions are replaced by identity (every module attribute that *is* fla's function), classes by
their methods, so existing model instances switch too, and everything is restored by ``undo()``
or on leaving a ``with lamina.patch_fla():`` block. Patching twice is harmless (the second
patch finds nothing of fla's left to replace).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lamina._optional import require_fla

# (fla module, attribute) -> (lamina module, attribute)
_FUNCTIONS: dict[tuple[str, str], tuple[str, str]] = {
    **{(f"fla.ops.{pkg}", name): ("lamina.ops.delta_rule", name)
       for pkg, names in {
           "delta_rule": ("chunk_delta_rule", "fused_recurrent_delta_rule"),
           "gated_delta_rule": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
           "kda": ("chunk_kda", "fused_recurrent_kda"),
           "gdn2": ("chunk_gdn2", "fused_recurrent_gdn2"),
       }.items() for name in names},
    ("fla.modules.causal_conv1d", "causal_conv1d"): ("lamina.ops.short_conv", "causal_conv1d"),
    ("fla.modules.causal_conv1d", "causal_conv1d_update"): ("lamina.ops.short_conv", "causal_conv1d_update"),
    ("fla.modules.norm.layernorm", "rms_norm"): ("lamina.ops.rms_norm_gated", "rms_norm"),
    ("fla.modules.norm.fused_norm_gate", "rms_norm_gated"): ("lamina.ops.rms_norm_gated", "rms_norm_gated"),
}

# (fla class, method) -> (lamina class, method): lamina's modules keep fla's attribute names
_METHODS: dict[tuple[str, str, str], tuple[str, str]] = {
    ("fla.modules.causal_conv1d", "ShortConvolution", "forward"): ("lamina.layers.short_conv", "ShortConvolution"),
    ("fla.modules.causal_conv1d", "ShortConvolution", "step"): ("lamina.layers.short_conv", "ShortConvolution"),
    ("fla.modules.norm.layernorm", "RMSNorm", "forward"): ("lamina.layers.norm", "RMSNorm"),
    ("fla.modules.norm.fused_norm_gate", "FusedRMSNormGated", "forward"): ("lamina.layers.norm", "FusedRMSNormGated"),
}


def _torch_swiglu(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (F.silu(x.float()) * y.float()).to(x.dtype)


def _torch_swiglu_linear(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(_torch_swiglu(x, y), weight, bias)


def _torch_cross_entropy(module: Any, input: torch.Tensor, target: torch.Tensor) -> Any:
    """fla's ``FusedCrossEntropyLoss.forward`` in PyTorch (logit scale, softcap, label smoothing, z-loss)."""
    if getattr(module, "process_group", None) is not None:
        raise NotImplementedError("FusedCrossEntropyLoss with a process_group has no CPU path under lamina.patch_fla()")
    logits = input.float() * module.logit_scale
    if module.logit_softcapping is not None:
        logits = module.logit_softcapping * torch.tanh(logits / module.logit_softcapping)
    valid = target != module.ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    smoothing = module.label_smoothing
    loss = lse - (1.0 - smoothing) * picked - smoothing * logits.mean(dim=-1)
    z_loss = module.lse_square_scale * lse.square()
    zero = torch.zeros_like(loss)
    loss, z_loss = torch.where(valid, loss + z_loss, zero), torch.where(valid, z_loss, zero)
    if module.reduction != "none":
        loss, z_loss = loss.sum(), z_loss.sum()
        if module.reduction == "mean":
            count = valid.sum()
            loss, z_loss = loss / count, z_loss / count
    return (loss, z_loss) if module.return_z_loss else loss


def _on_cpu_else(original: Callable[..., Any], cpu: Callable[..., Any], method: bool = False) -> Callable[..., Any]:
    """A function that takes ``cpu`` when its (first tensor) input lives on the CPU, else ``original``."""
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        first = next(a for a in (*args[1 if method else 0:], *kwargs.values()) if isinstance(a, torch.Tensor))
        return (cpu if first.device.type == "cpu" else original)(*args, **kwargs)
    dispatch.__wrapped__ = original
    dispatch._lamina_cpu_path = True
    dispatch.__doc__ = f"lamina.patch_fla(): {getattr(original, '__qualname__', original)} with a CPU path"
    return dispatch


class FlaPatch:
    """The changes one :func:`patch_fla` made; ``undo()`` (or leaving the ``with`` block) restores fla."""

    def __init__(self) -> None:
        self._changes: list[tuple[Any, str, Any]] = []

    @property
    def active(self) -> bool:
        return bool(self._changes)

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._changes.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    def _replace_everywhere(self, original: Any, replacement: Any) -> None:
        for mod_name, module in list(sys.modules.items()):
            if module is None or not (mod_name == "fla" or mod_name.startswith("fla.")):
                continue
            for attr, value in list(vars(module).items()):
                if value is original:
                    self._set(module, attr, replacement)

    def apply(self) -> FlaPatch:
        require_fla()
        for (fla_mod, attr), (lam_mod, lam_attr) in _FUNCTIONS.items():
            original = getattr(importlib.import_module(fla_mod), attr)
            self._replace_everywhere(original, getattr(importlib.import_module(lam_mod), lam_attr))
        for (fla_mod, cls_name, method), (lam_mod, lam_cls) in _METHODS.items():
            cls = getattr(importlib.import_module(fla_mod), cls_name)
            ours = getattr(getattr(importlib.import_module(lam_mod), lam_cls), method)
            if cls.__dict__.get(method) is not ours:
                self._set(cls, method, ours)
        activations = importlib.import_module("fla.modules.activations")
        for name, cpu in (("swiglu", _torch_swiglu), ("swiglu_linear", _torch_swiglu_linear)):
            original = getattr(activations, name)
            if not getattr(original, "_lamina_cpu_path", False):
                self._replace_everywhere(original, _on_cpu_else(original, cpu))
        ce_cls = importlib.import_module("fla.modules.fused_cross_entropy").FusedCrossEntropyLoss
        if not getattr(ce_cls.forward, "_lamina_cpu_path", False):
            self._set(ce_cls, "forward", _on_cpu_else(ce_cls.forward, _torch_cross_entropy, method=True))
        return self

    def undo(self) -> None:
        """Put back every attribute this patch replaced, newest first."""
        while self._changes:
            owner, name, value = self._changes.pop()
            setattr(owner, name, value)

    def __enter__(self) -> FlaPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def patch_fla() -> FlaPatch:
    """Swap fla's delta-rule ops, short convolution and norms for lamina's (module docstring).

    ``lamina.patch_fla()`` patches until ``.undo()``; ``with lamina.patch_fla(): ...`` patches
    for the block. Needs fla (``pip install flash-linear-attention==0.6.0`` for its layers and
    models); patch after importing the fla modules you use or before, either works.
    """
    return FlaPatch().apply()
