"""HRMGatedUpdate and HRMCore: gate semantics, truncated backprop, flat mode, passes, fused vs reference op."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lamina.layers.hrm as hrm_layers
from lamina.layers.hrm import HRMCore, HRMGatedUpdate
from lamina.reference.hrm import hrm_gated_update_ref
from tests.tolerances import assert_close

D = 16


class MLPBlock(nn.Module):
    """A [B, T, D] -> [B, T, D] block with parameters and saved activations."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_core(mode="hierarchical", n_cycles=2, steps_per_cycle=2, grad_steps=2, passes=1, backend="torch",
              gate="channel", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    core = HRMCore(MLPBlock(D), MLPBlock(D), D, n_cycles, steps_per_cycle, grad_steps, passes=passes, mode=mode,
                   gate=gate, backend=backend)
    return core.to(dtype)


def count_saved(core: nn.Module, x: torch.Tensor) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        core(x)
    return len(saved)


@pytest.mark.parametrize("gate", ["channel", "token"])
def test_gated_update_module_is_the_op_on_its_projection(gate):
    torch.manual_seed(0)
    mod = HRMGatedUpdate(D, gate=gate, backend="torch")
    nn.init.normal_(mod.bias)
    nn.init.normal_(mod.norm_weight)
    h, c, ctx = torch.randn(3, 4, D), torch.randn(3, 4, D), torch.randn(3, 4, D)
    logits = torch.cat([h, c, ctx], -1) @ mod.proj.weight.t()
    assert logits.shape[-1] == (D if gate == "channel" else 1)
    expected = hrm_gated_update_ref(h, c, logits, mod.bias, mod.norm_weight, eps=mod.eps)
    assert_close("y", mod(h, c, ctx), expected, kind="elementwise")
    no_ctx = HRMGatedUpdate(D, gate=gate, norm=False, context=False, backend="torch")
    assert no_ctx.norm_weight is None and no_ctx.proj.in_features == 2 * D
    with pytest.raises(ValueError, match="context must be given"):
        mod(h, c)
    with pytest.raises(ValueError, match="context must be None"):
        no_ctx(h, c, ctx)


@pytest.mark.parametrize("mode", ["hierarchical", "flat"])
def test_only_the_last_k_steps_hold_a_graph(mode):
    """Saved activations grow with K (steps with gradients) and do not depend on M."""
    x = torch.randn(2, 3, D)
    # one fast step per cycle: every step costs the same (fast and slow update)
    saved = {(m, k): count_saved(make_core(mode, n_cycles=m, steps_per_cycle=1, grad_steps=k), x)
             for m, k in ((4, 1), (4, 2), (4, 3), (8, 1), (8, 3))}
    per_step = saved[(4, 2)] - saved[(4, 1)]
    assert per_step > 0
    assert saved[(4, 3)] - saved[(4, 1)] == 2 * per_step
    assert saved[(8, 1)] == saved[(4, 1)] and saved[(8, 3)] == saved[(4, 3)]


def test_truncated_steps_get_no_gradient():
    x = torch.randn(2, 3, D)
    full = make_core(grad_steps=4)  # M = 4: every step differentiated, the initial states get gradients
    full(x)[0].sum().backward()
    assert full.fast_init.grad is not None and full.slow_init.grad is not None
    # steps 0 and 1 (the first cycle, the only one that reads the initial states) run under no_grad
    truncated = make_core(grad_steps=2)
    truncated(x)[0].sum().backward()
    assert truncated.fast_init.grad is None and truncated.slow_init.grad is None
    # with K = 3, step 1 is differentiated: it still reads the initial slow state, not the fast one
    three = make_core(grad_steps=3)
    three(x)[0].sum().backward()
    assert three.fast_init.grad is None and three.slow_init.grad is not None
    assert all(p.grad is not None for p in truncated.fast_block.parameters())


