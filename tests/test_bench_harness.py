"""Timing, ceilings, results files, inputs, and the torch-eager baselines against the references."""

from __future__ import annotations

import json
import time

import pytest
import torch

from lamina.bench import eager, specs
from lamina.bench.ceilings import Ceilings, measure_ceilings, roofline_fractions
from lamina.bench.inputs import grad_leaves, make_inputs
from lamina.bench.results import ResultWriter, default_results_path, environment, read_results, repo_root
from lamina.bench.suite import SuiteConfig, _time_warm
from lamina.bench.timing import SLOW_CALL_REPEATS, TimingConfig, time_fn, wall_time_once
from tests.tolerances import assert_close


def test_cpu_timing_reports_ordered_quantiles():
    t = time_fn(lambda: time.sleep(0.002), "cpu", config=TimingConfig(cpu_min_run_s=0.05))
    assert t.method == "torch.utils.benchmark"
    assert t.runs >= 3
    assert t.p20_ms <= t.median_ms <= t.p80_ms
    assert 1.9 <= t.median_ms < 50


@pytest.mark.parametrize("repeats", [None, 1])
def test_slow_calls_are_timed_singly_and_gradients_reset(repeats):
    leaf = torch.ones(3, requires_grad=True)
    seen = []

    def step():
        seen.append(leaf.grad is None)
        (leaf * 2).sum().backward()
        time.sleep(0.02)

    config = TimingConfig(slow_call_s=0.005, **({} if repeats is None else {"slow_call_repeats": repeats}))
    t = time_fn(step, "cpu", leaves=[leaf], config=config)
    # the warm-up call that finds the call slow, then the single calls
    assert t.method == "single calls" and t.runs == (repeats or SLOW_CALL_REPEATS) == len(seen) - 1
    assert all(seen), "every timed call must start with .grad reset to None"
    assert t.median_ms >= 20


def test_no_repeats_times_the_call_already_made():
    # slow_call_repeats=0 (the sweeps' dry runs): a slow call is timed by the warm-up call alone
    calls = []
    config = TimingConfig(slow_call_s=0.005, slow_call_repeats=0)
    t = time_fn(lambda: calls.append(time.sleep(0.02)), "cpu", config=config)
    assert (t.method, t.runs, len(calls)) == ("single call", 1, 1) and t.median_ms >= 20


def _compiling_call(first_s: float, then_s: float):
    """A call whose first run takes ``first_s`` (a JIT compile and autotune) and every later one ``then_s``."""
    calls = []

    def fn():
        time.sleep(first_s if not calls else then_s)
        calls.append(None)

    return fn, calls


@pytest.mark.parametrize("deadline_in_s", [None, 0.0])
def test_the_compiling_first_call_is_never_the_timing(deadline_in_s):
    # a first call of 0.3 s (compiling), then calls of 2 ms: the timing is of the fast calls, with or without a
    # deadline that leaves no time for repeats
    fn, calls = _compiling_call(0.3, 0.002)
    cfg = SuiteConfig(device="cpu", ops=[], providers=[], shape_set="tiny",
                      timing=TimingConfig(slow_call_s=0.1, cpu_min_run_s=0.02))
    first = wall_time_once(fn, "cpu")
    deadline = None if deadline_in_s is None else time.monotonic() + deadline_in_s
    t = _time_warm(fn, cfg, [], first, deadline)
    assert t.method == "torch.utils.benchmark" and t.median_ms < 100, t
    assert len(calls) > 2


def test_a_slow_warm_call_is_the_timing_when_the_deadline_is_near():
    # slow after compiling too (0.15 s > slow_call_s): with no time for repeats, the second call is the timing
    fn, calls = _compiling_call(0.4, 0.15)
    cfg = SuiteConfig(device="cpu", ops=[], providers=[], shape_set="tiny", timing=TimingConfig(slow_call_s=0.1))
    t = _time_warm(fn, cfg, [], wall_time_once(fn, "cpu"), time.monotonic())
    assert (t.method, t.runs, len(calls)) == ("single call (time budget)", 1, 2)
    assert 150 <= t.median_ms < 390, t


