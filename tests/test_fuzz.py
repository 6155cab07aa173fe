"""`lamina fuzz`: cases pass against the references; planted bugs and crashes are found, shrunk,
saved and replayed; the command line, the case drawing and the hypothesis strategies."""

from __future__ import annotations

import functools
import json
import runpy

import pytest
import torch

import lamina
from lamina import fuzz
from lamina.fuzz import runner, space


def _quiet():
    lines: list[str] = []
    return lines, lines.append


# --- clean runs: the normal (PyTorch) and the interpreter (Triton) mode ---------------------------

def test_fuzz_pytorch_mode_passes_and_prints_a_summary(tmp_path):
    lines, log = _quiet()
    # a fixed number of cases (not --seconds): the same cases run however loaded the machine is
    code = fuzz.main(["--cases", "3", "--seed", "0", "--device", "cpu", "--out", str(tmp_path)], log=log)
    assert code == 0, "\n".join(lines)
    assert "\ntotal " in lines[-2] and "cases/min" in lines[-2] and lines[-1].endswith(" s")
    assert "0 failed" in lines[-1] and not list(tmp_path.iterdir())


@pytest.mark.interpret
def test_fuzz_interpret_mode_reaches_the_triton_kernels(tmp_path):
    lines, log = _quiet()
    code = fuzz.main(["--interpret", "--op", "hrm_gated_update", "rms_norm_gated", "causal_conv1d", "--cases", "2",
                      "--seed", "1", "--out", str(tmp_path)], log=log)
    assert code == 0, "\n".join(lines)
    assert any("backend=triton" in line for line in lines if line.startswith("ok")), "\n".join(lines)


# --- planted bugs ----------------------------------------------------------------------------------

class FloorChunkPrep:
    """The chunk preparation kernel launched for floor(T_n / BT) chunks per sequence instead of
    ceil(T_n / BT): a partial last chunk is never prepared (a real off-by-one of a chunk count: the
    result is right whenever every length is a multiple of the chunk size)."""

    def __init__(self, kernel):
        from lamina.kernels._utils import raw_jit

        self.kernel = kernel
        self.at = raw_jit(kernel).arg_names.index("chunk_indices")  # the launcher passes it by position

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            cu_seqlens, indices, T = args[self.at - 1], args[self.at], kwargs["T"]
            seq, within = indices[:, 0].long(), indices[:, 1].long()
            lens = torch.full_like(seq, T) if cu_seqlens is None else (cu_seqlens[1:] - cu_seqlens[:-1]).long()[seq]
            full = indices[(within + 1) * kwargs["BT"] <= lens].contiguous()
            if full.shape[0]:
                self.kernel[(full.shape[0] * kwargs["HV"],)](*args[:self.at], full, *args[self.at + 1:], **kwargs)

        return launch


@pytest.mark.interpret
def test_planted_chunk_count_off_by_one_is_found_and_shrunk(monkeypatch, tmp_path):
    from lamina.kernels import delta_chunk_fwd

    monkeypatch.setattr(delta_chunk_fwd, "_prep_fwd", FloorChunkPrep(delta_chunk_fwd._prep_fwd))
    lines, log = _quiet()
    report = fuzz.run(ops=["chunk_delta_rule"], cases=200, seed=0, backend="triton", grad=False, out=tmp_path,
                      log=log, shrink_seconds=8, max_failures=1)
    assert len(report.failures) == 1 and report.cases <= 200, "\n".join(lines)
    failure = report.failures[0]
    shrunk = failure.shrunk
    T = shrunk["T"] if shrunk["lens"] is None else max(shrunk["lens"])
    assert T <= 2 * shrunk["chunk_size"] and T % shrunk["chunk_size"] != 0, shrunk
    assert failure.kind == "mismatch" and failure.path.exists()
    assert any("reproduce: lamina fuzz --op chunk_delta_rule" in line and "--no-grad" in line for line in lines)


