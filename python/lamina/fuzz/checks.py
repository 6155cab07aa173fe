"""Fuzz cases of prism_attention, hrm_gated_update, causal_conv1d and rms_norm_gated against
``lamina.reference`` in float64 (kinds of comparison as in the op's own tests)."""

from __future__ import annotations

import math

import torch

from lamina.fuzz.common import DTYPES, Draw, as_ref, backward, compare_grads, leaf, offsets
from lamina.testing import assert_attention_close, assert_close, gradient_scale, reduction_scale


def check_attention(case: dict) -> None:
    """Output and dq, dk, dv against float64, bounded by PyTorch's own error in the case dtype."""
    import lamina
    from lamina.reference import attention_grads_ref, attention_ref

    dtype, device, grad = DTYPES[case["dtype"]], case["device"], case["grad"]
    draw = Draw(case["seed"])
    hkv, D = case["HKV"], case["D"]
    H = hkv * case["group"]
    varlen = case["lens_q"] is not None
    T = sum(case["lens_q"]) if varlen else case["T"]
    S = sum(case["lens_k"]) if varlen else case["S"]
    B = case["B"]
    masters = {"q": draw.randn(B, T, H, D), "k": draw.randn(B, S, hkv, D), "v": draw.randn(B, S, hkv, D)}
    x = {n: leaf(m, dtype, device, grad) for n, m in masters.items()}
    refs = {n: as_ref(t, grad) for n, t in x.items()}
    lowp = {n: t.detach().cpu().requires_grad_(grad) for n, t in x.items()}  # PyTorch in the same dtype
    kw: dict = {"causal": case["causal"], "scale": case["scale"]}
    cu_q = cu_k = None
    if varlen:
        cu_q, cu_k = offsets(case["lens_q"], device), offsets(case["lens_k"], device)
    o = lamina.prism_attention(x["q"], x["k"], x["v"], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               backend=case["backend"], **kw)
    ref_kw = dict(kw, cu_seqlens_q=None if cu_q is None else cu_q.cpu(),
                  cu_seqlens_k=None if cu_k is None else cu_k.cpu())
    o_ref = attention_ref(refs["q"], refs["k"], refs["v"], **ref_kw)
    o_low = attention_ref(lowp["q"], lowp["k"], lowp["v"], **ref_kw)
    assert_attention_close("o", o, o_ref, o_low, dtype=dtype)
    if not grad:
        return
    do = draw.cotangent(o.shape, o.dtype)
    for out in (o, o_ref, o_low):
        backward([out], [do])
    scale = gradient_scale([refs[name].grad for name in "qkv"], peak=True)
    base = dict.fromkeys("qkv")
    if dtype == torch.float32:  # PyTorch's autograd in float32 can be exact where the kernels' formulas are not
        base = dict(zip("qkv", attention_grads_ref(*(lowp[n].detach() for n in "qkv"), do.to(dtype), **ref_kw)))
    score_peak = (D ** -0.5 if case["scale"] is None else case["scale"]) * math.prod(
        refs[n].detach().norm(dim=-1).max().item() for n in "qk")
    for name in "qkv":
        assert_attention_close(f"d{name}", x[name].grad, refs[name].grad, lowp[name].grad, grad=True, dtype=dtype,
                               scale=scale, baseline=base[name], score_peak=score_peak)


def check_hrm(case: dict) -> None:
    import lamina
    from lamina.reference import hrm_gated_update_ref

    dtype, device, grad = DTYPES[case["dtype"]], case["device"], case["grad"]
    draw = Draw(case["seed"])
    rows, D = case["rows"], case["D"]
    G = 1 if case["per_token_gate"] else D
    masters = {"h": draw.randn(rows, D), "c": draw.randn(rows, D), "gate": draw.randn(rows, G),
               "bias": draw.randn(G) if case["bias"] else None,
               "norm_weight": 1 + 0.1 * draw.randn(D) if case["norm"] else None}
    x = {n: leaf(m, dtype, device, grad) for n, m in masters.items()}
    refs = {n: as_ref(t, grad) for n, t in x.items()}
    y = lamina.hrm_gated_update(x["h"], x["c"], x["gate"], bias=x["bias"], norm_weight=x["norm_weight"],
                                backend=case["backend"])
    y_ref = hrm_gated_update_ref(refs["h"], refs["c"], refs["gate"], bias=refs["bias"],
                                 norm_weight=refs["norm_weight"])
    assert_close("y", y, y_ref, kind="elementwise", dtype=dtype)
    if not grad:
        return
    dy = draw.cotangent(y.shape, y.dtype)
    backward([y], [dy])
    backward([y_ref], [dy])
    compare_grads({n: t for n, t in x.items() if n in ("h", "c") or (n == "gate" and not case["per_token_gate"])},
                  refs, {n: ("elementwise", dtype) for n in x})
    # Gradients that sum over rows (bias, norm weight, a per-token gate's over D) can cancel to a value far
    # below their terms, where no relative bound holds: FlashAttention's rule instead, at most 3x the error
    # of PyTorch's own computation in the same precision (the reference on the op's inputs, in float32),
    # with the floor taken at the root-sum-square of the summands (``reduction_scale``): the float64
    # reference run once more with bias, norm weight and gate broadcast to [rows, D], whose gradients are
    # the summands themselves.
    reductions = [n for n in ("bias", "norm_weight", "gate") if x[n] is not None
                  and (n != "gate" or case["per_token_gate"])]
    if not reductions:
        return
    low = {n: None if t is None else t.detach().cpu().requires_grad_(True) for n, t in x.items()}
    y_low = hrm_gated_update_ref(low["h"], low["c"], low["gate"], bias=low["bias"], norm_weight=low["norm_weight"])
    backward([y_low], [dy])
    full = {n: refs[n].detach().expand(rows, D).clone().requires_grad_(True) for n in reductions}
    y_full = hrm_gated_update_ref(refs["h"].detach(), refs["c"].detach(), full.get("gate", refs["gate"].detach()),
                                  bias=full.get("bias"), norm_weight=full.get("norm_weight"))
    backward([y_full], [dy])
    for n in reductions:
        scale = reduction_scale(full[n].grad, refs[n].shape)
        assert_attention_close(f"d{n}", x[n].grad, refs[n].grad, low[n].grad, grad=True, dtype=dtype, scale=scale)


