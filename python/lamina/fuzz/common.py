"""Helpers shared by the case checks: dtypes, seeded tensors, cotangents, gradient comparison."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator

import torch

from lamina.testing import assert_close, gradient_scale

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


class Draw:
    """float64 tensors from one seeded CPU generator (the same numbers on every device)."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.gen, dtype=torch.float64)

    def cotangent(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A random cotangent already rounded to the output's ``dtype`` (float64 values), so that the op
        and the oracle differentiate the same loss."""
        return self.randn(*shape).to(dtype).double()


def offsets(lens: list[int], device: str) -> torch.Tensor:
    """``cu_seqlens [N + 1]`` int32 of a pack of sequences of lengths ``lens``."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def leaf(x: torch.Tensor | None, dtype: torch.dtype, device: str, grad: bool) -> torch.Tensor | None:
    """``x`` rounded to ``dtype`` on ``device``, a leaf that requires grad when ``grad``."""
    if x is None:
        return None
    return x.to(dtype).to(device).detach().requires_grad_(grad)


def as_ref(x: torch.Tensor | None, grad: bool) -> torch.Tensor | None:
    """The float64 CPU copy of an op input (the same rounded values), a leaf for the oracle."""
    if x is None:
        return None
    return x.detach().double().cpu().requires_grad_(grad)


def backward(outputs: list[torch.Tensor], cotangents: list[torch.Tensor]) -> None:
    """Backward of ``sum <output, cotangent>`` (cotangents float64 on CPU, cast to each output)."""
    pairs = [(o, c.to(o.device, o.dtype)) for o, c in zip(outputs, cotangents) if o is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])


def compare_grads(inputs: dict[str, torch.Tensor | None], refs: dict[str, torch.Tensor | None],
                  kinds: dict[str, tuple[str, torch.dtype]],
                  baselines: dict[str, torch.Tensor | None] | None = None,
                  scales: dict[str, float] | None = None) -> None:
    """``d<name>`` of every input that requires grad against the oracle's; ``kinds[name]`` is
    ``(kind, dtype row)`` of the tolerance table; a gradient that is zero in exact math is compared at
    ``gradient_scale`` of the call's reference gradients, or at ``scales[name]`` where that is larger (a
    parameter's ``reduction_scale``, which is 0 where every term is). ``baselines``: the inputs of a plain
    float32 run of the oracle, whose gradients serve as ``assert_close``'s ``baseline``."""
    scale = gradient_scale([refs[n].grad for n, x in inputs.items() if x is not None and x.requires_grad])
    for name, x in inputs.items():
        if x is None or not x.requires_grad:
            continue
        ref = refs[name].grad
        if x.grad is None:
            if ref is not None and bool(ref.ne(0).any()):
                raise AssertionError(f"d{name}: the op gave no gradient, the reference a nonzero one")
            continue
        if ref is None:
            ref = torch.zeros_like(refs[name])
        kind, dtype = kinds[name]
        base = None
        if baselines is not None and baselines.get(name) is not None:
            base = baselines[name].grad
            base = torch.zeros_like(baselines[name]) if base is None else base
        assert_close(f"d{name}", x.grad, ref, kind=kind, dtype=dtype, scale=max(scale, (scales or {}).get(name, 0.0)),
                     baseline=base)


def compare_in_stages(compare: Callable[[dict[str, float], object], None],
                      scales: Callable[[], dict[str, float]] | None = None,
                      baseline: Callable[[], object] | None = None) -> None:
    """Run ``compare(scales, base)`` (it raises ``AssertionError`` on a miss) at most three times, each a
    wider floor than the last: without the sum-of-terms ``scales`` (``compare({}, None)``); on a miss with
    them, where ``scales`` is given (it works them out: result or gradient name -> floor); on a miss again
    against a plain float32 run, where the case is float32 (``baseline`` given: it runs that and returns
    what ``compare`` takes as ``base``). The scales only ever raise a floor, so a case that passes without
    them passes with them: they are worked out (the oracle a few times more) only once, and only after a
    miss."""
    scales = functools.cache(scales) if scales is not None else None
    try:
        try:
            compare({}, None)
        except AssertionError:
            if scales is None:
                raise
            compare(scales(), None)
    except AssertionError:
        if baseline is None:
            raise
        compare(scales() if scales is not None else {}, baseline())


def raise_floors(scales: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """``scales`` with each of ``more``'s floors taken where it is larger (in place; returned)."""
    for name, value in more.items():
        scales[name] = max(scales.get(name, 0.0), value)
    return scales


def float32_copies(inputs: dict[str, torch.Tensor | None], grad: bool) -> dict[str, torch.Tensor | None]:
    """float32 CPU leaves with the values of ``inputs``: the inputs of a plain float32 baseline run."""
    return {n: None if t is None else t.detach().float().cpu().requires_grad_(grad) for n, t in inputs.items()}


@contextlib.contextmanager
def pytorch_dispatch() -> Iterator[None]:
    """``backend="auto"`` picks PyTorch on CPU inside this block, even under ``TRITON_INTERPRET=1``
    (the dispatcher reads the variable at every call): runs a float64 layer copy as the oracle."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