def test_cases_on_the_kernels_run_their_speed_alternatives(monkeypatch, tmp_path):
    """Half the delta-rule cases on lamina's kernels draw one of the chunked kernels' speed alternatives (every
    one comes up), the others none, and a case runs under its own: a defect planted in one alternative alone
    (the first output element negated while ``solve_block=16`` is active) is found, and the shrunk case keeps
    that alternative, since without it the case passes."""
    from lamina.kernels.delta_tuning import ALTERNATIVES, active_tuning

    drawn = [space.draw_case(op, 0, i, backend="triton") for op in space.DELTA_OPS for i in range(40)]
    tunings = [c["tuning"] for c in drawn]
    assert all(t is None or t in [a.choices() for a in ALTERNATIVES] for t in tunings)
    assert 0.35 < sum(t is None for t in tunings) / len(tunings) < 0.65
    assert [a.choices() for a in ALTERNATIVES if a.choices() not in tunings] == []
    assert all("tuning" not in space.draw_case(op, 0, i, backend="torch") for op in space.DELTA_OPS for i in range(4))

    real = lamina.chunk_delta_rule

    def planted(*args, **kwargs):
        kwargs["backend"] = "torch"  # fast: what is checked is that the case's alternative is active
        o, ht = real(*args, **kwargs)
        return (_negate_first_element(lambda: (o, ht))() if active_tuning().solve_block == 16 else (o, ht))

    monkeypatch.setattr(lamina, "chunk_delta_rule", planted)
    lines, log = _quiet()
    report = fuzz.run(ops=["chunk_delta_rule"], cases=400, seed=0, backend="triton", grad=False, out=tmp_path,
                      log=log, shrink_seconds=10, max_failures=1)
    assert len(report.failures) == 1, "\n".join(lines)
    failure = report.failures[0]
    assert failure.original["tuning"] == {"solve_block": 16} == failure.shrunk["tuning"], failure
    assert any("tuning={'solve_block': 16}" in line for line in lines if line.startswith("FAIL")), "\n".join(lines)


def _negate_first_element(real):
    def op(*args, **kwargs):
        o, ht = real(*args, **kwargs)
        sign = torch.ones(o.numel(), dtype=o.dtype, device=o.device)
        sign[0] = -1
        return o * sign.view(o.shape), ht

    return op


def test_planted_flipped_element_is_found_shrunk_saved_and_replayed(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(lamina, "chunk_gated_delta_rule", _negate_first_element(lamina.chunk_gated_delta_rule))
    lines, log = _quiet()
    report = fuzz.run(ops=["chunk_gated_delta_rule"], cases=200, seed=3, backend="torch", out=tmp_path, log=log,
                      shrink_seconds=15, max_failures=1)
    assert len(report.failures) == 1 and report.cases <= 200, "\n".join(lines)
    failure = report.failures[0]
    shrunk = failure.shrunk
    assert shrunk["T"] is not None and shrunk["T"] <= 2 * shrunk["chunk_size"], shrunk
    assert all(shrunk[key] <= failure.original[key] for key in ("B", "H", "ratio", "K", "V")), shrunk
    saved = json.loads(failure.path.read_text())
    assert saved["case"] == shrunk and saved["original"] == failure.original and saved["kind"] == "mismatch"
    # replay: the saved case still fails (exit 1) while the bug is in, the snippet raises the same way
    replay_lines, replay_log = _quiet()
    assert fuzz.main(["--replay", str(failure.path)], log=replay_log) == 1
    assert replay_lines[0].startswith("still fails")
    with pytest.raises(AssertionError, match="^o: "):
        runpy.run_path(str(failure.path.with_suffix(".py")), run_name="__main__")
    monkeypatch.undo()  # bug fixed: the replay passes, the snippet runs clean
    assert fuzz.main(["--replay", str(failure.path)], log=replay_log) == 0
    runpy.run_path(str(failure.path.with_suffix(".py")), run_name="__main__")
    assert "passed: the failure no longer reproduces" in capsys.readouterr().out


def test_crashes_are_reported_shrunk_and_saved(monkeypatch, tmp_path):
    real = lamina.hrm_gated_update

    def crashes_past_three_rows(h, *args, **kwargs):
        if h.shape[0] > 3:
            raise RuntimeError("planted crash")
        return real(h, *args, **kwargs)

    monkeypatch.setattr(lamina, "hrm_gated_update", crashes_past_three_rows)
    lines, log = _quiet()
    code = fuzz.main(["--op", "hrm_gated_update", "--cases", "6", "--seed", "4", "--no-grad", "--out", str(tmp_path),
                      "--shrink-seconds", "10"], log=log)
    text = "\n".join(lines)
    assert code == 1 and "CRASH" in text and "planted crash" in text
    assert "reproduce: lamina fuzz --op hrm_gated_update --seed 4 --index " in text and "--no-grad" in text
    saved = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("hrm_gated_update-*.json"))]
    assert saved and all(s["kind"] == "crash:RuntimeError" and s["case"]["rows"] == 4 for s in saved), saved
    assert (tmp_path / "hrm_gated_update-0.py").exists()


