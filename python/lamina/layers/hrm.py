"""HRM modules: the gated state update and the two-speed recurrent core (DESIGN.md, "HRM").

``HRMCore`` replaces a stack of L layers with two shared-weight blocks iterated
``M = n_cycles * steps_per_cycle`` times: a fast block every step and a slow block at the end
of every cycle. Only the last ``grad_steps`` steps are differentiated (truncated backprop);
the earlier ones run under ``torch.no_grad`` and hold no autograd graph.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from lamina._validate import check_bool, check_eps, check_layer_input
from lamina.ops.hrm_update import GATES, hrm_gated_update

MODES = ("hierarchical", "flat", "one_step")


def _check_block(name: str, block: object) -> nn.Module:
    if not isinstance(block, nn.Module):
        raise TypeError(f"{name} must be an nn.Module mapping [B, T, D] -> [B, T, D], got {type(block).__name__}")
    return block


def _check_positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class HRMGatedUpdate(nn.Module):
    """``y = z * h + (1 - z) * c`` with a learned gate, optionally RMS-normalised (one fused op).

    The gate logits are a linear map of ``[h, c, context]`` concatenated on the last dim
    (``[h, c]`` when ``context=False``): one logit per channel (``gate="channel"``) or one per
    token (``gate="token"``). The gate bias and the RMSNorm weight are applied inside
    ``lamina.hrm_gated_update``, so their gradients come from its fused backward.

    Args:
        d_model: D, the width of h, c and context.
        gate: "channel" ([..., D] logits) or "token" ([..., 1] logits).
        norm: RMS-normalise the result with a learned weight.
        context: the gate also sees a third input of width D.
        eps: RMSNorm epsilon.
        gate_bias_init: initial gate bias; sigmoid(0) = 0.5 mixes h and c equally.
        backend: passed to ``hrm_gated_update``.
    """

    def __init__(
        self,
        d_model: int,
        gate: str = "channel",
        norm: bool = True,
        context: bool = True,
        eps: float = 1e-6,
        gate_bias_init: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        _check_positive("d_model", d_model)
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
        norm, context, eps = check_bool("norm", norm), check_bool("context", context), check_eps("eps", eps)
        self.d_model, self.gate, self.eps, self.backend, self.has_context = d_model, gate, eps, backend, context
        n_in = 3 if context else 2
        gate_dim = d_model if gate == "channel" else 1
        self.proj = nn.Linear(n_in * d_model, gate_dim, bias=False)
        self.bias = nn.Parameter(torch.full((gate_dim,), float(gate_bias_init)))
        self.norm_weight = nn.Parameter(torch.ones(d_model)) if norm else None

    def forward(self, h: torch.Tensor, c: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """h, c, context: [..., D] -> [..., D]."""
        if self.has_context and context is None:
            raise ValueError("context must be given: this HRMGatedUpdate was built with context=True")
        if not self.has_context and context is not None:
            raise ValueError("context must be None: this HRMGatedUpdate was built with context=False")
        check_layer_input("h", h, self, width=self.d_model, ndim=None, width_name="d_model")
        for name, x in (("c", c), ("context", context)):
            if x is not None:
                check_layer_input(name, x, self, width=self.d_model, ndim=None, match_dtype=False,
                                  width_name="d_model")
                if x.shape != h.shape:
                    raise ValueError(f"{name} must have the shape of h {tuple(h.shape)}, got {tuple(x.shape)}")
        # one dtype for the fused op: under autocast the block output c and the logits may be
        # lower precision than the state h
        c = c.to(h.dtype)
        parts = (h, c, context.to(h.dtype)) if self.has_context else (h, c)
        logits = self.proj(torch.cat(parts, dim=-1)).to(h.dtype)
        return hrm_gated_update(h, c, logits, self.bias, self.norm_weight, eps=self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, gate={self.gate!r}, norm={self.norm_weight is not None}"


class HRMCore(nn.Module):
    """Two-speed shared-weight recurrence over an input encoding ``x: [B, T, D]``.

    Per step ``i = 0 .. M-1`` (``M = n_cycles * steps_per_cycle``), in ``mode="hierarchical"``::

        zL = fast_update(zL, fast_block(zL + zH + x), context=x)       # every step
        zH = slow_update(zH, slow_block(zH + zL))                      # when (i + 1) % steps_per_cycle == 0

    and the output fuses slow state, fast state and input: ``out_update(zH, zL, context=x)``.
    The states start from learned vectors. Steps ``0 .. M-K-1`` run under ``torch.no_grad``,
    the last ``K = grad_steps`` with gradients. ``passes`` supervision passes run one after
    another, each starting from the previous pass's detached states; ``forward`` returns every
    pass's output so that a loss can be taken on each.

    ``mode="flat"``: ``z = fast_block(z + x)`` iterated M times, no slow block, no gates (the
    Universal-Transformer ablation); ``slow_block`` is neither used nor registered.
    ``mode="one_step"``: the original HRM's one-step gradient: only the final fast update and
    the final slow update are differentiated (``grad_steps`` must be 1).

    Args:
        fast_block, slow_block: any nn.Module mapping [B, T, D] -> [B, T, D] (for ``forward(x, cache=)``
            one that also takes ``cache=``).
        d_model: D.
        n_cycles: N, slow updates per pass.
        steps_per_cycle: T, fast steps per slow update.
        grad_steps: K, 1 <= K <= M, trailing steps with gradients.
        passes: S, supervision passes.
        mode: "hierarchical", "flat" or "one_step".
        gate, norm, backend: passed to every HRMGatedUpdate.
    """

    def __init__(
        self,
        fast_block: nn.Module,
        slow_block: nn.Module | None,
        d_model: int,
        n_cycles: int,
        steps_per_cycle: int,
        grad_steps: int,
        passes: int = 1,
        mode: str = "hierarchical",
        gate: str = "channel",
        norm: bool = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        for name, value in (("d_model", d_model), ("n_cycles", n_cycles), ("steps_per_cycle", steps_per_cycle),
                            ("grad_steps", grad_steps), ("passes", passes)):
            _check_positive(name, value)
        steps = n_cycles * steps_per_cycle
        if grad_steps > steps:
            raise ValueError(
                f"grad_steps must be <= n_cycles * steps_per_cycle = {steps}, got {grad_steps}"
            )
        if mode == "one_step" and grad_steps != 1:
            raise ValueError(f"mode='one_step' differentiates only the final step: grad_steps must be 1, "
                             f"got {grad_steps}")
        self.mode, self.d_model, self.passes = mode, d_model, passes
        self.n_cycles, self.steps_per_cycle, self.grad_steps = n_cycles, steps_per_cycle, grad_steps
        self.fast_block = _check_block("fast_block", fast_block)
        self.fast_init = nn.Parameter(torch.randn(d_model))
        if mode == "flat":
            self.slow_block = None
            return
        self.slow_block = _check_block("slow_block", slow_block)
        self.slow_init = nn.Parameter(torch.randn(d_model))
        kw = {"gate": gate, "norm": norm, "backend": backend}
        self.fast_update = HRMGatedUpdate(d_model, context=True, **kw)
        self.slow_update = HRMGatedUpdate(d_model, context=False, **kw)
        self.out_update = HRMGatedUpdate(d_model, context=True, **kw)

    @property
    def steps(self) -> int:
        """M, the shared-weight steps of one pass."""
        return self.n_cycles * self.steps_per_cycle

    @property
    def block_applications(self) -> int:
        """Block calls of one forward: ``passes * (M + n_cycles)`` (``passes * M`` in flat mode)."""
        per_pass = self.steps if self.mode == "flat" else self.steps + self.n_cycles
        return self.passes * per_pass

    def block_schedule(self) -> list[str]:
        """Which block each call of one forward runs, in order: ``"fast"`` or ``"slow"``."""
        one_pass = []
        for i in range(self.steps):
            one_pass.append("fast")
            if self.mode != "flat" and (i + 1) % self.steps_per_cycle == 0:
                one_pass.append("slow")
        return one_pass * self.passes

    @staticmethod
    def _call(block: nn.Module, inp: torch.Tensor, entries: Iterator[object] | None) -> torch.Tensor:
        return block(inp) if entries is None else block(inp, cache=next(entries))

    def _step(self, i: int, x: torch.Tensor, zl: torch.Tensor, zh: torch.Tensor | None,
              entries: Iterator[object] | None):
        if self.mode == "flat":
            return self._call(self.fast_block, zl + x, entries), None
        zl = self.fast_update(zl, self._call(self.fast_block, zl + zh + x, entries), x)
        if (i + 1) % self.steps_per_cycle == 0:
            zh = self.slow_update(zh, self._call(self.slow_block, zh + zl, entries))
        return zl, zh

    def _pass(self, x: torch.Tensor, zl: torch.Tensor, zh: torch.Tensor | None, entries: Iterator[object] | None):
        first_grad = self.steps - self.grad_steps
        with torch.no_grad():
            for i in range(first_grad):
                zl, zh = self._step(i, x, zl, zh, entries)
        for i in range(first_grad, self.steps):
            zl, zh = self._step(i, x, zl, zh, entries)
        out = zl if self.mode == "flat" else self.out_update(zh, zl, x)
        return out, zl, zh

    def forward(self, x: torch.Tensor, cache: Sequence[object] | None = None) -> list[torch.Tensor]:
        """x: [B, T, D] input encoding -> a list of ``passes`` outputs, each [B, T, D].

        ``cache``: for incremental decoding, one entry per block call (``block_applications`` of
        them, in the order of ``block_schedule()``); call ``j`` runs ``block(input, cache=cache[j])``,
        so each application of a shared block keeps its own state (e.g. the keys and values of the
        earlier tokens at that application). None: the blocks are called as ``block(input)``.
        """
        check_layer_input("x", x, self, width=self.d_model, width_name="d_model")
        entries = None
        if cache is not None:
            if not isinstance(cache, Sequence) or isinstance(cache, str):
                raise TypeError(f"cache must be a sequence of {self.block_applications} entries (one per block "
                                f"call), got {type(cache).__name__}")
            if len(cache) != self.block_applications:
                raise ValueError(f"cache must have one entry per block call ({self.block_applications}), "
                                 f"got {len(cache)}")
            entries = iter(cache)
        zl = self.fast_init.to(x.dtype).expand_as(x)
        zh = None if self.mode == "flat" else self.slow_init.to(x.dtype).expand_as(x)
        outputs = []
        for _ in range(self.passes):
            out, zl, zh = self._pass(x, zl, zh, entries)
            outputs.append(out)
            # the next pass starts from these states but no gradient crosses passes
            zl = zl.detach()
            zh = zh.detach() if zh is not None else None
        return outputs

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, n_cycles={self.n_cycles}, steps_per_cycle={self.steps_per_cycle}, "
                f"grad_steps={self.grad_steps}, passes={self.passes}")
