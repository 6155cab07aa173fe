"""The delta-rule ops (lamina.chunk_* and lamina.fused_recurrent_*): fla semantics of the gate options,
dispatch, gradients through the Triton path, custom-op registration and torch.compile, bad input.

Triton paths run under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close

import lamina
from lamina.ops.delta_rule_core import beta_activation, gate_activation, l2norm

B, T, H, HV, K, V = 1, 24, 2, 4, 32, 32


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(dtype)


def base_inputs(dtype=torch.float32):
    return rand(B, T, H, K, dtype=dtype, seed=1), rand(B, T, H, K, dtype=dtype, seed=2), \
        rand(B, T, HV, V, dtype=dtype, seed=3)


# --- gate semantics against fla 0.6's own formulas ---------------------------------------------

def test_gate_formulas_match_fla():
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate

    g3, g4 = rand(2, 5, HV, seed=4), rand(2, 5, HV, K, seed=5)
    A_log, bias3, bias4 = rand(HV, seed=6), rand(HV, seed=7), rand(HV * K, seed=8)
    assert_close("gdn gate", gate_activation(g3, A_log, bias3), naive_gdn_gate(g3, A_log, bias3), kind="elementwise")
    assert_close("kda gate", gate_activation(g4, A_log, bias4), naive_kda_gate(g4, A_log, bias4), kind="elementwise")
    assert_close("kda bounded gate", gate_activation(g4, A_log, bias4, lower_bound=-4.0),
                 naive_kda_lowerbound_gate(g4, A_log, bias4, lower_bound=-4.0), kind="elementwise")
    assert_close("kda bounded gate without A_log", gate_activation(g4, None, bias4, lower_bound=-3.0),
                 naive_kda_lowerbound_gate(g4, None, bias4, lower_bound=-3.0), kind="elementwise")
    beta = rand(2, 5, HV, seed=9)
    assert torch.equal(beta_activation(beta, False, False), beta)
    assert_close("2 sigmoid", beta_activation(beta, True, True), 2 * torch.sigmoid(beta), kind="elementwise")
    x = rand(3, 7, K, seed=10)
    assert_close("l2norm", l2norm(x), x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6), kind="elementwise")


@pytest.mark.interpret
@pytest.mark.parametrize("op, backend, grad, forward_norms, norm_grads", [
    ("chunk", "triton", False, 0, 0), ("chunk", "triton", True, 0, 2), ("recurrent", "triton", True, 0, 2),
    ("chunk", "torch", True, 0, 0)])
def test_where_the_qk_l2norm_runs(monkeypatch, op, backend, grad, forward_norms, norm_grads):
    """use_qk_l2norm_in_kernel: the Triton forwards normalise q and k inside their kernels (launched with
    L2NORM, no L2-norm kernel; the token-by-token one each row in float32, as fla's fused_recurrent kernels),
    and so does the backward (the raw rows, l2norm_qk), which then runs the L2-norm kernel's backward once each
    on dq and dk; the torch path never. The results (against fla's references and float64) are checked by the
    tests that use the option."""
    import lamina.kernels.delta_chunk_bwd as bwd
    import lamina.kernels.delta_chunk_fwd as fwd
    import lamina.kernels.delta_recurrent_fwd as rec
    import lamina.kernels.rms_norm_gated as norm_kernels

    norms, norm_grads_run, fused, fused_bwd = [], [], [], []
    real, real_bwd, prep, launch_bwd = norm_kernels.rms_norm_fwd, norm_kernels.rms_norm_bwd, fwd._prep_fwd, \
        bwd.delta_chunk_bwd
    monkeypatch.setattr(norm_kernels, "rms_norm_fwd", lambda *a: norms.append(a[-1]) or real(*a))
    monkeypatch.setattr(norm_kernels, "rms_norm_bwd", lambda *a: norm_grads_run.append(a[-1]) or real_bwd(*a))
    monkeypatch.setattr(bwd, "delta_chunk_bwd",
                        lambda *a, **kw: fused_bwd.append(kw["l2norm_qk"]) or launch_bwd(*a, **kw))

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: fused.append(kw["L2NORM"]) or prep[grid](*a, **kw)

    monkeypatch.setattr(fwd, "_prep_fwd", Spy())
    token_by_token, launch_rec = [], rec._recurrent_fwd

    class RecurrentSpy:
        def __getitem__(self, grid):
            return lambda *a, **kw: token_by_token.append(kw["L2NORM"]) or launch_rec[grid](*a, **kw)

    monkeypatch.setattr(rec, "_recurrent_fwd", RecurrentSpy())
    q, k, v = (x.requires_grad_(grad) for x in base_inputs())
    g, beta = -rand(B, T, HV, seed=11).abs(), rand(B, T, HV, seed=12).sigmoid()
    fn = lamina.chunk_gated_delta_rule if op == "chunk" else lamina.fused_recurrent_gated_delta_rule
    o, _ = fn(q, k, v, g, beta=beta, use_qk_l2norm_in_kernel=True, backend=backend)
    assert norms == ["l2"] * forward_norms
    assert fused == ([True] if op == "chunk" and backend == "triton" else [])
    assert token_by_token == ([True] if op == "recurrent" else [])
    if grad:
        norms.clear()
        fused.clear()
        o.sum().backward()
        assert norms == [] and norm_grads_run == ["l2"] * norm_grads
        # the backward's kernels take the raw rows; the token-by-token path's backward first recomputes its
        # states with the chunked forward, on the raw rows too
        assert fused_bwd == ([True] if backend == "triton" else [])
        assert fused == ([] if op == "chunk" else [True])


@pytest.mark.interpret
@pytest.mark.parametrize("grad", [False, True])
def test_token_by_token_l2norm_is_taken_in_float32(grad):
    """The token-by-token forward normalises the raw rows in float32 (as fla's fused_recurrent kernels do): with
    q and k nearly orthogonal (cosine 1e-3), one token's output ``scale (q.k) beta v`` keeps the table's bf16
    bound; rows normalised and rounded to bf16 first leave its product off by about 2^-9 / sqrt(K) of the
    rows' norms, a quarter of it at K = 64."""
    from lamina.reference import delta_rule_family_recurrent_ref

    K, V = 64, 16
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(K, generator=gen, dtype=torch.float64)
    k = torch.randn(K, generator=gen, dtype=torch.float64)
    k = k - (k @ q) / (q @ q) * q + 1e-3 * k.norm() / q.norm() * q
    q, k = (x.view(1, 1, 1, K).bfloat16().requires_grad_(grad) for x in (q, k))
    v = torch.randn(1, 1, 1, V, generator=gen).bfloat16()
    g, beta = torch.zeros(1, 1, 1), torch.full((1, 1, 1), 0.5).bfloat16()
    o, _ = lamina.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True,
                                                   backend="triton")
    q64, k64 = (torch.nn.functional.normalize(x.detach().double(), dim=-1) for x in (q, k))
    assert abs(float((q64 * k64).sum())) < 2e-3  # the case: nearly orthogonal after rounding to bf16
    ref, _ = delta_rule_family_recurrent_ref(q64, k64, v.double(), g.double(), beta.double(), beta.double(),
                                             K ** -0.5, None, False, None)
    assert_close("o", o, ref, dtype=torch.bfloat16)


@pytest.mark.interpret
@pytest.mark.parametrize("op", ["chunk_delta_rule", "chunk_gated_delta_rule"])
def test_chunked_forward_scales_q_k_after_the_product(op):
    """The chunked forward's ``scale Q K^T`` takes the scale after the product of the 16-bit rows (with a dense
    decay, as fla's output kernel does): q and k nearly orthogonal (cosine 3e-3), one token's output
    ``scale (q.k) beta v`` keeps the table's bf16 bound; q times the scale rounded to bf16 as an operand
    left it off by about 2^-9 / sqrt(K) of the rows' norms (RMS error ratio 0.031 here)."""
    from lamina.reference import delta_rule_family_recurrent_ref

    K, V = 48, 16  # a scale 48^-0.5 that rounds (a power of two would not)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(K, generator=gen, dtype=torch.float64)
    k = torch.randn(K, generator=gen, dtype=torch.float64)
    k = F.normalize(k - (k @ q) / (q @ q) * q + 3e-3 * k.norm() / q.norm() * q, dim=0)
    q, k = (x.view(1, 1, 1, K).bfloat16() for x in (q, k))
    v = torch.randn(1, 1, 1, V, generator=gen).bfloat16()
    beta = torch.full((1, 1, 1), 0.5).bfloat16()
    gate = {"g": torch.zeros(1, 1, 1)} if op == "chunk_gated_delta_rule" else {}
    o, _ = getattr(lamina, op)(q, k, v, beta=beta, backend="triton", **gate)
    q64, k64 = q.double(), k.double()
    assert abs(float((q64 * k64).sum())) < 1e-2 * float(q64.norm() * k64.norm())  # nearly orthogonal
    ref, _ = delta_rule_family_recurrent_ref(q64, k64, v.double(), None, beta.double(), beta.double(), K ** -0.5,
                                             None, False, None)
    assert_close("o", o, ref, dtype=torch.bfloat16)


@pytest.mark.interpret
@pytest.mark.parametrize("recurrent", [False, True])
def test_kda_with_all_options_matches_fla_naive(recurrent):
    from fla.ops.kda.naive import naive_recurrent_kda

    q, k, v = base_inputs()
    g, beta = rand(B, T, HV, K, seed=11), rand(B, T, HV, seed=12)
    A_log, dt_bias, h0 = rand(HV, seed=13), rand(HV * K, seed=14), rand(B, HV, K, V, seed=15)
    fn = lamina.fused_recurrent_kda if recurrent else lamina.chunk_kda
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
              allow_neg_eigval=True, backend="triton")
    qn, kn = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    gf = -A_log.exp()[:, None] * F.softplus(g + dt_bias.view(HV, K))
    # fla's naive KDA is written for HV == H: expand q and k to the value heads
    rep = lambda x: x.repeat_interleave(HV // H, dim=2).double()
    ref_o, ref_s = naive_recurrent_kda(rep(qn), rep(kn), v.double(), gf.double(), 2 * torch.sigmoid(beta.double()),
                                       scale=K ** -0.5, initial_state=h0.double(), output_final_state=True)
    assert_close("o", o, ref_o)
    assert_close("final_state", s, ref_s)


@pytest.mark.interpret
def test_gdn2_matches_fla_naive():
    from fla.ops.gdn2.naive import naive_recurrent_gdn2

    q, k, v = base_inputs()
    g, b, w = -torch.rand(B, T, HV, K) * 3, torch.rand(B, T, HV, K) * 2, torch.rand(B, T, HV, V)
    o, s = lamina.chunk_gdn2(q, k, v, g, b, w, output_final_state=True, chunk_size=16, backend="triton")
    rep = lambda x: x.repeat_interleave(HV // H, dim=2).double()
    ref_o, ref_s = naive_recurrent_gdn2(rep(q), rep(k), v.double(), g.double(), b.double(), w.double(),
                                        scale=K ** -0.5, output_final_state=True)
    assert_close("o", o, ref_o)
    assert_close("final_state", s, ref_s)


# --- dispatch and the torch path ---------------------------------------------------------------

CALLS = {
    "delta": lambda q, k, v, g, b, w, **kw: lamina.chunk_delta_rule(q, k, v, b[..., 0], **kw),
    "gdn": lambda q, k, v, g, b, w, **kw: lamina.chunk_gated_delta_rule(q, k, v, g[..., 0], b[..., 0], **kw),
    "kda": lambda q, k, v, g, b, w, **kw: lamina.chunk_kda(q, k, v, g, b[..., 0], **kw),
    "gdn2": lambda q, k, v, g, b, w, **kw: lamina.chunk_gdn2(q, k, v, g, b, w, **kw),
}
RECURRENT_CALLS = {
    "delta": lambda q, k, v, g, b, w, **kw: lamina.fused_recurrent_delta_rule(q, k, v, b[..., 0], **kw),
    "gdn": lambda q, k, v, g, b, w, **kw: lamina.fused_recurrent_gated_delta_rule(q, k, v, g[..., 0],
                                                                                   beta=b[..., 0], **kw),
    "kda": lambda q, k, v, g, b, w, **kw: lamina.fused_recurrent_kda(q, k, v, g, b[..., 0], **kw),
    "gdn2": lambda q, k, v, g, b, w, **kw: lamina.fused_recurrent_gdn2(q, k, v, g, b, w[..., :V], **kw),
}


def family_inputs(dtype=torch.float32):
    q, k, v = base_inputs(dtype)
    g = -torch.rand(B, T, HV, K, generator=torch.Generator().manual_seed(20)) * 2
    b = torch.rand(B, T, HV, K, generator=torch.Generator().manual_seed(21))
    w = torch.rand(B, T, HV, V, generator=torch.Generator().manual_seed(22))
    h0 = rand(B, HV, K, V, seed=23)
    return q, k, v, g, b, w, h0


@pytest.mark.interpret
@pytest.mark.parametrize("variant", list(CALLS))
def test_triton_and_torch_backends_agree_with_gradients(variant):
    """Forward and every gradient of the Triton path against autograd through the float64 torch path."""
    inputs = family_inputs()
    leaves = [x.clone().requires_grad_() for x in inputs]
    leaves64 = [x.detach().double().requires_grad_() for x in inputs]
    do, ds = rand(B, T, HV, V, seed=24), rand(B, HV, K, V, seed=25)
    outs = []
    for xs, backend in ((leaves, "triton"), (leaves64, "torch")):
        o, s = CALLS[variant](*xs[:6], initial_state=xs[6], output_final_state=True, use_qk_l2norm_in_kernel=True,
                              chunk_size=16, backend=backend)
        ((o * do.to(o.dtype)).sum() + (s * ds.to(s.dtype)).sum()).backward()
        outs.append((o, s))
    assert_close("o", outs[0][0], outs[1][0])
    assert_close("final_state", outs[0][1], outs[1][1])
    names = ["q", "k", "v", "g", "b", "w", "initial_state"]
    for name, a, e in zip(names, leaves, leaves64):
        if e.grad is None:  # an input the variant does not use (g of DeltaNet, w outside GDN-2)
            assert a.grad is None, name
            continue
        assert a.grad is not None, name
        assert_close(f"d{name}", a.grad, e.grad)


@pytest.mark.interpret
@pytest.mark.parametrize("variant", ["gdn", "gdn2"])
def test_recurrent_ops_match_chunk_ops_and_differentiate(variant):
    inputs = family_inputs()
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, s = RECURRENT_CALLS[variant](*leaves[:6], initial_state=leaves[6], output_final_state=True,
                                    backend="triton")
    (o.sum() + s.sum()).backward()
    leaves64 = [x.detach().double().requires_grad_() for x in inputs]
    o2, s2 = CALLS[variant](*leaves64[:6], initial_state=leaves64[6], output_final_state=True, backend="torch")
    (o2.sum() + s2.sum()).backward()
    assert_close("o", o, o2)
    assert_close("final_state", s, s2)
    for name, a, e in zip(["q", "k", "v", "initial_state"], [leaves[i] for i in (0, 1, 2, 6)],
                          [leaves64[i] for i in (0, 1, 2, 6)]):
        assert_close(f"d{name}", a.grad, e.grad)


@pytest.mark.interpret
def test_gate_parameters_get_gradients_through_triton():
    q, k, v = base_inputs()
    g, beta = rand(B, T, HV, seed=30), rand(B, T, HV, seed=31)
    A_log, dt_bias = rand(HV, seed=32).requires_grad_(), rand(HV, seed=33).requires_grad_()
    A64, dt64 = A_log.detach().double().requires_grad_(), dt_bias.detach().double().requires_grad_()
    for backend, a, d, cast in (("triton", A_log, dt_bias, lambda x: x), ("torch", A64, dt64, torch.Tensor.double)):
        o, _ = lamina.chunk_gated_delta_rule(cast(q), cast(k), cast(v), cast(g), cast(beta), use_gate_in_kernel=True,
                                             A_log=a, dt_bias=d, use_beta_sigmoid_in_kernel=True, chunk_size=16,
                                             backend=backend)
        o.sum().backward()
    assert_close("dA_log", A_log.grad, A64.grad)
    assert_close("ddt_bias", dt_bias.grad, dt64.grad)


# (op, per-channel gate, A_log, dt_bias, lower_bound) of each form of fla's use_gate_in_kernel
FUSED_GATES = [
    ("gdn", False, True, True, None),
    ("gdn", False, True, False, None),
    ("kda", True, True, True, None),
    ("kda", True, True, True, -4.0),
    ("kda", True, False, True, -3.0),
    ("kda", True, False, False, -2.0),
    ("gdn2", True, True, True, None),
    ("kda_recurrent", True, True, True, None),
]


@pytest.mark.interpret
@pytest.mark.parametrize("variant, channel, with_a, with_bias, lower_bound", FUSED_GATES,
                         ids=lambda x: str(x))
def test_gate_activation_fused_into_the_kernels(monkeypatch, variant, channel, with_a, with_bias, lower_bound):
    """use_gate_in_kernel with autograd on the Triton path: the chunked kernels activate the raw gate themselves
    (the PyTorch gate_activation never runs; the token-by-token forward takes the activated gate, and its
    backward, the chunked one, the raw gate) and give the float64 torch path's output, state and the gradients
    of every input, the raw gate, A_log and dt_bias included (two chunks of 16 and a partial third, GVA)."""
    import lamina.ops.delta_rule as ops
    import lamina.ops.delta_rule_core as core

    t = 40
    q, k, v = rand(B, t, H, K, seed=60), rand(B, t, H, K, seed=61), rand(B, t, HV, V, seed=62)
    g = rand(B, t, HV, *((K,) if channel else ()), seed=63) * 2
    b, w = torch.rand(B, t, HV, K), torch.rand(B, t, HV, V)
    A_log = rand(HV, seed=64) if with_a else None
    dt_bias = rand(HV * K if channel else HV, seed=65) if with_bias else None
    h0, do, ds = rand(B, HV, K, V, seed=66), rand(B, t, HV, V, seed=67), rand(B, HV, K, V, seed=68)
    calls = {"gdn": lambda *x, **kw: lamina.chunk_gated_delta_rule(*x[:4], x[4][..., 0], **kw),
             "kda": lambda *x, **kw: lamina.chunk_kda(*x[:4], x[4][..., 0], **kw),
             "gdn2": lambda *x, **kw: lamina.chunk_gdn2(*x, **kw),
             "kda_recurrent": lambda *x, chunk_size, **kw: lamina.fused_recurrent_kda(*x[:4], x[4][..., 0], **kw)}
    results = []
    for dtype, backend in ((torch.float32, "triton"), (torch.float64, "torch")):
        leaves = [None if x is None else x.detach().to(dtype).requires_grad_()
                  for x in (q, k, v, g, b, w, h0, A_log, dt_bias)]
        inputs = leaves[:6] if variant == "gdn2" else leaves[:5]
        extra = {} if lower_bound is None else dict(lower_bound=lower_bound)
        with monkeypatch.context() as m:
            if backend == "triton":
                for module in (ops,) if variant.endswith("recurrent") else (ops, core):
                    m.setattr(module, "gate_activation", lambda *a, **kw: pytest.fail("gate_activation ran"))
            o, s = calls[variant](*inputs, initial_state=leaves[6], output_final_state=True, use_gate_in_kernel=True,
                                  A_log=leaves[7], dt_bias=leaves[8], chunk_size=16, backend=backend, **extra)
            ((o * do.to(dtype)).sum() + (s * ds.to(dtype)).sum()).backward()
        results.append((o, s, leaves))
    (o, s, got), (o64, s64, want) = results
    assert_close("o", o, o64)
    assert_close("final_state", s, s64)
    names = ["q", "k", "v", "g", "b", "w", "initial_state", "A_log", "dt_bias"]
    for name, a, e in zip(names, got, want):
        if e is None or e.grad is None:
            assert a is None or a.grad is None, name
            continue
        assert_close(f"d{name}", a.grad, e.grad)


@pytest.mark.interpret
@pytest.mark.parametrize("variant", ["gdn", "kda"])
@pytest.mark.parametrize("raw_gate", [True, False], ids=["raw-gate", "log-decay"])
def test_no_gradient_below_the_log_decay_floor(variant, raw_gate):
    """Log decays below the chunked forms' floor (-40): a raw gate of 1e6 (use_gate_in_kernel), or log decays of
    -1e4 and -inf, at two tokens of one value head. The Triton path's output, state and every gradient, A_log's and
    dt_bias's included, match the float64 token loop (no floor: its decay there is exactly 0, or exp(-40) at
    most), and the floored tokens' gate gradient is exactly 0, the floor's (a clamp's), as on the PyTorch path.
    Without the floor's zero gradient, the rounding left in the floored tokens' gradient reaches A_log multiplied
    by the log decay itself: an RMS error ratio of 7e-3 (gdn) and 1.3e-2 (kda) in dA_log here, against 2e-5."""
    from lamina.fuzz.delta import gate64
    from lamina.reference import delta_rule_family_recurrent_ref

    t, floored = 40, [(5, 1), (20, 1)]  # one in the first chunk of 16, one in the second
    q, k, v = rand(B, t, H, K, seed=70), F.normalize(rand(B, t, H, K, seed=71), dim=-1), rand(B, t, HV, V, seed=72)
    gate_shape = (B, t, HV) + ((K,) if variant == "kda" else ())
    beta = torch.rand(B, t, HV, generator=torch.Generator().manual_seed(73))
    A_log, dt_bias = rand(HV, seed=74) * 0.3, rand(HV * K if variant == "kda" else HV, seed=75) * 0.3
    h0, do, ds = rand(B, HV, K, V, seed=76), rand(B, t, HV, V, seed=77), rand(B, HV, K, V, seed=78)
    if raw_gate:
        g = rand(*gate_shape, seed=79)
        for i, j in floored:
            g[0, i, j] = 1e6  # -exp(A_log) * softplus(1e6 + dt_bias): about -1e6
    else:
        g = -F.softplus(rand(*gate_shape, seed=79))
        for (i, j), x in zip(floored, (-1e4, float("-inf"))):
            g[0, i, j] = x
    op = lamina.chunk_kda if variant == "kda" else lamina.chunk_gated_delta_rule
    results = []
    for dtype in (torch.float32, torch.float64):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, g, beta, h0, A_log, dt_bias)]
        q_, k_, v_, g_, beta_, h0_, a_, bias_ = leaves
        if dtype == torch.float32:
            gate = dict(use_gate_in_kernel=True, A_log=a_, dt_bias=bias_) if raw_gate else {}
            o, s = op(q_, k_, v_, g_, beta_, initial_state=h0_, output_final_state=True, chunk_size=16,
                      backend="triton", **gate)
        else:  # the fuzzer's float64 gate (fla's formula), then the token loop, which takes every log decay as it is
            log_decay = gate64(g_, a_, bias_, None) if raw_gate else g_
            o, s = delta_rule_family_recurrent_ref(q_, k_, v_, g=log_decay, erase=beta_, write=beta_, scale=K ** -0.5,
                                                   initial_state=h0_, output_final_state=True)
        ((o * do.to(dtype)).sum() + (s * ds.to(dtype)).sum()).backward()
        results.append((o, s, leaves))
    (o, s, got), (o64, s64, want) = results
    assert_close("o", o, o64)
    assert_close("final_state", s, s64)
    names = ["q", "k", "v", "g", "beta", "initial_state"] + (["A_log", "dt_bias"] if raw_gate else [])
    for name, a, e in zip(names, got, want):
        assert_close(f"d{name}", a.grad, e.grad)
    for i, j in floored:
        assert not got[3].grad[0, i, j].any(), (i, j)


# (op, allow_neg_eigval, with use_gate_in_kernel, activation dtype) of fla's use_beta_sigmoid_in_kernel
FUSED_BETAS = [
    ("gdn", False, False, torch.float32),
    ("kda", True, True, torch.float32),
    ("gdn", True, True, torch.bfloat16),
    ("kda_recurrent", False, False, torch.float32),
]


@pytest.mark.interpret
@pytest.mark.parametrize("variant, neg_eigval, with_gate, dtype", FUSED_BETAS, ids=lambda x: str(x))
def test_beta_sigmoid_fused_into_the_kernels(monkeypatch, variant, neg_eigval, with_gate, dtype):
    """use_beta_sigmoid_in_kernel (``2 * sigmoid`` with allow_neg_eigval) with autograd on the Triton path: the
    chunked kernels read the raw beta and activate it themselves, forward and backward (the PyTorch
    beta_activation never runs; the token-by-token forward takes it activated), and give the float64 torch path's
    output, state and the gradients of every input, the raw beta's included (raw values of both signs out to
    |6|, in the sigmoid's tails; two chunks of 16 and a partial third, GVA; bf16 on the same rounded inputs;
    with the l2norm of q and k fused in too)."""
    import lamina.ops.delta_rule as ops
    import lamina.ops.delta_rule_core as core

    t = 40
    q, k, v = rand(B, t, H, K, seed=70), rand(B, t, H, K, seed=71), rand(B, t, HV, V, seed=72)
    g = rand(B, t, HV, *((K,) if variant.startswith("kda") else ()), seed=73)
    g = g * 2 if with_gate else -g.abs() / 4
    beta = rand(B, t, HV, seed=74) * 3
    A_log, dt_bias = rand(HV, seed=75), rand(HV * K if variant.startswith("kda") else HV, seed=76)
    h0, do, ds = rand(B, HV, K, V, seed=77), rand(B, t, HV, V, seed=78), rand(B, HV, K, V, seed=79)
    op = {"gdn": lamina.chunk_gated_delta_rule, "kda": lamina.chunk_kda,
          "kda_recurrent": lambda *x, chunk_size, **kw: lamina.fused_recurrent_kda(*x, **kw)}[variant]
    gate = dict(use_gate_in_kernel=True) if with_gate else {}
    results, activations = [], []
    for backend in ("triton", "torch"):
        # q, k, v in the activations' dtype (rounded the same for both), the gates, the state and the parameters fp32
        wide = torch.float64 if backend == "torch" else torch.float32
        leaves = [(x.to(dtype) if x.dim() == 4 and x is not g and x is not h0 else x).to(wide).detach().clone()
                  for x in (q, k, v, g, beta, h0)]
        if backend == "triton":
            leaves[:3] = [x.to(dtype) for x in leaves[:3]]
        params = [x.to(wide).detach().clone() for x in (A_log, dt_bias)] if with_gate else []
        for x in (*leaves, *params):
            x.requires_grad_()
        if params:
            gate.update(A_log=params[0], dt_bias=params[1])
        with monkeypatch.context() as m:
            if backend == "triton":
                real = core.beta_activation
                for module in (ops, core):
                    m.setattr(module, "beta_activation", lambda *a, f=real: activations.append(variant) or f(*a))
            # with the l2norm of q and k, as the layers run it (the transitions then stay bounded)
            o, s = op(*leaves[:5], initial_state=leaves[5], output_final_state=True, use_beta_sigmoid_in_kernel=True,
                      allow_neg_eigval=neg_eigval, use_qk_l2norm_in_kernel=True, chunk_size=16, backend=backend,
                      **gate)
            ((o * do.to(o.dtype)).sum() + (s * ds.to(s.dtype)).sum()).backward()
        results.append((o, s, leaves + params))
    # the chunked kernels activate beta themselves; the token-by-token path activates it first
    assert activations == (["kda_recurrent"] if variant == "kda_recurrent" else [])
    (o, s, got), (o64, s64, want) = results
    tol = {} if dtype == torch.float32 else dict(dtype=dtype)
    assert_close("o", o, o64, **tol)
    assert_close("final_state", s, s64, **tol)
    for name, a, e in zip(["q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"], got, want):
        assert a.grad is not None and e.grad is not None, name
        assert_close(f"d{name}", a.grad, e.grad, **tol)


def test_torch_path_gradcheck_float64():
    """The CPU path (gate, beta and l2norm transforms + chunked reference) in float64, GVA with HV = 2H."""
    gen = torch.Generator().manual_seed(40)
    shapes = [(1, 4, 1, 3), (1, 4, 1, 3), (1, 4, 2, 2), (1, 4, 2), (1, 4, 2), (2,), (2,)]
    args = [torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]

    def fn(q, k, v, g, beta, A_log, dt_bias):
        return lamina.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                             A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
                                             chunk_size=16, output_final_state=True, backend="torch")

    assert torch.autograd.gradcheck(fn, args)


