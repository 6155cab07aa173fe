"""Fuzz cases of lamina's layers at tiny sizes: the layer in the case dtype against a float64 copy
of itself with the same weights, run on CPU through the PyTorch ops (``backend="torch"``, or
PyTorch dispatch for the fla-compatible layers, which take no backend). Compared: the output, the
input gradient and every parameter gradient (RMS error ratio, recurrence rows of the table; the gate's
``A_log`` and ``dt_bias`` relative to the root-sum-square of their terms, the output also relative to its
op's output terms and every parameter gradient to its op's input-gradient terms, carried through the
layer)."""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from typing import NamedTuple

import torch

from lamina.fuzz.common import DTYPES, Draw, compare_in_stages, pytorch_dispatch, raise_floors
from lamina.fuzz.delta import (
    _decay_scales,
    _oracle,
    _per_gate,
    decay_term_sizes,
    gradient_term_sizes,
    output_term_sizes,
)
from lamina.fuzz.space import DELTA_SPECS
from lamina.testing import assert_close, gradient_scale, reduction_scale

# Arguments of the delta-rule ops that the naive stand-ins below model; any other must keep its default.
_MODELLED = {"q", "k", "v", "g", "gk", "beta", "b", "w", "A_log", "dt_bias", "scale", "initial_state",
             "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "lower_bound",
             "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
             "chunk_size", "backend", "safe_gate", "disable_recompute"}


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


def _naive_op(name: str, op):
    """A stand-in for the delta-rule op ``name``: the fuzzer's oracle (naive ``lamina.reference`` math,
    in the inputs' precision) behind the op's own signature."""
    signature = inspect.signature(op)

    def call(*args, **kwargs):
        case, r, cu = _op_case(name, signature, args, kwargs)
        o, ht = _oracle(case, r, cu, chunked=DELTA_SPECS[name].chunked)
        return o.to(r["v"].dtype), (ht if case["output_final_state"] else None)

    return call


def _op_case(name: str, signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[dict, dict, object]:
    """The fuzzer's case, inputs and ``cu_seqlens`` of a call of the delta-rule op ``name``."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    for param, value in a.items():
        if param not in _MODELLED and value is not signature.parameters[param].default:
            raise ValueError(f"the float32 baseline does not model {name}'s {param}")
    case = {"op": name, "scale": a["scale"], "l2norm": a["use_qk_l2norm_in_kernel"],
            "gate_in_kernel": a.get("use_gate_in_kernel", False), "lower_bound": a.get("lower_bound"),
            "beta_sigmoid": a.get("use_beta_sigmoid_in_kernel", False),
            "allow_neg_eigval": a.get("allow_neg_eigval", False), "state_v_first": a.get("state_v_first", False),
            "chunk_size": a.get("chunk_size"), "output_final_state": a["output_final_state"]}
    r = {n: a.get(n) for n in ("q", "k", "v", "g", "gk", "beta", "b", "w", "initial_state", "A_log", "dt_bias")}
    return case, r, a["cu_seqlens"]


def _broadcast_gate_parameters(name: str, op, params: dict[str, torch.Tensor], terms: dict[str, list]):
    """The naive stand-in for ``name`` with the in-kernel gate's ``A_log`` and ``dt_bias`` (the layer's
    parameters in ``params``) replaced by leaves broadcast to the gate's shape; each leaf is recorded in
    ``terms`` under the parameter's name, with the parameter's shape as the gate sees it."""
    signature = inspect.signature(op)
    naive = _naive_op(name, op)

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        a = bound.arguments
        g = a.get("g")
        record = _OpCall(*_op_case(name, signature, args, kwargs))
        if g is not None and not a.get("use_gate_in_kernel", False) and g.grad_fn is not None:
            record.layer_gates = _layer_gates(g, params)
        for arg in ("A_log", "dt_bias"):
            p = a.get(arg)
            if p is None or g is None or not a.get("use_gate_in_kernel", False):
                continue
            owner = next((n for n, q in params.items() if q is p), None)
            if owner is None:
                continue
            record.owners[arg] = owner
            shaped = _per_gate(p.detach(), g)
            a[arg] = shaped.expand(g.shape).clone().requires_grad_()
            terms.setdefault(owner, []).append((a[arg], (1, 1, *shaped.shape)))
        # the op's inputs as the layer formed them (_input_scales)
        record.inputs = {n: t for n, t in a.items() if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        o, ht = naive(*bound.args, **bound.kwargs)
        # zero, a leaf: y's derivatives by the op's output (_output_scale)
        record.slack = torch.zeros_like(o, requires_grad=True)
        record.outputs = (o + record.slack, ht)
        for out in record.outputs:
            if out is not None and out.requires_grad:
                out.retain_grad()
        terms.setdefault(_CALLS, []).append(record)
        return record.outputs

    return call


# The key of ``terms`` under which the stand-ins record their calls (``_OpCall``).
_CALLS = "calls of the delta-rule ops"


class _LayerGate(NamedTuple):
    """A gate the layer formed from its parameter ``owner`` before the op (GatedDeltaNet2): ``g`` as the op
    received it, and each gate element's derivative by the parameter element it depends on (``slope``)."""

    owner: str
    g: torch.Tensor
    param: torch.Tensor
    slope: torch.Tensor

    def scale(self, size: torch.Tensor) -> float:
        """The RMS over the parameter's elements of the root-sum-squares of the terms ``size_e * dg_e/dp_j``
        (``reduction_scale(rms=True)``):
        every gate element depends on one parameter element (a per-head or per-channel parameter,
        broadcast), so ``sum_e (size_e J_ej)^2 = [J^T (size^2 * J 1)]_j``, one product with the Jacobian's
        transpose."""
        (squares,) = torch.autograd.grad(self.g, self.param, size.pow(2) * self.slope, retain_graph=True)
        return squares.mean().sqrt().item()


