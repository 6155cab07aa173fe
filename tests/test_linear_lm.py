"""lamina.models.LinearLM: forward, loss and gradients on CPU, decoding equals the full forward,
the Triton path under the interpreter, and configuration errors. (Greedy generation through the
cache for every delta-rule layer, pure and hybrid: tests/test_generation.py.)"""

from __future__ import annotations

import pytest
import torch

from lamina.models import LinearLM, LinearLMConfig

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