# --- command line, case drawing, shrinking ----------------------------------------------------------

def test_fuzz_rejects_bad_arguments():
    for argv in (["--op", "nope"], ["--cases", "0"], ["--seconds", "0"], ["--dtype", "float8"]):
        with pytest.raises(SystemExit):
            fuzz.main(argv, log=lambda line: None)


def test_iters_is_an_alias_of_cases():
    lines, log = _quiet()
    assert fuzz.main(["--op", "rms_norm_gated", "--iters", "2", "--backend", "torch"], log=log) == 0
    assert "2 passed, 0 failed" in lines[-1]


def test_cases_are_reproducible_and_vary_by_op_and_index():
    a = space.draw_case("chunk_kda", 7, 3)
    assert a == space.draw_case("chunk_kda", 7, 3) and json.loads(json.dumps(a)) == a
    shapes = {tuple(space.draw_case(op, 7, 3)[key] for key in ("H", "ratio", "K", "V"))
              for op in space.DELTA_OPS}
    assert len(shapes) > 1  # variants of one seed and index get different shapes
    assert a != space.draw_case("chunk_kda", 7, 4) != space.draw_case("chunk_kda", 8, 3)


def test_reproducer_names_every_option():
    case = space.draw_case("chunk_gdn2", 5, 9, backend="triton", interpret=True, grad=False)
    line = runner.reproducer(case, "auto", ("float16",), interpret=True)
    for part in ("--op chunk_gdn2", "--seed 5", "--index 9", "--device cpu", "--backend auto", "--interpret",
                 "--dtype float16", "--no-grad"):
        assert part in line


def test_space_covers_the_options():
    drawn = [space.draw_case(op, 0, i) for op in space.DELTA_OPS for i in range(12)]
    for key in ("initial_state", "output_final_state", "l2norm", "gate_in_kernel", "beta_sigmoid",
                "allow_neg_eigval", "state_v_first", "gk", "dt_bias", "resets"):
        assert any(c[key] for c in drawn), key
    assert any(c["resets"] and c["gate_in_kernel"] for c in drawn)  # raw gates of 1e6
    assert any(c["lens"] and 1 in c["lens"] for c in drawn) and any(c["T"] == 1 for c in drawn)
    assert any(c["lens"] and 0 in c["lens"] for c in drawn)  # an empty sequence in the pack
    assert all(sum(c["lens"]) > 0 for c in drawn if c["lens"])
    assert any(c["lower_bound"] is not None for c in drawn) and any(not c["beta"] for c in drawn)
    assert {c.get("chunk_size") for c in drawn} >= {16, 32, 64}
    interp = [space.draw_case(op, 0, i, interpret=True) for op in space.KERNEL_OPS for i in range(4)]
    assert {c["backend"] for c in interp} == {"torch", "triton"}
    assert all(c["dtype"] == "float32" for c in interp if c["backend"] == "torch")


def test_shrinking_keeps_only_changes_that_still_fail():
    case = space.draw_case("causal_conv1d", 1, 0)
    case.update(B=2, T=40, lens=None, D=64, bias=True, residual=True)

    def fails_while_wide(c):
        if c["D"] >= 20 and c["residual"]:
            raise AssertionError("y: planted")

    from lamina.fuzz.shrink import shrink_case
    shrunk, message, steps = shrink_case(case, "mismatch", fails_while_wide, seconds=10)
    assert shrunk["D"] == 20 and shrunk["residual"] and shrunk["T"] == 1 and shrunk["B"] == 1 and not shrunk["bias"]
    assert message == "AssertionError: y: planted" and steps > 0


def test_hypothesis_strategies_draw_runnable_cases():
    hypothesis = pytest.importorskip("hypothesis")
    from lamina._strategies import check_case, delta_rule_cases

    @hypothesis.settings(max_examples=4, deadline=None, derandomize=True)
    @hypothesis.given(delta_rule_cases("fused_recurrent_kda", max_t=12, max_dim=16))
    def check(case):
        assert case["op"] == "fused_recurrent_kda" and case["K"] <= 16 and case["V"] <= 16
        check_case(case)

    check()


@pytest.mark.parametrize("op,mode", [("DeltaNet", "chunk"), ("GatedDeltaNet", "fused_recurrent"),
                                     ("KimiDeltaAttention", "chunk"), ("GatedDeltaNet2", "fused_recurrent")])