def _layer_gates(g: torch.Tensor, params: dict[str, torch.Tensor]) -> list[_LayerGate]:
    """The layer's ``A_log`` and ``dt_bias`` that it formed ``g`` from, with the slopes ``J 1`` of ``g`` by
    each (the Jacobian times ones, by the double-backward trick)."""
    g.retain_grad()
    gates = []
    for owner, p in params.items():
        if owner.rsplit(".", 1)[-1] not in ("A_log", "dt_bias"):
            continue
        probe = torch.zeros_like(g, requires_grad=True)
        (back,) = torch.autograd.grad(g, p, probe, create_graph=True, allow_unused=True)
        if back is not None:
            (slope,) = torch.autograd.grad(back, probe, torch.ones_like(back))
            gates.append(_LayerGate(owner, g, p, slope))
    return gates


class _OpCall:
    """One call of a delta-rule op inside the layer's float64 copy (``_broadcast_gate_parameters``): its
    case, inputs and outputs, the layer's parameters it takes as the in-kernel gate's (``owners``, by the
    op's argument) and the gates the layer formed itself (``layer_gates``)."""

    def __init__(self, case: dict, r: dict, cu) -> None:
        self.case, self.r, self.cu = case, {n: None if t is None else t.detach() for n, t in r.items()}, cu
        self.owners: dict[str, str] = {}
        self.layer_gates: list[_LayerGate] = []
        self.outputs: tuple = (None, None)
        self.slack: torch.Tensor | None = None
        self.inputs: dict[str, torch.Tensor] = {}

    def scales(self) -> dict[str, float]:
        """The layer's gate parameters at the size of the terms the chunked backward sums into the log decay's
        gradient (``lamina.fuzz.delta.decay_term_sizes``), with the op's output gradients of the backward."""
        o, ht = self.outputs
        if o.grad is None or not (self.owners or self.layer_gates):
            return {}
        cotangents = [o.grad.detach(), None if ht is None or ht.grad is None else ht.grad.detach()]
        case = {**self.case, "output_final_state": cotangents[1] is not None}
        scales = {}
        if self.owners:
            scales = {self.owners[n]: v for n, v in _decay_scales(case, self.r, self.cu, cotangents,
                                                                   list(self.owners)).items()}
        if self.layer_gates:
            size = decay_term_sizes(case, self.r, self.cu, cotangents)
            for gate in self.layer_gates:
                if gate.g.grad is not None and size.shape == gate.g.shape:
                    terms = gate.scale(torch.maximum(size, gate.g.grad.abs()))
                    raise_floors(scales, {gate.owner: terms})
        return scales


