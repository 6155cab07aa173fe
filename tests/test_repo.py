"""The README's test command is the one CI runs, and `import lamina` stays light."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line for block in blocks[:2] for line in block.splitlines() if line and not line.startswith("#")]


def test_ci_runs_readme_test_command():
    main_job, test_cmd = _readme_commands()[:2]
    assert "lamina" in main_job and "pytest" in test_cmd
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci, f"README test command not run verbatim by .ci/run: {test_cmd!r}"
    # in a virtual environment of its own, not the machine's Python
    assert "python3 -m venv" in (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci or any(line.startswith("set -e") for line in ci)


def _ci_cleanup_function() -> str:
    text = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"^cleanup\(\) \{\n.*?^\}\n", text, flags=re.S | re.M)
    assert match, ".ci/run defines no cleanup() function"
    assert re.search(r"^trap cleanup EXIT$", text, flags=re.M), ".ci/run does not run cleanup() on exit"
    return match.group(0)


def _run_ci_cleanup(tmp_path: Path, last_command: str) -> subprocess.CompletedProcess:
    """``.ci/run``'s exit handler, under its ``set -euo pipefail``, after leg 2's install ended and was reaped."""
    script = "\n".join([
        "set -euo pipefail",
        _ci_cleanup_function(),
        f"work={tmp_path / 'work'}",
        'mkdir -p "$work"',
        "true & leg2_install=$!",
        'wait "$leg2_install"',
        "trap cleanup EXIT",
        last_command,
    ])
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True)


def test_ci_exit_handler_keeps_the_runs_status(tmp_path):
    passed = _run_ci_cleanup(tmp_path, "echo passed")
    assert passed.returncode == 0, passed.stderr
    assert not (tmp_path / "work").exists()
    failed = _run_ci_cleanup(tmp_path, "exit 3")
    assert failed.returncode == 3, failed.stderr
    assert not (tmp_path / "work").exists()


def test_import_lamina_is_light_and_quiet():
    code = ("import sys, warnings; warnings.simplefilter('error'); import lamina; "
            "heavy = [m for m in ('triton', 'lamina.kernels', 'fla', 'lamina._C') if m in sys.modules]; "
            "print(heavy)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert proc.stderr == ""


def test_no_block_pointers_in_kernels():
    """Triton 3.9 removed ``tl.make_block_ptr`` (NotImplementedError, also under the interpreter)."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "kernels").rglob("*.py")
                 if "make_block_ptr" in p.read_text() or "boundary_check" in p.read_text()]
    assert offenders == []


def test_tested_triton_range():
    from lamina._versions import TRITON_REQUIREMENT, triton_in_tested_range, triton_status

    assert TRITON_REQUIREMENT == "triton>=3.6.0,<3.10"
    for inside in ("3.6.0", "3.7.1", "3.8.0", "3.9.0", "3.9.1+git1a2b3c"):
        assert triton_in_tested_range(inside), inside
        assert "within the tested range" in triton_status(inside)
    for outside in ("3.5.1", "3.2.0", "3.10.0", "4.0.0", "nightly"):
        assert not triton_in_tested_range(outside), outside
        assert "OUTSIDE the tested range 3.6.0 to 3.9.x" in triton_status(outside)
    assert "not installed" in triton_status(None)


def test_installed_triton_is_in_the_tested_range():
    import triton

    from lamina._versions import triton_in_tested_range

    assert triton_in_tested_range(triton.__version__), triton.__version__


def test_setup_states_the_tested_ranges():
    """The installed metadata (what pip resolved against) carries the ranges of lamina._versions."""
    from importlib.metadata import requires

    from lamina._versions import TORCH_REQUIREMENT, TRITON_REQUIREMENT

    def specifiers(requirement: str) -> tuple[str, set[str]]:
        name, spec = re.match(r"([A-Za-z0-9_.-]+)\s*\(?([^;)]*)", requirement).groups()
        return name.lower(), {part.strip() for part in spec.split(",") if part.strip()}

    installed = dict(specifiers(r) for r in requires("lamina") or [] if "extra ==" not in r)
    for wanted in (TRITON_REQUIREMENT, TORCH_REQUIREMENT):
        name, spec = specifiers(wanted)
        assert installed.get(name) == spec, (name, installed.get(name), spec)


def test_lamina_info_prints_the_triton_status():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "lamina.info"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("triton "))
    assert "within the tested range 3.6.0 to 3.9.x" in line
