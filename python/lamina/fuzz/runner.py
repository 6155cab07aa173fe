"""Running fuzz cases: one case (``run_case``), a whole run with shrinking and saving (``run``)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lamina.fuzz.shrink import describe, failure_kind, first_line, save_failure, shrink_case
from lamina.fuzz.space import DELTA_OPS, DTYPE_NAMES, LAYER_OPS, OPS, draw_case

# Shrinking budget per failure: enough for ~30 interpreter cases, ~300 PyTorch ones.
SHRINK_SECONDS = 60.0


def run_case(case: dict) -> None:
    """Run one case (op and float64 oracle); raises AssertionError on a mismatch, or the op's exception."""
    op = case["op"]
    if op in DELTA_OPS:
        from lamina.fuzz.delta import check_delta

        return check_delta(case)
    if op in LAYER_OPS:
        from lamina.fuzz.layers import check_layer

        return check_layer(case)
    from lamina.fuzz import checks

    runners = {"prism_attention": checks.check_attention, "hrm_gated_update": checks.check_hrm,
               "causal_conv1d": checks.check_conv, "rms_norm_gated": checks.check_norm}
    if op not in runners:
        raise ValueError(f"case['op'] must be one of {', '.join(OPS)}, got {op!r}")
    return runners[op](case)


def ensure_interpreter() -> None:
    """Set ``TRITON_INTERPRET=1`` for CPU Triton cases; it must come before triton is imported."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise RuntimeError("--interpret (Triton kernels on CPU) needs TRITON_INTERPRET=1 before triton is imported, "
                           "but triton is already imported in this process; run `TRITON_INTERPRET=1 lamina fuzz ...` "
                           "or call lamina.fuzz.run(interpret=True) before anything imports triton")
    os.environ["TRITON_INTERPRET"] = "1"


@dataclass
class OpStats:
    cases: int = 0
    failures: int = 0  # mismatches against the reference
    crashes: int = 0  # exceptions
    seconds: float = 0.0


@dataclass
class Failure:
    """A failing case: as drawn, as shrunk, the shrunk case's message, and where it was saved."""

    original: dict
    shrunk: dict
    message: str
    kind: str
    path: Path | None = None


@dataclass
class FuzzReport:
    per_op: dict[str, OpStats] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the run, shrinking included
    shrink_seconds: float = 0.0  # time spent shrinking (not counted in a run's ``seconds`` budget)

    @property
    def cases(self) -> int:
        return sum(s.cases for s in self.per_op.values())

    @property
    def ok(self) -> bool:
        return not self.failures

    def table(self) -> str:
        """Per op: cases, failures, crashes, cases per minute; and the total."""
        rows = [f"{'op':<34} {'cases':>6} {'failures':>9} {'crashes':>8} {'cases/min':>10}"]
        total = OpStats()
        for op, s in self.per_op.items():
            rows.append(f"{op:<34} {s.cases:>6} {s.failures:>9} {s.crashes:>8} {_rate(s):>10}")
            total.cases += s.cases
            total.failures += s.failures
            total.crashes += s.crashes
            total.seconds += s.seconds
        rows.append(f"{'total':<34} {total.cases:>6} {total.failures:>9} {total.crashes:>8} {_rate(total):>10}")
        return "\n".join(rows)


def _rate(s: OpStats) -> str:
    return f"{60 * s.cases / s.seconds:.1f}" if s.seconds > 0 else "-"


def reproducer(case: dict, backend: str, dtypes: tuple[str, ...] | None, interpret: bool) -> str:
    """The command that draws and runs ``case`` again (every option that changes the draw or the run)."""
    parts = ["lamina fuzz", f"--op {case['op']}", f"--seed {case['run_seed']}", f"--index {case['index']}",
             "--cases 1", f"--device {case['device']}", f"--backend {backend}"]
    if interpret:
        parts.append("--interpret")
    if dtypes:
        parts.append("--dtype " + " ".join(dtypes))
    if not case["grad"]:
        parts.append("--no-grad")
    return " ".join(parts)