def test_layer_baseline_runs_the_naive_ops_and_matches_float64(monkeypatch, op, mode):
    """The float32 baseline of a layer case swaps every delta-rule op for the naive stand-in, which must
    model each option the layer passes: its float32 output is within the table of the float64 layer."""
    import copy

    import lamina.ops.delta_rule as ops
    from lamina.fuzz.common import pytorch_dispatch
    from lamina.fuzz.layers import build_layer, naive_delta_ops
    from lamina.testing import assert_close

    case = {"op": op, "seed": 3, "hidden": 32, "heads": 2, "head_dim": 16, "v_ratio": 2, "mode": mode,
            "short_conv": True, "allow_neg_eigval": True, "use_gate": True, "rotary": False, "kv_heads": 1}
    layer = build_layer(case)
    oracle = copy.deepcopy(layer).double()
    x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(0))
    with pytorch_dispatch():
        y_ref = oracle(x.double())
    y_ref = y_ref[0] if isinstance(y_ref, tuple) else y_ref
    calls = []
    fast = {name: getattr(ops, name) for name in space.DELTA_SPECS}
    for name, fn in fast.items():
        counted = functools.wraps(fn)(lambda *a, _n=name, _f=fn, **k: calls.append(_n) or _f(*a, **k))
        monkeypatch.setattr(ops, name, counted)
    with pytorch_dispatch(), naive_delta_ops():
        y = layer(x)
    y = y[0] if isinstance(y, tuple) else y
    assert calls == []  # the stand-ins ran, not lamina's ops
    assert_close("y", y, y_ref)
    with pytest.raises(ValueError, match="does not model"):
        with naive_delta_ops():
            ops.chunk_gated_delta_rule(x.view(2, 21, 2, 16), x.view(2, 21, 2, 16), x.view(2, 21, 2, 16),
                                       g=x.view(2, 21, 2, 16)[..., 0], beta=None, head_first=True)


def _gradient_times(real, name: str, factor: float):
    """``real`` with the gradient of its argument ``name`` multiplied by ``factor`` (values unchanged)."""
    def op(*args, **kwargs):
        x = kwargs[name]
        kwargs[name] = x * factor - (x * (factor - 1)).detach()
        return real(*args, **kwargs)

    return op


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_kda"])
@pytest.mark.parametrize("name", ["A_log", "dt_bias", "beta"])
def test_gate_parameter_gradients_off_by_a_percent_are_found(monkeypatch, op, name):
    """``A_log``, ``dt_bias`` and ``beta`` are compared at the root-sum-square of their terms
    (``reduction_scale``): the case passes as drawn, and fails on the planted input once its gradient is
    1% off."""
    from lamina.fuzz.delta import check_delta

    case = space.draw_case(op, 7, 0, backend="torch")
    case.update(g=True, gate_in_kernel=True, dt_bias=True, lower_bound=None, gate_strength="moderate", grad=True,
                beta=True)
    check_delta(case)
    monkeypatch.setattr(lamina, op, _gradient_times(getattr(lamina, op), name, 1.01))
    with pytest.raises(AssertionError, match=f"^d{name}: "):
        check_delta(case)


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_kda", "fused_recurrent_gdn2"])
def test_cases_with_resets_pass_and_find_the_missing_floor(monkeypatch, op):
    """A case with ``resets`` has log decays of -inf among its inputs and passes on the PyTorch path; without the
    chunked forms' floor on the log decays it fails (their outputs turn NaN where the token loop's are not)."""
    from lamina.fuzz import delta
    from lamina.fuzz.common import Draw

    case = space.draw_case(op, 7, 0, backend="torch")
    case.update(g=True, gate_in_kernel=False, lower_bound=None, dt_bias=False, gk=False, gate_strength="mild",
                resets=True, H=1, ratio=1, B=2, T=40, lens=None, chunk_size=16, grad=True)
    x = delta._masters(case, Draw(case["seed"]))  # the inputs check_delta draws
    assert torch.isneginf(x["g"]).any() and torch.isfinite(x["g"]).any()
    delta.check_delta(case)
    monkeypatch.setattr("lamina.ops.delta_rule_cpu.LOG_DECAY_FLOOR", float("-inf"))
    with pytest.raises(AssertionError):
        delta.check_delta(case)