def test_strong_decay_long_sequence_cpu_path_is_finite():
    """g = -20 per token on half the channels, T = 4096, on the PyTorch path: no NaN/inf anywhere."""
    gen = torch.Generator().manual_seed(41)
    Tl = 4096
    q, k = torch.randn(1, Tl, 1, 16, generator=gen), torch.randn(1, Tl, 1, 16, generator=gen)
    v = torch.randn(1, Tl, 1, 16, generator=gen)
    g = -torch.rand(1, Tl, 1, 16, generator=gen)
    g[..., ::2] = -20.0
    beta = torch.rand(1, Tl, 1, generator=gen)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    o, s = lamina.chunk_kda(*leaves, output_final_state=True, use_qk_l2norm_in_kernel=True, backend="torch")
    (o.sum() + s.sum()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    for x in leaves:
        assert torch.isfinite(x.grad).all()


def test_auto_backend_on_cpu_follows_the_interpreter(monkeypatch):
    q, k, v, g, b, w, _ = family_inputs()
    calls = []
    import lamina.ops.delta_rule_core as core

    real = core.select_backend
    monkeypatch.setattr(core, "select_backend", lambda *a, **kw: calls.append(real(*a, **kw)) or calls[-1])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lamina.chunk_kda(q, k, v, g, b[..., 0])
    assert calls == ["torch"]
    with pytest.raises(ValueError, match="backend"):
        lamina.chunk_kda(q, k, v, g, b[..., 0], backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        lamina.chunk_kda(q, k, v, g, b[..., 0], backend="nope")


# --- custom op registration and torch.compile -----------------------------------------------------

def _gdn(q, k, v, g, beta, backend):
    o, s = lamina.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                         use_beta_sigmoid_in_kernel=True, chunk_size=16, backend=backend)
    return o * 2, s


@pytest.mark.versions
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpret)])
def test_torch_compile_fullgraph_matches_eager(backend):
    """fullgraph=True traces the whole op (the torch path inline, the Triton path as lamina::delta_rule_fwd/bwd
    with their fake implementations); aot_eager keeps the check quick on CPU."""
    torch._dynamo.reset()
    q, k, v = base_inputs()
    g, beta = -torch.rand(B, T, HV), rand(B, T, HV, seed=50)
    eager = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    comp = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o1, s1 = _gdn(*eager, backend)
    o2, s2 = torch.compile(_gdn, fullgraph=True, backend="aot_eager")(*comp, backend)
    assert_close("o", o2, o1.detach())
    assert_close("final_state", s2, s1.detach())
    o1.sum().backward()
    o2.sum().backward()
    for a, e in zip(comp, eager):
        assert_close("grad", a.grad, e.grad)


