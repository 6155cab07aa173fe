"""benchmarks/device_check.sh: syntax, and a DRY_RUN=1 pass on the CPU that checks what it writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lamina.bench import specs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
# Files the device tool brings back (at most 8, no deeper than two folders).
EXPECTED = ("summary.txt", "setup.log", "pytest_gpu.log", "bench.jsonl", "bench.log", "info_kernels.log")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_writes_every_file_and_ends_with_the_summary(tmp_path):
    out = tmp_path / "device_out"
    env = {
        **os.environ,
        "OUT": str(out),
        "DRY_RUN": "1",
        "PYTHON": sys.executable,
        # keep the CI pass short: one small test file, two ops, the layers forward only, a short kernel-report
        # window (a report that needs longer is recorded as timed out, which the check tolerates like any
        # failed step)
        "PYTEST_ARGS": "-m gpu -q -p no:cacheprovider tests/test_bench_gpu.py",
        "BENCH_ARGS": "--device cpu --shapes tiny --mode fwd --op hrm_update,delta_rule "
                      "--exclude torch-compile --threads 1 --cpu-min-run-s 0.02",
        "BENCH_LAYERS_TIMEOUT": "60",
        "LAYERS_BENCH_ARGS": "--device cpu --shapes tiny --mode fwd --threads 1 --cpu-min-run-s 0.02",
        "BENCH_DECODE_TIMEOUT": "40",
        "DECODE_BENCH_ARGS": "--device cpu --threads 1 --cpu-min-run-s 0.02",
        "INFO_TIMEOUT": "10",
        "LAMINA_BENCH_PLAIN": "1",
    }
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(p.name for p in out.iterdir())
    assert set(EXPECTED) <= set(files) and len(files) <= 8, files
    summary = (out / "summary.txt").read_text()
    assert proc.stdout.rstrip().endswith(summary.rstrip().splitlines()[-1])  # the last lines are the summary
    steps = summary.split("=== steps", 1)[1]
    for step, status in (("install", "ok"), ("fla_import", "skipped ("), ("build_cuda", "skipped (DRY_RUN"),
                         ("pytest_gpu", "ok"), ("bench ", "ok"), ("bench_layers", "ok"), ("bench_decode", "ok"),
                         ("bench_generation", "ok"), ("info_kernels", "")):
        assert any(line.startswith(step) and status in line for line in steps.splitlines()), (step, steps)
    records = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "ceiling" for r in records)
    ok = [r for r in records if r["kind"] == "result" and r["status"] == "ok"]
    assert {r["op"] for r in ok} >= {"hrm_update", "delta_rule", *specs.LAYER_OPS}
    assert {r["provider"] for r in ok if r["op"] in specs.LAYER_OPS} == {"lamina-torch"}
    assert "x vs reference" in summary
    assert "skipped" in (out / "pytest_gpu.log").read_text()