def run(
    ops: list[str] | tuple[str, ...] | None = None,
    seconds: float | None = None,
    cases: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    backend: str = "auto",
    interpret: bool = False,
    dtypes: list[str] | tuple[str, ...] | None = None,
    out: str | Path | None = None,
    grad: bool = True,
    log: Callable[[str], None] | None = None,
    *,
    start: int = 0,
    shrink_seconds: float = SHRINK_SECONDS,
    max_failures: int | None = None,
) -> FuzzReport:
    """Fuzz ``ops`` (default: all) round-robin from case index ``start``.

    Stops after ``cases`` cases per op or ``seconds`` of wall time spent on cases (shrinking not
    counted), whichever comes first (default: 3 cases per op). Every failure (mismatch or
    exception) is shrunk for at most ``shrink_seconds``, then saved under ``out`` (when given) as
    ``<op>-<n>.json`` and ``<op>-<n>.py``; the run stops early after ``max_failures`` failures
    when given.
    ``interpret`` (or ``backend="triton"`` on CPU) runs Triton kernels under the interpreter.
    """
    ops = tuple(OPS if ops is None else ops)
    for op in ops:
        if op not in OPS:
            raise ValueError(f"ops: each must be one of {', '.join(OPS)}, got {op!r}")
    for name in dtypes or ():
        if name not in DTYPE_NAMES:
            raise ValueError(f"dtypes: each must be one of {DTYPE_NAMES}, got {name!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cpu" and backend in ("triton",):
        interpret = True
    if device == "cpu" and backend == "cuda":
        raise ValueError("backend='cuda' needs device='cuda'")
    if interpret and device == "cpu":
        ensure_interpreter()
        import lamina.kernels  # noqa: F401 - decorate the kernels now, in interpreter mode
    if cases is None and seconds is None:
        cases = 3
    log = log or (lambda line: None)
    dtypes = tuple(dtypes) if dtypes else None
    report = FuzzReport(per_op={op: OpStats() for op in ops})
    began = time.monotonic()
    index = start
    while True:
        if cases is not None and index - start >= cases:
            break
        for op in ops:
            if seconds is not None and time.monotonic() - began - report.shrink_seconds >= seconds:
                break
            if max_failures is not None and len(report.failures) >= max_failures:
                break
            case = draw_case(op, seed, index, device=device, backend=backend, interpret=interpret, dtypes=dtypes,
                             grad=grad)
            _one(case, report, out, backend, dtypes, interpret, shrink_seconds, log)
        else:
            index += 1
            continue
        break
    report.seconds = time.monotonic() - began
    return report


def _one(case: dict, report: FuzzReport, out, backend: str, dtypes, interpret: bool, shrink_seconds: float,
         log) -> None:
    stats = report.per_op[case["op"]]
    t0 = time.monotonic()
    try:
        run_case(case)
        error = None
    except Exception as exc:  # noqa: BLE001 - a crash is a failure like a mismatch
        error = exc
    stats.cases += 1
    stats.seconds += time.monotonic() - t0
    head = f"{case['op']:<34} #{case['index']:<5}"
    if error is None:
        log(f"ok    {head} {describe(case)} ({time.monotonic() - t0:.2f} s)")
        return
    kind = failure_kind(error)
    if kind == "mismatch":
        stats.failures += 1
    else:
        stats.crashes += 1
    first = first_line(error)
    log(f"{'FAIL ' if kind == 'mismatch' else 'CRASH'} {head} {describe(case)}\n      {first}")
    log(f"      reproduce: {reproducer(case, backend, dtypes, interpret)}")
    t_shrink = time.monotonic()
    shrunk, message, steps = shrink_case(case, kind, run_case, shrink_seconds)
    report.shrink_seconds += time.monotonic() - t_shrink
    failure = Failure(original=case, shrunk=shrunk, message=message or first, kind=kind)
    log(f"      shrunk in {steps} steps to: {describe(shrunk)}")
    if out is not None:
        failure.path = save_failure(out, case, shrunk, kind, failure.message)
        log(f"      saved: {failure.path} (replay: lamina fuzz --replay {failure.path}; or python "
            f"{failure.path.with_suffix('.py')})")
    report.failures.append(failure)