def check_conv(case: dict) -> None:
    import lamina
    from lamina.reference import causal_conv1d_ref

    dtype, device, grad = DTYPES[case["dtype"]], case["device"], case["grad"]
    draw = Draw(case["seed"])
    B, D, W = case["B"], case["D"], case["W"]
    T = case["T"] if case["lens"] is None else sum(case["lens"])
    N = B if case["lens"] is None else len(case["lens"])
    masters = {"x": draw.randn(B, T, D), "weight": draw.randn(D, W) / W ** 0.5,
               "bias": draw.randn(D) if case["bias"] else None,
               "residual": draw.randn(B, T, D) if case["residual"] else None,
               "initial_state": draw.randn(N, D, W) if case["initial_state"] else None}
    # weight and bias are float32 module parameters; the rest in the case dtype
    x = {n: leaf(m, torch.float32 if n in ("weight", "bias") else dtype, device, grad) for n, m in masters.items()}
    refs = {n: as_ref(t, grad) for n, t in x.items()}
    cu = None if case["lens"] is None else offsets(case["lens"], device)
    y, final = lamina.causal_conv1d(x["x"], x["weight"], x["bias"], x["residual"], x["initial_state"],
                                    output_final_state=case["output_final_state"], activation=case["activation"],
                                    backend=case["backend"], cu_seqlens=cu)
    y_ref, final_ref = causal_conv1d_ref(refs["x"], refs["weight"], refs["bias"], refs["residual"],
                                         refs["initial_state"], output_final_state=True,
                                         activation=case["activation"], cu_seqlens=None if cu is None else cu.cpu())
    assert_close("y", y, y_ref, kind="elementwise", dtype=dtype)
    if case["output_final_state"]:
        if final is None:
            raise AssertionError("final_state: None with output_final_state=True")
        assert_close("final_state", final, final_ref, kind="elementwise", dtype=dtype)
    if not grad:
        return
    dy, dfinal = draw.cotangent(y.shape, y.dtype), draw.cotangent(final_ref.shape, y.dtype)
    backward([y, final if case["output_final_state"] else None], [dy, dfinal])
    backward([y_ref, final_ref if case["output_final_state"] else None], [dy, dfinal])
    kinds = {"x": ("recurrence", dtype), "initial_state": ("recurrence", dtype),
             "residual": ("elementwise", dtype),  # dy itself
             "weight": ("recurrence", torch.float32), "bias": ("recurrence", torch.float32)}  # sums over tokens
    compare_grads(x, refs, kinds)


def check_norm(case: dict) -> None:
    import lamina
    from lamina.reference import rms_norm_gated_ref

    dtype, device, grad = DTYPES[case["dtype"]], case["device"], case["grad"]
    draw = Draw(case["seed"])
    rows, D = case["rows"], case["D"]
    masters = {"x": draw.randn(rows, D), "g": draw.randn(rows, D),
               "weight": 1 + 0.5 * draw.randn(D) if case["weight"] else None,
               "bias": draw.randn(D) if case["bias"] else None,
               "residual": draw.randn(rows, D) if case["residual"] else None}
    param = ("weight", "bias")
    x = {n: leaf(m, torch.float32 if n in param else dtype, device, grad) for n, m in masters.items()}
    refs = {n: as_ref(t, grad) for n, t in x.items()}
    kw = dict(activation=case["activation"], prenorm=case["prenorm"], residual_in_fp32=case["residual_in_fp32"])
    out = lamina.rms_norm_gated(x["x"], x["g"], x["weight"], x["bias"], residual=x["residual"],
                                backend=case["backend"], **kw)
    out_ref = rms_norm_gated_ref(refs["x"], refs["g"], refs["weight"], refs["bias"], residual=refs["residual"], **kw)
    outs = list(out) if case["prenorm"] else [out]
    outs_ref = list(out_ref) if case["prenorm"] else [out_ref]
    assert_close("y", outs[0], outs_ref[0], kind="elementwise", dtype=dtype)
    if case["prenorm"]:
        res_dtype = dtype if x["residual"] is not None or not case["residual_in_fp32"] else torch.float32
        assert_close("residual_out", outs[1], outs_ref[1], kind="elementwise", dtype=res_dtype)
    if not grad:
        return
    cot = [draw.cotangent(o.shape, o.dtype) for o in outs]
    backward(outs, cot)
    backward(outs_ref, cot)
    # weight/bias: sums over rows in float32; x, g, residual: the backward subtracts a row reduction
    compare_grads(x, refs, {n: ("recurrence", torch.float32 if n in param else dtype) for n in x})