@pytest.mark.interpret
def test_custom_op_registration_opcheck():
    q, k, v, g, b, w, h0 = family_inputs()
    no_gate = (False, None, None, None)
    gate = (True, torch.randn(g.shape[2]), torch.randn(g.shape[2] * g.shape[3]), None)  # the raw gate, fused in
    beta = b[..., 0]  # a scalar beta, raw with beta_act
    for output_v_new, gate_args, l2norm_qk, beta_act in ((False, no_gate, False, 0), (True, no_gate, False, 0),
                                                         (False, gate, False, 0), (False, gate, True, 2)):
        erase, write = (beta, beta) if beta_act else (b, w)
        args = (q, k, v, g, erase, write, 0.25, h0, True, None, 16, False, True, output_v_new, *gate_args, l2norm_qk,
                beta_act)
        torch.library.opcheck(torch.ops.lamina.delta_rule_fwd.default, args,
                              test_utils=("test_schema", "test_faketensor"))


# --- bad input --------------------------------------------------------------------------------------

def _good():
    q, k, v = base_inputs()
    return dict(q=q, k=k, v=v, g=-torch.rand(B, T, HV, K), beta=torch.rand(B, T, HV))


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(q=a["q"][0]), "q must have 4 dimensions"),
    (lambda a: a.update(k=a["k"][:, :-1]), "k must have shape"),
    (lambda a: a.update(v=a["v"][:, :-1]), "v must have shape"),
    (lambda a: a.update(v=torch.randn(B, T, 3, V)), "multiple of H"),
    (lambda a: a.update(g=a["g"][..., 0]), "g must have shape"),
    (lambda a: a.update(beta=a["beta"][..., :1]), "beta must have shape"),
    (lambda a: a.update(k=a["k"].half()), "k must have the dtype of q"),
    (lambda a: a.update(q=torch.randn(B, T, H, 1024), k=torch.randn(B, T, H, 1024)), "head dim K"),
    (lambda a: a.update(initial_state=torch.zeros(B, HV, K, V + 1)), "initial_state must have shape"),
    (lambda a: a.update(initial_state=torch.zeros(B, HV, K, V, dtype=torch.float16)), "initial_state must have dtype"),
    (lambda a: a.update(initial_state=torch.zeros(B, HV, K, V, device="meta")), "same device"),
    (lambda a: a.update(chunk_size=48), "chunk_size"),
    (lambda a: a.update(q=[1, 2]), "q must be a torch.Tensor"),
])
def test_bad_input_kda(change, match):
    args = _good()
    change(args)
    exc = TypeError if "torch.Tensor" in match else ValueError
    with pytest.raises(exc, match=match):
        lamina.chunk_kda(**args, backend="torch")


