"""The delta-rule ops on a CUDA device (Triton, compiled): the interpreter matrix again, the
large bf16 shape B=2, T=2048, H=4, K=V=128 for every variant with gradients, determinism of
the backward, strong decay at T=4096, and wide keys (K = 256, 512 forward only).

References run in float64 on the same device: the token loop for short inputs, the chunked
reference (same map, float64) for long ones.
"""

from __future__ import annotations

import pytest
import torch
from test_delta_fwd import CHUNK_CASES, RECURRENT_CASES, VARIANTS, make_inputs
from tolerances import assert_close

import lamina
from lamina.kernels.delta_chunk_common import DecayKind
from lamina.kernels.delta_tuning import ALTERNATIVES, delta_tuning

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(autouse=True)
def _kernels_for_every_dtype(monkeypatch):
    """These tests check the kernels themselves: the ops' float32 fence (``training_path``, which sends float32 on
    CUDA to the PyTorch path) is lifted, so the float32 cases run the float32 kernels (and fail where they are
    known to: benchmarks/results/2026-12-06-nvidia-h100/README.md)."""
    import lamina.ops.delta_rule_core as core

    monkeypatch.setattr(core, "UNTRUSTED_FP32_DEVICES", ())

OPS = {
    "delta": (lamina.chunk_delta_rule, lamina.fused_recurrent_delta_rule),
    "gdn": (lamina.chunk_gated_delta_rule, lamina.fused_recurrent_gated_delta_rule),
    "kda": (lamina.chunk_kda, lamina.fused_recurrent_kda),
    "gdn2": (lamina.chunk_gdn2, lamina.fused_recurrent_gdn2),
}


def _cuda(xs):
    return [None if x is None else x.to(DEV) for x in xs]


def _call(variant, recurrent, q, k, v, g, b, w, s0, cu, backend="triton", **kw):
    fn = OPS[variant][1 if recurrent else 0]
    # by keyword: fla's fused_recurrent_gated_delta_rule takes (q, k, v, g, gk, gv, beta, ...)
    gates = {"delta": dict(beta=b), "gdn": dict(g=g, beta=b), "kda": dict(g=g, beta=b),
             "gdn2": dict(g=g, b=b, w=w)}[variant]
    return fn(q, k, v, **gates, initial_state=s0, output_final_state=True, cu_seqlens=cu, backend=backend, **kw)


def _reference(variant, q, k, v, g, b, w, s0, cu, chunked=False):
    from lamina.reference import delta_rule_family_chunk_ref, delta_rule_family_recurrent_ref

    f64 = [None if x is None else x.double() for x in (q, k, v, g, b, w, s0)]
    q, k, v, g, b, w, s0 = f64
    if chunked:
        return delta_rule_family_chunk_ref(q, k, v, g, b, w, None, s0, True, cu)
    return delta_rule_family_recurrent_ref(q, k, v, g, b, w, None, s0, True, cu)


@pytest.mark.parametrize("variant,B,T,H,HV,K,V,dtype,extra", CHUNK_CASES)
def test_chunk_matrix_on_gpu(variant, B, T, H, HV, K, V, dtype, extra):
    xs = _cuda(make_inputs(variant, B, T, H, HV, K, V, dtype, **extra))
    o, s = _call(variant, False, *xs)
    ref_o, ref_s = _reference(variant, *xs)
    assert_close("o", o, ref_o, dtype=dtype)
    assert_close("final_state", s, ref_s, dtype=dtype)


@pytest.mark.parametrize("variant,B,T,H,HV,K,V,dtype,extra", RECURRENT_CASES)
def test_recurrent_matrix_on_gpu(variant, B, T, H, HV, K, V, dtype, extra):
    xs = _cuda(make_inputs(variant, B, T, H, HV, K, V, dtype, **extra))
    o, s = _call(variant, True, *xs)
    ref_o, ref_s = _reference(variant, *xs)
    assert_close("o", o, ref_o, dtype=dtype)
    assert_close("final_state", s, ref_s, dtype=dtype)


def _grads(variant, leaves, do, ds, backend, cu=None, **kw):
    o, s = _call(variant, False, *leaves, cu, backend=backend, **kw)
    torch.autograd.backward([o, s], [do.to(o.dtype), ds.to(s.dtype)])
    return o, s, [None if x is None else x.grad for x in leaves]


