"""lamina.patch_fla(): fla's causal LMs run (forward, backward, generate) on CPU on lamina's ops; undo restores fla."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close

import lamina

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import fla.layers.gated_deltanet as fla_gdn_layer
    import fla.modules as fla_modules
    import fla.ops as fla_ops
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, KDAConfig, KDAForCausalLM

VOCAB = 96
MODELS = {
    "GatedDeltaNet": (GatedDeltaNetConfig, GatedDeltaNetForCausalLM, dict(head_dim=16, num_heads=2)),
    "KDA": (KDAConfig, KDAForCausalLM, dict(head_dim=16, num_heads=2)),
}


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def tiny_model(name: str):
    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(0)
    config = config_cls(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB, intermediate_size=128, **extra)
    return model_cls(config)


@pytest.mark.parametrize("name", list(MODELS))
def test_fla_causal_lm_trains_and_generates_on_cpu(name, torch_path):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, as generation batches prompts of different lengths
    with lamina.patch_fla():
        model = tiny_model(name)
        out = model(input_ids=ids, labels=ids)  # fla's defaults: fused norm, swiglu and cross entropy
        out.loss.backward()
        for pname, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert torch.isfinite(out.loss) and out.loss.item() > 0
        model.eval()
        result = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=0)
        full_mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], dim=1)
        with torch.no_grad():
            full = model(input_ids=result.sequences, attention_mask=full_mask).logits
    assert result.sequences.shape == (2, 15)
    for i, step_logits in enumerate(result.logits):
        # generating with the cache gives the logits of the full forward at the same position
        assert_close(f"logits of generated token {i}", step_logits, full[:, 9 + i])


def test_patch_swaps_and_undo_restores():
    originals = (fla_ops.chunk_gated_delta_rule, fla_gdn_layer.chunk_gated_delta_rule,
                 fla_gdn_layer.fused_recurrent_gated_delta_rule, fla_modules.ShortConvolution.forward,
                 fla_modules.FusedRMSNormGated.forward, fla_modules.RMSNorm.forward)
    patch = lamina.patch_fla()
    try:
        assert patch.active
        assert fla_gdn_layer.chunk_gated_delta_rule is lamina.chunk_gated_delta_rule
        assert fla_ops.chunk_gated_delta_rule is lamina.chunk_gated_delta_rule
        assert fla_gdn_layer.fused_recurrent_gated_delta_rule is lamina.fused_recurrent_gated_delta_rule
        assert fla_modules.ShortConvolution.forward is lamina.layers.ShortConvolution.forward
        with lamina.patch_fla() as again:  # nothing of fla's left to replace but the CPU paths' wrappers
            assert fla_ops.chunk_gated_delta_rule is lamina.chunk_gated_delta_rule
        assert not again.active
        assert fla_ops.chunk_gated_delta_rule is lamina.chunk_gated_delta_rule  # the outer patch still holds
    finally:
        patch.undo()
    assert not patch.active
    now = (fla_ops.chunk_gated_delta_rule, fla_gdn_layer.chunk_gated_delta_rule,
           fla_gdn_layer.fused_recurrent_gated_delta_rule, fla_modules.ShortConvolution.forward,
           fla_modules.FusedRMSNormGated.forward, fla_modules.RMSNorm.forward)
    assert all(a is b for a, b in zip(now, originals))


def test_cpu_cross_entropy_matches_pytorch():
    """The CPU path given to fla's FusedCrossEntropyLoss against F.cross_entropy and a by-hand z-loss."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(12, 30, generator=gen)
    target = torch.randint(0, 30, (12,), generator=gen)
    target[[2, 7]] = -100
    with lamina.patch_fla():
        for smoothing in (0.0, 0.1):
            for reduction in ("mean", "sum", "none"):
                loss_fn = fla_modules.FusedCrossEntropyLoss(label_smoothing=smoothing, reduction=reduction)
                expected = F.cross_entropy(logits, target, label_smoothing=smoothing, reduction=reduction)
                assert_close(f"loss {smoothing} {reduction}", loss_fn(logits, target), expected, kind="elementwise")
        z_fn = fla_modules.FusedCrossEntropyLoss(lse_square_scale=1e-2, return_z_loss=True, reduction="sum")
        loss, z = z_fn(logits, target)
    valid = target != -100
    lse = torch.logsumexp(logits, -1)[valid]
    assert_close("z_loss", z, 1e-2 * lse.square().sum(), kind="elementwise")
    assert_close("loss with z", loss, F.cross_entropy(logits, target, reduction="sum") + z, kind="elementwise")