@pytest.mark.parametrize("cu,match", [
    ([0, 10, 24], "batch size 1"),
    ([0, 12, 6, 24], "non-decreasing"),
    ([1, 12, 24], "start at 0"),
    ([0, 12, 20], "end at"),
])
def test_bad_cu_seqlens(cu, match):
    q, k, v = [torch.cat([x, x]) for x in base_inputs()] if cu == [0, 10, 24] else base_inputs()
    beta = torch.rand(q.shape[0], T, HV)
    with pytest.raises(ValueError, match=match):
        lamina.chunk_delta_rule(q, k, v, beta, cu_seqlens=torch.tensor(cu), backend="torch")


def test_bad_gate_arguments():
    q, k, v = base_inputs()
    g, beta = torch.randn(B, T, HV), torch.rand(B, T, HV)
    with pytest.raises(ValueError, match="A_log"):
        lamina.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True, backend="torch")
    with pytest.raises(ValueError, match="A_log must have"):
        lamina.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True, A_log=torch.zeros(3), backend="torch")
    with pytest.raises(ValueError, match="dt_bias must have"):
        lamina.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True, A_log=torch.zeros(HV),
                                      dt_bias=torch.zeros(HV * K), backend="torch")
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        lamina.chunk_gated_delta_rule(q, k, v, g, beta, allow_neg_eigval=True, backend="torch")
    g4 = torch.randn(B, T, HV, K)
    with pytest.raises(ValueError, match="lower_bound"):
        lamina.chunk_kda(q, k, v, g4, beta, use_gate_in_kernel=True, safe_gate=True, A_log=torch.zeros(HV),
                         backend="torch")
    with pytest.raises(ValueError, match=r"lower_bound must be in \[-5, 0\)"):
        lamina.chunk_kda(q, k, v, g4, beta, use_gate_in_kernel=True, safe_gate=True, lower_bound=-7.0,
                         backend="torch")
    with pytest.raises(ValueError, match="b must have shape"):
        lamina.chunk_gdn2(q, k, v, g4, beta, torch.rand(B, T, HV, V), backend="torch")
    with pytest.raises(ValueError, match="w must have shape"):
        lamina.chunk_gdn2(q, k, v, g4, torch.rand(B, T, HV, K), torch.rand(B, T, HV, K + 1), backend="torch")


