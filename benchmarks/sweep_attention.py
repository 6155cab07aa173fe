"""The attention and HRM-update sweep: one prepared GPU run that sets ``prism_attention``'s dispatch table.

On a GPU (``--device cuda``, at most about 6 minutes on an H200 with the default ``--time-budget``):

* ``prism_attention`` over head dims 64, 96, 128, 192, 256, 320, 384, 512, causal and not, at
  B x T = 4 x 4096 with H x D = 2048 (equal FLOPs at every D; ``lamina.bench.specs``, shape set
  "sweep"), bf16, forward and forward+backward, for lamina's kernel, FlashAttention (when installed)
  and SDPA's flash, cuDNN and memory-efficient backends;
* ``hrm_update`` at 4096 rows of 1024, 2048 and 4096, forward and backward, for lamina's Triton and
  CUDA C++ kernels, eager PyTorch and torch.compile, with the fraction of the measured copy bandwidth.

It appends every record to ``--out`` (JSON lines, the suite's format: ``lamina bench summary`` reads
it), then writes the dispatch table (the fastest path per case, ``lamina.ops.attention_dispatch``) to
``--table`` and prints it with lamina / best-SDPA and lamina / FlashAttention per head dim and the HRM
fractions. Committing a GPU run's table as ``python/lamina/data/attention_dispatch.json`` makes it the
default; ``LAMINA_ATTENTION_TABLE=FILE`` tries one first.

``--dry-run``: the same code on the CPU at tiny shapes (shape set "sweep-dry") with the CPU providers, in
seconds; CI runs it. ``--table-from FILE.jsonl``: only rebuild the table and the report from saved records.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from lamina.bench.results import ResultWriter, environment, read_results
from lamina.bench.suite import SuiteConfig, run_suite
from lamina.bench.timing import TimingConfig
from lamina.ops.attention_dispatch import DispatchTable, describe, table_from_records

OPS = ("prism_attention", "hrm_update")
MODES = {"prism_attention": ["fwd", "fwd+bwd"], "hrm_update": ["fwd", "bwd"]}
GPU_PROVIDERS = ["lamina-triton", "lamina-cuda", "flash-attn", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient",
                 "torch-eager", "torch-compile"]
CPU_PROVIDERS = ["lamina-torch", "sdpa-flash", "sdpa-math", "torch-eager"]
# 32 attention cases x 5 paths and 6 HRM cases x 4: about 180 timings and every Triton compile in 300 s.
GPU_TIME_BUDGET_S = 300.0
GPU_TIMING = TimingConfig(warmup_ms=10.0, rep_ms=50.0)
# the dry run times the call that checked each provider runs, and no more (interpreter timings are no result)
DRY_TIMING = TimingConfig(warmup_ms=1.0, rep_ms=5.0, cpu_min_run_s=0.01, slow_call_s=0.1, slow_call_repeats=0)


def config(device: str, dry_run: bool, time_budget_s: float | None) -> SuiteConfig:
    return SuiteConfig(
        device=device, ops=list(OPS), providers=CPU_PROVIDERS if dry_run else GPU_PROVIDERS,
        shape_set="sweep-dry" if dry_run else "sweep", op_modes=MODES,
        timing=DRY_TIMING if dry_run else GPU_TIMING,
        time_budget_s=time_budget_s if time_budget_s is not None else (None if dry_run else GPU_TIME_BUDGET_S),
        measure_ceilings=True, tiny_ceilings=dry_run)


def ratios(records: list[dict[str, Any]]) -> list[str]:
    """Per attention case: lamina / best SDPA and lamina / FlashAttention (time ratios, < 1: lamina faster)."""
    times: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in records:
        if r.get("kind") == "result" and r.get("op") == "prism_attention" and r.get("status") == "ok":
            p = r["params"]
            times[(p["D"], p["causal"], r["mode"], p["dtype"])][r["provider"]] = float(r["ms"])
    lines = []
    for (D, causal, mode, dtype), t in sorted(times.items()):
        lamina = t.get("lamina-triton", t.get("lamina-torch"))
        sdpa = [ms for name, ms in t.items() if name.startswith("sdpa")]
        flash = t.get("flash-attn")
        fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(f"  D={D:<4} {'causal' if causal else 'full  '} {mode:<8} {dtype}: lamina {fmt(lamina)} ms, "
                     f"lamina/best-SDPA {fmt(lamina / min(sdpa) if lamina and sdpa else None)}, "
                     f"lamina/FlashAttention {fmt(lamina / flash if lamina and flash else None)}")
    return lines


def hrm_lines(records: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in records:
        if r.get("kind") == "result" and r.get("op") == "hrm_update" and r.get("status") == "ok":
            frac = r.get("frac_bandwidth")
            lines.append(f"  {r['shape']:<22} {r['mode']:<4} {r['provider']:<14} {float(r['ms']):8.3f} ms  "
                         f"{'n/a' if frac is None else f'{100 * frac:.0f}%'} of copy bandwidth")
    return lines


def report(records: list[dict[str, Any]], table: DispatchTable) -> str:
    return "\n".join([describe(table), "prism_attention, time ratios:", *ratios(records),
                      "hrm_update:", *hrm_lines(records)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dry-run", action="store_true", help="tiny CPU shapes and providers (seconds)")
    parser.add_argument("--out", default="sweep_attention.jsonl", help="records (JSON lines, appended)")
    parser.add_argument("--table", default="attention_dispatch.json", help="where the dispatch table is written")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds (default 300 on a GPU)")
    parser.add_argument("--table-from", metavar="FILE.jsonl", help="rebuild the table from saved records only")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    if args.table_from:
        records = read_results([args.table_from])
        env = next((r.get("env", {}) for r in records if r.get("op") == "prism_attention"), {})
    else:
        writer = ResultWriter(args.out)
        try:
            def progress(task, rec):
                print(f"{task.op:<16} {task.mode:<8} {task.label:<32} {task.provider:<15} {rec['status']:<8} "
                      f"{rec.get('ms') or rec.get('reason') or ''}", flush=True)

            records, _ = run_suite(config(args.device, args.dry_run, args.time_budget), writer, progress)
        finally:
            writer.close()
        env = environment(args.device)
    source = (f"sweep on {env.get('device_name') or args.device}, commit {(env.get('commit') or '?')[:10]}, "
              f"torch {env.get('torch')}, triton {env.get('triton')}, {env.get('date')}")
    table = table_from_records(records, source)
    Path(args.table).write_text(json.dumps(table.to_json(), indent=1) + "\n")
    print(report(records, table))
    print(f"dispatch table: {args.table} ({len(table.entries)} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