def test_a_slow_call_costs_its_first_call_and_the_single_calls_only():
    # slow every time, no deadline: the second call is the first of the single calls (no extra call)
    fn, calls = _compiling_call(0.3, 0.11)
    cfg = SuiteConfig(device="cpu", ops=[], providers=[], shape_set="tiny", timing=TimingConfig(slow_call_s=0.1))
    t = _time_warm(fn, cfg, [], wall_time_once(fn, "cpu"), None)
    assert (t.method, t.runs, len(calls)) == ("single calls", SLOW_CALL_REPEATS, 1 + SLOW_CALL_REPEATS)
    assert 110 <= t.median_ms < 200, t  # not the first call (300 ms)


def test_roofline_fractions_by_hand():
    c = Ceilings(copy_gbps=2.0, matmul_tflops=4.0, matmul_dtype="fp32", matmul_n=1, copy_bytes=1, device="cpu")
    # 2e12 FLOPs and 1e9 bytes in 1 s: 2 TFLOP/s (half of 4), 1 GB/s (half of 2); bound 0.5 s of 1 s.
    out = roofline_fractions(2e12, 1e9, 1000.0, c)
    assert out == pytest.approx({"tflops": 2.0, "gbps": 1.0, "frac_matmul": 0.5, "frac_bandwidth": 0.5,
                                 "roofline_frac": 0.5})
    # memory-bound: 8e9 bytes need 4 s at 2 GB/s; measured 8 s.
    assert roofline_fractions(1e9, 8e9, 8000.0, c)["roofline_frac"] == pytest.approx(0.5)
    assert roofline_fractions(1.0, 1.0, 1.0, None)["roofline_frac"] is None


def test_tiny_ceilings_are_positive():
    c = measure_ceilings("cpu", tiny=True, config=TimingConfig(cpu_min_run_s=0.01))
    assert c.copy_gbps > 0 and c.matmul_tflops > 0 and c.matmul_dtype == "fp32"


def test_results_round_trip_and_bad_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    w = ResultWriter(path)
    w.write({"kind": "result", "op": "kda", "ms": 1.5})
    w.write({"kind": "ceiling", "copy_gbps": 3.0})
    w.close()
    recs = read_results([path])
    assert [r["kind"] for r in recs] == ["result", "ceiling"] and recs[0]["schema"] == 1
    with path.open("a") as fh:
        fh.write("{not json\n")
    with pytest.raises(ValueError, match=r"r\.jsonl:3: not a JSON line"):
        read_results([path])
    with pytest.raises(ValueError, match="does not exist"):
        read_results([tmp_path / "missing.jsonl"])
    (tmp_path / "other.jsonl").write_text(json.dumps({"op": "kda"}) + "\n")
    with pytest.raises(ValueError, match="'kind' field"):
        read_results([tmp_path / "other.jsonl"])


def test_environment_and_default_path():
    env = environment("cpu")
    for key in ("device_name", "commit", "torch", "triton", "fla", "date", "lamina"):
        assert key in env
    assert env["torch"] == torch.__version__
    root = repo_root()
    if root is not None:  # editable install from this repository
        assert env["commit"] and len(env["commit"]) == 40


@pytest.mark.parametrize("field, set_name, value, unset_name", [
    ("allocator_env", "MALLOC_TRIM_THRESHOLD_", "1073741824", "LD_PRELOAD"),
    # the Triton settings that change what the kernels compile to
    ("triton_env", "TRITON_DEFAULT_FP_FUSION", "0", "TRITON_F32_DEFAULT"),
])
def test_environment_records_the_settings_that_change_timings(monkeypatch, field, set_name, value, unset_name):
    monkeypatch.setenv(set_name, value)
    monkeypatch.delenv(unset_name, raising=False)
    env = environment("cpu")
    assert env[field].get(set_name) == value
    assert unset_name not in env[field]