@pytest.mark.interpret
def test_triton_path_rejects_float64():
    q, k, v = base_inputs(torch.float64)
    beta = torch.rand(B, T, HV, dtype=torch.float64)
    with pytest.raises(ValueError, match="backend='torch'"):
        lamina.chunk_delta_rule(q, k, v, beta, backend="triton")
    q = torch.randn(B, 4, H, 520, requires_grad=True)
    with pytest.raises(ValueError, match=r"K must be in \[1, 512\]"):
        lamina.chunk_delta_rule(q, q, torch.randn(B, 4, HV, 16), torch.rand(B, 4, HV), backend="triton")


def check_training_against_float64(variant: str, t: int, k_dim: int, v_dim: int, heads: tuple[int, int] = (H, HV),
                                   dtype: torch.dtype = torch.float32, **kwargs) -> None:
    """The Triton path through the op's autograd (``kwargs`` to the op), output, final state and every
    gradient against autograd through the float64 torch path, on the same inputs (q, k, v and the betas rounded
    to ``dtype``, the Triton path's activations; the log decay, the initial state and the upstream gradients
    float32, as fla takes them), each at ``dtype``'s tolerance; ``heads``: (q/k heads, value heads)."""
    H, HV = heads
    q, k = rand(B, t, H, k_dim, seed=40), rand(B, t, H, k_dim, seed=41)
    v = rand(B, t, HV, v_dim, seed=42)
    g = -torch.rand(B, t, HV, k_dim, generator=torch.Generator().manual_seed(43))
    b = torch.rand(B, t, HV, k_dim, generator=torch.Generator().manual_seed(44))
    w = torch.rand(B, t, HV, v_dim, generator=torch.Generator().manual_seed(45))
    h0 = rand(B, HV, k_dim, v_dim, seed=46)
    do, ds = rand(B, t, HV, v_dim, seed=47), rand(B, HV, k_dim, v_dim, seed=48)
    q, k, v, b, w = (x.to(dtype).float() for x in (q, k, v, b, w))
    results = []
    for run_dtype, backend in ((dtype, "triton"), (torch.float64, "torch")):
        wide = torch.promote_types(run_dtype, torch.float32)
        leaves = [x.detach().to(wide if x is g or x is h0 else run_dtype).requires_grad_()
                  for x in (q, k, v, g, b, w, h0)]
        o, s = CALLS[variant](*leaves[:6], initial_state=leaves[6], output_final_state=True,
                              use_qk_l2norm_in_kernel=True, backend=backend, **kwargs)
        ((o * do.to(o.dtype)).sum() + (s * ds.to(s.dtype)).sum()).backward()
        results.append((o, s, leaves))
    (o, s, got), (o64, s64, want) = results
    assert_close("o", o, o64, dtype=dtype)
    assert_close("final_state", s, s64, dtype=dtype)
    for name, a, e in zip(["q", "k", "v", "g", "b", "w", "initial_state"], got, want):
        if e.grad is None:
            assert a.grad is None, name
            continue
        assert_close(f"d{name}", a.grad, e.grad, dtype=dtype)