def test_passes_are_detached():
    x = torch.randn(2, 3, D)
    core = make_core(grad_steps=4, passes=2)
    outputs = core(x)
    assert len(outputs) == 2 and all(o.shape == x.shape for o in outputs)
    outputs[1].sum().backward()  # the second pass starts from detached states: nothing reaches the initial states
    assert core.fast_init.grad is None and core.slow_init.grad is None
    outputs = core(x)
    outputs[0].sum().backward()
    assert core.fast_init.grad is not None


def test_flat_mode_has_no_slow_module_and_no_gate():
    slow = MLPBlock(D)
    core = HRMCore(MLPBlock(D), slow, D, n_cycles=2, steps_per_cycle=3, grad_steps=2, mode="flat")
    params = {id(p) for p in core.parameters()}
    assert not any(id(p) in params for p in slow.parameters())
    assert core.slow_block is None
    assert not any(isinstance(m, HRMGatedUpdate) for m in core.modules())
    # flat iteration is z <- fast_block(z + x), M times
    x = torch.randn(2, 3, D)
    z = core.fast_init.expand_as(x)
    for _ in range(6):
        z = core.fast_block(z + x)
    assert_close("flat", core(x)[0], z, kind="elementwise")


def test_one_step_is_the_final_step_gradient():
    x = torch.randn(2, 3, D)
    one = make_core("one_step", grad_steps=1)
    ref = make_core("hierarchical", grad_steps=1)
    ref.load_state_dict(one.state_dict())
    out_one, out_ref = one(x)[0], ref(x)[0]
    assert torch.equal(out_one, out_ref)
    out_one.sum().backward()
    out_ref.sum().backward()
    for a, b in zip(one.parameters(), ref.parameters()):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad)
    with pytest.raises(ValueError, match="grad_steps must be 1"):
        make_core("one_step", grad_steps=2)


@pytest.mark.interpret
@pytest.mark.parametrize("gate", ["channel", "token"])
def test_fused_op_and_reference_op_give_identical_cores(gate, monkeypatch):
    """The whole core in float64 with the fused Triton op (interpreter) vs the reference op."""
    x = torch.randn(2, 3, D, dtype=torch.float64)
    fused = make_core(grad_steps=3, passes=2, backend="triton", gate=gate, dtype=torch.float64)
    out_fused = fused(x)
    sum(o.sum() for o in out_fused).backward()

    def reference_op(h, c, gate_logits, bias=None, norm_weight=None, eps=1e-6, out=None, backend="auto"):
        return hrm_gated_update_ref(h, c, gate_logits, bias, norm_weight, eps)

    monkeypatch.setattr(hrm_layers, "hrm_gated_update", reference_op)
    ref = make_core(grad_steps=3, passes=2, backend="triton", gate=gate, dtype=torch.float64)
    out_ref = ref(x)
    sum(o.sum() for o in out_ref).backward()
    for a, b in zip(out_fused, out_ref):
        assert_close("output", a, b, kind="elementwise")
    for (name, a), b in zip(fused.named_parameters(), ref.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert_close(name, a.grad, b.grad, kind="elementwise")


def test_core_validation():
    block = MLPBlock(D)
    with pytest.raises(ValueError, match="mode must be one of"):
        HRMCore(block, block, D, 2, 2, 1, mode="deep")
    with pytest.raises(ValueError, match=r"grad_steps must be <= n_cycles \* steps_per_cycle = 4, got 5"):
        HRMCore(block, block, D, 2, 2, 5)
    with pytest.raises(ValueError, match="n_cycles must be a positive int"):
        HRMCore(block, block, D, 0, 2, 1)
    with pytest.raises(TypeError, match="slow_block must be an nn.Module"):
        HRMCore(block, lambda x: x, D, 2, 2, 1)
    with pytest.raises(ValueError, match="gate must be one of"):
        HRMGatedUpdate(D, gate="row")
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, d_model=16\]"):
        HRMCore(block, block, D, 2, 2, 1)(torch.randn(2, 3, 8))
