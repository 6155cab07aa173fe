"""Fuzz cases of lamina's layers at tiny sizes: the layer in the case dtype against a float64 copy
of itself with the same weights, run on CPU through the PyTorch ops (``backend="torch"``, or
PyTorch dispatch for the fla-compatible layers, which take no backend). Compared: the output, the
input gradient and every parameter gradient (RMS error ratio, recurrence rows of the table)."""

from __future__ import annotations

import copy

import torch

from lamina.fuzz.common import DTYPES, Draw, pytorch_dispatch
from lamina.testing import assert_close, gradient_scale


def build_layer(case: dict) -> torch.nn.Module:
    """The layer of ``case`` with weights drawn from its seed (float32, on CPU)."""
    from lamina import layers

    op = case["op"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(case["seed"])
        if op == "PrismAttention":
            return layers.PrismAttention(case["hidden"], case["heads"], case["kv_heads"], rotary=case["rotary"],
                                         backend="auto")
        common = dict(hidden_size=case["hidden"], num_heads=case["heads"], mode=case["mode"],
                      use_short_conv=case["short_conv"], allow_neg_eigval=case["allow_neg_eigval"])
        if op == "DeltaNet":
            return layers.DeltaNet(use_gate=case["use_gate"], **common)
        common.update(head_dim=case["head_dim"], num_v_heads=case["heads"] * case["v_ratio"], expand_v=1)
        if op == "GatedDeltaNet":
            return layers.GatedDeltaNet(use_gate=case["use_gate"], **common)
        if op == "KimiDeltaAttention":
            return layers.KimiDeltaAttention(**common)
        if op == "GatedDeltaNet2":
            return layers.GatedDeltaNet2(**common)
    raise ValueError(f"not a layer: {op!r}")


def _forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out


def check_layer(case: dict) -> None:
    dtype, device, grad = DTYPES[case["dtype"]], case["device"], case["grad"]
    draw = Draw(case["seed"])
    layer = build_layer(case)
    oracle = copy.deepcopy(layer).double()
    if case["op"] == "PrismAttention":
        oracle.backend = "torch"
    layer = layer.to(device=device, dtype=dtype)
    x64 = draw.randn(case["B"], case["T"], case["hidden"])
    x = x64.to(dtype).to(device).requires_grad_(grad)
    x_ref = x.detach().double().cpu().requires_grad_(grad)
    if case["backend"] == "torch" and device == "cpu":
        with pytorch_dispatch():
            y = _forward(layer, x)
    else:
        y = _forward(layer, x)
    with pytorch_dispatch():
        y_ref = _forward(oracle, x_ref)
    assert_close("y", y, y_ref, dtype=dtype)
    if not grad:
        return
    dy = draw.cotangent(y.shape, y.dtype)
    if case["backend"] == "torch" and device == "cpu":
        with pytorch_dispatch():
            y.backward(dy.to(device, y.dtype))
    else:
        y.backward(dy.to(device, y.dtype))
    with pytorch_dispatch():
        y_ref.backward(dy)
    ref_params = dict(oracle.named_parameters())
    scale = gradient_scale([x_ref.grad, *(p.grad for p in ref_params.values())])
    assert_close("dx", x.grad, x_ref.grad, dtype=dtype, scale=scale)
    for name, p in layer.named_parameters():
        ref = ref_params[name].grad
        if p.grad is None or ref is None:
            if (p.grad is None) != (ref is None):
                raise AssertionError(f"d{name}: gradient present in only one of layer and float64 copy")
            continue
        assert_close(f"d{name}", p.grad, ref, dtype=dtype, scale=scale)
