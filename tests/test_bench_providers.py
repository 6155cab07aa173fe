"""The provider registry: exact names, skip reasons, and failures recorded instead of raised."""

from __future__ import annotations

import sys

import pytest
import torch

from lamina.bench import eager, specs
from lamina.bench.providers import PROVIDERS, ProviderSkip, availability, get_provider, output_of
from lamina.bench.suite import PROVIDER_ORDER, SuiteConfig, classify, plan, run_suite
from lamina.bench.timing import TimingConfig
from tests.tolerances import assert_close

ISSUE_NAMES = {"lamina-triton", "lamina-cuda", "lamina-torch", "lamina-cpu-ext", "fla", "flash-attn", "sdpa-flash",
               "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "torch-eager", "torch-compile", "reference",
               # fla's CPU forms, the baselines of lamina's PyTorch path
               "fla-naive-chunk", "fla-naive-recurrent"}
FAST = TimingConfig(cpu_min_run_s=0.01, slow_call_s=5.0)


def test_registry_holds_exactly_the_issue_providers():
    assert set(PROVIDERS) == ISSUE_NAMES
    assert set(PROVIDER_ORDER) == ISSUE_NAMES


def test_lookup_is_by_exact_name():
    assert get_provider("lamina-torch").name == "lamina-torch"
    with pytest.raises(ValueError, match="unknown provider 'Lamina-Torch'; known providers: lamina-triton"):
        get_provider("Lamina-Torch")
    with pytest.raises(ValueError, match="unknown provider"):
        plan(SuiteConfig(device="cpu", ops=["kda"], providers=["fla2"], shape_set="tiny"))


def test_cpu_skips_come_with_reasons():
    reasons = {(name, op): why for name, op, why in availability("cpu")}
    assert "cuda" in reasons[("lamina-triton", "kda")]
    assert "cuda" in reasons[("fla", "gated_delta_rule")]
    assert "cuda" in reasons[("sdpa-cudnn", "prism_attention")]
    assert "attention provider" in reasons[("flash-attn", "kda")]
    assert "token loop" in reasons[("torch-compile", "kda")]
    assert reasons[("torch-eager", "kda")] is None
    assert reasons[("sdpa-math", "prism_attention")] is None
    # every skip is a non-empty sentence
    assert all(why is None or len(why) > 10 for why in reasons.values())


def test_layer_ops_on_cpu_run_lamina_only_and_say_why_not_the_others(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reasons = {(name, op): why for name, op, why in availability("cpu", list(specs.LAYER_OPS))}
    for op in specs.LAYER_OPS:
        assert reasons[("lamina-torch", op)] is None
        assert "cuda" in reasons[("fla", op)] and "need a GPU" in reasons[("fla", op)]
        assert "cuda" in reasons[("lamina-triton", op)]
        assert "kernel-op baseline" in reasons[("reference", op)]
    # the layer takes no backend: on CUDA it runs the Triton kernels (lamina-triton), on the CPU the
    # PyTorch path unless the interpreter is on
    assert "lamina-triton" in get_provider("lamina-torch").skip_reason("layer_kda", "cuda")
    assert get_provider("lamina-triton").skip_reason("layer_kda", "cuda") is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET=1" in get_provider("lamina-torch").skip_reason("layer_kda", "cpu")
    tasks = plan(SuiteConfig(device="cuda", ops=list(specs.LAYER_OPS), providers=list(PROVIDERS),
                             shape_set="standard"))
    assert {t.provider for t in tasks} == {"lamina-triton", "lamina-torch", "fla"}
    assert len(tasks) == 4 * 2 * 2 * 3  # ops x modes (fwd, fwd+bwd) x shapes x providers


def test_layer_sides_load_the_same_weights_from_fla(monkeypatch):
    pytest.importorskip("fla.layers", reason="flash-linear-attention is not installed")
    import torch

    from lamina.bench import layers

    calls = []
    real = layers._construct
    monkeypatch.setattr(layers, "_construct", lambda side, op, p: calls.append(side) or real(side, op, p))
    p = specs.shapes_for("layer_kda", "tiny")[0]
    layers.clear()
    # as on CUDA: fla's layer provides the weights (its layer builds on the CPU; only its kernels need a GPU)
    ours = layers.build_layer("lamina", "layer_kda", p, "cpu", torch.float64, weights_from_fla=True)
    assert calls == ["lamina", "fla"]  # lamina's layer, then fla's for the weights
    theirs = layers.build_layer("fla", "layer_kda", p, "cpu", torch.float64, weights_from_fla=True)
    assert type(ours).__module__.startswith("lamina.") and type(theirs).__module__.startswith("fla.")
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == torch.float64 for k in a)
    assert layers.build_layer("lamina", "layer_kda", p, "cpu", torch.float64, True) is ours  # kept for the next mode
    # on the CPU by default, and without fla's layers: lamina's own under the same seed (the same values)
    for missing in (False, True):
        if missing:
            monkeypatch.setitem(sys.modules, "fla.layers", None)
        layers.clear()
        calls.clear()
        again = layers.build_layer("lamina", "layer_kda", p, "cpu", torch.float64, weights_from_fla=missing)
        assert calls == (["lamina", "fla", "lamina"] if missing else ["lamina", "lamina"])
        assert all(torch.equal(again.state_dict()[k], a[k]) for k in a)
    layers.clear()