@pytest.mark.grid
@pytest.mark.interpret
@pytest.mark.parametrize("variant", ["delta", "gdn2"])
def test_training_with_keys_of_512(variant):
    """K = 512 through the op's autograd (forward kernels saving states, the backward's in-memory scan), two
    value heads sharing one q/k head."""
    check_training_against_float64(variant, 20, 512, 16, heads=(1, 2), chunk_size=16)


@pytest.mark.parametrize("device_type,dtype,needs_grad,chunked,backend,expected", [
    ("cuda", torch.float32, True, True, "auto", "torch"),
    ("cuda", torch.float32, True, True, "triton", ValueError),
    ("cuda", torch.float32, False, True, "auto", "torch"),
    ("cuda", torch.float32, False, True, "triton", ValueError),
    ("cuda", torch.float32, True, False, "triton", ValueError),
    ("cuda", torch.float32, False, False, "triton", "triton"),
    ("cuda", torch.bfloat16, True, True, "triton", "triton"),
    ("cuda", torch.float16, True, True, "auto", "triton"),
    ("cpu", torch.float32, True, True, "triton", "triton"),
])
def test_float32_training_path(device_type, dtype, needs_grad, chunked, backend, expected):
    # the float32 chunked Triton kernels are not trusted on CUDA (wrong gradients and illegal memory accesses on an
    # H200 and an H100): "auto" runs float32 on the PyTorch path there, forward (chunked) and backward, an explicit
    # "triton" says why it refuses, and everything else keeps its path (the token-by-token forward too)
    from lamina.ops.delta_rule_core import training_path

    args = ("chunk_gated_delta_rule", "triton", backend, device_type, dtype, needs_grad, chunked)
    if expected is ValueError:
        what = "that need gradients" if needs_grad else "in the chunked forward"
        with pytest.raises(ValueError, match=rf"chunk_gated_delta_rule: backend='triton' with float32 inputs {what} "
                                             r".* bfloat16"):
            training_path(*args)
    else:
        assert training_path(*args) == expected


