"""``lamina bench plot``: PNG charts from results files (matplotlib, from the ``[bench]`` extra).

Two charts per (op, mode, device):
* ``<op>-<mode>-<device>-speedup.png``: for every shape, each provider's speedup over the
  group's baseline (report.baseline_of), bars on a log axis, the baseline at 1;
* ``<op>-<mode>-<device>-roofline.png``: each provider's fraction of the roofline
  (time at the measured copy/matmul ceilings over the measured time), 1.0 is the machine's limit.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from lamina.bench.report import baseline_of, grouped
from lamina.bench.results import read_results

# Figure geometry: width grows with the number of shapes so that labels do not overlap.
FIG_HEIGHT_IN = 4.5
FIG_WIDTH_PER_SHAPE_IN = 1.6
FIG_MIN_WIDTH_IN = 6.0
DPI = 110


class MissingMatplotlib(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingMatplotlib(
            "matplotlib is not installed; install the benchmark extra: `pip install -e .[bench]` "
            "(or `pip install matplotlib`)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def _bars(plt: Any, shapes: list[str], series: dict[str, list[float | None]], ylabel: str, title: str,
          path: Path, log: bool, hline: float | None) -> None:
    width_in = max(FIG_MIN_WIDTH_IN, FIG_WIDTH_PER_SHAPE_IN * len(shapes) + 2)
    fig, ax = plt.subplots(figsize=(width_in, FIG_HEIGHT_IN), dpi=DPI)
    n = max(1, len(series))
    bar_w = 0.8 / n
    for i, (prov, values) in enumerate(series.items()):
        xs = [j + (i - (n - 1) / 2) * bar_w for j in range(len(shapes))]
        pts = [(x, v) for x, v in zip(xs, values) if v is not None and v > 0]
        if pts:
            ax.bar([x for x, _ in pts], [v for _, v in pts], width=bar_w, label=prov)
    if hline is not None:
        ax.axhline(hline, color="black", linewidth=0.8, linestyle="--")
    if log:
        ax.set_yscale("log")
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_results(files: list[str | os.PathLike[str]], outdir: str | os.PathLike[str]) -> list[Path]:
    """Write the charts of every timed group in ``files`` to ``outdir``; returns the PNG paths."""
    plt = _pyplot()
    records = read_results(list(files))
    outdir = Path(outdir)
    # (op, mode, device) -> shape -> provider -> (speedup, roofline fraction)
    charts: dict[tuple[str, str, str], dict[str, dict[str, tuple[float | None, float | None]]]] = defaultdict(dict)
    for (op, shape, mode, device), group in grouped(records).items():
        ok = [r for r in group if r.get("status") == "ok"]
        if not ok:
            continue
        base = baseline_of(group)
        charts[(op, mode, device)][shape] = {
            r["provider"]: (base["ms"] / r["ms"] if base else None, r.get("roofline_frac")) for r in ok
        }
    written = []
    if charts:
        outdir.mkdir(parents=True, exist_ok=True)
    for (op, mode, device), by_shape in charts.items():
        shapes = list(by_shape)
        providers = list(dict.fromkeys(p for cells in by_shape.values() for p in cells))
        speed = {p: [by_shape[s].get(p, (None, None))[0] for s in shapes] for p in providers}
        roof = {p: [by_shape[s].get(p, (None, None))[1] for s in shapes] for p in providers}
        stem = _slug(f"{op}-{mode}-{device}")
        if any(v is not None for vals in speed.values() for v in vals):
            path = outdir / f"{stem}-speedup.png"
            _bars(plt, shapes, speed, "speedup over the baseline (x)", f"{op} {mode} on {device}: speedup",
                  path, log=True, hline=1.0)
            written.append(path)
        if any(v is not None for vals in roof.values() for v in vals):
            path = outdir / f"{stem}-roofline.png"
            _bars(plt, shapes, roof, "fraction of the roofline", f"{op} {mode} on {device}: roofline fraction",
                  path, log=False, hline=1.0)
            written.append(path)
    return written
