"""`lamina bench` end to end on the CPU: --quick, --op for every op, providers, summary and plot."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from lamina.bench import specs
from lamina.bench.cli import main
from lamina.bench.results import read_results

FIXTURE = Path(__file__).parent / "data" / "bench_results_fixture.jsonl"
# One thread: the test workers share two cores, and oversubscribed OpenMP barriers make CPU timings erratic.
FAST = ["--threads", "1", "--cpu-min-run-s", "0.02"]


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    monkeypatch.setenv("LAMINA_BENCH_PLAIN", "1")
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _ok_rows(text: str) -> list[list[str]]:
    """Table rows (split on runs of 2+ spaces) whose 'ms' column is a number."""
    rows = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]
    return [r for r in rows if len(r) >= 10 and re.fullmatch(r"[0-9.]+", r[4])]


def test_quick_prints_a_comparison_table_with_ratios(tmp_path, capsys):
    out = tmp_path / "quick.jsonl"
    rc = main(["--quick", "--device", "cpu", "--shapes", "tiny", "--out", str(out), *FAST])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = _ok_rows(text)
    providers = {r[3] for r in rows}
    assert len(providers) >= 3, f"fewer than three providers ran: {providers}\n{text}"
    assert {"reference", "torch-eager"} <= providers
    assert any(re.search(r"[0-9.e+-]+x vs reference", r[9]) for r in rows), text
    assert {r[0] for r in rows} >= {"delta_rule", "prism_attention", "hrm_update"}
    assert "ceilings (cpu)" in text
    recs = read_results([out])
    results = [r for r in recs if r["kind"] == "result"]
    assert results and all(r["env"]["torch"] == torch.__version__ for r in results)
    assert any(r["kind"] == "ceiling" for r in recs)
    assert all(r["mode"] == "fwd" for r in results)
    # every provider planned for the CPU is accounted for: timed, or skipped with a reason
    assert all(r["status"] == "ok" or r["reason"] for r in results)


@pytest.mark.parametrize("op", [op for op in specs.OPS if op not in specs.LAYER_OPS])
def test_each_op_runs_on_cpu(op, capsys):
    rc = main(["--op", op, "--device", "cpu", "--shapes", "tiny", "--mode", "fwd", "--no-ceilings", "--no-save",
               "--exclude", "torch-compile", *FAST])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = _ok_rows(text)
    assert rows and {r[0] for r in rows} == {op}
    assert "reference" in {r[3] for r in rows}


def test_each_mode_of_an_op(tmp_path, capsys):
    out = tmp_path / "modes.jsonl"
    rc = main(["--op", "hrm_update", "--device", "cpu", "--shapes", "tiny", "--no-ceilings", "--out", str(out),
               "--provider", "torch-eager,reference", *FAST])
    assert rc == 0, capsys.readouterr().out
    recs = [r for r in read_results([out]) if r["kind"] == "result"]
    assert sorted({r["mode"] for r in recs}) == sorted(specs.MODES)
    assert all(r["status"] == "ok" for r in recs)
    by_mode = {r["mode"]: r for r in recs if r["provider"] == "reference"}
    assert by_mode["fwd+bwd"]["flops"] == pytest.approx(by_mode["fwd"]["flops"] + by_mode["bwd"]["flops"])


def test_layers_group_runs_every_layer_on_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # lamina's PyTorch path, as on a user's CPU
    out = tmp_path / "layers.jsonl"
    rc = main(["--op", "layers", "--device", "cpu", "--shapes", "tiny", "--no-ceilings", "--out", str(out), *FAST])
    text = capsys.readouterr().out
    assert rc == 0, text
    recs = [r for r in read_results([out]) if r["kind"] == "result"]
    ok = [r for r in recs if r["status"] == "ok"]
    assert {(r["op"], r["mode"]) for r in ok} == {(op, m) for op in specs.LAYER_OPS for m in ("fwd", "fwd+bwd")}
    assert {r["provider"] for r in ok} == {"lamina-torch"}
    for r in ok:
        assert r["flops"] == specs.get_op(r["op"]).flops(r["params"], r["mode"]) and r["ms"] > 0
    fla = [r for r in recs if r["provider"] == "fla"]
    assert len(fla) == 8 and all(r["status"] == "skipped" and "need a GPU" in r["reason"] for r in fla)
    assert {r["provider"] for r in recs} == {"lamina-torch", "lamina-triton", "fla"}  # no kernel baselines
    assert {r[0] for r in _ok_rows(text)} == set(specs.LAYER_OPS)


def test_providers_subcommand_lists_skips_with_reasons(capsys):
    assert main(["providers", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"lamina-triton\s+skipped: lamina-triton runs on cuda, not cpu", text)
    assert re.search(r"flash-attn\s+skipped: .*cuda", text)
    assert re.search(r"torch-eager\s+available", text)


def test_bad_arguments_exit_2_with_a_sentence(capsys):
    assert main(["--provider", "flash"]) == 2
    err = capsys.readouterr().err
    assert "unknown provider 'flash'" in err and "flash-attn" in err
    assert main(["--op", "attention"]) == 2
    err = capsys.readouterr().err
    assert "unknown op 'attention'" in err and "layers" in err
    if not torch.cuda.is_available():
        assert main(["--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_summary_of_the_fixture(capsys):
    assert main(["summary", str(FIXTURE)]) == 0
    text = capsys.readouterr().out
    assert "fixture (synthetic numbers)" in text
    assert "1.45x vs fla" in text  # 1.60 ms / 1.10 ms
    assert "skipped: sdpa-flash (1 case): fixture: not run" in text


def test_plot_renders_non_trivial_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e .[bench])")
    import matplotlib.image
    import numpy as np

    assert main(["plot", str(FIXTURE), "--outdir", str(tmp_path)]) == 0
    pngs = sorted(tmp_path.glob("*.png"))
    names = {p.name for p in pngs}
    assert {"gated_delta_rule-fwd-cuda-speedup.png", "prism_attention-fwd-cuda-roofline.png"} <= names
    for png in pngs:
        assert png.stat().st_size > 5000, png
        pixels = matplotlib.image.imread(png)
        assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 300
        assert float(np.std(pixels)) > 0.05, f"{png.name} is nearly blank"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(FIXTURE)]) == 2
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and "pip install" in err


def test_pytest_benchmark_suite_plans_the_quick_cases_of_lamina_bench(monkeypatch):
    """benchmarks/test_bench_suite.py's quick-* tests are the cases `lamina bench --quick` plans."""
    import runpy
    from pathlib import Path

    from lamina.bench import cli, suite

    seen = {}

    def fake_run_suite(cfg, writer=None, progress=None, on_start=None):
        seen["tasks"] = suite.plan(cfg)
        return [], None

    monkeypatch.setattr(suite, "run_suite", fake_run_suite)
    monkeypatch.setattr(cli, "_warn_if_oversubscribed", lambda device: None)
    module = runpy.run_path(str(Path(__file__).parents[1] / "benchmarks" / "test_bench_suite.py"))
    assert cli.main(["--quick", "--no-save", "--no-ceilings", "--device", module["DEVICE"]]) == 0
    quick = [task for kind, task in module["CASES"] if kind == "quick"]
    assert [module["case_id"]("quick", t) for t in quick] == [module["case_id"]("quick", t) for t in seen["tasks"]]
    assert quick and all(module["case_id"]("quick", t).startswith("quick-") for t in quick)
