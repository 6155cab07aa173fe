"""benchmarks/device_check.sh: syntax, and a DRY_RUN=1 pass on the CPU that checks what it writes."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lamina.bench import specs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
# Files the device tool brings back (at most 8, no deeper than two folders).
EXPECTED = ("summary.txt", "setup.log", "pytest_gpu.log", "bench.jsonl", "bench.log", "info_kernels.log",
            "sanitizer.log")
CASES = ROOT / "benchmarks" / "sanitizer_cases.py"
# Stands in for compute-sanitizer in the dry run: checks the options the script passes, runs the program
# (the sanitizer cases on the CPU) and ends with the tool's summary line, as the real tool does; for
# UNSUPPORTED_TOOL it fails as the real tool does on gVisor machines ("Device not supported").
FAKE_SANITIZER = """#!/usr/bin/env bash
[ "$1" = "--tool" ] && [ "$3" = "--error-exitcode" ] && [ "$4" = "1" ] || { echo "bad options: $*"; exit 2; }
[ "${PYTORCH_NO_CUDA_MEMORY_CACHING:-}" = "1" ] || { echo "the caching allocator hides overruns"; exit 3; }
tool=$2
shift 4
echo "========= COMPUTE-SANITIZER ($tool)"
[ "$tool" = "${UNSUPPORTED_TOOL:-}" ] && { echo "========= Error: Device not supported"; exit 1; }
"$@"
rc=$?
echo "========= ERROR SUMMARY: 0 errors"
[ "$rc" -eq 0 ] || exit 1
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")


def _stand_in(tmp_path, text: str) -> str:
    path = tmp_path / "compute-sanitizer"
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def _cases_module():
    spec = importlib.util.spec_from_file_location("sanitizer_cases", CASES)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sanitizer_cases", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _steps(summary: str) -> list[str]:
    return summary.split("=== steps", 1)[1].splitlines()


