"""Hypothesis strategies for lamina's fuzz cases (re-exported by ``lamina.testing``).

The strategies draw the same case dicts as ``lamina fuzz`` (``lamina.fuzz.space``), with every
random choice made by hypothesis, so a failing example shrinks towards T = 1, small dims and
fewer options. Run a case with ``check_case`` (the op against its float64 reference; raises
AssertionError on a mismatch)::

    from hypothesis import given, settings
    from lamina.testing import check_case, delta_rule_cases

    @settings(max_examples=20, deadline=None)
    @given(delta_rule_cases("chunk_gated_delta_rule", max_t=40, max_dim=32))
    def test_gdn(case):
        check_case(case)

hypothesis is a test dependency only: it is imported when a strategy is built.
"""

from __future__ import annotations

from typing import Any

from lamina.fuzz.space import DELTA_OPS, LAYER_OPS, OPS, TORCH_CPU, Limits, draw_from


def _hypothesis():
    try:
        from hypothesis import strategies as st
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("lamina's strategies need hypothesis: pip install hypothesis "
                          "(or pip install 'lamina[test]')") from exc
    return st


class _Choices:
    """The ``random.Random`` methods ``lamina.fuzz.space`` uses, answered by hypothesis draws."""

    def __init__(self, draw: Any, st: Any) -> None:
        self.draw, self.st = draw, st

    def random(self) -> float:
        return self.draw(self.st.floats(0.0, 1.0, exclude_max=True))

    def randint(self, a: int, b: int) -> int:
        return self.draw(self.st.integers(a, b))

    def choice(self, seq):
        return self.draw(self.st.sampled_from(list(seq)))

    def uniform(self, a: float, b: float) -> float:
        return self.draw(self.st.floats(a, b))

    def getrandbits(self, n: int) -> int:
        return self.draw(self.st.integers(0, 2 ** n - 1))


def cases(op: str, *, max_t: int = 64, max_dim: int = 64, device: str = "cpu", backend: str = "torch",
          dtypes: tuple[str, ...] | None = None, grad: bool = True, limits: Limits | None = None):
    """A strategy of fuzz cases of ``op`` (any of ``lamina.fuzz.OPS``) within ``max_t`` tokens and
    head dims ``max_dim`` (or explicit ``limits``). ``backend="triton"`` on CPU needs TRITON_INTERPRET=1."""
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    st = _hypothesis()
    lim = limits or Limits("strategy", max_t=max_t, max_dim=max_dim, attn_dim=max(16, max_dim - max_dim % 8),
                           max_heads=TORCH_CPU.max_heads, max_ratio=TORCH_CPU.max_ratio,
                           max_batch=TORCH_CPU.max_batch, max_rows=max_t, layer_width=max(16, max_dim))

    @st.composite
    def strategy(draw):
        return draw_from(op, _Choices(draw, st), device=device, backend=backend, dtypes=dtypes, grad=grad,
                         limits=lim)

    return strategy()


def delta_rule_cases(variant: str = "chunk_gated_delta_rule", **kwargs):
    """Cases of one delta-rule op (``chunk_*`` or ``fused_recurrent_*``); keywords as ``cases``."""
    if variant not in DELTA_OPS:
        raise ValueError(f"variant must be one of {', '.join(DELTA_OPS)}, got {variant!r}")
    return cases(variant, **kwargs)


def attention_cases(**kwargs):
    """Cases of ``prism_attention`` (varlen, GQA, causal, head dims in multiples of 8)."""
    return cases("prism_attention", **kwargs)


def layer_cases(layer: str = "GatedDeltaNet", **kwargs):
    """Cases of one layer: ``DeltaNet``, ``GatedDeltaNet``, ``KimiDeltaAttention``, ``GatedDeltaNet2``
    or ``PrismAttention``."""
    if layer not in LAYER_OPS:
        raise ValueError(f"layer must be one of {', '.join(LAYER_OPS)}, got {layer!r}")
    return cases(layer, **kwargs)


def check_case(case: dict) -> None:
    """Run a case: the op and its float64 oracle; AssertionError on a mismatch."""
    from lamina.fuzz.runner import run_case

    run_case(case)


__all__ = ["attention_cases", "cases", "check_case", "delta_rule_cases", "layer_cases"]
