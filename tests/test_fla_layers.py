"""The fla-compatible layers (lamina.layers.DeltaNet, GatedDeltaNet, KimiDeltaAttention, GatedDeltaNet2).

Checked against fla 0.6's own layer code: same parameters (names, shapes, dtypes, and the same
initial values for the same seed), strict loading of fla's weights, and, with fla's layer running
on lamina's ops through ``lamina.patch_fla()``, the same outputs and gradients. What the patch
swaps in (the ops, the short convolution and the norms) is checked against float64 references in
their own tests; here fla's layer code is the independent side. Decoding token by token through
the cache must equal the full-sequence forward.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tolerances import assert_close

import lamina
from lamina.layers import Cache, DeltaNet, GatedDeltaNet, GatedDeltaNet2, KimiDeltaAttention

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import fla.layers as fla_layers

D = 64
LAYERS = {
    "DeltaNet": (DeltaNet, fla_layers.DeltaNet),
    "GatedDeltaNet": (GatedDeltaNet, fla_layers.GatedDeltaNet),
    "KimiDeltaAttention": (KimiDeltaAttention, fla_layers.KimiDeltaAttention),
    "GatedDeltaNet2": (GatedDeltaNet2, fla_layers.GatedDeltaNet2),
}
# Several option sets per layer, non-default ones included.
OPTIONS = {
    "DeltaNet": [
        dict(hidden_size=D, num_heads=2),
        dict(hidden_size=D, num_heads=2, use_gate=True, qk_activation="relu", qk_norm="sum", allow_neg_eigval=True,
             conv_bias=True, expand_v=2.0),
        dict(d_model=D, num_heads=4, use_short_conv=False, use_beta=False, qk_activation="elu", expand_k=0.5),
    ],
    "GatedDeltaNet": [
        dict(hidden_size=D, head_dim=16, num_heads=2),
        dict(hidden_size=D, head_dim=16, num_heads=2, num_v_heads=4, expand_v=1, use_gate=False, allow_neg_eigval=True,
             conv_bias=True),
        dict(hidden_size=D, head_dim=32, num_heads=2, use_short_conv=False, output_gate_activation="sigmoid",
             conv_size=3),
    ],
    "KimiDeltaAttention": [
        dict(hidden_size=D, head_dim=16, num_heads=2),
        dict(hidden_size=D, head_dim=16, num_heads=2, num_v_heads=4, expand_v=2, allow_neg_eigval=True, conv_bias=True),
        dict(hidden_size=D, head_dim=32, num_heads=2, safe_gate=True, lower_bound=-3.0, use_short_conv=False),
    ],
    "GatedDeltaNet2": [
        dict(hidden_size=D, head_dim=16, num_heads=2),
        dict(hidden_size=D, head_dim=16, num_heads=2, num_v_heads=4, allow_neg_eigval=True, conv_bias=True),
        dict(hidden_size=D, head_dim=32, num_heads=2, expand_v=0.5, use_short_conv=False, conv_size=2),
    ],
}
CASES = [(name, i) for name in LAYERS for i in range(len(OPTIONS[name]))]


def build(name: str, i: int, which: int, seed: int = 0, **extra) -> torch.nn.Module:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla warns when the short convolution is off
        return LAYERS[name][which](**OPTIONS[name][i], **extra)


@pytest.fixture
def torch_path(monkeypatch):
    """Run lamina's ops on their PyTorch path (CPU without the interpreter) for this test."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.parametrize("name,i", CASES)
def test_parameters_match_fla(name, i):
    ours, theirs = build(name, i, 0), build(name, i, 1)
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
        # same construction order and draws: the same seed gives the same initial values
        assert torch.equal(a[key], b[key]), key
    for pa, pb in zip(ours.parameters(), theirs.parameters()):
        assert getattr(pa, "_no_weight_decay", False) == getattr(pb, "_no_weight_decay", False)
    other = build(name, i, 0, seed=1)
    other.load_state_dict(b, strict=True)
    assert all(torch.equal(x, y) for x, y in zip(other.state_dict().values(), b.values()))


def _inputs(kind: str, T: int = 20):
    gen = torch.Generator().manual_seed(3)
    if kind == "varlen":
        return torch.randn(1, T, D, generator=gen), dict(cu_seqlens=torch.tensor([0, 7, T]))
    x = torch.randn(2, T, D, generator=gen)
    if kind == "mask":  # left padding on row 1, right padding on row 0
        mask = torch.ones(2, T, dtype=torch.long)
        mask[0, -5:] = 0
        mask[1, :6] = 0
        return x, dict(attention_mask=mask)
    return x, {}