def _cheap_run(tmp_path, timeout=120, **extra):
    """A dry run with every step but the sanitizer's left out or cut to nothing (the benchmark: a 1 s limit)."""
    out = tmp_path / "device_out"
    env = {**os.environ, "OUT": str(out), "DRY_RUN": "1", "PYTHON": sys.executable, "SKIP_PYTEST": "1",
           "SKIP_INFO": "1", "BENCH_TIMEOUT": "1", "LAMINA_BENCH_PLAIN": "1", **extra}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, (out / "summary.txt").read_text()


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_writes_every_file_and_ends_with_the_summary(tmp_path):
    out = tmp_path / "device_out"
    env = {
        **os.environ,
        "OUT": str(out),
        "DRY_RUN": "1",
        "PYTHON": sys.executable,
        # keep the CI pass short: one small test file, two ops, the layers forward only
        "PYTEST_ARGS": "-m gpu -q -p no:cacheprovider tests/test_bench_gpu.py",
        "BENCH_ARGS": "--device cpu --shapes tiny --mode fwd --op hrm_update,delta_rule "
                      "--exclude torch-compile --threads 1 --cpu-min-run-s 0.02",
        "BENCH_LAYERS_TIMEOUT": "60",
        "LAYERS_BENCH_ARGS": "--device cpu --shapes tiny --mode fwd --threads 1 --cpu-min-run-s 0.02",
        # the decode and generation steps get 40 s each: their cases are cut to fit well inside it on a loaded
        # machine (one batch size, a short prompt and few new tokens)
        "BENCH_DECODE_TIMEOUT": "40",
        "DECODE_BENCH_ARGS": "--device cpu --threads 1 --cpu-min-run-s 0.02",
        "GENERATION_BENCH_ARGS": "--device cpu --threads 1 --batch-sizes 1 --prompt-len 8 --new-tokens 4",
        # the kernel report's step, cut to one kernel's configurations (the whole report is the static report
        # tests' and CI's)
        "INFO_ARGS": "--kernels --arch 90 --filter _rms_norm_fwd_kernel",
        "LAMINA_BENCH_PLAIN": "1",
        # the attention / HRM sweep's dry run (tiny CPU shapes): its records join bench.jsonl, its table bench.log
        "SWEEP_TIMEOUT": "90",
        "TMPDIR": str(tmp_path),
    }
    env.pop("TRITON_INTERPRET", None)
    env.pop("SANITIZER", None)
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(p.name for p in out.iterdir())
    assert set(EXPECTED) <= set(files) and len(files) <= 8, files
    summary = (out / "summary.txt").read_text()
    assert proc.stdout.rstrip().endswith(summary.rstrip().splitlines()[-1])  # the last lines are the summary
    steps = _steps(summary)
    for step, status in (("install", "ok"), ("fla_import", "skipped ("), ("build_cuda", "skipped (DRY_RUN"),
                         ("pytest_gpu", "ok"), ("sanitizer", "ok"), ("bench ", "ok"), ("bench_layers", "ok"),
                         ("bench_decode", "ok"), ("bench_generation", "ok"), ("sweep", "ok"), ("info_kernels", "ok")):
        assert any(line.startswith(step) and status in line for line in steps), (step, steps)
    from lamina._optional import compiled_extension

    cases = _cases_module()
    # the dry run's cases; those of the C++ kernels are skipped, with the reason, where lamina._C is not built
    n_ext = sum(any(k.startswith(cases.EXT) for k in c.kernels) for c in cases.CASES if c.name in cases.QUICK)
    n_skip = 0 if compiled_extension() is not None else n_ext
    assert (f"no sanitizer: sanitizer cases: {len(cases.QUICK) - n_skip} ok, 0 failed, {n_skip} skipped"
            in summary), summary
    log = (out / "sanitizer.log").read_text()
    assert all(f"{name} " in log for name in cases.QUICK), log
    records = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "ceiling" for r in records)
    ok = [r for r in records if r["kind"] == "result" and r["status"] == "ok"]
    assert {r["op"] for r in ok} >= {"hrm_update", "delta_rule", *specs.LAYER_OPS}
    assert {r["provider"] for r in ok if r["op"] in specs.LAYER_OPS} == {"lamina-torch"}
    assert "x vs reference" in summary
    sweep = [r for r in ok if r["op"] == "prism_attention" and r["params"]["D"] == 80]  # the sweep's dry shapes
    assert {r["provider"] for r in sweep} >= {"lamina-torch", "sdpa-flash", "sdpa-math"}, sweep
    table = json.loads((tmp_path / "attention_dispatch.json").read_text())
    assert table["schema"] == 1 and len(table["entries"]) == 8, table  # 2 head dims x causal/not x fwd, fwd+bwd
    assert "attention dispatch (prism_attention backend='auto' on CUDA): sweep on" in (out / "bench.log").read_text()
    assert "skipped" in (out / "pytest_gpu.log").read_text()
    report = (out / "info_kernels.log").read_text()
    assert "_rms_norm_fwd_kernel" in report and "0 default configurations with problems" in report, report


def test_delta_sweep_step_times_every_alternative_in_its_dry_run(tmp_path):
    """The delta-rule sweep's step (benchmarks/sweep_delta.py --dry-run: lamina's kernels under the interpreter,
    fla's naive chunk forms in fla's place): the defaults and fla in both modes, every alternative in the modes
    it changes, its records in bench.jsonl and its report in bench.log."""
    sweep = _sweep_module()
    out, summary = _cheap_run(tmp_path, timeout=300, SKIP_SANITIZER="1", BENCH_TIMEOUT="0",
                              SWEEP_DELTA_TIMEOUT="240")
    assert any(line.startswith("sweep_delta") and " ok " in line for line in _steps(summary)), summary
    records = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    ran = {(r["op"], r["mode"], r["provider"]) for r in records if r["kind"] == "result" and r["status"] == "ok"}
    expected = {(op, mode, provider) for op in sweep.OPS for mode in sweep.MODES
                for provider in ("lamina-triton", "fla-naive-chunk")}
    for tuning, modes, ops in sweep.ALTERNATIVES:
        expected |= {(op, mode, f"lamina-triton[{tuning.label()}]") for op in ops for mode in modes}
    assert expected <= ran, sorted(expected - ran)
    log = (out / "bench.log").read_text()
    assert "lamina / fla (time ratio" in log and "defaults it would choose: DeltaTuning(" in log, log


