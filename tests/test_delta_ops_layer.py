"""DeltaRuleAttention (lamina.layers.delta_rule): every mode runs, trains and matches its torch path."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close

from lamina.layers import DeltaRuleAttention

D, T = 64, 12


def make(mode, backend, **kw):
    torch.manual_seed(0)
    return DeltaRuleAttention(hidden_size=D, num_heads=2, head_dim=32, num_v_heads=4, mode=mode, chunk_size=16,
                              backend=backend, **kw)


@pytest.mark.grid
@pytest.mark.interpret
@pytest.mark.parametrize("mode,extra", [("delta", {"use_short_conv": True}), ("gdn", {}), ("kda", {}),
                                        ("gdn2", {"allow_neg_eigval": True})])
def test_layer_triton_matches_torch_and_trains(mode, extra):
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 7, T])
    layers = [make(mode, "triton", **extra), make(mode, "torch", **extra)]
    outs = []
    for layer in layers:
        y, state = layer(x, cu_seqlens=cu, output_final_state=True)
        assert y.shape == x.shape and state.shape == (2, 4, 32, 32)
        (y.square().mean() + state.mean()).backward()
        outs.append(y)
    assert_close("y", outs[0], outs[1].detach())
    for (name, p_triton), p_torch in zip(layers[0].named_parameters(), layers[1].parameters()):
        assert p_triton.grad is not None, name
        assert_close(f"grad {name}", p_triton.grad, p_torch.grad)


@pytest.mark.interpret
def test_layer_eval_uses_the_recurrent_twin_with_the_same_result():
    layer = make("kda", "triton").eval()
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y_rec, s_rec = layer(x, output_final_state=True)
        layer.train()
        y_chunk, s_chunk = layer(x, output_final_state=True)
    assert_close("y", y_rec, y_chunk)
    assert_close("final_state", s_rec, s_chunk)


def test_layer_rejects_bad_configuration():
    with pytest.raises(ValueError, match="mode"):
        DeltaRuleAttention(hidden_size=D, num_heads=2, mode="mamba")
    with pytest.raises(ValueError, match="num_v_heads"):
        DeltaRuleAttention(hidden_size=D, num_heads=2, num_v_heads=3)
    with pytest.raises(ValueError, match=r"x must have 3 dimensions \[B, T, hidden_size=64\]"):
        make("gdn", "torch")(torch.randn(T, D))
