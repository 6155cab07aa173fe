"""Ends a test process whose CUDA context a kernel fault has broken, so the tests after it still mean something.

After an illegal memory access (or another sticky CUDA error) every later CUDA call in the process fails:
every test that runs after it in the same process errors, in its first fixture, without saying anything
about its own kernel. (The first GPU run of the suite lost every per-test result this way.)

* Under pytest-xdist the worker exits as soon as the faulting test's reports are sent. xdist then reports
  that test once more, as "crashed", and starts a fresh worker for the tests queued on the old one.
* Without xdist the session stops after the faulting test, naming it.

``tests/conftest.py`` imports the hooks; ``pytest -p cuda_fault`` loads them into any other run.
"""

from __future__ import annotations

import os
import sys

import pytest

# Lower-case fragments of the CUDA errors that leave the context unusable (cudaErrorIllegalAddress,
# cudaErrorLaunchFailure, cudaErrorMisalignedAddress, cudaErrorIllegalInstruction, cudaErrorAssert, ...),
# as torch ("CUDA error: ...") and Triton ("Triton Error [CUDA]: ...") word them.
STICKY_CUDA_ERRORS = (
    "illegal memory access",
    "illegal address",
    "misaligned address",
    "unspecified launch failure",
    "illegal instruction",
    "device-side assert",
    "hardware stack error",
    "uncorrectable ecc error",
)

_faulted: set[str] = set()


def is_sticky_cuda_fault(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from, is a CUDA error that breaks the context.

    torch and Triton raise these as RuntimeError (torch.AcceleratorError is one); other exception types
    (a failed assertion that quotes such a message, say) do not count.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).lower()
        if (isinstance(exc, RuntimeError) and "cuda" in text
                and any(fragment in text for fragment in STICKY_CUDA_ERRORS)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if call.excinfo is not None and is_sticky_cuda_fault(call.excinfo.value):
        _faulted.add(item.nodeid)
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            item.session.shouldstop = (f"a sticky CUDA error in {item.nodeid} broke this process's CUDA context; "
                                       "the tests after it cannot run here (with pytest-xdist they run in a "
                                       "fresh worker)")
    return report


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    # trylast: xdist's worker has sent this test's reports (execnet writes them before returning)
    if nodeid in _faulted and os.environ.get("PYTEST_XDIST_WORKER"):
        print(f"\n{os.environ['PYTEST_XDIST_WORKER']}: a sticky CUDA error in {nodeid}; ending this worker",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(3)
