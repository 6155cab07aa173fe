"""Gradients of the chunked delta-rule reference (it is the ops' CPU autograd path) and its
numerical safety under strong channel-wise decay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lamina.reference import delta_rule
from lamina.reference.delta_rule import delta_rule_family_chunk_ref, delta_rule_family_recurrent_ref
from tests.tolerances import assert_close

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Small shapes gain nothing from intra-op threads; under ``pytest -n 2`` on two cores the
    spinning OpenMP threads of both workers slowed tests down 10-40x (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


GRAD_CASES = {
    # name: (decay, erase, write, T, H, HV, K, V, seqlens, chunk size)
    "delta": (None, "channel", "head", 7, 1, 2, 4, 3, None, 4),
    "gated (scalar decay)": ("head", "head", "head", 9, 1, 1, 3, 4, None, 4),
    "kda (channel decay)": ("channel", "head", "head", 6, 1, 1, 4, 4, None, 4),
    "gdn2 (channel decay, channel gates)": ("channel", "channel", "channel", 9, 1, 2, 4, 3, None, 4),
    "gdn2 varlen": ("channel", "channel", "channel", 0, 1, 1, 3, 3, [5, 3], 4),
    "gdn2 chunk 3 (padded split)": ("channel", "channel", "channel", 7, 1, 1, 3, 3, None, 3),
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_chunk_ref_gradcheck(name, monkeypatch):
    """Analytic gradients of the chunk ref against finite differences, for every input it takes.

    The channel-decay scores are computed in groups of chunk-heads; a group of 2 here makes
    every case span several groups.
    """
    monkeypatch.setattr(delta_rule, "CACHE_BLOCK_ELEMENTS", 2 * 4 * 4)
    decay, erase, write, T, H, HV, K, V, seqlens, chunk_size = GRAD_CASES[name]
    B, N = 1, 1
    if seqlens is not None:
        T, N = sum(seqlens), len(seqlens)
    cu_seqlens = None if seqlens is None else torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()])
    leaves = {
        "q": torch.randn(B, T, H, K, dtype=F64),
        "k": F.normalize(torch.randn(B, T, H, K, dtype=F64), dim=-1),
        "v": torch.randn(B, T, HV, V, dtype=F64),
        "initial_state": torch.randn(N, HV, K, V, dtype=F64),
    }
    if decay is not None:
        leaves["g"] = -2 * torch.rand((B, T, HV) if decay == "head" else (B, T, HV, K), dtype=F64)
    leaves["erase"] = torch.rand((B, T, HV) if erase == "head" else (B, T, HV, K), dtype=F64)
    leaves["write"] = torch.rand((B, T, HV) if write == "head" else (B, T, HV, V), dtype=F64)
    names = list(leaves)

    def fn(*tensors):
        kwargs = dict(zip(names, tensors))
        return delta_rule_family_chunk_ref(
            **kwargs, output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=chunk_size
        )

    inputs = tuple(x.requires_grad_() for x in leaves.values())
    assert torch.autograd.gradcheck(fn, inputs)


def strong_channel_decay_inputs(T: int) -> dict:
    """float32, H = 1, K = V = 16; g = -20 per token on every other K channel, -U(0, 1) elsewhere.

    Over a 64-token chunk the cumulative log decay reaches -1280: exp(-G) overflows float32.
    """
    K = V = 16
    g = -torch.rand(1, T, 1, K)
    g[..., ::2] = -20.0
    return dict(
        q=torch.randn(1, T, 1, K),
        k=F.normalize(torch.randn(1, T, 1, K), dim=-1),
        v=torch.randn(1, T, 1, V),
        g=g,
        erase=torch.rand(1, T, 1, K),
        write=torch.rand(1, T, 1, V),
        initial_state=torch.randn(1, 1, K, V),
    )


def check_finite_forward_backward(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    leaves = {key: x.clone().requires_grad_() for key, x in inputs.items()}
    o, s = delta_rule_family_chunk_ref(**leaves, output_final_state=True)
    assert torch.isfinite(o).all(), "non-finite output"
    assert torch.isfinite(s).all(), "non-finite final state"
    (o.square().sum() + s.square().sum()).backward()
    for key, leaf in leaves.items():
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all(), f"non-finite gradient of {key}"
        assert leaf.grad.abs().sum() > 0, f"gradient of {key} is identically zero"
    return o.detach(), s.detach()


def test_strong_channel_decay_finite_and_correct_t1024():
    """No NaN/inf in outputs or gradients, and still the token loop's answer (float32 row)."""
    inputs = strong_channel_decay_inputs(1024)
    o, s = check_finite_forward_backward(inputs)
    o_ref, s_ref = delta_rule_family_recurrent_ref(
        **{key: x.double() for key, x in inputs.items()}, output_final_state=True
    )
    assert_close("o", o, o_ref)
    assert_close("final_state", s, s_ref)


def test_strong_channel_decay_finite_t4096():
    check_finite_forward_backward(strong_channel_decay_inputs(4096))


def test_grouped_channel_scores_match_one_group(monkeypatch):
    """Outputs and gradients do not depend on how the channel-decay scores are grouped."""
    inputs = strong_channel_decay_inputs(200)
    inputs["g"] = inputs["g"] / 10  # moderate decay, so that all gradients are far from zero
    results = []
    for block in (1 << 30, 16 * 64 * 3):  # one group; groups of 3 chunk-heads (C = 64, K = 16)
        monkeypatch.setattr(delta_rule, "CACHE_BLOCK_ELEMENTS", block)
        leaves = {key: x.double().requires_grad_() for key, x in inputs.items()}
        o, s = delta_rule_family_chunk_ref(**leaves, output_final_state=True)
        (o.square().sum() + s.square().sum()).backward()
        results.append([o, s] + [leaf.grad for leaf in leaves.values()])
    for name, one, grouped in zip(["o", "final_state", *inputs], *results):
        assert_close(name, grouped, one)