def test_default_results_path_is_outside_the_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv("LAMINA_RESULTS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = default_results_path("cpu")
    assert path.name.endswith("-cpu.jsonl")
    assert path.parent == tmp_path / "cache" / "lamina" / "bench"
    monkeypatch.setenv("LAMINA_RESULTS_DIR", str(tmp_path / "mine"))
    assert default_results_path("cpu").parent == tmp_path / "mine"
    root = repo_root()
    if root is not None:
        assert not default_results_path("cpu").resolve().is_relative_to(root.resolve())


@pytest.mark.parametrize("op", list(specs.OPS))
def test_inputs_are_seeded_nonzero_and_leaves(op):
    p = specs.shapes_for(op, "tiny")[0]
    a = make_inputs(op, p, "cpu", requires_grad=True)
    b = make_inputs(op, p, "cpu", requires_grad=True)
    tensors = {k: v for k, v in a.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    assert tensors
    for name, t in tensors.items():
        assert torch.equal(t, b[name]), f"{name} is not reproducible"
        assert t.abs().sum() > 0 and torch.isfinite(t).all(), name
    assert all(leaf.is_leaf for leaf in grad_leaves(a))
    if op in specs.DELTA_OPS and "g" in a:
        assert (a["g"] <= 0).all()  # log decay


def _ref():
    return pytest.importorskip("lamina.reference.delta_rule", reason="lamina.reference.delta_rule not importable")


@pytest.mark.parametrize("op", specs.DELTA_OPS)
def test_eager_delta_family_matches_the_reference(op):
    ref = _ref()
    from lamina.bench.providers import _delta_family_kwargs

    p = specs.delta_shape(0, 0, 1, 8, "fp64", HV=2, V=16, seqlens=(17, 23))
    x = make_inputs(op, p, "cpu")
    kw = _delta_family_kwargs(op, x)
    state = torch.randn(2, 2, 8, 16, dtype=torch.float64)
    o, s = eager.delta_family_eager(x["q"], x["k"], x["v"], **kw, initial_state=state, cu_seqlens=x["cu_seqlens"])
    o_ref, s_ref = ref.delta_rule_family_recurrent_ref(x["q"], x["k"], x["v"], **kw, initial_state=state,
                                                       output_final_state=True, cu_seqlens=x["cu_seqlens"])
    assert_close(f"{op} eager o", o, o_ref)
    assert_close(f"{op} eager state", s, s_ref)


def test_eager_decode_matches_the_reference():
    ref = _ref()
    p = {**specs.decode_shape(3, 2, 8, "fp64"), "HV": 4}
    x = make_inputs("gdn_decode", p, "cpu")
    state = x["state"].double()
    o, s = eager.gdn_decode_eager(x["q"], x["k"], x["v"], x["g"], x["beta"], state)
    o_ref, s_ref = ref.delta_rule_family_recurrent_ref(x["q"], x["k"], x["v"], g=x["g"], erase=x["beta"],
                                                       write=x["beta"], initial_state=state, output_final_state=True)
    assert_close("decode o", o, o_ref)
    assert_close("decode state", s, s_ref)


@pytest.mark.parametrize("causal,tq,tk", [(True, 24, 24), (False, 1, 40)])
def test_eager_attention_matches_the_reference(causal, tq, tk):
    ref = pytest.importorskip("lamina.reference.attention", reason="lamina.reference.attention not importable")
    p = specs.attn_shape(2, tq, 4, 16, "fp64", causal=causal, Tk=tk, HKV=2)
    x = make_inputs("prism_attention", p, "cpu")
    out = eager.attention_eager(x["q"], x["k"], x["v"], causal=causal)
    assert_close("eager attention", out, ref.attention_ref(x["q"], x["k"], x["v"], causal=causal),
                 kind="elementwise")


def test_eager_hrm_update_matches_the_reference():
    ref = pytest.importorskip("lamina.reference.hrm", reason="lamina.reference.hrm not importable")
    x = make_inputs("hrm_update", specs.hrm_shape(16, 32, "fp64"), "cpu")
    args = (x["h"], x["c"], x["gate_logits"])
    kw = {"bias": x["bias"], "norm_weight": x["norm_weight"]}
    assert_close("eager hrm", eager.hrm_update_eager(*args, **kw), ref.hrm_gated_update_ref(*args, **kw),
                 kind="elementwise")


@pytest.mark.parametrize("W", [1, 4])
def test_eager_short_conv_matches_the_reference(W):
    from lamina.reference.short_conv import causal_conv1d_ref

    x = make_inputs("short_conv", specs.conv_shape(2, 9, 6, W, "fp64"), "cpu")
    bias = torch.linspace(-1, 1, 6, dtype=torch.float64)
    for b in (None, bias):
        want = causal_conv1d_ref(x["x"], x["weight"], b, activation="silu")[0]
        assert_close("eager short conv", eager.short_conv_eager(x["x"], x["weight"], b, "silu"), want,
                     kind="elementwise")
