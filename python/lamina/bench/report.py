"""Terminal output: a progress bar while the suite runs, then the comparison table.

``rich`` renders both when it is installed and the stream is a terminal; otherwise
a plain-text fallback prints one line per measurement and a fixed-width table.
Ratios compare every provider with the group's baseline (the first that ran of a
per-op preference list: fla, FlashAttention or sdpa on GPUs; the reference on CPUs; fla for
the layer ops).
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, TextIO

from lamina.bench.specs import ATTENTION_OPS, DELTA_OPS, LAYER_OPS

# Baseline preference per device and op family.
_BASELINES_CUDA_DELTA = ("fla", "torch-eager", "reference")
_BASELINES_LAYERS = ("fla",)  # lamina's layer against fla's; on a CPU only lamina's runs (no baseline)
_BASELINES_CUDA_ATTN = ("flash-attn", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "torch-eager")
_BASELINES_CUDA_OTHER = ("torch-compile", "torch-eager", "reference")
_BASELINES_CPU = ("reference", "torch-eager", "sdpa-math")


def baseline_preference(op: str, device: str) -> tuple[str, ...]:
    if op in LAYER_OPS:
        return _BASELINES_LAYERS
    if device != "cuda":
        return _BASELINES_CPU
    if op in DELTA_OPS or op == "gdn_decode":
        return _BASELINES_CUDA_DELTA
    if op in ATTENTION_OPS:
        return _BASELINES_CUDA_ATTN
    return _BASELINES_CUDA_OTHER


def group_key(rec: dict[str, Any]) -> tuple[str, str, str, str]:
    return (rec["op"], rec["shape"], rec["mode"], rec["device"])


def grouped(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str, str], list[dict[str, Any]]]:
    """Result records by (op, shape, mode, device), in first-seen order; the latest record of a
    provider in a group wins (a results file can hold several runs)."""
    groups: dict[tuple[str, str, str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for rec in records:
        if rec.get("kind") == "result":
            groups[group_key(rec)][rec["provider"]] = rec
    return {k: list(v.values()) for k, v in groups.items()}


def baseline_of(group: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The group's baseline record: the first preferred provider with status ok."""
    ok = {r["provider"]: r for r in group if r.get("status") == "ok"}
    if not ok:
        return None
    op, device = group[0]["op"], group[0]["device"]
    for name in baseline_preference(op, device):
        if name in ok:
            return ok[name]
    return None


def ratio_text(x: float) -> str:
    """A speedup with three significant digits: 1.45x, 738x, 0.00177x."""
    return f"{x:.3g}x"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table_rows(records: Iterable[dict[str, Any]]) -> list[list[str]]:
    """One row per timed record: op, shape, mode, provider, ms, p20-p80, TFLOP/s, GB/s, roofline %, ratio."""
    rows = []
    for _, group in grouped(records).items():
        base = baseline_of(group)
        for rec in group:
            if rec.get("status") != "ok":
                continue
            if base is None:
                ratio = "-"
            elif rec is base:
                ratio = f"1x (base: {base['provider']})"
            else:
                ratio = f"{ratio_text(base['ms'] / rec['ms'])} vs {base['provider']}"
            roof = rec.get("roofline_frac")
            rows.append([rec["op"], rec["shape"], rec["mode"], rec["provider"], f"{rec['ms']:.3f}",
                         f"{rec['ms_p20']:.3f}-{rec['ms_p80']:.3f}", _fmt(rec.get("tflops"), ".3f"),
                         _fmt(rec.get("gbps"), ".1f"), "-" if roof is None else f"{100 * roof:.1f}", ratio])
    return rows


HEADER = ["op", "shape", "mode", "provider", "ms", "p20-p80", "TFLOP/s", "GB/s", "roofline %", "speedup"]


def not_run_lines(records: Iterable[dict[str, Any]]) -> list[str]:
    """Skipped and failed providers, one line per (status, provider, reason) with a case count."""
    counts: dict[tuple[str, str, str], int] = defaultdict(int)
    for rec in records:
        if rec.get("kind") == "result" and rec.get("status") in ("skipped", "error"):
            counts[(rec["status"], rec["provider"], rec.get("reason") or "")] += 1
    return [f"{status}: {prov} ({n} case{'s' if n > 1 else ''}): {reason}"
            for (status, prov, reason), n in counts.items()]


def ratio_lines(records: Iterable[dict[str, Any]]) -> list[str]:
    """For each group where a lamina provider ran: its speedup over every other provider that ran."""
    lines = []
    for (op, shape, mode, _), group in grouped(records).items():
        ok = [r for r in group if r.get("status") == "ok"]
        for mine in (r for r in ok if r["provider"].startswith("lamina-")):
            others = [f"{ratio_text(o['ms'] / mine['ms'])} over {o['provider']}" for o in ok if o is not mine]
            if others:
                lines.append(f"{op} {shape} {mode}: {mine['provider']} {mine['ms']:.3f} ms, speedup "
                             + ", ".join(others))
    return lines


def _use_rich(stream: TextIO) -> bool:
    if os.environ.get("LAMINA_BENCH_PLAIN") == "1" or not getattr(stream, "isatty", lambda: False)():
        return False
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _plain_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def print_report(records: list[dict[str, Any]], ceilings: dict[str, Any] | None = None,
                 stream: TextIO | None = None) -> None:
    """The comparison table, the ceilings, the lamina speedups and the providers that did not run."""
    stream = stream or sys.stdout
    rows = table_rows(records)
    ceil = None
    if ceilings:
        ceil = (f"ceilings ({ceilings['device']}): copy {ceilings['copy_gbps']:.1f} GB/s, "
                f"{ceilings['matmul_dtype']} matmul {ceilings['matmul_tflops']:.2f} TFLOP/s (n={ceilings['matmul_n']})")
    if _use_rich(stream):
        from rich.console import Console
        from rich.table import Table

        console = Console(file=stream)
        table = Table(title="lamina bench")
        for h in HEADER:
            table.add_column(h, justify="right" if h not in ("op", "shape", "mode", "provider", "speedup") else "left")
        for r in rows:
            table.add_row(*r)
        console.print(table)
        emit = console.print
    else:
        print(_plain_table(HEADER, rows), file=stream)
        emit = lambda s: print(s, file=stream)
    if ceil:
        emit(ceil)
    for line in ratio_lines(records):
        emit(line)
    for line in not_run_lines(records):
        emit(line)


class Progress:
    """A progress bar on stderr (rich) or one line per measurement (plain)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = 0
        self.done = 0
        self._rich = None
        self._task = None

    def start(self, total: int) -> None:
        self.total = total
        if _use_rich(self.stream):
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._rich = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=Console(file=self.stream))
            self._rich.start()
            self._task = self._rich.add_task("lamina bench", total=total)

    def update(self, task: Any, rec: dict[str, Any]) -> None:
        self.done += 1
        what = f"{rec['op']} {rec['mode']} {rec['shape']} {rec['provider']}"
        status = f"{rec['ms']:.3f} ms" if rec.get("status") == "ok" else rec.get("status", "?")
        if self._rich is not None:
            self._rich.update(self._task, advance=1, description=f"{what}: {status}")
        else:
            width = len(str(self.total))
            print(f"[{self.done:>{width}}/{self.total}] {what}: {status}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
