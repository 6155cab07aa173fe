"""The static kernel report: it catches spills, and every kernel configuration it compiles passes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code_or_args: list[str], timeout: int = 900, drop: tuple[str, ...] = (),
         **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and k not in drop} | env_extra
    env["PYTHONPATH"] = str(ROOT / "tests" / "data") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.versions
def test_report_detects_spills_and_hgmma(tmp_path):
    """Each row twice, in an empty Triton cache: first from ptxas's log (where it shows no stack frame), then,
    the cubin cached, from the cubin's resource usage and disassembly; both reads agree."""
    code = textwrap.dedent("""
        import json
        from dataclasses import asdict
        from lamina.info import compile_spec
        import aot_demo_kernels as d
        specs = [(d.FITS, 90), (d.SPILLS, 90), (d.FITS, 80)]
        for _ in range(2):
            rows = [compile_spec(spec, arch) for spec, arch in specs]
            print(json.dumps([{**asdict(r), "seconds": 0, "problems": r.problems()} for r in rows]))
    """)
    proc = _run(["-c", code], TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    assert proc.returncode == 0, proc.stderr
    from_log, from_cubin = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    assert from_log == from_cubin
    fits, spills, fits80 = from_log
    assert fits["problems"] == [] and fits["hgmma"] and fits["spill_stores"] == 0
    assert fits["registers"] > 0 and fits["shared_bytes"] > 0
    assert spills["spill_stores"] > 0 and spills["stack_bytes"] > 0
    assert any("spills" in p for p in spills["problems"])
    assert fits80["problems"] == [] and fits80["arch"] == 80 and not fits80["hgmma"]


@pytest.mark.versions
def test_report_flags_the_tf32_wgmma_eight_columns_wide():
    """A float32 64 x 16 product at 8 warps compiles for sm_90 to wgmma m64n8k8 in tf32 (Triton issue #10629,
    which reads past its shared operand): a problem of the row; at 4 warps it is m64n16k8, and no problem."""
    code = textwrap.dedent("""
        import json
        from lamina.info import compile_spec
        import aot_demo_kernels as d
        rows = [compile_spec(d.TF32_N8, 90), compile_spec(d.TF32_N16, 90)]
        print(json.dumps([(r.wgmma, r.problems()) for r in rows]))
    """)
    proc = _run(["-c", code])
    assert proc.returncode == 0, proc.stderr
    (n8, problems8), (n16, problems16) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert n8.get("m64n8k8.tf32", 0) > 0 and any("Triton #10629" in p for p in problems8), (n8, problems8)
    assert "m64n8k8.tf32" not in n16 and n16.get("m64n16k8.tf32", 0) > 0 and problems16 == [], (n16, problems16)


def test_wgmma_shapes_counts_each_shape_and_type():
    from lamina.info import wgmma_shapes

    ptx = ("wgmma.mma_async.sync.aligned.m64n8k8.f32.tf32.tf32 {%f1}, %rd1, %rd2, p, 1, 1;\n"
           "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 {%f1}, %rd1, %rd2, p, 1, 1;\n"
           "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 0;\n"
           "wgmma.mma_async.sync.aligned.m64n8k8.f32.tf32.tf32 {%f2}, %rd3, %rd4, p, 1, 1;\n")
    assert wgmma_shapes(ptx) == {"m64n8k8.tf32": 2, "m64n16k8.tf32": 1, "m64n8k16.bf16": 1}


def test_ptxas_log_is_read_in_both_forms():
    from lamina.info import _parse_ptxas_log

    for tool in ("ptxas", "ptxas-blackwell"):  # Triton 3.6's and 3.9's
        log = (f"{tool} info    : Compiling entry function 'k' for 'sm_90a'\n"
               f"{tool} info    : Function properties for k\n"
               "    16 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n"
               f"{tool} info    : Used 255 registers, used 1 barriers\n")
        assert _parse_ptxas_log(log) == (255, 16)
    assert _parse_ptxas_log("") is None


# The SM versions to compile for: lamina info's default (sm_90 and sm_80) unless LAMINA_STATIC_REPORT_ARCHS
# names them ("90" or "90,80"); CI's second leg (the GPU image's Triton) compiles for the GPU's sm_90 only.
ARCHS = os.environ.get("LAMINA_STATIC_REPORT_ARCHS", "90,80")
# The default configurations, and with LAMINA_STATIC_REPORT_ALTERNATIVES=1 the non-default rows too (the
# delta-rule family's speed alternatives and fused options, on their targets): CI's second leg compiles them
# under the GPU image's Triton, where the device sweep runs them; the first leg runs them under the interpreter
# (tests marked grid) and leaves out their compile (about a quarter of the report's time).
ALTERNATIVES = os.environ.get("LAMINA_STATIC_REPORT_ALTERNATIVES", "0") == "1"
# The report is compiled in parts (`lamina info --kernels --shard K/N`), one test each, one compile process
# each: pytest-xdist spreads them over its workers, and no single test runs for the whole report.
SHARDS = 8


@pytest.mark.versions
@pytest.mark.parametrize("env", [{}, {"TRITON_DEFAULT_FP_FUSION": "0"}, {"TRITON_DEFAULT_FP_FUSION": "1"},
                                 {"TRITON_FORCE_DISABLE_FP_FUSION": "1"}], ids=["unset", "default-0", "default-1",
                                                                              "force-disable"])
def test_the_report_compiles_with_fp_fusion_on_unless_the_user_sets_triton_default(env):
    """The static report compiles as lamina's launches run (``kernels/_utils.fp_fusion``): a multiply and an
    add fuse into one FMA with TRITON_DEFAULT_FP_FUSION unset (Triton 3.10's default would not), without
    Triton 3.9's warning about the unset variable; where the user sets it, their choice applies, and Triton
    3.9's TRITON_FORCE_DISABLE_FP_FUSION turns fusion off (3.6 has no such variable). ``lamina info`` says
    which of the two the PTX shows."""
    import triton

    from lamina.kernels._utils import TRITON_ENV

    force = "TRITON_FORCE_DISABLE_FP_FUSION" in env
    if force and not hasattr(triton.knobs.language, "force_disable_fp_fusion"):
        pytest.skip(f"Triton {triton.__version__} has no TRITON_FORCE_DISABLE_FP_FUSION")
    code = textwrap.dedent("""
        import json, triton
        from lamina.info import compile_spec, environment_summary
        import aot_demo_kernels as d
        ptx = []
        compile = triton.compile
        def spy(src, target=None, options=None):
            compiled = compile(src, target=target, options=options)
            ptx.append(compiled.asm["ptx"])
            return compiled
        triton.compile = spy
        row = compile_spec(d.AXPY, 90)
        said = environment_summary()["triton_compile"]
        print(json.dumps([row.error, "fma.rn.f32" in ptx[0], "mul.rn.f32" in ptx[0], said]))
    """)
    proc = _run(["-W", "always", "-c", code], drop=TRITON_ENV, **env)
    assert proc.returncode == 0, proc.stderr
    error, fma, mul, said = json.loads(proc.stdout.strip().splitlines()[-1])
    assert error == "", error
    fused = env.get("TRITON_DEFAULT_FP_FUSION") != "0" and not force
    assert (fma, mul) == (fused, not fused), proc.stdout
    assert said == {"fp fusion": "on" if fused else "off", **env}, said
    assert "TRITON_DEFAULT_FP_FUSION" not in proc.stderr, proc.stderr


@pytest.mark.versions
@pytest.mark.parametrize("shard", range(1, SHARDS + 1))
def test_kernel_configs_compile_without_spills(shard):
    """Every configuration compiled (the defaults; the alternatives too where asked for) has no problem: no
    compile error, spill or shared memory over the target's limit, and HGMMA in every matrix kernel on sm_90."""
    proc = _run(["-m", "lamina.info", "--kernels", "--json", "--arch", ARCHS, "--jobs", "1",
                 "--shard", f"{shard}/{SHARDS}", *([] if ALTERNATIVES else ["--defaults-only"])])
    assert proc.stdout, proc.stderr
    saved = os.environ.get("LAMINA_STATIC_REPORT_DIR")
    if saved:  # CI prints the table from these files (`lamina info --kernels --from-json`) instead of compiling twice
        Path(saved).mkdir(parents=True, exist_ok=True)
        (Path(saved) / f"shard-{shard}-of-{SHARDS}.json").write_text(proc.stdout)
    rows = json.loads(proc.stdout)
    assert rows, f"shard {shard}/{SHARDS} compiled no kernel configuration"
    bad = [f'{r["name"]}[{r["config"]}] sm_{r["arch"]}: {"; ".join(r["problems"])}' for r in rows if r["problems"]]
    assert not bad, "\n".join(bad)
    assert {r["arch"] for r in rows} <= {int(a) for a in ARCHS.split(",")}
    assert ALTERNATIVES or all(r["default"] for r in rows)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # every compile asks for FP fusion as the launches do (kernels/_utils.fp_fusion): no warning about its default
    assert os.environ.get("TRITON_DEFAULT_FP_FUSION") or "TRITON_DEFAULT_FP_FUSION" not in proc.stderr, proc.stderr


@pytest.mark.versions
def test_the_report_shards_cover_every_kernel_module_once():
    """Every kernel module registers configurations, and the shards split them without gaps or overlaps."""
    code = textwrap.dedent(f"""
        import json
        from lamina.info import _load_registry
        from lamina.kernels._utils import raw_jit
        specs = _load_registry()
        parts = [[i for i in range(len(specs)) if i % {SHARDS} == k] for k in range({SHARDS})]
        print(json.dumps({{"modules": sorted({{raw_jit(s.fn).__module__ for s in specs}}), "n": len(specs),
                          "parts": parts}}))
    """)
    proc = _run(["-c", code], timeout=300)
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(proc.stdout.strip().splitlines()[-1])
    from lamina.kernels import KERNEL_MODULES

    missing = set(KERNEL_MODULES) - set(listed["modules"])
    assert not missing, f"kernel modules that register no configuration with the report: {sorted(missing)}"
    unlisted = set(listed["modules"]) - set(KERNEL_MODULES)
    assert not unlisted, f"registered kernels defined in modules missing from KERNEL_MODULES: {sorted(unlisted)}"
    indices = sorted(i for part in listed["parts"] for i in part)
    assert indices == list(range(listed["n"])) and all(listed["parts"])


def test_shards_partition_the_report(monkeypatch):
    """kernel_report(shard=(k, n)) compiles the k-th part; the n parts together are the whole report, once;
    ``defaults_only`` leaves the non-default rows out of each part."""
    import lamina.info as info

    specs = [type("Spec", (), {"name": f"k{i}", "meta": {"archs": [90]} if i == 3 else {}, "default": i != 6})()
             for i in range(7)]
    monkeypatch.setattr(info, "_load_registry", lambda: specs)
    monkeypatch.setattr(info, "_compile_one", lambda i, arch: (i, arch))
    whole = info.kernel_report((90, 80), jobs=1)
    parts = [info.kernel_report((90, 80), jobs=1, shard=(k, 3)) for k in (1, 2, 3)]
    assert sorted(x for part in parts for x in part) == sorted(whole)
    assert len(whole) == 13 and (3, 80) not in whole
    assert parts[0] == [(0, 90), (0, 80), (3, 90), (6, 90), (6, 80)]
    assert info.kernel_report((90, 80), jobs=1, shard=(1, 3), defaults_only=True) == [(0, 90), (0, 80), (3, 90)]


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
    # several saved parts (one per --shard) make one table
    parts = [tmp_path / "part-1.json", tmp_path / "part-2.json"]
    for part, row in zip(parts, (ok, spilled)):
        part.write_text(json.dumps([asdict(row)]))
    proc = _run(["-m", "lamina.info", "--kernels", "--from-json", *map(str, parts)])
    assert proc.returncode == 1 and "2 compiled configurations, 1 default configurations with problems" in proc.stdout
    proc = _run(["-m", "lamina.info", "--kernels", "--from-json", str(tmp_path / "missing.json")])
    assert proc.returncode == 2 and "--from-json" in proc.stderr


@pytest.mark.parametrize("bad", [["--arch", "75"], ["--shard", "0/4"], ["--shard", "5/4"], ["--shard", "2"]])
def test_info_rejects_unknown_arch_and_bad_shards(bad):
    proc = _run(["-m", "lamina.info", "--kernels", *bad])
    assert proc.returncode == 2 and bad[0] in proc.stderr
