"""Malformed calls raise ValueError/TypeError naming the argument; NaN/inf inputs propagate like the reference.

The sweep (``lamina.fuzz.bad_inputs.run_bad_inputs``) covers every public op and layer; the
targeted tests below pin the review findings (NaN query row on the default CPU attention path,
v/gate dtypes, g > 0, ``scale="abc"``, a wrong hidden size) and the NaN policy of
``lamina._validate`` on every path that runs on CPU (PyTorch and the Triton interpreter).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import lamina
import lamina.layers
import lamina.models
from lamina import reference as R
from lamina.fuzz.bad_inputs import Mutation, Target, _run_one, run_bad_inputs

# Public names that are not ops, layers or models (schedules, patching, caches, configs).
NOT_CALLS = {"PrismSchedule", "patch_fla", "__version__", "Cache", "PrismDecoderConfig", "HRMLMConfig",
             "LinearLMConfig"}
PUBLIC = sorted((set(lamina.__all__) | set(lamina.layers.__all__) | set(lamina.models.__all__)) - NOT_CALLS)
BACKENDS = ("torch", "triton")


def test_every_public_op_and_layer_rejects_20_malformed_calls_by_name():
    report = run_bad_inputs(log=None)
    assert report.ok, "\n".join(report.crashes)
    assert sorted(report.per_op) == PUBLIC
    too_few = {name: n for name, n in report.per_op.items() if n < 20}
    assert not too_few, f"fewer than 20 malformed calls: {too_few}"
    assert report.checked == sum(report.per_op.values())


def _target(call) -> Target:
    return Target("probe", lambda dev: {}, call, ())


def test_the_sweep_reports_silence_other_errors_unnamed_arguments_and_hangs():
    named = Mutation("m", "alpha", lambda kw, d: None)

    def raise_(exc):
        def call(kw):
            raise exc
        return call

    assert _run_one(_target(raise_(ValueError("alpha must be > 0"))), named, torch.device("cpu"), 5) is None
    assert "did not raise" in _run_one(_target(lambda kw: 1), named, torch.device("cpu"), 5)
    assert "RuntimeError" in _run_one(_target(raise_(RuntimeError("alpha"))), named, torch.device("cpu"), 5)
    assert "without naming" in _run_one(_target(raise_(ValueError("alphabet"))), named, torch.device("cpu"), 5)
    start = time.monotonic()
    assert "hang" in _run_one(_target(lambda kw: time.sleep(1.0)), named, torch.device("cpu"), 0.1)
    assert time.monotonic() - start < 0.9
    empty = Mutation("T=0", "alpha", lambda kw, d: None, empty_ok=True)
    assert _run_one(_target(lambda kw: torch.zeros(1, 0)), empty, torch.device("cpu"), 5) is None
    assert "did not raise" in _run_one(_target(lambda kw: torch.zeros(1)), empty, torch.device("cpu"), 5)


def test_run_bad_inputs_names_unknown_ops():
    with pytest.raises(ValueError, match="ops"):
        run_bad_inputs(ops=["no_such_op"], log=None)


# --- review findings -------------------------------------------------------------------------------

def _qkv(T: int = 4, H: int = 2, K: int = 16, dtype=torch.float32):
    return (torch.randn(1, T, H, K, dtype=dtype), F.normalize(torch.randn(1, T, H, K, dtype=dtype), dim=-1),
            torch.randn(1, T, H, K, dtype=dtype))


@pytest.mark.parametrize("fn", [lamina.chunk_gated_delta_rule, lamina.fused_recurrent_gated_delta_rule])
def test_v_and_gate_dtypes_must_match_q(fn):
    q, k, v = _qkv()
    g, beta = -torch.rand(1, 4, 2), torch.rand(1, 4, 2)
    with pytest.raises(ValueError, match=r"^v must have the dtype of q \(float32\), got float16"):
        fn(q, k, v.half(), g=g, beta=beta, backend="torch")
    with pytest.raises(ValueError, match=r"^g must have the dtype of q \(float32\) or float32, got float64"):
        fn(q, k, v, g=g.double(), beta=beta, backend="torch")
    with pytest.raises(ValueError, match=r"^beta must have the dtype of q \(float16\) or float32, got bfloat16"):
        fn(q.half(), k.half(), v.half(), g=g, beta=beta.bfloat16(), backend="torch")
    # fla's convention: float32 gates with half-precision q, k, v
    o, _ = fn(q.half(), k.half(), v.half(), g=g, beta=beta.half(), backend="torch")
    assert o.dtype == torch.float16


def test_positive_log_decay_is_refused_on_cpu_and_raw_gates_are_not():
    q, k, v = _qkv()
    g, beta = -torch.rand(1, 4, 2), torch.rand(1, 4, 2)
    g[0, 2, 1] = 0.25
    with pytest.raises(ValueError, match=r"^g must be <= 0 .* got a maximum of 0.25"):
        lamina.chunk_gated_delta_rule(q, k, v, g, beta, backend="torch")
    with pytest.raises(ValueError, match=r"^g must be <= 0"):
        lamina.chunk_kda(q, k, v, g[..., None].expand(1, 4, 2, 16), beta, backend="torch")
    with pytest.raises(ValueError, match=r"^gk must be <= 0"):
        lamina.fused_recurrent_gated_delta_rule(q, k, v, gk=g[..., None].expand(1, 4, 2, 16).contiguous(),
                                                beta=beta, backend="torch")
    # with use_gate_in_kernel g is the raw gate input: any sign, the activation makes the decay
    o, _ = lamina.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True, A_log=torch.zeros(2),
                                         dt_bias=torch.zeros(2), backend="torch")
    assert torch.isfinite(o).all()
    # g = 0 (no decay) is the boundary and allowed; NaN passes the check and propagates
    g0 = torch.zeros(1, 4, 2)
    g0[0, 1, 0] = float("nan")
    o, _ = lamina.chunk_gated_delta_rule(q, k, v, g0, beta, backend="torch")
    assert torch.isnan(o[0, 1:, 0]).all() and torch.isfinite(o[0, :, 1]).all()


def test_scale_must_be_a_number():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"^scale must be a float or None, got str 'abc'"):
        lamina.chunk_delta_rule(q, k, v, torch.rand(1, 4, 2), scale="abc", backend="torch")
    with pytest.raises(TypeError, match=r"^scale must be a float or None, got str"):
        lamina.prism_attention(q, k, v, scale="abc", backend="torch")
    with pytest.raises(TypeError, match=r"^softmax_scale must be a float or None, got bool"):
        lamina.prism_attention_with_kvcache(q, k, v, softmax_scale=True, backend="torch")
    with pytest.raises(ValueError, match=r"^scale must be finite, got inf"):
        lamina.prism_attention(q, k, v, scale=float("inf"), backend="torch")


@pytest.mark.parametrize("make, call", [
    (lambda: lamina.layers.GatedDeltaNet(hidden_size=32, head_dim=16, num_heads=2, expand_v=1),
     lambda m, x: m(x)),
    (lambda: lamina.layers.DeltaRuleAttention(hidden_size=32, num_heads=2), lambda m, x: m(x)),
    (lambda: lamina.layers.PrismAttention(32, 2), lambda m, x: m(x)),
    (lambda: lamina.layers.HRMGatedUpdate(32, context=False), lambda m, x: m(x, x)),
])
def test_a_wrong_hidden_size_is_named(make, call):
    module = make()
    width = r"^(hidden_states|x|h) must have shape \[(B, T|\.\.\.), (hidden_size|d_model)=32\], got \(1, 4, 24\)"
    with pytest.raises(ValueError, match=width):
        call(module, torch.randn(1, 4, 24))
    with pytest.raises(ValueError, match=r"must have the dtype of the layer's parameters \(float32\), got float64"):
        call(module, torch.randn(1, 4, 32, dtype=torch.float64))


# --- NaN / inf policy: every output the reference makes non-finite is non-finite ------------------

def _missing(out: torch.Tensor, ref: torch.Tensor) -> int:
    """Elements non-finite in the reference but finite in ``out`` (a NaN turned into a number)."""
    return int((~torch.isfinite(ref) & torch.isfinite(out)).sum())


def _poison(x: torch.Tensor, value: float, index: tuple[int, ...]) -> torch.Tensor:
    x = x.clone()
    x[index] = value
    return x


DELTA = {
    "chunk_delta_rule": (R.delta_rule_ref, None),
    "chunk_gated_delta_rule": (R.gated_delta_rule_ref, "scalar"),
    "chunk_kda": (R.kda_ref, "key"),
    "fused_recurrent_delta_rule": (R.delta_rule_ref, None),
    "fused_recurrent_gated_delta_rule": (R.gated_delta_rule_ref, "scalar"),
    "fused_recurrent_kda": (R.kda_ref, "key"),
}
# One head per poisoned input (heads are independent): one call checks them all.
POISONED = ("q", "k", "v", "beta", "g")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(DELTA))
def test_delta_rule_nan_and_inf_propagate(name, backend):
    ref_fn, gate = DELTA[name]
    T, H, K, t = 8, len(POISONED), 16, 3  # token t carries the bad value
    q, k, v = _qkv(T, H, K)
    args = {"q": q, "k": k, "v": v, "beta": torch.rand(1, T, H)}
    if gate is not None:
        args["g"] = -torch.rand(*((1, T, H) if gate == "scalar" else (1, T, H, K)))
    order = ["q", "k", "v"] + (["g"] if gate else []) + ["beta"]
    # the interpreter is slow: NaN only there (inf runs on the torch path)
    for value in (float("nan"), float("inf")) if backend == "torch" else (float("nan"),):
        bad = dict(args)
        for head, where in enumerate(POISONED):
            if where in bad:  # +inf is not a log decay (g <= 0 is checked): g gets -inf, a full decay
                bad[where] = _poison(bad[where], -value if where == "g" else value, (0, t, head))
        ref, _ = ref_fn(*(bad[n].double() for n in order))
        kw = {"chunk_size": 16} if name.startswith("chunk") else {}
        out, _ = getattr(lamina, name)(**bad, backend=backend, **kw)
        assert _missing(out, ref) == 0, value
        for head, where in enumerate(POISONED[:4]):
            assert torch.isfinite(out[0, :t, head]).all() or name.startswith("chunk"), where  # nothing leaks back
            assert not torch.isfinite(out[0, t:, head]).all(), f"the bad {where} must reach the output"
        if name.startswith("fused"):  # token by token: exactly the reference's pattern
            assert torch.equal(torch.isfinite(out), torch.isfinite(ref))
        if gate is not None and value == float("inf"):  # g = -inf, a decay of 0: finite, as in the reference
            head = POISONED.index("g")
            assert torch.isfinite(ref[0, :, head]).all() and torch.isfinite(out[0, :, head]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("need_lse", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_nan_query_row_is_nan_like_the_reference(backend, need_lse, causal):
    """The review finding: the default CPU path (SDPA) returned 0 for a query row holding a NaN."""
    q, k, v = (torch.randn(1, 5, 4, 16) for _ in range(3))
    # heads are independent (no GQA): head 0 a NaN query, 1 an infinite query, 2 a NaN key, 3 an infinite value
    q = _poison(_poison(q, float("nan"), (0, 2, 0, 3)), float("inf"), (0, 2, 1, 3))
    k = _poison(k, float("nan"), (0, 2, 2, 3))
    v = _poison(v, float("inf"), (0, 2, 3, 3))
    ref = R.attention_ref(q.double(), k.double(), v.double(), causal=causal)
    out = lamina.prism_attention(q, k, v, causal=causal, return_lse=need_lse, backend=backend)
    out = out[0] if need_lse else out
    assert _missing(out, ref) == 0
    assert torch.isnan(out[0, 2, 0]).all(), "a NaN query row gives NaN"
    assert not torch.isfinite(out[0, 2, 1]).any()
    for head in (0, 1):  # the other query rows are untouched
        assert torch.isfinite(out[0, [0, 1, 3, 4], head]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_hrm_update_nan_propagates(backend):
    h, c, gate = (torch.randn(3, 16) for _ in range(3))
    for name in ("h", "c", "gate"):
        args = {"h": h, "c": c, "gate": gate}
        args[name] = _poison(args[name], float("nan"), (1, 5))
        for norm in (None, torch.ones(16)):
            ref = R.hrm_gated_update_ref(args["h"].double(), args["c"].double(), args["gate"].double(),
                                         norm_weight=None if norm is None else norm.double())
            out = lamina.hrm_gated_update(args["h"], args["c"], args["gate"], norm_weight=norm, backend=backend)
            assert _missing(out, ref) == 0 and not torch.isfinite(out[1]).all()
            assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_conv1d_nan_propagates(backend):
    x, weight = torch.randn(1, 8, 4), torch.randn(4, 3)
    x = _poison(x, float("nan"), (0, 3, 1))
    ref, _ = R.causal_conv1d_ref(x.double(), weight.double(), activation="silu")
    out, _ = lamina.causal_conv1d(x, weight, activation="silu", backend=backend)
    assert _missing(out, ref) == 0
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref))  # tokens 3..5 of channel 1 only
    cache = torch.randn(2, 4, 3)
    x1 = _poison(torch.randn(2, 4), float("inf"), (1, 2))
    ref, _ = R.causal_conv1d_update_ref(x1.double(), cache.double(), weight=weight.double())
    out, _ = lamina.causal_conv1d_update(x1, cache.clone(), weight=weight, backend=backend)
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gated", [False, True])
def test_rms_norm_nan_propagates(backend, gated):
    x, g, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    for name in ("x", "g") if gated else ("x",):
        args = {"x": x, "g": g}
        args[name] = _poison(args[name], float("nan"), (1, 4))
        if gated:
            ref = R.rms_norm_gated_ref(args["x"].double(), args["g"].double(), w.double())
            out = lamina.rms_norm_gated(args["x"], args["g"], w, backend=backend)
        else:
            ref = R.rms_norm_ref(args["x"].double(), w.double())
            out = lamina.rms_norm(args["x"], w, backend=backend)
        assert _missing(out, ref) == 0 and not torch.isfinite(out[1]).all()
        assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()