@pytest.mark.interpret
@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_kda"])
def test_raw_gates_with_resets_pass_on_the_kernels(op):
    """A case with ``resets`` and ``use_gate_in_kernel`` has raw gates of 1e6 among its inputs (log decays of
    about -1e6 exp(A_log), which the chunked kernels floor) and passes on the Triton kernels, the raw gate's,
    A_log's and dt_bias's gradients included (through the floor none reaches them; before, dA_log carried the
    floored tokens' rounding times 1e6)."""
    from lamina.fuzz import delta
    from lamina.fuzz.common import Draw

    case = space.draw_case(op, 7, 0, backend="triton", interpret=True)
    case.update(g=True, gate_in_kernel=True, lower_bound=None, dt_bias=True, gk=False, gate_strength="moderate",
                resets=True, H=1, ratio=2, B=2, T=40, lens=None, chunk_size=16, grad=True, dtype="float32",
                tuning=None)
    x = delta._masters(case, Draw(case["seed"]))  # the inputs check_delta draws
    assert (x["g"] == 1e6).any() and (x["g"] < 1e6).any()
    delta.check_delta(case)


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_kda"])
@pytest.mark.parametrize("name", ["q", "k"])
def test_shared_query_key_gradients_off_by_three_bounds_are_found(monkeypatch, op, name):
    """With two value heads per q/k head, ``q`` and ``k`` are compared at the RMS of their terms'
    root-sum-squares over the value heads (``reduction_scale(rms=True)``), which without cancellation is
    their own RMS: a float32 case passes as drawn, and fails once the gradient is off by three times the
    table's RMS bound."""
    from lamina.fuzz.delta import check_delta
    from lamina.testing import RECURRENCE_RMS_RATIO

    case = space.draw_case(op, 7, 0, backend="torch")
    case.update(H=2, ratio=2, B=1, T=33, lens=None, grad=True)
    check_delta(case)
    factor = 1 + 3 * RECURRENCE_RMS_RATIO[torch.float32]
    monkeypatch.setattr(lamina, op, _gradient_times(getattr(lamina, op), name, factor))
    with pytest.raises(AssertionError, match=f"^d{name}: RMS error ratio"):
        check_delta(case)


@pytest.mark.parametrize("state_v_first", [False, True])
def test_value_channel_terms_sum_to_each_gradient(state_v_first):
    """``value_channel_term_sizes`` splits the loss by value channel, output and final state alike: for a
    value-side input every element is one channel's, so its scale is its gradient's own RMS; for q (one
    value head) the terms' root-sum-squares are at least the gradient's size."""
    from lamina.fuzz.common import Draw, as_ref, backward
    from lamina.fuzz.delta import _masters, _oracle, value_channel_term_sizes
    from lamina.testing import reduction_scale

    case = space.draw_case("chunk_kda", 7, 0, backend="torch")
    case.update(H=1, ratio=1, B=1, T=5, lens=None, grad=True, initial_state=True, output_final_state=True,
                state_v_first=state_v_first, dtype="float32")
    draw = Draw(case["seed"])
    refs = {n: as_ref(m, True) for n, m in _masters(case, draw).items()}
    o, ht = _oracle(case, refs, None)
    cotangents = [draw.cotangent(o.shape, torch.float64), draw.cotangent(ht.shape, torch.float64)]
    backward([o, ht], cotangents)
    sizes = value_channel_term_sizes(case, refs, None, cotangents)
    scales = {n: reduction_scale(size, size.shape, rms=True) for n, size in sizes.items()}
    for name in ("v", "initial_state"):
        assert scales[name] == pytest.approx(refs[name].grad.pow(2).mean().sqrt().item(), rel=1e-12)
    assert scales["q"] >= refs["q"].grad.pow(2).mean().sqrt().item() * (1 - 1e-12)


