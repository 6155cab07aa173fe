"""Gradients of the delta-rule references (the token loop is the gradient oracle of every other
test) and the numerical safety of the plain chunked reference under strong channel-wise decay.

The vectorised CPU path of the ops (``lamina.ops.delta_rule_cpu``) is tested in
tests/test_delta_rule_cpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
    # name: (decay, erase, write, T, H, HV, K, V, seqlens)
    "delta, GVA": (None, "head", "head", 5, 1, 2, 3, 2, None),
    "gated (scalar decay)": ("head", "head", "head", 5, 1, 1, 3, 3, None),
    "kda (channel decay)": ("channel", "head", "head", 4, 1, 1, 3, 3, None),
    "gdn2 varlen (channel gates)": ("channel", "channel", "channel", 0, 1, 1, 3, 2, [3, 1]),
}


def grad_leaves(decay, erase, write, T, H, HV, K, V, seqlens) -> tuple[dict, torch.Tensor | None]:
    """float64 leaves of the family (contracting: unit keys, gates in [0, 1]) and ``cu_seqlens``."""
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
    return leaves, cu_seqlens


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_token_loop_gradcheck(name):
    """Autograd through the token loop against finite differences, for every input it takes."""
    leaves, cu_seqlens = grad_leaves(*GRAD_CASES[name])
    names = list(leaves)

    def fn(*tensors):
        return delta_rule_family_recurrent_ref(**dict(zip(names, tensors)), output_final_state=True,
                                               cu_seqlens=cu_seqlens)

    assert torch.autograd.gradcheck(fn, tuple(x.requires_grad_() for x in leaves.values()))


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_chunk_ref_gradients_match_token_loop(name):
    """The plain chunked reference is differentiable and gives the token loop's gradients (chunk 2:
    several chunks, a ragged last one)."""
    leaves, cu_seqlens = grad_leaves(*GRAD_CASES[name])
    grads = []
    for fn, extra in ((delta_rule_family_recurrent_ref, {}), (delta_rule_family_chunk_ref, {"chunk_size": 2})):
        inputs = {key: x.clone().requires_grad_() for key, x in leaves.items()}
        o, s = fn(**inputs, output_final_state=True, cu_seqlens=cu_seqlens, **extra)
        (o * torch.linspace(-1, 1, o.numel(), dtype=F64).view_as(o)).sum().add(s.square().sum()).backward()
        grads.append({key: x.grad for key, x in inputs.items()})
    for key in leaves:
        assert_close(f"d{key}", grads[1][key], grads[0][key])


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


def test_chunk_ref_strong_channel_decay_finite_and_correct():
    """No NaN/inf in the plain chunked form's outputs or gradients, and the token loop's answer
    (float32 row): it never forms exp(-G)."""
    inputs = strong_channel_decay_inputs(256)
    leaves = {key: x.clone().requires_grad_() for key, x in inputs.items()}
    o, s = delta_rule_family_chunk_ref(**leaves, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all(), "non-finite output or final state"
    (o.square().sum() + s.square().sum()).backward()
    for key, leaf in leaves.items():
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all(), f"non-finite gradient of {key}"
    o_ref, s_ref = delta_rule_family_recurrent_ref(
        **{key: x.double() for key, x in inputs.items()}, output_final_state=True
    )
    assert_close("o", o.detach(), o_ref)
    assert_close("final_state", s.detach(), s_ref)
