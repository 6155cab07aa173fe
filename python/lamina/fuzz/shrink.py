"""Greedy shrinking of a failing case, and saving it as JSON plus a runnable Python snippet.

``shrink_case`` tries one simplification at a time (shorter T towards 1 and the chunk
boundaries, fewer sequences, smaller B, heads, ratio and dims, one flag dropped, float32) and keeps
it only while the case still fails with the same kind of failure (``failure_kind``), until no
simplification is left or the time budget is spent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from lamina.fuzz.space import DELTA_SPECS, LAYER_OPS

# Keys a case carries for bookkeeping, never simplified.
_FIXED = ("op", "seed", "device", "backend", "run_seed", "index", "chunk_size")
# Counts shrunk towards 1 (in this order: the biggest savings first).
_COUNTS = ("B", "rows", "H", "HKV", "heads", "ratio", "group", "v_ratio", "kv_heads")
# Head dims: towards small widths.
_DIMS = ("K", "V", "D", "head_dim")
# Options with a simpler value than the drawn one.
_SIMPLER = {"scale": None, "lower_bound": None, "activation": None, "gate_strength": "mild", "mode": "chunk",
            "dtype": "float32", "tuning": None}


def failure_kind(exc: BaseException) -> str:
    """"mismatch" for an AssertionError (a comparison failed), else "crash:<exception type>"."""
    return "mismatch" if isinstance(exc, AssertionError) else f"crash:{type(exc).__name__}"


def _shorter(n: int, chunk: int) -> list[int]:
    """Lengths below ``n`` to try: 1, chunk boundaries +/- 1, halves, n - 1."""
    out = [1, chunk - 1, chunk, chunk + 1, 2 * chunk - 1, 2 * chunk, n // 2, n - 1]
    return sorted({t for t in out if 1 <= t < n})


def _smaller(n: int) -> list[int]:
    return sorted({x for x in (1, n // 2, n - 1) if 1 <= x < n})


def _narrower(op: str, key: str, n: int) -> list[int]:
    if op == "prism_attention":  # head dims: multiples of 8 from 16
        return sorted({x for x in (16, (n // 16) * 8, n - 8) if 16 <= x < n and x % 8 == 0})
    if key == "head_dim":  # layers: 8 and 16 (PrismAttention's smallest, enforced by fixup)
        return sorted({x for x in (8, 16) if x < n})
    return sorted({x for x in (4, 8, 16, n // 2, n - 1) if 4 <= x < n})


def fixup(case: dict) -> dict | None:
    """Make a modified case consistent again (dependent options), or None when it is not valid."""
    c = dict(case)
    op = c["op"]
    if op in DELTA_SPECS:
        spec = DELTA_SPECS[op]
        if spec.g is not None and not spec.g_optional and not c["g"]:
            return None
        if not c["g"]:
            c["gate_in_kernel"] = False
        if not c["gate_in_kernel"]:
            c["lower_bound"], c["dt_bias"] = None, False
        if spec.gates == "bw" and not c["beta"]:
            return None
        if not c["beta"]:
            c["beta_sigmoid"] = False
        if not c["beta_sigmoid"]:
            c["allow_neg_eigval"] = False
        if not (c["g"] or c["gk"]):
            c["gate_strength"] = None
        elif c["gate_strength"] is None:
            return None
    if op in LAYER_OPS:
        if op == "PrismAttention" and (c["heads"] % c["kv_heads"] or c["head_dim"] < 16):
            return None
        c["hidden"] = c["heads"] * c["head_dim"]
    for key in ("lens", "lens_q", "lens_k"):
        if c.get(key) is not None and not c[key]:
            return None
    if c.get("lens_q") is not None and len(c["lens_q"]) != len(c["lens_k"]):
        return None
    return c


def candidates(case: dict) -> Iterator[dict]:
    """Simplifications of ``case``, most effective first (each already through ``fixup``)."""
    chunk = case.get("chunk_size") or 16

    def emit(**changes):
        c = fixup({**case, **changes})
        if c is not None and c != case:
            yield c

    for key in ("T", "S"):
        if case.get(key) is not None:
            for t in _shorter(case[key], chunk):
                yield from emit(**{key: t})
    for key in ("lens", "lens_q", "lens_k"):
        lens = case.get(key)
        if lens is None:
            continue
        if key == "lens":  # one dense sequence instead of a pack
            yield from emit(lens=None, T=max(lens), B=1)
        for i in range(len(lens)):  # one sequence fewer
            drop = {k: case[k][:i] + case[k][i + 1:] for k in ("lens", "lens_q", "lens_k") if case.get(k)}
            yield from emit(**drop)
        for i, n in enumerate(lens):
            for t in _shorter(n, chunk):
                yield from emit(**{key: lens[:i] + [t] + lens[i + 1:]})
    for key in _COUNTS:
        if isinstance(case.get(key), int):
            for n in _smaller(case[key]):
                yield from emit(**{key: n})
    for key in _DIMS:
        if isinstance(case.get(key), int):
            for n in _narrower(case["op"], key, case[key]):
                yield from emit(**{key: n})
    for key, value in case.items():
        if key not in _FIXED and value is True:
            yield from emit(**{key: False})
    for key, value in _SIMPLER.items():
        if key in case and case[key] != value:
            yield from emit(**{key: value})


def shrink_case(case: dict, kind: str, run: Callable[[dict], None], seconds: float,
                log: Callable[[str], None] | None = None) -> tuple[dict, str, int]:
    """Greedy shrink of a case failing with ``kind``; ``run`` raises while a case fails.

    Returns ``(smallest failing case, its message, accepted steps)``; stops after ``seconds``."""
    deadline = time.monotonic() + seconds
    message, steps = "", 0
    progress = True
    while progress and time.monotonic() < deadline:
        progress = False
        for cand in candidates(case):
            if time.monotonic() >= deadline:
                break
            try:
                run(cand)
            except Exception as exc:  # noqa: BLE001 - a crash is a failure too
                if failure_kind(exc) == kind:
                    case, message, steps, progress = cand, first_line(exc), steps + 1, True
                    if log is not None:
                        log(f"      shrunk: {describe(case)}")
                    break
    return case, message, steps


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text.splitlines()[0]}"


def describe(case: dict) -> str:
    """A one-line summary of a case: its shapes and options, without the bookkeeping keys."""
    skip = ("op", "seed", "device", "run_seed", "index", "grad")
    parts = [f"{k}={v}" for k, v in case.items() if k not in skip and v is not None and v is not False]
    return " ".join(parts).replace(", ", ",")


SNIPPET = '''"""Reproducer of a `lamina fuzz` failure ({op}, {kind}): {message}

