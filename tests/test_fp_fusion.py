"""Every kernel launch asks for FP fusion as ``kernels/_utils.fp_fusion`` says (the static report's compiles:
tests/test_static_report.py), so that Triton 3.10's change of default leaves lamina's kernels as measured."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_every_launch_in_the_kernels_passes_fp_fusion():
    """Each ``kernel[grid](...)`` call in kernels/ passes ``enable_fp_fusion=fp_fusion()``."""
    launches, missing = 0, []
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                launches += 1
                passed = {kw.arg: ast.unparse(kw.value) for kw in node.keywords if kw.arg}
                if passed.get("enable_fp_fusion") != "fp_fusion()":
                    missing.append(f"{path.name}:{node.lineno} {ast.unparse(node.func.value)}")
    assert launches >= 25, launches  # the walk finds the launches (25 when this was written)
    assert missing == []


@pytest.mark.interpret
@pytest.mark.parametrize("user_default", [None, "0"])
def test_the_launches_reach_the_kernels_with_fp_fusion(monkeypatch, user_default):
    """Through the autotune wrappers too: each launch of a delta-rule and an attention forward and backward
    arrives with ``enable_fp_fusion=True``, or None (Triton's default, the user's) where the user set
    TRITON_DEFAULT_FP_FUSION."""
    from triton.runtime.interpreter import InterpretedFunction

    import lamina

    if user_default is None:
        monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    else:
        monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", user_default)
    launched = []
    run = InterpretedFunction.run

    def spy(self, *args, **kwargs):
        launched.append((self.fn.__name__, kwargs.get("enable_fp_fusion", "not passed")))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", spy)
    B, T, H, K = 1, 8, 1, 16
    q, k, v = (torch.randn(B, T, H, K, requires_grad=True) for _ in range(3))
    g = (-torch.rand(B, T, H)).requires_grad_()
    beta = torch.rand(B, T, H, requires_grad=True)
    o, _ = lamina.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    o.sum().backward()
    lamina.prism_attention(q, k, v, causal=True).sum().backward()

    # the delta rule's five (two of them autotuned), the attention's four (three autotuned) and the l2norm's
    # backward
    assert {name for name, _ in launched} == {
        "_delta_chunk_prep_fwd_kernel", "_delta_chunk_scan_fwd_kernel", "_delta_chunk_bwd_prep_kernel",
        "_delta_chunk_bwd_dh_kernel", "_delta_chunk_bwd_dqk_kernel", "_prism_attn_fwd_kernel",
        "_prism_attn_bwd_preprocess_kernel", "_prism_attn_bwd_dkdv_kernel", "_prism_attn_bwd_dq_kernel",
        "_rms_norm_bwd_kernel"}
    expected = True if user_default is None else None
    assert {value for _, value in launched} == {expected}, launched
