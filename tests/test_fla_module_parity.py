"""lamina's ShortConvolution, RMSNorm and FusedRMSNormGated against fla 0.6's modules: the same
constructor arguments give the same state_dict (keys, shapes, dtypes, initial values) and fla's
checkpoints load strictly; the functional ops and forward methods take fla's arguments in fla's order."""

from __future__ import annotations

import inspect

import pytest
import torch

from lamina.layers.norm import FusedRMSNormGated, RMSNorm
from lamina.layers.short_conv import ShortConvolution
from lamina.ops import rms_norm_gated as lamina_norm_ops
from lamina.ops import short_conv as lamina_conv_ops

fla_modules = pytest.importorskip("fla.modules")


def assert_same_checkpoint(ours: torch.nn.Module, theirs: torch.nn.Module, init_equal: bool) -> None:
    mine, fla_sd = ours.state_dict(), theirs.state_dict()
    assert list(mine) == list(fla_sd)
    for key, value in mine.items():
        assert value.shape == fla_sd[key].shape and value.dtype == fla_sd[key].dtype, key
        if init_equal:
            assert torch.equal(value, fla_sd[key]), key
    ours.load_state_dict(fla_sd, strict=True)
    for key, value in ours.state_dict().items():
        assert torch.equal(value, fla_sd[key]), key


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_short_convolution_checkpoint(bias, dtype):
    ours = ShortConvolution(48, 4, bias=bias, activation="silu", dtype=dtype)
    theirs = fla_modules.ShortConvolution(48, 4, bias=bias, activation="silu", dtype=dtype)
    assert_same_checkpoint(ours, theirs, init_equal=False)  # random (nn.Conv1d's) initialisation
    for attr in ("hidden_size", "activation", "kernel_size", "padding", "groups", "state_size"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr


@pytest.mark.parametrize("elementwise_affine, bias", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16])
def test_rms_norm_checkpoint(elementwise_affine, bias, dtype):
    ours = RMSNorm(64, elementwise_affine=elementwise_affine, bias=bias, eps=1e-6, dtype=dtype)
    theirs = fla_modules.RMSNorm(64, elementwise_affine=elementwise_affine, bias=bias, eps=1e-6, dtype=dtype)
    assert_same_checkpoint(ours, theirs, init_equal=True)
    assert ours.eps == theirs.eps and ours.hidden_size == theirs.hidden_size
    assert (ours.bias is None) == (theirs.bias is None) and (ours.weight is None) == (theirs.weight is None)


@pytest.mark.parametrize("elementwise_affine", [True, False])
@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
def test_fused_rms_norm_gated_checkpoint(elementwise_affine, activation):
    ours = FusedRMSNormGated(64, elementwise_affine=elementwise_affine, activation=activation, dtype=torch.bfloat16)
    theirs = fla_modules.FusedRMSNormGated(64, elementwise_affine=elementwise_affine, activation=activation,
                                           dtype=torch.bfloat16)
    assert_same_checkpoint(ours, theirs, init_equal=True)
    assert ours.bias is None and theirs.bias is None
    assert (ours.eps, ours.activation) == (theirs.eps, theirs.activation)


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


@pytest.mark.parametrize("ours, theirs, fla_only", [
    (lamina_conv_ops.causal_conv1d, "fla.modules.causal_conv1d.causal_conv1d", {"cp_context"}),
    (lamina_conv_ops.causal_conv1d_update, "fla.modules.causal_conv1d.causal_conv1d_update", set()),
    (lamina_norm_ops.rms_norm, "fla.modules.norm.layernorm.rms_norm", set()),
    (lamina_norm_ops.rms_norm_gated, "fla.modules.norm.fused_norm_gate.rms_norm_gated", set()),
    (ShortConvolution.forward, "fla.modules.ShortConvolution.forward", set()),
    (ShortConvolution.step, "fla.modules.ShortConvolution.step", set()),
    (RMSNorm.forward, "fla.modules.RMSNorm.forward", set()),
    (FusedRMSNormGated.forward, "fla.modules.FusedRMSNormGated.forward", set()),
    (ShortConvolution.__init__, "fla.modules.ShortConvolution.__init__", set()),
    (RMSNorm.__init__, "fla.modules.RMSNorm.__init__", set()),
    (FusedRMSNormGated.__init__, "fla.modules.FusedRMSNormGated.__init__", set()),
])
def test_fla_argument_names_and_order(ours, theirs, fla_only):
    """fla's parameters come first, in fla's order, with fla's names; lamina adds only trailing
    keywords (``backend``). A default may differ only where lamina's dispatch chooses the backend."""
    import importlib

    module, _, attr = theirs.rpartition(".")
    try:
        target = importlib.import_module(module)
        fla_fn = getattr(target, attr)
    except ModuleNotFoundError:
        owner_module, _, owner = module.rpartition(".")
        fla_fn = getattr(getattr(importlib.import_module(owner_module), owner), attr)
    fla_params = [p for p in _params(fla_fn) if p[0] not in fla_only]
    lamina_params = _params(ours)
    assert [n for n, _ in lamina_params[:len(fla_params)]] == [n for n, _ in fla_params]
    assert all(n == "backend" for n, _ in lamina_params[len(fla_params):])
    for (name, ours_default), (_, fla_default) in zip(lamina_params, fla_params):
        if name != "backend" and fla_default is not inspect.Parameter.empty:
            assert ours_default == fla_default, name


@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_flas_torch_reference(prenorm, with_residual):
    """fla ships a PyTorch reference of its RMSNorm (residual and prenorm included): same results in float64."""
    from fla.modules.norm.layernorm import rms_norm_ref

    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((3, 5, 32), (32,), (32,)))
    res = torch.randn(3, 5, 32, generator=g, dtype=torch.float64) if with_residual else None
    ours = lamina_norm_ops.rms_norm(x, w, b, residual=res, eps=1e-5, prenorm=prenorm, backend="torch")
    theirs = rms_norm_ref(x, w, b, residual=res, eps=1e-5, prenorm=prenorm)
    for a, e in zip(ours if prenorm else (ours,), theirs if prenorm else (theirs,)):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