def test_float32_training_path_is_the_ops(monkeypatch):
    # the op asks training_path with its inputs' device, dtype and whether they need gradients
    import lamina.ops.delta_rule_core as core

    seen = []
    real = core.training_path
    monkeypatch.setattr(core, "training_path", lambda *a, **kw: seen.append((*a[3:], kw)) or real(*a, **kw))
    q, k, v = (torch.randn(1, 8, 1, 16) for _ in range(3))
    g, beta = -torch.rand(1, 8, 1), torch.rand(1, 8, 1)
    lamina.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, backend="torch")
    lamina.chunk_gated_delta_rule(q.requires_grad_(), k, v, g=g, beta=beta, backend="torch")
    with torch.no_grad():
        lamina.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, backend="torch")
    lamina.fused_recurrent_gated_delta_rule(q.detach(), k, v, g=g, beta=beta, backend="torch", output_v_new=True)
    chunked, recurrent = {"chunked": True}, {"chunked": False}
    assert seen == [("cpu", torch.float32, False, chunked), ("cpu", torch.float32, True, chunked),
                    ("cpu", torch.float32, False, chunked), ("cpu", torch.float32, False, recurrent)]


@pytest.mark.grid  # leg 1 of CI; the oldest-Triton leg runs the kernels' own l2norm tests (test_delta_fwd.py)
@pytest.mark.interpret
@pytest.mark.parametrize("variant,dtype", [("gdn", torch.bfloat16), ("kda", torch.float16), ("gdn2", torch.bfloat16)])
def test_qk_l2norm_in_the_kernels_with_gradients(variant, dtype):
    """use_qk_l2norm_in_kernel on the chunked Triton path in 16-bit, q and k rows of norms 0.1 to 10, varlen:
    the output, final state and every gradient (through the norm, to the raw q and k) against autograd through
    the float64 torch path on the same rounded inputs."""
    q, k, v, g, b, w, _ = family_inputs()
    gen = torch.Generator().manual_seed(31)
    q, k = (x * 10 ** (2 * torch.rand(*x.shape[:3], 1, generator=gen) - 1) for x in (q, k))
    inputs = [x.to(dtype) if x.dim() == 4 and x is not g else x for x in (q, k, v, g, b, w)]
    cu = torch.tensor([0, 7, T], dtype=torch.int32)
    h0 = rand(2, HV, K, V, seed=32)
    leaves = [x.clone().requires_grad_() for x in (*inputs, h0)]
    leaves64 = [x.detach().double().requires_grad_() for x in (*inputs, h0)]
    do, ds = rand(1, T * B, HV, V, seed=33), rand(2, HV, K, V, seed=34)
    outs = []
    for xs, backend in ((leaves, "triton"), (leaves64, "torch")):
        flat = [x.reshape(1, -1, *x.shape[2:]) for x in xs[:6]]
        o, s = CALLS[variant](*flat, initial_state=xs[6], output_final_state=True, use_qk_l2norm_in_kernel=True,
                              cu_seqlens=cu, backend=backend)
        ((o * do.to(o.dtype)).sum() + (s * ds.to(s.dtype)).sum()).backward()
        outs.append((o, s))
    assert_close("o", outs[0][0], outs[1][0], dtype=dtype)
    assert_close("final_state", outs[0][1], outs[1][1], dtype=dtype)
    for name, a, e in zip(["q", "k", "v", "g", "b", "w", "initial_state"], leaves, leaves64):
        if e.grad is None:
            assert a.grad is None, name
            continue
        assert_close(f"d{name}", a.grad, e.grad, dtype=dtype)


