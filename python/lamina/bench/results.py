"""Results as JSON lines: one record per (op, shape, mode, provider), plus one per ceiling.

Every record carries the run's environment (device name, commit, torch, triton,
fla and lamina versions, date), so a line read on its own says where it was
measured. Records are appended and flushed one by one: a run stopped by a timeout
keeps everything measured so far.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any, TextIO

import torch

from lamina.kernels._utils import TRITON_ENV

SCHEMA_VERSION = 1


def repo_root() -> Path | None:
    """The repository lamina is installed from (editable install), or None."""
    import lamina

    root = Path(lamina.__file__).resolve().parents[2]
    if (root / "setup.py").is_file() and (root / "benchmarks").is_dir():
        return root
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(root: Path | None, *args: str) -> str | None:
    if root is None:
        return None
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else _cpu_name()


def device_slug(device: str) -> str:
    """``nvidia-h200`` for an H200, ``cpu`` for the CPU: the file-name part of the default results path."""
    if device != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-") or "cuda"


# Environment variables that change how the process allocates host memory: on glibc, freed heap memory
# returned to the OS is faulted back in on the next call, which can double a CPU timing (``benchmarks/README.md``).
ALLOCATOR_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX", "LD_PRELOAD")


def environment(device: str) -> dict[str, Any]:
    """Where and with what a run measured."""
    root = repo_root()
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {
        "device": device,
        "device_name": device_name(device),
        "gpu": device_name(device) if device == "cuda" else None,
        "cpu_threads": torch.get_num_threads(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "allocator_env": {name: os.environ[name] for name in ALLOCATOR_ENV if name in os.environ},
        "triton_env": {name: os.environ[name] for name in TRITON_ENV if name in os.environ},
        "commit": _git(root, "rev-parse", "HEAD"),
        "dirty": bool(status) if root is not None else None,
        "lamina": _version("lamina"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "fla": _version("fla-core"),
        "flash_attn": _version("flash-attn") or _version("flash_attn"),
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


# Where ``lamina bench`` appends its results unless given ``--out``.
RESULTS_DIR_ENV = "LAMINA_RESULTS_DIR"


def results_dir() -> Path:
    """``$LAMINA_RESULTS_DIR``, else ``$XDG_CACHE_HOME/lamina/bench`` (``~/.cache/lamina/bench``).

    Never a folder of the checkout: a benchmark run must not dirty the working tree. Results meant
    for the repository are written with ``--out benchmarks/results/...`` and committed on purpose.
    """
    explicit = os.environ.get(RESULTS_DIR_ENV)
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "lamina" / "bench"


def default_results_path(device: str) -> Path:
    """``<results_dir()>/<date>-<device>.jsonl``."""
    return results_dir() / f"{_dt.date.today().isoformat()}-{device_slug(device)}.jsonl"


class ResultWriter:
    """Appends records to a JSON-lines file, flushing after each."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path is not None else None
        self._fh: TextIO | None = None

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", encoding="utf-8")
        self._fh.write(json.dumps({"schema": SCHEMA_VERSION, **record}, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_results(paths: list[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """All records of the given JSON-lines files; ValueError naming the file and line of a bad one."""
    records = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"results file {str(path)!r} does not exist")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line ({exc})") from exc
            if not isinstance(rec, dict) or "kind" not in rec:
                raise ValueError(f"{path}:{n}: expected a benchmark record with a 'kind' field")
            records.append(rec)
    return records
