"""The static kernel report: it catches spills, and every default kernel configuration passes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code_or_args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "tests" / "data") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.versions
def test_report_detects_spills_and_hgmma():
    code = textwrap.dedent("""
        import json
        from dataclasses import asdict
        from lamina.info import compile_spec
        import aot_demo_kernels as d
        rows = [compile_spec(d.FITS, 90), compile_spec(d.SPILLS, 90), compile_spec(d.FITS, 80)]
        print(json.dumps([{**asdict(r), "problems": r.problems()} for r in rows]))
    """)
    proc = _run(["-c", code])
    assert proc.returncode == 0, proc.stderr
    fits, spills, fits80 = json.loads(proc.stdout.strip().splitlines()[-1])
    assert fits["problems"] == [] and fits["hgmma"] and fits["spill_stores"] == 0
    assert fits["registers"] > 0 and fits["shared_bytes"] > 0
    assert spills["spill_stores"] > 0
    assert any("spills" in p for p in spills["problems"])
    assert fits80["problems"] == [] and fits80["arch"] == 80


# The SM versions to compile for: lamina info's default (sm_90 and sm_80) unless LAMINA_STATIC_REPORT_ARCHS
# names them ("90" or "90,80"); CI's second leg (the GPU image's Triton) compiles for the GPU's sm_90 only.
ARCHS = os.environ.get("LAMINA_STATIC_REPORT_ARCHS", "90,80")


@pytest.mark.versions
def test_every_default_kernel_config_compiles_without_spills():
    proc = _run(["-m", "lamina.info", "--kernels", "--json", "--arch", ARCHS])
    assert proc.stdout, proc.stderr
    saved = os.environ.get("LAMINA_STATIC_REPORT_JSON")
    if saved:  # CI prints the table from this file (`lamina info --kernels --from-json`) instead of compiling twice
        Path(saved).write_text(proc.stdout)
    rows = json.loads(proc.stdout)
    from lamina.kernels import KERNEL_MODULES

    modules = {r["module"] for r in rows}
    assert rows, "no kernel configuration is registered"
    bad = [f'{r["name"]}[{r["config"]}] sm_{r["arch"]}: {"; ".join(r["problems"])}'
           for r in rows if r["default"] and r["problems"]]
    assert not bad, "\n".join(bad)
    assert {int(a) for a in ARCHS.split(",")} == {r["arch"] for r in rows}
    missing = set(KERNEL_MODULES) - modules
    assert not missing, f"kernel modules that register no configuration with the report: {sorted(missing)}"
    unlisted = modules - set(KERNEL_MODULES)
    assert not unlisted, f"registered kernels defined in modules missing from KERNEL_MODULES: {sorted(unlisted)}"
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_info_runs():
    proc = _run(["-m", "lamina.cli", "info"])
    assert proc.returncode == 0, proc.stderr
    assert "torch" in proc.stdout and "backends" in proc.stdout


def test_table_from_a_saved_report(tmp_path):
    from lamina.info import KernelReport

    ok = KernelReport("k", "c", 90, True, True, registers=100, stack_bytes=0, spill_stores=0, spill_loads=0,
                      shared_bytes=1024, hgmma=True)
    spilled = KernelReport("k", "c2", 80, True, True, registers=255, stack_bytes=8, spill_stores=1, spill_loads=1,
                           shared_bytes=1024)
    from dataclasses import asdict

    for rows, status in (([ok], 0), ([ok, spilled], 1)):
        path = tmp_path / "report.json"
        path.write_text(json.dumps([asdict(r) for r in rows]))
        proc = _run(["-m", "lamina.info", "--kernels", "--from-json", str(path)])
        assert proc.returncode == status, proc.stderr
        assert f"{len(rows)} compiled configurations, {status} default configurations with problems" in proc.stdout
    proc = _run(["-m", "lamina.info", "--kernels", "--from-json", str(tmp_path / "missing.json")])
    assert proc.returncode == 2 and "--from-json" in proc.stderr


@pytest.mark.parametrize("bad", [["--arch", "75"]])
def test_info_rejects_unknown_arch(bad):
    proc = _run(["-m", "lamina.info", "--kernels", *bad])
    assert proc.returncode != 0 and "--arch" in proc.stderr