def test_l2norm_fused_on_hopper_and_under_the_interpreter(monkeypatch):
    """``l2norm_in_kernels``: the forward fuses the l2norm of q and k on sm_90 and on CPU (the interpreter), not on
    other GPUs (the fused kernels spill on sm_80); there the op runs the L2-norm kernel first and launches the
    chunked kernels without L2NORM."""
    import lamina.kernels.delta_chunk_common as common
    import lamina.kernels.delta_chunk_fwd as fwd
    import lamina.kernels.rms_norm_gated as norm_kernels

    for major, fused in ((9, True), (8, False), (10, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, m=major: (m, 0))
        assert common.l2norm_in_kernels(torch.device("cuda")) == fused
    assert common.l2norm_in_kernels(torch.device("cpu"))
    monkeypatch.undo()
    norms, fused_launches = [], []
    real, prep = norm_kernels.rms_norm_fwd, fwd._prep_fwd
    monkeypatch.setattr(norm_kernels, "rms_norm_fwd", lambda *a: norms.append(a[-1]) or real(*a))

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: fused_launches.append(kw["L2NORM"]) or prep[grid](*a, **kw)

    monkeypatch.setattr(fwd, "_prep_fwd", Spy())
    monkeypatch.setattr(common, "l2norm_in_kernels", lambda device: False)
    q, k, v = base_inputs()
    g, beta = -rand(B, T, HV, seed=11).abs(), rand(B, T, HV, seed=12).sigmoid()
    o, _ = lamina.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend="triton")
    assert norms == ["l2", "l2"] and fused_launches == [False]
    monkeypatch.setattr(common, "l2norm_in_kernels", lambda device: True)
    fused_o, _ = lamina.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend="triton")
    assert norms == ["l2", "l2"] and fused_launches == [False, True]
    assert_close("o fused against o normalised first", fused_o, o)
