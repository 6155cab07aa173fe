"""The dependency versions lamina is tested with, in one place.

``setup.py`` reads this file (it runs it without importing lamina), so the requirement pip
resolves and the range ``lamina info`` checks cannot drift apart. CI tests both ends of the
Triton range, each in a fresh virtual environment (``.ci/run``): the newest Triton pip picks
with the README's torch, and the oldest Triton with the oldest torch.
"""

from __future__ import annotations

# Oldest Triton tested (CI's second leg pins it; the GPU image has it with torch 2.11).
TRITON_OLDEST = (3, 6, 0)
# Newest Triton minor release tested (what pip picks on a fresh machine today). Triton 3.9 removed
# block pointers; lamina's kernels use plain pointers only.
TRITON_NEWEST_MINOR = (3, 9)
# Oldest torch tested (CI's second leg): the GPU image's build, whose Triton is TRITON_OLDEST.
TORCH_OLDEST = (2, 11)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


TRITON_REQUIREMENT = (
    f"triton>={_dotted(TRITON_OLDEST)},<{TRITON_NEWEST_MINOR[0]}.{TRITON_NEWEST_MINOR[1] + 1}"
)
TORCH_REQUIREMENT = f"torch>={_dotted(TORCH_OLDEST)}"


def release(version: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: ``"3.9.0+git1a2b"`` -> ``(3, 9, 0)``."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


def triton_in_tested_range(version: str) -> bool:
    """Whether a Triton version lies between the oldest and the newest tested release."""
    rel = release(version)
    return bool(rel) and TRITON_OLDEST <= rel and rel[:2] <= TRITON_NEWEST_MINOR


def triton_range_text() -> str:
    return f"{_dotted(TRITON_OLDEST)} to {_dotted(TRITON_NEWEST_MINOR)}.x"


def triton_status(version: str | None) -> str:
    """One line for ``lamina info``: the installed Triton and whether it was tested."""
    if version is None:
        return f"not installed (lamina needs {TRITON_REQUIREMENT})"
    if triton_in_tested_range(version):
        return f"{version} (within the tested range {triton_range_text()})"
    return (f"{version}: OUTSIDE the tested range {triton_range_text()}; kernels may fail to compile or "
            f"give wrong results, install `pip install \"{TRITON_REQUIREMENT}\"`")