def test_key_channel_terms_of_one_token_with_orthogonal_rows():
    """``key_channel_term_sizes`` splits ``<o, do>`` by q's key channels: at one token without an initial
    state ``dv = beta scale (q . k) do``, 0 for q orthogonal to k, and its size is ``|beta scale do|`` times
    the root-sum-square of the terms ``q_c k_c`` (one channel a block at K = 16); the final state's term,
    which does not depend on q, is ``beta k . dht`` per value channel."""
    from lamina.fuzz.common import Draw, as_ref
    from lamina.fuzz.delta import _masters, _oracle, key_channel_term_sizes

    case = space.draw_case("chunk_delta_rule", 7, 0, backend="torch")
    case.update(H=1, ratio=1, B=1, T=1, lens=None, grad=True, initial_state=False, output_final_state=False,
                l2norm=False, beta=True, beta_sigmoid=False, allow_neg_eigval=False, dtype="float32", K=16, V=8)
    draw = Draw(case["seed"])
    refs = {n: None if m is None else as_ref(m, True) for n, m in _masters(case, draw).items()}
    q = torch.zeros(1, 1, 1, 16, dtype=torch.float64)
    k = torch.zeros_like(q)
    q[..., :5] = torch.tensor([1.0, 2.0, -3.0, 0.5, 1.0])
    k[..., :5] = torch.tensor([2.0, 1.0, 1.0, 0.0, -1.0])  # q . k = 2 + 2 - 3 + 0 - 1 = 0
    refs["q"], refs["k"] = as_ref(q, True), as_ref(k, True)
    o, _ = _oracle(case, refs, None)
    do = Draw(1).cotangent(o.shape, torch.float64)
    o.backward(do)
    assert refs["v"].grad.abs().max().item() < 1e-15  # dv = 0 in exact math
    sizes = key_channel_term_sizes(case, refs, None, [do, None])
    beta = refs["beta"].detach()[..., None]
    terms = (q * k).pow(2).sum().sqrt()
    expected = (beta * case["scale"] * do).abs() * terms
    torch.testing.assert_close(sizes["v"], expected, rtol=1e-12, atol=0)

    case["output_final_state"] = True
    dht = Draw(2).cotangent((1, 1, 16, 8), torch.float64)
    with_state = key_channel_term_sizes(case, refs, None, [do, dht])
    state_term = (beta * (k[..., :, None] * dht[:, None, 0]).sum(-2)).abs()
    torch.testing.assert_close(with_state["v"], (expected.pow(2) + state_term.pow(2)).sqrt(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("op", ["fused_recurrent_kda", "chunk_gdn2"])
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_gradients_summed_over_value_channels_off_by_three_bounds_are_found(monkeypatch, op, name):
    """Every gradient is also compared at the RMS of its terms' root-sum-squares over the value channels,
    which without cancellation is about its own RMS: a float32 case passes as drawn, and fails once the
    gradient is off by three times the table's RMS bound."""
    from lamina.fuzz.delta import check_delta
    from lamina.testing import RECURRENCE_RMS_RATIO

    case = space.draw_case(op, 7, 0, backend="torch")
    case.update(H=1, ratio=1, B=1, T=33, lens=None, grad=True, beta=True, dtype="float32")
    check_delta(case)
    factor = 1 + 3 * RECURRENCE_RMS_RATIO[torch.float32]
    monkeypatch.setattr(lamina, op, _gradient_times(getattr(lamina, op), name, factor))
    with pytest.raises(AssertionError, match=f"^d{name}: RMS error ratio"):
        check_delta(case)


def test_output_terms_at_one_token_are_the_key_channel_products():
    """At one token from a zero state DeltaNet's output is ``scale (q . k) beta v``: its terms per key channel
    are ``scale q_c k_c beta v``, whose root-sum-square ``output_term_sizes`` gives."""
    from lamina.fuzz.common import Draw, as_ref
    from lamina.fuzz.delta import _masters, output_term_sizes

    case = space.draw_case("chunk_delta_rule", 7, 0, backend="torch")
    case.update(H=1, ratio=1, B=1, T=1, K=12, lens=None, initial_state=False, beta=True, l2norm=False, scale=0.3,
                dtype="float32")
    r = {n: as_ref(m, False) for n, m in _masters(case, Draw(case["seed"])).items()}
    size = output_term_sizes(case, r, None)
    q, k, v, beta = r["q"][0, 0, 0], r["k"][0, 0, 0], r["v"][0, 0, 0], r["beta"][0, 0, 0]
    want = 0.3 * beta.abs() * v.abs() * (q * k).pow(2).sum().sqrt()
    torch.testing.assert_close(size[0, 0, 0], want, rtol=1e-12, atol=0)


def _outputs_times(real, factor: float):
    """``real`` with its output (the first result) multiplied by ``factor``."""
    def op(*args, **kwargs):
        o, ht = real(*args, **kwargs)
        return o * factor, ht

    return op


@pytest.mark.parametrize("op", ["chunk_kda", "fused_recurrent_gated_delta_rule"])
def test_outputs_off_by_three_bounds_are_found(monkeypatch, op):
    """The output is also compared at the RMS of its terms' root-sum-squares over the key channels
    (``output_term_sizes``), which without cancellation is about its own RMS: a float32 case passes as
    drawn, and fails once the output is off by three times the table's RMS bound."""
    from lamina.fuzz.delta import check_delta
    from lamina.testing import RECURRENCE_RMS_RATIO

    case = space.draw_case(op, 7, 0, backend="torch")
    case.update(H=1, ratio=1, B=1, T=33, lens=None, grad=False, dtype="float32")
    check_delta(case)
    monkeypatch.setattr(lamina, op, _outputs_times(getattr(lamina, op), 1 + 3 * RECURRENCE_RMS_RATIO[torch.float32]))
    with pytest.raises(AssertionError, match="^o: RMS error ratio"):
        check_delta(case)


@pytest.mark.parametrize("op", ["DeltaNet", "GatedDeltaNet", "KimiDeltaAttention", "GatedDeltaNet2"])
def test_layer_outputs_off_by_three_bounds_are_found(monkeypatch, op):
    """A layer's output is also compared at its op's output terms carried through the layer
    (``_output_scale``): a 17-token float32 case passes as drawn, and fails once the output is off by three
    times the table's RMS bound."""
    from lamina.fuzz import layers
    from lamina.testing import RECURRENCE_RMS_RATIO

    case = space.draw_case(op, 7, 0, backend="torch", dtypes=("float32",))
    case.update(B=1, T=17, grad=False)
    layers.check_layer(case)
    real = layers.build_layer
    factor = 1 + 3 * RECURRENCE_RMS_RATIO[torch.float32]

    def planted(c):  # the layer under test only: its float64 and float32 copies keep the hook, unplanted
        layer = real(c)
        proj = layer.o_proj
        proj.register_forward_hook(lambda module, args, out: out * factor if module is proj else out)
        return layer

    monkeypatch.setattr(layers, "build_layer", planted)
    with pytest.raises(AssertionError, match="^y: RMS error ratio"):
        layers.check_layer(case)


@pytest.mark.parametrize("op,name", [("DeltaNet", "q_proj"), ("GatedDeltaNet", "b_proj"),
                                     ("KimiDeltaAttention", "k_proj"), ("GatedDeltaNet2", "b_proj")])
def test_layer_projection_gradients_off_by_three_bounds_are_found(monkeypatch, op, name):
    """A layer's parameters are also compared at the value-channel terms of its op's input gradients carried
    through the layer (``_input_scales``): a 17-token float32 case passes as drawn, and fails once the planted
    projection's weight gradient is off by three times the table's RMS bound."""
    from lamina.fuzz import layers
    from lamina.testing import RECURRENCE_RMS_RATIO

    case = space.draw_case(op, 7, 0, backend="torch", dtypes=("float32",))
    case.update(B=1, T=17, grad=True)
    layers.check_layer(case)
    real = layers.build_layer
    factor = 1 + 3 * RECURRENCE_RMS_RATIO[torch.float32]

    def planted(c):
        layer = real(c)
        getattr(layer, name).weight.register_hook(lambda g: g * factor)
        return layer

    monkeypatch.setattr(layers, "build_layer", planted)
    with pytest.raises(AssertionError, match=f"^d{name}.weight: RMS error ratio"):
        layers.check_layer(case)


@pytest.mark.parametrize("op,name", [("GatedDeltaNet", "a_proj.weight"), ("KimiDeltaAttention", "f_proj.1.weight")])
def test_layer_gate_projection_gradients_off_by_three_bounds_of_their_terms_are_found(monkeypatch, op, name):
    """The projection a layer forms its gate input from is compared at its terms carried through the layer,
    the log decay's among them (``decay_input_term_sizes``), which are larger than its own RMS at 17 tokens
    (a_proj 2.98 against 0.82, f_proj.1 0.17 against 0.08): a float32 case passes as drawn, and fails once
    the gradient is off by three times the table's RMS bound at that size."""
    import copy

    from lamina.fuzz import layers
    from lamina.fuzz.common import Draw
    from lamina.testing import RECURRENCE_RMS_RATIO

    case = space.draw_case(op, 7, 0, backend="torch", dtypes=("float32",))
    case.update(B=1, T=17, grad=True)
    layers.check_layer(case)
    draw = Draw(case["seed"])  # check_layer's input and cotangent, and its float64 copy of the layer
    oracle = layers.build_layer(case).double()
    x = draw.randn(case["B"], case["T"], case["hidden"])
    with layers.pytorch_dispatch():
        y = layers._forward(copy.deepcopy(oracle), x)
    dy = draw.cotangent(y.shape, torch.float32)
    floor = layers._scales(oracle, x, dy)[name]
    with layers.pytorch_dispatch():
        layers._forward(oracle, x).backward(dy)
    rms = dict(oracle.named_parameters())[name].grad.pow(2).mean().sqrt().item()
    assert floor > rms
    factor = 1 + 3 * RECURRENCE_RMS_RATIO[torch.float32] * floor / rms
    real = layers.build_layer

    def planted(c):
        layer = real(c)
        dict(layer.named_parameters())[name].register_hook(lambda g: g * factor)
        return layer

    monkeypatch.setattr(layers, "build_layer", planted)
    with pytest.raises(AssertionError, match=f"^d{name}: RMS error ratio"):
        layers.check_layer(case)


@pytest.mark.parametrize("op,gate_in_kernel", [("chunk_gated_delta_rule", False), ("chunk_kda", False),
                                               ("chunk_kda", True), ("fused_recurrent_gated_delta_rule", True)])
def test_decay_gradients_off_by_three_bounds_are_found(monkeypatch, op, gate_in_kernel):
    """The log decay's inputs are compared at no less than the size of the terms the chunked backward sums
    into their gradients (``q dq`` and ``k dk``), which is below their own RMS past one token: a float32
    case passes as drawn, and fails once ``dg`` is off by three times the table's RMS bound."""
    from lamina.fuzz.delta import check_delta
    from lamina.testing import RECURRENCE_RMS_RATIO

    case = space.draw_case(op, 7, 0, backend="torch")
    case.update(H=2, ratio=2, B=1, T=33, lens=None, grad=True, g=True, gk=False, gate_in_kernel=gate_in_kernel,
                dt_bias=gate_in_kernel, lower_bound=None, gate_strength="moderate")
    check_delta(case)
    factor = 1 + 3 * RECURRENCE_RMS_RATIO[torch.float32]
    monkeypatch.setattr(lamina, op, _gradient_times(getattr(lamina, op), "g", factor))
    with pytest.raises(AssertionError, match="^dg: RMS error ratio"):
        check_delta(case)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_attention_gradients_ten_parts_per_million_off_are_found(monkeypatch, name):
    """float32 attention's floor grows with the scores' size (the backward's probabilities are formed again
    from the forward's log-sum-exp) and PyTorch's error is also taken from a plain float32 form of the
    kernels' backward: a case passes as drawn, and fails once one gradient is 1e-5 off."""
    from lamina.fuzz.checks import check_attention

    case = space.draw_case("prism_attention", 7, 0, backend="torch")
    case.update(dtype="float32", grad=True, HKV=2, group=2, D=64, B=1, T=24, S=24, lens_q=None, lens_k=None,
                causal=True, scale=None)
    check_attention(case)
    real, index = lamina.prism_attention, "qkv".index(name)

    def planted(*args, **kwargs):
        args = list(args)
        args[index] = args[index] * 1.00001 - (args[index] * 0.00001).detach()
        return real(*args, **kwargs)

    monkeypatch.setattr(lamina, "prism_attention", planted)
    with pytest.raises(AssertionError, match=f"^d{name}: max error"):
        check_attention(case)


@pytest.mark.interpret
@pytest.mark.parametrize("op", ["KimiDeltaAttention", "GatedDeltaNet2"])
@pytest.mark.parametrize("name", ["A_log", "dt_bias"])
def test_layer_gate_parameter_gradients_off_by_three_bounds_are_found(monkeypatch, op, name):
    """The layers' gate parameters are also compared at the size of the terms the op's chunked backward sums
    into ``dg`` (and GatedDeltaNet2's, formed in the layer, at its gate's terms): a 17-token float32 case
    passes as drawn, and fails once the planted parameter's gradient is off by three times the RMS bound."""
    from lamina.fuzz import layers
    from lamina.testing import RECURRENCE_RMS_RATIO

    case = space.draw_case(op, 7, 0, backend="triton", interpret=True, dtypes=("float32",))
    case.update(B=1, T=17, mode="chunk")
    layers.check_layer(case)
    real = layers.build_layer
    factor = 1 + 3 * RECURRENCE_RMS_RATIO[torch.float32]

    def planted(c):
        layer = real(c)
        getattr(layer, name).register_hook(lambda g: g * factor)
        return layer

    monkeypatch.setattr(layers, "build_layer", planted)
    with pytest.raises(AssertionError, match=f"^d{name}: "):
        layers.check_layer(case)