Rebuilds the case below and runs it against the float64 reference; raises while the failure persists.
"""
import json
import os

CASE = json.loads({case_json!r})

if CASE["device"] == "cpu" and CASE["backend"] == "triton":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before lamina imports triton

from lamina.fuzz import run_case  # noqa: E402

run_case(CASE)
print("passed: the failure no longer reproduces")
'''


def save_failure(out: str | Path, original: dict, shrunk: dict, kind: str, message: str) -> Path:
    """Write ``<op>-<n>.json`` (shrunk and original case, kind, message) and ``<op>-<n>.py``; returns the JSON path."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    while (folder / f"{shrunk['op']}-{n}.json").exists():
        n += 1
    path = folder / f"{shrunk['op']}-{n}.json"
    record = {"case": shrunk, "original": original, "kind": kind, "message": message}
    path.write_text(json.dumps(record, indent=1) + "\n")
    path.with_suffix(".py").write_text(SNIPPET.format(op=shrunk["op"], kind=kind, message=message.replace('"""', "'''"),
                                                      case_json=json.dumps(shrunk)))
    return path


def load_case(path: str | Path) -> dict:
    """The case of a saved failure (``{"case": ...}``) or of a JSON file holding one case dict."""
    data = json.loads(Path(path).read_text())
    case = data["case"] if "case" in data else data
    if not isinstance(case, dict) or "op" not in case:
        raise ValueError(f"{path}: expected a fuzz case (a JSON object with 'op') or a saved failure with 'case'")
    return case