@pytest.mark.parametrize("variant", list(OPS))
def test_large_bf16_forward_backward_and_determinism(variant):
    B, T, H, HV, K, V = 2, 2048, 4, 4, 128, 128
    base = _cuda(make_inputs(variant, B, T, H, HV, K, V, torch.bfloat16, decay=(0.0, 0.5), h0=True))[:7]
    gen = torch.Generator(device=DEV).manual_seed(7)
    do = torch.randn(B, T, HV, V, device=DEV, generator=gen)
    ds = torch.randn(B, HV, K, V, device=DEV, generator=gen)
    leaf = lambda xs, dt=None: [None if x is None else x.detach().to(dt or x.dtype).requires_grad_() for x in xs]
    run1 = _grads(variant, leaf(base), do, ds, "triton")
    run2 = _grads(variant, leaf(base), do, ds, "triton")
    ref = _grads(variant, leaf(base, torch.float64), do, ds, "torch")
    assert_close("o", run1[0], ref[0], dtype=torch.bfloat16)
    assert_close("final_state", run1[1], ref[1], dtype=torch.bfloat16)
    names = ("q", "k", "v", "g", "b", "w", "initial_state")
    for name, g1, g2, gr in zip(names, run1[2], run2[2], ref[2]):
        if gr is None:
            continue
        assert torch.equal(g1, g2), f"d{name} differs between two backward runs"
        assert_close(f"d{name}", g1, gr, dtype=torch.bfloat16)


# every speed alternative of the chunked kernels (the sweep times them, and a faster one becomes a default), on the
# variants it changes: channel_dots only those with a per-channel decay
ALTERNATIVE_CASES = [(variant, tuning) for tuning in ALTERNATIVES for variant in OPS
                     if not tuning.channel_dots or VARIANTS[variant][0] == DecayKind.CHANNEL]


@pytest.mark.parametrize("variant,tuning", ALTERNATIVE_CASES,
                         ids=[f"{variant}-{tuning.label()}" for variant, tuning in ALTERNATIVE_CASES])
def test_speed_alternatives_forward_backward(variant, tuning):
    """Each speed alternative through the op, forward and backward inside its ``delta_tuning`` block, at bf16,
    K = V = 128, three packed sequences (one of a single token) and two value heads per qk head: output, final
    state and every gradient against autograd through the float64 torch path on the same inputs."""
    xs = _cuda(make_inputs(variant, 1, 700, 2, 4, 128, 128, torch.bfloat16, varlen=[0, 300, 301, 700], h0=True))
    gen = torch.Generator(device=DEV).manual_seed(10)
    do = torch.randn(1, 700, 4, 128, device=DEV, generator=gen)
    ds = torch.randn(3, 4, 128, 128, device=DEV, generator=gen)
    leaf = lambda dt=None: [None if x is None else x.detach().to(dt or x.dtype).requires_grad_() for x in xs[:7]]
    with delta_tuning(**tuning.choices()):
        o, s, got = _grads(variant, leaf(), do, ds, "triton", cu=xs[7])
    o64, s64, want = _grads(variant, leaf(torch.float64), do, ds, "torch", cu=xs[7])
    assert_close("o", o, o64, dtype=torch.bfloat16)
    assert_close("final_state", s, s64, dtype=torch.bfloat16)
    for name, g, gr in zip(("q", "k", "v", "g", "b", "w", "initial_state"), got, want):
        if gr is not None:
            assert g is not None, f"d{name} missing"
            assert_close(f"d{name}", g, gr, dtype=torch.bfloat16)