@contextlib.contextmanager
def naive_delta_ops(params: dict[str, torch.Tensor] | None = None,
                    terms: dict[str, list] | None = None) -> Iterator[None]:
    """Layers built inside this block run the naive stand-ins instead of lamina's delta-rule ops; with
    ``params`` and ``terms``, the stand-ins of ``_broadcast_gate_parameters``."""
    import lamina.ops.delta_rule as ops

    saved = {name: getattr(ops, name) for name in DELTA_SPECS}
    try:
        for name, op in saved.items():
            stand_in = _naive_op(name, op) if terms is None else _broadcast_gate_parameters(name, op, params, terms)
            setattr(ops, name, stand_in)
        yield
    finally:
        for name, op in saved.items():
            setattr(ops, name, op)


def _scales(oracle: torch.nn.Module, x_ref: torch.Tensor, dy: torch.Tensor | None) -> dict[str, float]:
    """The output ``y`` at its delta-rule op's output terms carried through the layer (``_output_scale``).
    With ``dy`` (a case with gradients): every parameter (and the input, as ``"x"``) at its op's input
    gradients' terms carried through the layer (``_input_scales``); ``A_log`` and ``dt_bias`` sum one term
    per gate element: their gradients are compared relative to the root-sum-square of those terms
    (``lamina.testing.reduction_scale``). For the in-kernel gate, the float64 gradients of the parameters
    broadcast to the gate's shape where the layer hands them to its delta-rule op; for a gate the layer
    forms itself (GatedDeltaNet2), ``dg`` at the op times each gate element's derivative by the parameter
    (``_LayerGate``). Either is also taken at the size of the terms the op's chunked backward sums into
    ``dg`` (``_OpCall.scales``), as the op cases take it."""
    copy64 = copy.deepcopy(oracle)
    terms: dict[str, list] = {}
    with pytorch_dispatch(), naive_delta_ops(dict(copy64.named_parameters()), terms):
        x = x_ref.detach().requires_grad_(dy is not None)
        y = _forward(copy64, x)
        if dy is not None:
            y.backward(dy, retain_graph=True)

    calls = terms.pop(_CALLS, [])
    scales = {n: max((reduction_scale(t.grad, shape) for t, shape in uses if t.grad is not None), default=0.0)
              for n, uses in terms.items()}
    if dy is not None:
        for call in calls:
            raise_floors(scales, call.scales())
        raise_floors(scales, _input_scales(calls, {"x": x, **dict(copy64.named_parameters())}))  # input as "x"
    if calls:
        scales["y"] = _output_scale(y, calls)
    return scales


def _input_scales(calls: list[_OpCall], params: dict[str, torch.Tensor]) -> dict[str, float]:
    """The gradients of the leaves ``params`` (the layer's parameters and input) where the op's input
    gradients have errors of their terms' size, per value channel or per key channel of q
    (``lamina.fuzz.delta.gradient_term_sizes``): at each element ``i`` of a leaf the root-sum-square of
    ``d in_j/d p_i * size_j`` over the op's input elements ``j``, those terms carried through the layer's
    input side to first order, and their RMS over the leaf. One backward per input element, through the
    input side only. At one token, beta scales the output, which the output norm removes: d beta cancels
    over the value channels, and d b_proj with it."""
    squares = {n: torch.zeros_like(p) for n, p in params.items()}
    for call in calls:
        o, ht = call.outputs
        if o.grad is None:
            continue
        cotangents = [o.grad.detach(), None if ht is None or ht.grad is None else ht.grad.detach()]
        case = {**call.case, "output_final_state": cotangents[1] is not None}
        refs = {n: None if t is None else t.detach().requires_grad_(n in call.inputs) for n, t in call.r.items()}
        for n, size in gradient_term_sizes(case, refs, call.cu, cotangents).items():
            flat, weights = call.inputs[n].reshape(-1), size.reshape(-1)
            for j in torch.nonzero(weights).flatten().tolist():
                grads = torch.autograd.grad(flat[j], list(params.values()), retain_graph=True, allow_unused=True)
                for name, g in zip(params, grads):
                    if g is not None:
                        squares[name] += (g * weights[j]).pow(2)
    return {n: reduction_scale(sq.sqrt(), sq.shape, rms=True) for n, sq in squares.items() if bool(sq.any())}


