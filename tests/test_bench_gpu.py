"""The benchmark harness on a CUDA device (run by the device check; skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from lamina.bench.ceilings import measure_ceilings
from lamina.bench.suite import SuiteConfig, run_suite
from lamina.bench.timing import TimingConfig

pytestmark = pytest.mark.gpu
QUICK = TimingConfig(warmup_ms=5, rep_ms=10)
# The harness's own providers: an error from one of these is a bug of the suite, not of an op.
HARNESS_PROVIDERS = ["sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "torch-eager", "reference"]


def test_ceilings_on_the_gpu_are_plausible():
    c = measure_ceilings("cuda")
    # H200: about 4300 GB/s copy and 790 TFLOP/s bf16; any current GPU is within these bounds.
    assert 100 < c.copy_gbps < 20000
    assert 5 < c.matmul_tflops < 5000
    assert c.matmul_dtype == "bf16"


def test_suite_runs_every_op_on_the_gpu_with_do_bench():
    cfg = SuiteConfig(device="cuda", ops=["gated_delta_rule", "prism_attention", "hrm_update", "gdn_decode",
                                          "attention_decode", "short_conv"],
                      providers=[*HARNESS_PROVIDERS, "lamina-triton", "fla"], shape_set="tiny",
                      timing=QUICK, tiny_ceilings=True)
    records, ceilings = run_suite(cfg)
    assert ceilings is not None and ceilings.device == "cuda"
    harness = [r for r in records if r["provider"] in HARNESS_PROVIDERS]
    errors = [(r["provider"], r["op"], r["mode"], r["reason"]) for r in harness if r["status"] == "error"]
    assert not errors, errors
    timed = [r for r in records if r["status"] == "ok"]
    assert timed and all(r["timer"] in ("do_bench", "single calls") for r in timed)
    assert all(r["ms_p20"] <= r["ms"] <= r["ms_p80"] for r in timed)
    assert all(r["roofline_frac"] is not None for r in timed)


def test_fla_hopper_guard_is_a_skip():
    pytest.importorskip("fla", reason="fla-core is not installed (carry its wheel in wheels/)")
    import triton

    version = tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3])
    hopper = torch.cuda.get_device_capability() == (9, 0)
    # fla's guard: Hopper with Triton >= 3.4.0 and < 3.7.1 (fla issue #640).
    if not (hopper and (3, 4, 0) <= version < (3, 7, 1)):
        pytest.skip("fla's chunk backward runs on this GPU/Triton; its refusal cannot be observed here")
    cfg = SuiteConfig(device="cuda", ops=["gated_delta_rule"], providers=["fla"], shape_set="tiny", modes=["bwd"],
                      timing=QUICK, measure_ceilings=False)
    records, _ = run_suite(cfg)
    assert records and all(r["status"] in ("skipped", "ok") for r in records), records
    refused = [r for r in records if r["status"] == "skipped"]
    assert all("#640" in r["reason"] for r in refused)
