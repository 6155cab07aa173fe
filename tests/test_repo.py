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
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci, f"README test command not run verbatim by .ci/run: {test_cmd!r}"
    assert "set -euo pipefail" in ci or any(line.startswith("set -e") for line in ci)


def test_import_lamina_is_light_and_quiet():
    code = ("import sys, warnings; warnings.simplefilter('error'); import lamina; "
            "heavy = [m for m in ('triton', 'lamina.kernels', 'fla', 'lamina._C') if m in sys.modules]; "
            "print(heavy)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert proc.stderr == ""