def _output_scale(y: torch.Tensor, calls: list[_OpCall]) -> float:
    """The size of y's error where the op's output has errors of its terms' size
    (``lamina.fuzz.delta.output_term_sizes``): at each element ``i`` of y the root-sum-square of
    ``dy_i/do_j * size_j`` over the op's output elements ``j``, the terms carried through the layer's output
    side to first order, and their RMS over y (``reduction_scale(rms=True)``'s measure). The derivatives are
    y's by the zero ``slack`` each call added to its output, one backward per element of y, through the
    output side only."""
    slacks = [call.slack for call in calls]
    sizes = [output_term_sizes(call.case, call.r, call.cu) for call in calls]
    flat = y.reshape(-1)
    squares = 0.0
    for i in range(flat.numel()):
        grads = torch.autograd.grad(flat[i], slacks, retain_graph=True, allow_unused=True)
        squares += sum((g * size).pow(2).sum().item() for g, size in zip(grads, sizes) if g is not None)
    return (squares / max(flat.numel(), 1)) ** 0.5


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
    dy = draw.cotangent(y.shape, y.dtype)
    if grad:
        with pytorch_dispatch() if case["backend"] == "torch" and device == "cpu" else contextlib.nullcontext():
            y.backward(dy.to(device, y.dtype))
        with pytorch_dispatch():
            y_ref.backward(dy)
    ref_params = dict(oracle.named_parameters())

    def compare(scales: dict[str, float], base: tuple | None) -> None:
        _compare(layer, x, y, ref_params, x_ref, y_ref, dtype, scales, base)

    def baseline() -> tuple:
        # the same layer in float32 over naive delta-rule math (lamina.testing)
        plain = copy.deepcopy(oracle).float()
        x_b = x_ref.detach().float().requires_grad_(grad)
        with pytorch_dispatch(), naive_delta_ops():
            y_b = _forward(plain, x_b)
            if grad:
                y_b.backward(dy.float())
        return x_b, y_b, dict(plain.named_parameters())

    compare_in_stages(compare, lambda: _scales(oracle, x_ref, dy if grad else None),
                      baseline if dtype == torch.float32 else None)


def _compare(layer, x, y, ref_params, x_ref, y_ref, dtype, scales, base=None) -> None:
    x_b, y_b, base_params = base if base is not None else (None, None, {})
    assert_close("y", y, y_ref, dtype=dtype, baseline=y_b, scale=scales.get("y"))
    if x.grad is None and x_ref.grad is None:
        return
    scale = gradient_scale([x_ref.grad, *(p.grad for p in ref_params.values())])
    assert_close("dx", x.grad, x_ref.grad, dtype=dtype, scale=max(scale, scales.get("x", 0.0)),
                 baseline=None if x_b is None else x_b.grad)
    for name, p in layer.named_parameters():
        ref = ref_params[name].grad
        if p.grad is None or ref is None:
            if (p.grad is None) != (ref is None):
                raise AssertionError(f"d{name}: gradient present in only one of layer and float64 copy")
            continue
        b = base_params[name].grad if name in base_params else None
        assert_close(f"d{name}", p.grad, ref, dtype=dtype, scale=max(scale, scales.get(name, 0.0)), baseline=b)
