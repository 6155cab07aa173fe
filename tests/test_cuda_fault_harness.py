"""The harness ends a process whose CUDA context a fault broke (tests/cuda_fault.py), checked on the CPU.

A test that raises torch's wording of an illegal memory access stands in for the fault: the hooks look at
the exception only, so no GPU is needed to see what the harness does with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cuda_fault import is_sticky_cuda_fault

TESTS = Path(__file__).resolve().parent

FAULTY = '''
import os

import pytest


def test_a_fault():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_b_other_error():
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("i", range(4))
def test_c_after(i):
    # which process ran it
    with open(os.path.join(os.environ["FAULT_TEST_PIDS"], f"pid-{i}"), "w") as f:
        f.write(str(os.getpid()))
'''


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_faulty.py").write_text(FAULTY)
    (tmp_path / "pids").mkdir()
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, FAULT_TEST_PIDS=str(tmp_path / "pids"), PYTHONPATH=path)
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "cuda_fault", "-p", "no:cacheprovider", "-q",
                           *args,
                           "test_faulty.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("message,sticky", [
    ("CUDA error: an illegal memory access was encountered", True),
    ("Triton Error [CUDA]: an illegal memory access was encountered", True),
    ("CUDA error: unspecified launch failure", True),
    ("CUDA error: misaligned address", True),
    ("CUDA error: device-side assert triggered", True),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ("an illegal memory access", False),  # not a CUDA error
    ("q must be a CUDA tensor", False),
])
def test_which_errors_count(message, sticky):
    assert is_sticky_cuda_fault(RuntimeError(message)) is sticky
    assert not is_sticky_cuda_fault(AssertionError(message))  # a failed check quoting the message
    try:
        try:
            raise RuntimeError(message)
        except RuntimeError as inner:
            raise ValueError("while timing a config") from inner
    except ValueError as outer:
        assert is_sticky_cuda_fault(outer) is sticky


def test_xdist_worker_is_replaced_after_a_fault(tmp_path):
    pytest.importorskip("xdist")
    run = _run(tmp_path, "-n", "1")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    # the fault fails its test, its worker is replaced, and every test queued after it still runs and passes
    assert "[gw0] node down" in out, out
    assert "crashed while running 'test_faulty.py::test_a_fault'" in out, out
    assert "4 passed" in out, out
    # an error that leaves the context usable ends nothing: the tests after it ran in the same process
    pids = {(tmp_path / "pids" / f"pid-{i}").read_text() for i in range(4)}
    assert len(pids) == 1, pids
    assert out.count("node down") == 1, out


def test_without_xdist_the_session_stops_at_the_fault(tmp_path):
    run = _run(tmp_path, "-p", "no:xdist")
    out = run.stdout + run.stderr
    assert run.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "a sticky CUDA error in test_faulty.py::test_a_fault" in out, out
    assert "1 failed" in out and "passed" not in out, out
    assert not list((tmp_path / "pids").glob("pid-*"))
