"""lamina's token-loop references against fla's naive references (fla-core 0.6.0, a test dependency).

fla's naive functions compute in float32, so they are compared with lamina's float64 result on the
same float32 inputs, at the float32 row of the table. Their conventions differ and are adapted here,
on the inputs only:

* ``delta_rule_recurrence(q, k, v, beta, initial_state, output_final_state)``: [B, H, T, *] layout,
  scale fixed at K ** -0.5, no GVA.
* ``naive_recurrent_gated_delta_rule(q, k, v, beta, g, ...)``: beta before g; no GVA.
* ``naive_recurrent_kda(q, k, v, g, beta, ...)``: GVA through ``HV // H``.
* ``naive_recurrent_gdn2(q, k, v, g, b, w, ...)``: per-K erase b, per-V write w; no GVA.

None of them takes ``cu_seqlens``; varlen is covered against lamina's own token loop per sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from lamina.reference.delta_rule import delta_rule_ref, gated_delta_rule_ref, gdn2_ref, kda_ref
from tests.tolerances import assert_close

F32 = torch.float32

# Importing fla on a machine without a GPU warns about the fallback and about torch.jit.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Triton is not supported:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Small shapes gain nothing from intra-op threads; under ``pytest -n 2`` on two cores the
    spinning OpenMP threads of both workers slowed tests down 10-40x (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make(B: int, T: int, H: int, HV: int, K: int, V: int) -> dict:
    return dict(
        q=torch.randn(B, T, H, K, dtype=F32),
        k=F.normalize(torch.randn(B, T, H, K, dtype=F32), dim=-1),
        v=torch.randn(B, T, HV, V, dtype=F32),
        beta=torch.rand(B, T, HV, dtype=F32),
        g_head=-2 * torch.rand(B, T, HV, dtype=F32),
        g_channel=-2 * torch.rand(B, T, HV, K, dtype=F32),
        b=torch.rand(B, T, HV, K, dtype=F32),
        w=torch.rand(B, T, HV, V, dtype=F32),
        h0=torch.randn(B, HV, K, V, dtype=F32),
    )


def as64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.double() for t in tensors]


def compare(name: str, fla_out: tuple, ours: tuple) -> None:
    assert fla_out[0].dtype == F32, f"{name}: fla should return float32 here, got {fla_out[0].dtype}"
    assert_close(f"{name} o", fla_out[0], ours[0], dtype=F32)
    assert_close(f"{name} final_state", fla_out[1], ours[1], dtype=F32)


SHAPES = [(2, 37, 2, 32, 16), (1, 80, 1, 48, 64)]  # (B, T, H, K, V): K != V, a non-power-of-2 dim


@pytest.mark.parametrize("B,T,H,K,V", SHAPES)
def test_delta_rule_vs_fla(B, T, H, K, V):
    from fla.ops.delta_rule.naive import delta_rule_recurrence

    x = make(B, T, H, H, K, V)
    to_bhtd = lambda t: rearrange(t, "b t h ... -> b h t ...")
    o, s = delta_rule_recurrence(
        *(to_bhtd(x[key]) for key in ("q", "k", "v", "beta")), initial_state=x["h0"], output_final_state=True
    )
    ours = delta_rule_ref(*as64(x["q"], x["k"], x["v"], x["beta"]), initial_state=x["h0"].double(),
                          output_final_state=True)
    compare("delta_rule", (rearrange(o, "b h t d -> b t h d"), s), ours)


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("B,T,H,K,V", SHAPES)
def test_gated_delta_rule_vs_fla(B, T, H, K, V, scale):
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    x = make(B, T, H, H, K, V)
    fla_out = naive_recurrent_gated_delta_rule(
        x["q"], x["k"], x["v"], x["beta"], x["g_head"], scale=scale, initial_state=x["h0"], output_final_state=True
    )
    ours = gated_delta_rule_ref(*as64(x["q"], x["k"], x["v"], x["g_head"], x["beta"]), scale=scale,
                                initial_state=x["h0"].double(), output_final_state=True)
    compare("gated_delta_rule", fla_out, ours)


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("B,T,H,HV,K,V", [(2, 37, 2, 2, 32, 16), (1, 50, 2, 4, 48, 32)])
def test_kda_vs_fla(B, T, H, HV, K, V, scale):
    from fla.ops.kda.naive import naive_recurrent_kda

    x = make(B, T, H, HV, K, V)
    fla_out = naive_recurrent_kda(
        x["q"], x["k"], x["v"], x["g_channel"], x["beta"], scale=scale, initial_state=x["h0"], output_final_state=True
    )
    ours = kda_ref(*as64(x["q"], x["k"], x["v"], x["g_channel"], x["beta"]), scale=scale,
                   initial_state=x["h0"].double(), output_final_state=True)
    compare("kda", fla_out, ours)


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("B,T,H,K,V", SHAPES)
def test_gdn2_vs_fla(B, T, H, K, V, scale):
    from fla.ops.gdn2.naive import naive_recurrent_gdn2

    x = make(B, T, H, H, K, V)
    fla_out = naive_recurrent_gdn2(
        x["q"], x["k"], x["v"], x["g_channel"], x["b"], x["w"], scale=scale, initial_state=x["h0"],
        output_final_state=True,
    )
    ours = gdn2_ref(*as64(x["q"], x["k"], x["v"], x["g_channel"], x["b"], x["w"]), scale=scale,
                    initial_state=x["h0"].double(), output_final_state=True)
    compare("gdn2", fla_out, ours)


def test_no_initial_state_vs_fla():
    from fla.ops.kda.naive import naive_recurrent_kda

    x = make(1, 30, 1, 1, 16, 16)
    fla_out = naive_recurrent_kda(x["q"], x["k"], x["v"], x["g_channel"], x["beta"], output_final_state=True)
    ours = kda_ref(*as64(x["q"], x["k"], x["v"], x["g_channel"], x["beta"]), output_final_state=True)
    compare("kda without initial state", fla_out, ours)
