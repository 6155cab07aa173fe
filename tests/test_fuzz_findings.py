"""Open findings of ``lamina fuzz``, kept as saved cases that must keep failing until fixed.

Each is a precision limit of a path, not a wrong formula: the case fails the tolerance table by a
small factor. The test asserts that each still fails: once a change fixes one, the test fails and
the case moves to the regular tests.
"""

from pathlib import Path

import pytest

from lamina.fuzz.runner import run_case
from lamina.fuzz.shrink import load_case

FINDINGS = Path(__file__).parent / "data" / "fuzz_findings"

OPEN = {
    # The chunked form's dg (PyTorch path of chunk_* and of fused_recurrent_* with gradients) loses
    # precision as the per-channel decay grows: float32 RMS error ratio 5.6e-7 at g ~ -U(0, 1) per
    # token, 7.8e-6 at -U(0, 20) (T=46, K=75), against 1.3e-7 for the float32 token loop; this case
    # (K=75, V=47, T=46, g down to -20) reaches 2.6e-5 > 2e-5.
    "fused_recurrent_gdn2-extreme-gate-dg.json": "chunked dg under extreme decay",
    # The default CPU attention path (PyTorch's fused SDPA backward) recomputes P = exp(s - lse): its
    # float32 dv is up to ~8x PyTorch's naive softmax error on this case, above FlashAttention's 3x rule.
    "prism_attention-fp32-dv.json": "SDPA backward's float32 dv",
}


@pytest.mark.parametrize("name", sorted(OPEN))
def test_open_finding_still_fails(name):
    case = load_case(FINDINGS / name)
    with pytest.raises(AssertionError):
        run_case(case)