def _compare_with_patched_fla(name, i, kind, T=20, fla_on_torch_path=None):
    """``fla_on_torch_path``: a pytest monkeypatch; fla's layer then runs lamina's PyTorch path, ours Triton."""
    ours, theirs = build(name, i, 0), build(name, i, 1)
    x, kwargs = _inputs(kind, T)
    grads = []
    with lamina.patch_fla():
        for layer in (ours, theirs):
            if layer is theirs and fla_on_torch_path is not None:
                fla_on_torch_path.setenv("TRITON_INTERPRET", "0")
            xi = x.clone().requires_grad_()
            y, attn, _ = layer(xi, **kwargs)
            assert attn is None
            (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
            grads.append((y, xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (y0, dx0, dp0), (y1, dx1, dp1) = grads
    assert_close("o", y0, y1)
    assert_close("dx", dx0, dx1)
    for key in dp1:
        assert dp0[key] is not None, key
        assert_close(f"d{key}", dp0[key], dp1[key])
    if kind == "mask":  # padded positions give zeros, as fla
        assert not y0[0, -5:].any() and not y0[1, :6].any()


@pytest.mark.parametrize("kind", ["dense", "mask", "varlen"])
@pytest.mark.parametrize("name,i", CASES)
def test_same_outputs_and_grads_as_patched_fla(name, i, kind, torch_path):
    _compare_with_patched_fla(name, i, kind)


@pytest.mark.grid
@pytest.mark.interpret
@pytest.mark.parametrize("name", list(LAYERS))
def test_same_outputs_and_grads_as_patched_fla_triton(name, monkeypatch):
    """lamina's layer on the Triton kernels (interpreter) against fla's layer on lamina's PyTorch path."""
    _compare_with_patched_fla(name, 1, "mask", T=14, fla_on_torch_path=monkeypatch)


def _decode_matches_full(name, i, cache_cls=Cache, T=12, prefill=5):
    layer = build(name, i, 0, layer_idx=0).eval()
    x, kwargs = _inputs("mask", T)
    mask = kwargs["attention_mask"]
    mask[0] = 1  # decoding appends tokens on the right: row 0 unpadded, row 1 left-padded
    with torch.enable_grad():  # chunked path for the reference
        full, _, _ = layer(x, attention_mask=mask)
    cache = cache_cls()
    with torch.no_grad():
        outs = [layer(x[:, :prefill], attention_mask=mask[:, :prefill], past_key_values=cache, use_cache=True)[0]]
        for t in range(prefill, T):
            y, _, cache = layer(x[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache, use_cache=True)
            outs.append(y)
    stepped = torch.cat(outs, dim=1)
    keep = mask.bool()
    assert_close("decoded o", stepped[keep], full.detach()[keep])
    assert cache.get_seq_length() == T


@pytest.mark.parametrize("name,i", CASES)
def test_decoding_with_cache_equals_full_forward(name, i, torch_path):
    _decode_matches_full(name, i)


@pytest.mark.grid
@pytest.mark.interpret
@pytest.mark.parametrize("name", list(LAYERS))
def test_decoding_with_cache_equals_full_forward_triton(name):
    _decode_matches_full(name, 0)


def test_fla_cache_works_with_lamina_layers(torch_path):
    from fla.models.cache_utils import Cache as FlaCache

    _decode_matches_full("GatedDeltaNet", 0, cache_cls=FlaCache)


def test_bad_inputs_name_the_argument(torch_path):
    layer = build("GatedDeltaNet", 0, 0, layer_idx=0)
    x = torch.randn(2, 6, D)
    with pytest.raises(ValueError, match=r"hidden_states must have shape \[B, T, hidden_size=64\]"):
        layer(torch.randn(2, 6, D + 1))
    with pytest.raises(ValueError, match=r"attention_mask must be a \[batch_size, seq_len\]"):
        layer(x, attention_mask=torch.ones(2, 6, 6))
    with pytest.raises(ValueError, match="only 0 .padding. and 1"):
        layer(x, attention_mask=torch.full((2, 6), 2))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        layer(x, attention_mask=torch.ones(3, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask must be a bool or integer"):
        layer(x, attention_mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match="mode must be one of"):
        GatedDeltaNet(hidden_size=D, head_dim=16, num_heads=2, mode="parallel")
    with pytest.raises(ValueError, match="needs layer_idx"):
        build("GatedDeltaNet", 0, 0)(x, past_key_values=Cache(), use_cache=True)
    # a cache filled by another layer type
    cache = Cache()
    build("DeltaNet", 0, 0, layer_idx=0)(x, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"past_key_values\[0\]\['recurrent_state'\] must have shape"):
        layer(x, past_key_values=cache, use_cache=True)
    attn_cache = Cache()
    attn_cache.update(attn_state=(torch.zeros(2, 6, 4), torch.zeros(2, 6, 4)), layer_idx=0)
    with pytest.raises(ValueError, match="attention layer's key/value cache"):
        layer(x, past_key_values=attn_cache, use_cache=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'use_fast_kernels'"):
        GatedDeltaNet(hidden_size=D, head_dim=16, num_heads=2, use_fast_kernels=True)


def test_caller_tensors_are_not_modified(torch_path):
    layer = build("KimiDeltaAttention", 0, 0)
    x, kwargs = _inputs("mask")
    x0, m0 = x.clone(), kwargs["attention_mask"].clone()
    layer(x, **kwargs)
    assert torch.equal(x, x0) and torch.equal(kwargs["attention_mask"], m0)