def _sweep_module():
    spec = importlib.util.spec_from_file_location("sweep_delta", ROOT / "benchmarks" / "sweep_delta.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep


def test_delta_sweep_plans_both_modes_of_a_shape_before_the_next_shape():
    """A variant whose share of the budget runs out keeps forward+backward at its first shapes: the sweep plans
    shape by shape (the suite's default, mode by mode, is left as it was)."""
    from dataclasses import replace

    from lamina.bench.specs import SWEEP_DELTA_SHAPES
    from lamina.bench.suite import plan

    sweep = _sweep_module()
    cfg = sweep.config("cuda", False, ["lamina-triton", "fla"], list(sweep.MODES), 60.0, ("kda",))
    n = len(SWEEP_DELTA_SHAPES)
    assert n > 1
    cases = list(dict.fromkeys((t.shape_index, t.mode) for t in plan(cfg)))
    assert cases == [(i, mode) for i in range(n) for mode in sweep.MODES], cases
    cases = list(dict.fromkeys((t.shape_index, t.mode) for t in plan(replace(cfg, shapes_first=False))))
    assert cases == [(i, mode) for mode in sweep.MODES for i in range(n)], cases


def test_delta_sweep_report_leaves_out_compile_timings_and_mixed_timers():
    """Records whose timing was a compiling first call (written before ``first_call_ms``) are left out, a
    ratio of two timers is marked, and only ratios of one timer choose a default."""
    sweep = _sweep_module()

    def rec(shape, provider, ms, timer, **extra):
        return {"kind": "result", "status": "ok", "op": "kda", "mode": "fwd", "shape": shape, "provider": provider,
                "ms": ms, "timer": timer, **extra}

    label = sweep.ALTERNATIVES[0][0].label()
    alt = f"lamina-triton[{label}]"
    records = [rec("a", "lamina-triton", 2.0, "single calls", first_call_ms=900.0),
               rec("a", "fla", 1.0, "do_bench", first_call_ms=900.0),
               rec("a", alt, 1.0, "do_bench", first_call_ms=900.0),
               rec("b", "lamina-triton", 4.0, "do_bench", first_call_ms=900.0),
               rec("b", "fla", 5000.0, "single call (time budget)")]
    text = sweep.report(records)
    assert "(1 records left out: timed by their first call, which compiled)" in text, text
    assert "lamina/fla 2.00  (timers differ: single calls / do_bench)" in text, text
    assert "5000" not in text, text
    assert f"{label:<16} not timed (or only against a default of another timer)" in text, text
    assert "the defaults stay" in text, text
    records[0]["timer"] = "do_bench"
    assert f"defaults it would choose: DeltaTuning({label})" in sweep.report(records)


def test_delta_sweep_report_states_the_speed_targets():
    """Each lamina / fla ratio says whether it meets its mode's target (forward 2x fla, forward+backward 1.5x),
    GDN-2 / KDA whether it meets 1.15, and a ratio of two timers says neither."""
    sweep = _sweep_module()

    def rec(op, mode, provider, ms, timer="do_bench"):
        return {"kind": "result", "status": "ok", "op": op, "mode": mode, "shape": "s", "provider": provider,
                "ms": ms, "timer": timer}

    records = [rec("kda", "fwd", "lamina-triton", 1.0), rec("kda", "fwd", "fla", 2.5),
               rec("kda", "fwd+bwd", "lamina-triton", 4.0), rec("kda", "fwd+bwd", "fla", 5.0),
               rec("gdn2", "fwd", "lamina-triton", 1.2), rec("gdn2", "fwd", "fla", 2.0, "single calls"),
               rec("gdn2", "fwd+bwd", "lamina-triton", 4.4)]
    lines = sweep.report(records).splitlines()

    def line(*parts):
        (found,) = [x for x in lines if all(p in x for p in parts)]
        return found

    assert line("kda", "fwd ", "lamina/fla").endswith("lamina/fla 0.40 (target met)")
    assert line("kda", "fwd+bwd", "lamina/fla").endswith("lamina/fla 0.80 (target missed)")
    assert line("gdn2", "fwd ", "lamina/fla").endswith("lamina/fla 0.60  (timers differ: do_bench / single calls)")
    assert line("gdn2/kda", "fwd ").endswith("gdn2/kda 1.20 (target missed)")
    assert line("gdn2/kda", "fwd+bwd").endswith("gdn2/kda 1.10 (target met)")


def test_delta_sweep_report_chooses_the_output_kernel_by_the_state_pass_programs():
    """The separate output kernel, faster than the default where the state pass fills less than one wave and
    slower elsewhere, becomes ``output_kernel=None`` (chosen per call by the programs), not True; faster at both
    shapes, it becomes True; timed below one wave only, None."""
    sweep = _sweep_module()
    alt = "lamina-triton[output_kernel=True]"

    def rec(shape, provider, ms, programs):
        return {"kind": "result", "status": "ok", "op": "gdn2", "mode": "fwd", "shape": shape, "provider": provider,
                "ms": ms, "timer": "do_bench", "state_pass_programs": programs, "multiprocessors": 132}

    records = [rec("few", "lamina-triton", 1.0, 128), rec("few", alt, 0.8, 128),
               rec("many", "lamina-triton", 1.0, 1024), rec("many", alt, 1.2, 1024)]
    text = sweep.report(records)
    assert "(state pass: 128 programs, 132 multiprocessors)" in text, text
    assert "output_kernel=True geometric mean over 2 cases: 0.980" in text, text
    assert "output_kernel=None (this one below one wave, in 1 of 2 cases) geometric mean: 0.894" in text, text
    assert "defaults it would choose: DeltaTuning(output_kernel=None)" in text, text
    records[3]["ms"] = 0.9
    assert "defaults it would choose: DeltaTuning(output_kernel=True)" in sweep.report(records)
    # timed below one wave only: the choice by programs, which keeps the default where nothing was timed
    assert "defaults it would choose: DeltaTuning(output_kernel=None)" in sweep.report(records[:2])
    for r in records:  # off CUDA: no multiprocessors, no case below one wave
        r["multiprocessors"] = None
    assert "(this one below one wave, in 0 of 2 cases) geometric mean: 1.000" in sweep.report(records)


def test_delta_sweep_runs_the_variants_modes_shapes_and_alternatives_asked_for(tmp_path, capsys, monkeypatch):
    """--ops, --modes, --alternatives pick what runs (--warm: each case's first call, no report); --shapes out of
    range is refused."""
    from lamina.bench import providers

    sweep = _sweep_module()
    # the dry run makes lamina-triton a CPU provider for the rest of its process: only for this test here
    monkeypatch.setitem(providers.PROVIDERS, "lamina-triton", providers.PROVIDERS["lamina-triton"])
    out = tmp_path / "warm.jsonl"
    assert sweep.main(["--dry-run", "--warm", "--ops", "kda", "--modes", "fwd", "--shapes", "0",
                       "--alternatives", "solve_block=16", "--out", str(out)]) == 0
    assert "warm pass: 3 of 3 cases ran once" in capsys.readouterr().out
    ran = {(r["op"], r["mode"], r["provider"]) for r in map(json.loads, out.read_text().splitlines())}
    assert ran == {("kda", "fwd", "lamina-triton"), ("kda", "fwd", "fla-naive-chunk"),
                   ("kda", "fwd", "lamina-triton[solve_block=16]")}
    with pytest.raises(SystemExit) as stop:
        sweep.main(["--dry-run", "--shapes", "1"])
    assert stop.value.code == 2 and "--shapes" in capsys.readouterr().err


def test_sanitizer_step_runs_each_tool_and_stops_at_an_unsupported_device(tmp_path):
    """The GPU path through a stand-in: memcheck runs the cases and passes, racecheck meets a device the tool
    does not support, and the tools after it are not tried."""
    out, summary = _cheap_run(tmp_path, SANITIZER=_stand_in(tmp_path, FAKE_SANITIZER), UNSUPPORTED_TOOL="racecheck",
                              SANITIZER_TOOLS="memcheck racecheck initcheck",
                              SANITIZER_CASE_ARGS="--device cpu --only short_conv_update,rms_norm")
    steps = _steps(summary)
    assert any(line.startswith("memcheck") and "ok" in line for line in steps), steps
    assert any(line.startswith("racecheck") and "unsupported device" in line for line in steps), steps
    assert not any(line.startswith("initcheck") for line in steps), steps
    verdicts = summary.split("=== compute-sanitizer (sanitizer.log)", 1)[1]
    assert "memcheck: sanitizer cases: 2 ok, 0 failed, 0 skipped" in verdicts, verdicts
    assert "ERROR SUMMARY: 0 errors" in verdicts, verdicts
    assert "racecheck: compute-sanitizer does not support the GPU on this machine" in verdicts, verdicts
    log = (out / "sanitizer.log").read_text()
    assert "COMPUTE-SANITIZER (memcheck)" in log and "rms_norm " in log, log


def test_skip_sanitizer_leaves_the_step_out(tmp_path):
    out, summary = _cheap_run(tmp_path, SKIP_SANITIZER="1")
    assert any(line.startswith("sanitizer") and "skipped (SKIP_SANITIZER=1)" in line for line in _steps(summary))
    assert not (out / "sanitizer.log").exists() and "=== compute-sanitizer" not in summary


def test_sanitizer_cases_cover_every_kernel():
    """Every Triton kernel module of the static report's registry and every op of lamina._C has a case."""
    from lamina.kernels import KERNEL_MODULES

    listing = subprocess.run([sys.executable, str(CASES), "--list"], capture_output=True, text=True,
                             check=True).stdout
    named = {word for line in listing.splitlines() for word in line.split()[1:]}
    bindings = (ROOT / "csrc" / "bindings.cpp").read_text()
    ext_ops = set(re.findall(r'm\.def\(\s*"(\w+)\(', bindings))
    assert ext_ops, "no m.def( schemas found in csrc/bindings.cpp"
    missing = (set(KERNEL_MODULES) | {f"lamina._C:{op}" for op in ext_ops}) - named
    assert not missing, f"kernels without a sanitizer case: {sorted(missing)}"
    assert named <= set(KERNEL_MODULES) | {f"lamina._C:{op}" for op in ext_ops}, named


def test_autotuners_are_pinned_to_one_config_without_timing(tmp_path):
    """On a GPU the autotuners hold several configs: each keeps the first its pruning keeps, and none is timed."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import sanitizer_cases as s\n"
        "n = s.pin_autotuners()\n"
        "import torch\n"
        "from lamina.kernels.delta_chunk_fwd import _prep_fwd\n"
        # the launch arguments its own pruning reads (a 16-bit launch: every config of 8 warps)
        "_prep_fwd.nargs = {'q': torch.empty(0, dtype=torch.bfloat16)}\n"
        "pruned = _prep_fwd.prune_configs({'BKY': 64, 'BV': 32})\n"
        "assert n >= 4 and len(_prep_fwd.configs) > 1 and pruned == _prep_fwd.configs[:1], (n, pruned)\n"
        "assert _prep_fwd._bench(config=pruned[0]) == [0.0, 0.0, 0.0]\n"
        "print(n)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code, str(CASES.parent)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
