"""lamina.models.LinearLM: forward, loss and gradients on CPU, decoding equals the full forward,
the Triton path under the interpreter, and configuration errors. (Greedy generation through the
cache for every delta-rule layer, pure and hybrid: tests/test_generation.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch

import lamina
from lamina.models import LinearLM, LinearLMConfig

with warnings.catch_warnings():  # fla imports Triton's modules: at collection, under the interpreter (conftest)
    warnings.simplefilter("ignore")
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, KDAConfig, KDAForCausalLM

LAYERS = ("DeltaNet", "GatedDeltaNet", "KimiDeltaAttention", "GatedDeltaNet2")


def _model(layer: str, attention_every: int = 0, dtype=torch.float32, **kw) -> LinearLM:
    torch.manual_seed(0)
    config = LinearLMConfig(40, 32, 3, layer=layer, num_heads=2, head_dim=None if layer == "DeltaNet" else 16,
                            attention_every=attention_every, backend="torch", **kw)
    return LinearLM(config).to(dtype)


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.parametrize("layer", LAYERS)
def test_forward_loss_and_gradients(layer, torch_path):
    model = _model(layer, attention_every=2)
    ids = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(1))
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 11, 40)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 40), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    assert abs(out.loss.item() - torch.log(torch.tensor(40.0)).item()) < 0.5  # near uniform at initialisation
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.lm_head.weight is model.embed.weight  # tied


@pytest.mark.parametrize("layer", LAYERS)
def test_decode_logits_equal_the_full_forward(layer, torch_path):
    """Prefill 5 tokens, then decode 3 one at a time: the logits of every position equal the full
    forward's (float64, where the only difference is the order of the sums)."""
    model = _model(layer, attention_every=2, dtype=torch.float64).eval()
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2, 8)
        steps = [model.decode(ids[:, :5], cache)] + [model.decode(ids[:, t:t + 1], cache) for t in range(5, 8)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.interpret
def test_triton_path_under_the_interpreter_matches_pytorch(monkeypatch):
    model = _model("GatedDeltaNet", attention_every=2)
    ids = torch.randint(0, 40, (1, 9), generator=torch.Generator().manual_seed(3))
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ref = model(ids, labels=ids)
    ref.loss.backward()
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("kwargs,match", [
    ({"layer": "Mamba"}, "layer must be one of"),
    ({"attention_every": -1}, "attention_every"),
    ({"attention_every": 1, "attention_heads": 4}, "attention_heads"),  # head dim 8
    ({"mlp_ratio": 0}, "mlp_ratio"),
    ({"num_layers": 0}, "num_layers"),
])
def test_bad_configuration_is_refused_by_name(kwargs, match):
    base = dict(vocab_size=40, hidden_size=32, num_layers=2)
    with pytest.raises(ValueError, match=match):
        LinearLMConfig(**{**base, **kwargs})


@pytest.mark.parametrize("name", ["GatedDeltaNet", "KDA"])
def test_weights_of_an_fla_causal_lm_give_its_logits(name, torch_path):
    """fla's GatedDeltaNetForCausalLM / KDAForCausalLM (run on CPU through lamina.patch_fla) and a LinearLM
    of the same shape holding its weights (load_fla_state_dict) give the same logits; extra or missing
    weights and mismatched shapes are refused by name."""
    config_cls, model_cls, layer = {"GatedDeltaNet": (GatedDeltaNetConfig, GatedDeltaNetForCausalLM, "GatedDeltaNet"),
                                    "KDA": (KDAConfig, KDAForCausalLM, "KimiDeltaAttention")}[name]
    torch.manual_seed(0)
    fla_model = model_cls(config_cls(hidden_size=32, num_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=40,
                                     intermediate_size=64, tie_word_embeddings=False)).eval()
    with torch.no_grad():  # away from the initialisation, so that a weight in the wrong place shows
        for p in fla_model.parameters():
            p.add_(torch.randn_like(p), alpha=0.05)
    torch.manual_seed(1)
    model = LinearLM(LinearLMConfig(40, 32, 2, layer=layer, num_heads=2, head_dim=16, mlp_ratio=2.0,
                                    tie_embeddings=False, routing="cler")).eval()
    model.load_fla_state_dict(fla_model)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), lamina.patch_fla():
        expected = fla_model(input_ids=ids).logits
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)

    state = fla_model.state_dict()
    with pytest.raises(ValueError, match="no place in this LinearLM"):
        model.load_fla_state_dict({**state, "model.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="'blocks.0.mixer.extra', which this LinearLM does not have"):
        model.load_fla_state_dict({**state, "model.layers.0.attn.extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="has no 'model.layers.1.mlp_norm.weight'"):
        model.load_fla_state_dict({k: v for k, v in state.items() if k != "model.layers.1.mlp_norm.weight"})
    wide = LinearLM(LinearLMConfig(40, 32, 2, layer=layer, num_heads=2, head_dim=16, tie_embeddings=False))
    with pytest.raises(ValueError, match="mlp.gate_up.weight: the fla weight has shape"):
        wide.load_fla_state_dict(state)
    tied = LinearLM(LinearLMConfig(40, 32, 2, layer=layer, num_heads=2, head_dim=16, mlp_ratio=2.0))
    with pytest.raises(ValueError, match="tie_embeddings=False"):
        tied.load_fla_state_dict(state)