@pytest.mark.parametrize("variant", list(OPS))
def test_large_bf16_with_the_qk_l2norm_in_the_kernels(variant):
    """use_qk_l2norm_in_kernel at B=2, T=2048, K=V=128, bf16, raw q and k rows of norms 0.1 to 10: the forward
    normalises inside its kernels, the backward through the L2-norm kernel; output, state and every gradient
    against autograd through the float64 torch path on the same inputs."""
    B, T, H, HV, K, V = 2, 2048, 4, 4, 128, 128
    base = _cuda(make_inputs(variant, B, T, H, HV, K, V, torch.bfloat16, decay=(0.0, 0.5), h0=True))[:7]
    gen = torch.Generator(device=DEV).manual_seed(8)
    for i in (0, 1):  # rows of norms 10^-1 .. 10
        base[i] = (base[i].float() * 10 ** (2 * torch.rand(B, T, H, 1, device=DEV, generator=gen) - 1)).bfloat16()
    do = torch.randn(B, T, HV, V, device=DEV, generator=gen)
    ds = torch.randn(B, HV, K, V, device=DEV, generator=gen)
    leaf = lambda xs, dt=None: [None if x is None else x.detach().to(dt or x.dtype).requires_grad_() for x in xs]
    run = _grads(variant, leaf(base), do, ds, "triton", use_qk_l2norm_in_kernel=True)
    ref = _grads(variant, leaf(base, torch.float64), do, ds, "torch", use_qk_l2norm_in_kernel=True)
    assert_close("o", run[0], ref[0], dtype=torch.bfloat16)
    assert_close("final_state", run[1], ref[1], dtype=torch.bfloat16)
    for name, g, gr in zip(("q", "k", "v", "g", "b", "w", "initial_state"), run[2], ref[2]):
        if gr is not None:
            assert_close(f"d{name}", g, gr, dtype=torch.bfloat16)


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_large_bf16_with_the_gate_and_beta_in_the_kernels(variant):
    """The layers' options (use_gate_in_kernel, use_beta_sigmoid_in_kernel, use_qk_l2norm_in_kernel) at B=2,
    T=2048, K=V=128, bf16: the kernels read the raw gate and the raw beta (values of both signs, out to the
    sigmoid's tails) and activate them; output, state and every gradient (the raw gate's, the raw beta's, A_log's
    and dt_bias's included) against autograd through the float64 torch path on the same inputs."""
    B, T, H, HV, K, V = 2, 2048, 4, 4, 128, 128
    base = _cuda(make_inputs(variant, B, T, H, HV, K, V, torch.bfloat16, h0=True))[:7]
    gen = torch.Generator(device=DEV).manual_seed(9)
    base[3] = torch.randn(base[3].shape, device=DEV, generator=gen) * 2  # the raw gate input
    base[4] = base[5] = torch.randn(B, T, HV, device=DEV, generator=gen) * 3  # the raw beta
    params = [torch.randn(HV, device=DEV, generator=gen) * 0.5,
              torch.randn(HV * K if variant == "kda" else HV, device=DEV, generator=gen)]
    do = torch.randn(B, T, HV, V, device=DEV, generator=gen)
    ds = torch.randn(B, HV, K, V, device=DEV, generator=gen)
    results = []
    for backend, dt in (("triton", None), ("torch", torch.float64)):
        xs = [None if x is None else x.detach().to(dt or x.dtype).requires_grad_() for x in base]
        xs[5] = xs[4]  # one beta
        a, bias = (x.detach().to(dt or x.dtype).requires_grad_() for x in params)
        o, s, grads = _grads(variant, xs, do, ds, backend, use_gate_in_kernel=True, A_log=a, dt_bias=bias,
                             use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)
        results.append((o, s, grads[:5] + grads[6:] + [a.grad, bias.grad]))
    (o, s, got), (o64, s64, want) = results
    assert_close("o", o, o64, dtype=torch.bfloat16)
    assert_close("final_state", s, s64, dtype=torch.bfloat16)
    for name, g, gr in zip(("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"), got, want):
        assert g is not None and gr is not None, name
        assert_close(f"d{name}", g, gr, dtype=torch.bfloat16)


@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_strong_decay_long_sequence_is_finite(variant):
    xs = make_inputs(variant, 1, 4096, 2, 2, 64, 64, torch.bfloat16, decay=(0.0, 1.0))
    g = xs[3].clone()
    g[..., ::3] = -20.0
    xs = _cuda(list(xs[:3]) + [g] + list(xs[4:]))
    leaves = [None if x is None else x.requires_grad_() if x.is_floating_point() else x for x in xs[:6]]
    o, s = _call(variant, False, *leaves, None, None)
    (o.float().sum() + s.sum()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    for x in leaves:
        if x is not None and x.grad is not None:
            assert torch.isfinite(x.grad).all()
    ref_o, ref_s = _reference(variant, *[x.detach() if x is not None else None for x in leaves], None, None,
                              chunked=True)
    assert_close("o", o, ref_o, dtype=torch.bfloat16)
    assert_close("final_state", s, ref_s, dtype=torch.bfloat16)


@pytest.mark.parametrize("K,V,variant", [(256, 256, "gdn"), (192, 96, "kda"), (512, 64, "gdn2")])
def test_wide_keys_forward(K, V, variant):
    xs = _cuda(make_inputs(variant, 1, 300, 2, 2, K, V, torch.float16, h0=True))
    with torch.no_grad():
        o, s = _call(variant, False, *xs)
        o_rec, s_rec = _call(variant, True, *xs)
    ref_o, ref_s = _reference(variant, *xs, chunked=True)
    for name, a, e in (("o", o, ref_o), ("final_state", s, ref_s), ("o (recurrent)", o_rec, ref_o),
                       ("final_state (recurrent)", s_rec, ref_s)):
        assert_close(name, a, e, dtype=torch.float16)