def test_an_op_module_that_fails_to_import_is_a_skip_with_its_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "lamina.ops.hrm_update", None)
    why = get_provider("lamina-torch").skip_reason("hrm_update", "cpu")
    assert why is not None and "cannot import lamina.ops.hrm_update" in why


def test_the_suite_records_a_failed_import_as_skipped_and_goes_on(monkeypatch):
    monkeypatch.setitem(sys.modules, "lamina.ops.hrm_update", None)
    cfg = SuiteConfig(device="cpu", ops=["hrm_update"], providers=["lamina-torch", "torch-eager", "reference"],
                      shape_set="tiny", modes=["fwd"], timing=FAST, measure_ceilings=False)
    records, ceilings = run_suite(cfg)
    by = {r["provider"]: r for r in records}
    assert ceilings is None
    assert by["lamina-torch"]["status"] == "skipped"
    assert "cannot import lamina.ops.hrm_update" in by["lamina-torch"]["reason"]
    assert by["torch-eager"]["status"] == "ok" and by["torch-eager"]["ms"] > 0
    assert by["reference"]["status"] == "ok"


def test_a_provider_that_raises_is_recorded_as_an_error(monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(eager, "hrm_update_eager", broken)
    cfg = SuiteConfig(device="cpu", ops=["hrm_update"], providers=["torch-eager", "reference"], shape_set="tiny",
                      modes=["fwd", "bwd"], timing=FAST, measure_ceilings=False)
    records, _ = run_suite(cfg)
    eager_recs = [r for r in records if r["provider"] == "torch-eager"]
    assert [r["status"] for r in eager_recs] == ["error", "error"]
    assert "ZeroDivisionError: boom" in eager_recs[0]["reason"]
    assert all(r["status"] == "ok" for r in records if r["provider"] == "reference")


def test_classify_known_refusals():
    status, why = classify(RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs ... (see #640). Upgrade"), [])
    assert status == "skipped" and "#640" in why
    status, why = classify(RuntimeError("No viable backend for scaled_dot_product_attention was found."),
                           ["Flash attention requires head dim <= 256\nmore"])
    assert status == "skipped" and "head dim <= 256" in why
    assert classify(ValueError("op: backend='cuda' is not available for this op"), [])[0] == "skipped"
    assert classify(ProviderSkip("not here"), []) == ("skipped", "not here")
    assert classify(ImportError("no module x"), [])[0] == "skipped"
    assert classify(ZeroDivisionError("x"), [])[0] == "error"
    assert classify(ValueError("q must have 4 dimensions"), [])[0] == "error"


def test_case_limits_skip_oversized_token_loops_and_flash_attn_head_dims():
    big = specs.delta_shape(4, 2048, 16, 128, "bf16")
    why = get_provider("reference").skip_reason("kda", "cuda", big)
    assert why is not None and "TOKEN_LOOP_MAX_WORK" in why
    small = specs.delta_shape(8, 1024, 8, 64, "bf16")
    assert get_provider("torch-eager").skip_reason("kda", "cuda", small) is None
    # the short convolution's reference loops over tokens; its eager form does not
    conv = specs.conv_shape(2, 1024, 512, 4, "fp32")
    why = get_provider("reference").skip_reason("short_conv", "cpu", conv)
    assert why is not None and "CONV_TOKEN_LOOP_MAX_TOKENS" in why
    assert get_provider("torch-eager").skip_reason("short_conv", "cpu", conv) is None
    assert get_provider("reference").skip_reason("short_conv", "cpu", specs.conv_shape(1, 32, 64, 4, "fp32")) is None
    # flash-attn's head-dim limit: checked on the case, after the install check
    from lamina.bench.providers import _flash_attn_limit

    assert "up to 256" in _flash_attn_limit("prism_attention", specs.attn_shape(4, 4096, 8, 320, "bf16"), "cuda")
    assert _flash_attn_limit("prism_attention", specs.attn_shape(4, 4096, 20, 128, "bf16"), "cuda") is None


def test_time_budget_cut_is_recorded_not_dropped():
    cfg = SuiteConfig(device="cpu", ops=["hrm_update", "gdn_decode"], providers=["torch-eager", "reference"],
                      shape_set="tiny", modes=["fwd"], timing=FAST, time_budget_s=0.0, measure_ceilings=False)
    records, _ = run_suite(cfg)
    assert len(records) == len(plan(cfg)) == 4
    assert all(r["status"] == "skipped" and "time budget" in r["reason"] for r in records)


def test_sdpa_provider_runs_in_its_own_layout_with_its_own_leaves():
    p = specs.attn_shape(1, 16, 2, 8, "fp32")
    from lamina.bench.inputs import make_inputs

    x = make_inputs("prism_attention", p, "cpu", requires_grad=True)
    bound = get_provider("sdpa-math").bind("prism_attention", p, x)
    out = bound.fn()
    assert out.shape == (1, 2, 16, 8)
    out.sum().backward()
    assert all(leaf.grad is not None for leaf in bound.leaves)
    assert x["q"].grad is None  # the canonical inputs are not its leaves
    ref = eager.attention_eager(x["q"].detach(), x["k"].detach(), x["v"].detach(), causal=True)
    assert_close("sdpa-math vs torch-eager", out.detach().transpose(1, 2), ref, kind="elementwise")


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("op", list(specs.DELTA_OPS))
def test_fla_naive_providers_compute_what_lamina_computes(op, form):
    """fla's naive forms, called in each one's own argument order and layout, give lamina's PyTorch path's
    output and input gradients (a gate passed in the wrong place would not)."""
    p = specs.delta_shape(1, 64, 2, 16, "fp32")
    from lamina.bench.inputs import make_inputs

    x = make_inputs(op, p, "cpu", requires_grad=True)
    name = f"fla-naive-{form}"
    assert get_provider(name).skip_reason(op, "cpu", p) is None
    bound = get_provider(name).bind(op, p, x)
    out = output_of(bound.fn())
    leaves = bound.leaves or [t for t in x.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(out.sum(), leaves)
    ref_x = make_inputs(op, p, "cpu", requires_grad=True)
    ref = output_of(get_provider("lamina-torch").bind(op, p, ref_x).fn())
    ref_leaves = [ref_x[n] for n in ("q", "k", "v", *specs.DELTA_GATES[op])]
    ref_grads = torch.autograd.grad(ref.sum(), ref_leaves)
    head_first = op == "delta_rule"  # its leaves are [B, H, T, ...]
    if head_first:
        out, grads = out.transpose(1, 2), [g.transpose(1, 2) for g in grads]
    assert_close(f"{name} {op}: o", out, ref.detach())
    for leaf, grad, want in zip(("q", "k", "v", *specs.DELTA_GATES[op]), grads, ref_grads):
        assert_close(f"{name} {op}: d{leaf}", grad, want, scale=want.abs().max().item() + 1e-6)


def test_fla_naive_providers_say_why_they_skip():
    packed = specs.delta_shape(0, 0, 2, 16, "fp32", seqlens=(24, 40))
    assert "cu_seqlens" in get_provider("fla-naive-chunk").skip_reason("kda", "cpu", packed)
    gva = specs.delta_shape(1, 64, 2, 16, "fp32", HV=4)
    assert "value heads" in get_provider("fla-naive-recurrent").skip_reason("gdn2", "cpu", gva)
    odd = specs.delta_shape(1, 100, 2, 16, "fp32")
    assert "divisible by 32" in get_provider("fla-naive-chunk").skip_reason("delta_rule", "cpu", odd)
    assert "divisible by 64" in get_provider("fla-naive-chunk").skip_reason("kda", "cpu", odd)
    assert get_provider("fla-naive-chunk").skip_reason("gdn2", "cpu", odd) is None  # it pads
    assert "TOKEN_LOOP_MAX_WORK" in get_provider("fla-naive-recurrent").skip_reason(
        "kda", "cuda", specs.delta_shape(4, 2048, 16, 128, "bf16"))
    assert "delta-rule family" in get_provider("fla-naive-chunk").skip_reason("prism_attention", "cpu")
