"""The delta-rule sweep: one prepared GPU run that times every speed alternative of lamina's chunked
delta-rule kernels against their defaults and against fla's chunk kernels.

On a GPU (``--device cuda``, at most about 6 minutes on an H200 with the default ``--time-budget``): the
four variants (``delta_rule``, ``gated_delta_rule``, ``kda``, ``gdn2``) at the "sweep" shapes of
``lamina.bench.specs`` (2x4096x16x128, 1x8192x64x128, 4x2048x16x256, bf16), forward and forward+backward:

1. lamina's defaults and fla (``fla.ops``; its chunk backward may refuse Hopper under Triton 3.6, its
   guard for fla issue #640: the record then says so and forward+backward is compared where fla runs),
   shape by shape, both modes of a shape before the next shape (a variant whose budget runs out keeps its
   forward+backward ratios at the first shapes);
2. then each alternative of ``lamina.kernels.delta_tuning.ALTERNATIVES``, in the modes and variants it
   changes, while time is left: every record names it as provider ``lamina-triton[choice]``.

It appends every record to ``--out`` (JSON lines, the suite's format: ``lamina bench summary`` reads it)
and prints lamina / fla per variant and mode and GDN-2 / KDA per mode, each against its target
(``FLA_TARGETS``, ``GDN2_OVER_KDA_TARGET``), each alternative's time against the default per case, and
the defaults table it would choose (an alternative whose geometric-mean time over the cases it ran is
at least ``MIN_GAIN`` below the default's; for the separate output kernel also ``output_kernel=None``, the
choice per call by the state pass's programs, from each record's ``state_pass_programs`` and
``multiprocessors``). The defaults in ``DeltaTuning`` change only from a committed
GPU run's results. ``--report-from FILE.jsonl``: only print the report from saved records.

``--dry-run``: the same code on the CPU at a tiny shape, lamina's Triton kernels under the Triton
interpreter, fla's naive PyTorch chunk forms in fla's place (seconds); CI runs it.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # before Triton is imported: lamina's kernels on CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from dataclasses import replace  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from lamina.bench import providers as bench_providers  # noqa: E402
from lamina.bench.results import ResultWriter, read_results  # noqa: E402
from lamina.bench.specs import SWEEP_DELTA_SHAPES  # noqa: E402
from lamina.bench.suite import SuiteConfig, run_suite  # noqa: E402
from lamina.bench.timing import TimingConfig  # noqa: E402
from lamina.kernels._utils import multiprocessors  # noqa: E402
from lamina.kernels.delta_chunk_common import has_warpgroup_mma  # noqa: E402
from lamina.kernels.delta_chunk_fwd import scan_tiles, state_pass_programs  # noqa: E402
from lamina.kernels.delta_tuning import ALTERNATIVES as TUNING_ALTERNATIVES  # noqa: E402
from lamina.kernels.delta_tuning import DeltaTuning, active_tuning, delta_tuning  # noqa: E402

OPS = ("gated_delta_rule", "kda", "gdn2", "delta_rule")
MODES = ("fwd", "fwd+bwd")
# The variants with a per-channel decay (the only ones DeltaTuning.channel_dots changes).
CHANNEL_OPS = ("kda", "gdn2")
# Each alternative (lamina.kernels.delta_tuning, the static report's too), the modes it can change (the
# solve runs in the forward, the value blocks in the backward) and the variants it can change.
ALTERNATIVES: tuple[tuple[DeltaTuning, tuple[str, ...], tuple[str, ...]], ...] = tuple(
    (t, ("fwd",) if t.changes_forward else ("fwd+bwd",), CHANNEL_OPS if t.channel_dots else OPS)
    for t in TUNING_ALTERNATIVES)
# An alternative becomes a default only this much faster (geometric mean of its time ratios).
MIN_GAIN = 0.03
# The family's speed targets (lamina's time over the other's): the forward at least 2x fla's chunked forward,
# forward+backward at least 1.5x; GDN-2 no slower than 1.15x KDA.
FLA_TARGETS = {"fwd": 1 / 2.0, "fwd+bwd": 1 / 1.5}
GDN2_OVER_KDA_TARGET = 1.15
# The defaults and fla take this share of the budget at most; the alternatives share the rest.
BASELINE_SHARE = 0.4
GPU_TIME_BUDGET_S = 300.0
GPU_TIMING = TimingConfig(warmup_ms=10.0, rep_ms=40.0)
# The warm pass (--warm): each case's first call only (its compiles and autotuning), no timing; no result.
WARM_TIMING = TimingConfig(warmup_ms=1.0, rep_ms=1.0, slow_call_s=0.0, slow_call_repeats=0)
# the dry run times the call that checked each provider runs, and no more (interpreter timings are no result)
DRY_TIMING = TimingConfig(warmup_ms=1.0, rep_ms=5.0, cpu_min_run_s=0.01, slow_call_s=0.1, slow_call_repeats=0)
LAMINA = "lamina-triton"


class _Renamed:
    """A writer that records the current alternative as part of the provider's name (in the record itself,
    which the suite also returns), and with each of lamina's records the programs of its state pass and the
    device's multiprocessors (what ``DeltaTuning(output_kernel=None)`` chooses by)."""

    def __init__(self, writer: ResultWriter, device: str) -> None:
        self.writer, self.suffix, self.device = writer, "", torch.device(device)

    def write(self, record: dict[str, Any]) -> None:
        if record.get("provider") == LAMINA and record.get("op") in OPS and "params" in record:
            p = record["params"]
            tiles = scan_tiles(p["K"], p["V"], p["dtype"] == "fp32", has_warpgroup_mma(self.device), active_tuning())
            sequences = p["B"] if p.get("seqlens") is None else len(p["seqlens"])
            record["state_pass_programs"] = state_pass_programs(sequences, p["HV"], p["V"], tiles)
            record["multiprocessors"] = multiprocessors(self.device)
        if self.suffix and record.get("provider") == LAMINA:
            record["provider"] = f"{LAMINA}[{self.suffix}]"
        self.writer.write(record)


def _interpreter_provider() -> None:
    """Dry run: lamina's Triton kernels on CPU tensors (under the interpreter) as the ``lamina-triton``
    provider."""
    current = bench_providers.PROVIDERS[LAMINA]
    bench_providers.PROVIDERS[LAMINA] = replace(current, devices=("cuda", "cpu"), available=None)


def config(device: str, dry_run: bool, providers: list[str], modes: list[str], budget: float | None,
           ops: tuple[str, ...] = OPS, timing: TimingConfig | None = None,
           shapes: tuple[int, ...] | None = None) -> SuiteConfig:
    timing = timing or (DRY_TIMING if dry_run else GPU_TIMING)
    return SuiteConfig(device=device, ops=list(ops), providers=providers, shape_set="sweep-dry" if dry_run else "sweep",
                       op_modes={op: list(modes) for op in ops}, timing=timing, time_budget_s=budget,
                       measure_ceilings=False, shape_filter=None if shapes is None else {op: shapes for op in ops},
                       shapes_first=True)


def run(device: str, dry_run: bool, out: str, budget_s: float, ops: tuple[str, ...] = OPS,
        baseline_share: float = BASELINE_SHARE, alternatives: bool | tuple[str, ...] = True,
        modes: tuple[str, ...] = MODES,
        timing: TimingConfig | None = None, shapes: tuple[int, ...] | None = None) -> list[dict[str, Any]]:
    """Time the defaults and fla (``baseline_share`` of ``budget_s`` at most), then each alternative that
    changes one of ``ops`` in one of ``modes`` (``alternatives``: all, none, or those of these labels); records
    appended to ``out``. ``timing``: the suite's timing
    (``WARM_TIMING``: each case's first call only, the warm pass's); ``shapes``: indices of the shapes to run
    (default all)."""
    writer = ResultWriter(out)
    renamed = _Renamed(writer, device)
    records: list[dict[str, Any]] = []
    start = time.monotonic()
    fla = "fla-naive-chunk" if dry_run else "fla"

    def progress(task, rec):
        name = f"{task.provider}[{renamed.suffix}]" if renamed.suffix and task.provider == LAMINA else task.provider
        print(f"{task.op:<17} {task.mode:<8} {task.label:<22} {name:<34} {rec['status']:<8} "
              f"{rec.get('ms') or rec.get('reason') or ''}", flush=True)

    def suite(providers: list[str], of_modes: list[str], budget: float, of: tuple[str, ...]) -> None:
        cfg = config(device, dry_run, providers, of_modes, max(budget, 1.0), of, timing, shapes)
        got, _ = run_suite(cfg, renamed, progress)
        records.extend(got)

    chosen = [(t, tuple(m for m in changes if m in modes), tuple(op for op in changed if op in ops))
              for t, changes, changed in ALTERNATIVES]
    chosen = [(t, m, changed) for t, m, changed in chosen if m and changed and alternatives
              and (alternatives is True or t.label() in alternatives)]
    try:
        suite([LAMINA, fla], list(modes), budget_s * (baseline_share if chosen else 1.0), ops)
        for n, (tuning, alt_modes, changed) in enumerate(chosen):
            left = budget_s - (time.monotonic() - start)
            if left <= 1.0:
                print(f"time budget spent: {tuning.label()} and later alternatives not run")
                break
            renamed.suffix = tuning.label()
            with delta_tuning(**tuning.choices()):
                suite([LAMINA], list(alt_modes), left / (len(chosen) - n), changed)
    finally:
        renamed.suffix = ""
        writer.close()
    return records


def compile_timed(record: dict[str, Any]) -> bool:
    """A record written before the suite kept a case's first call out of its timing (no ``first_call_ms``), whose
    timing is that first call: Triton's compiles and autotuning, not the kernels."""
    return record.get("timer") == "single call (time budget)" and "first_call_ms" not in record


def _times(records: list[dict[str, Any]]) -> tuple[dict[tuple, dict[str, float]], dict[tuple, dict[str, str]], int,
                                                    dict[tuple, tuple[int, int | None]]]:
    """{(op, mode, shape): {provider: ms}} of the successful timings, the timer of each, how many records were
    left out as ``compile_timed``, and {case: (the default's state pass programs, the device's multiprocessors)}
    where the default's record gives them."""
    times: dict[tuple, dict[str, float]] = defaultdict(dict)
    timers: dict[tuple, dict[str, str]] = defaultdict(dict)
    waves: dict[tuple, tuple[int, int | None]] = {}
    left_out = 0
    for r in records:
        if r.get("kind") == "result" and r.get("status") == "ok" and r.get("op") in OPS:
            if compile_timed(r):
                left_out += 1
                continue
            case = (r["op"], r["mode"], r["shape"])
            times[case][r["provider"]] = float(r["ms"])
            timers[case][r["provider"]] = str(r.get("timer"))
            if r["provider"] == LAMINA and "state_pass_programs" in r:
                waves[case] = (int(r["state_pass_programs"]), r.get("multiprocessors"))
    return times, timers, left_out, waves


# The report's candidate for DeltaTuning(output_kernel=None): the separate output kernel's timing where the state
# pass has fewer programs than the device has multiprocessors, the default's elsewhere.
BY_PROGRAMS = DeltaTuning(output_kernel=None)


def _below_one_wave(wave: tuple[int, int | None] | None) -> bool:
    return wave is not None and wave[1] is not None and wave[0] < wave[1]


def _timer_note(timers: dict[str, str], *providers: str) -> str:
    """Names the timers when two timings of a ratio come from different ones (do_bench and single calls)."""
    used = [timers.get(p) for p in providers]
    return "" if len(set(used)) == 1 else f"  (timers differ: {' / '.join(str(u) for u in used)})"


def _met(ratio: float, target: float, timer_note: str) -> str:
    """Whether a ratio meets its target; nothing where its two timings come from different timers."""
    if timer_note:
        return ""
    return " (target met)" if ratio <= target else " (target missed)"


def report(records: list[dict[str, Any]]) -> str:
    """lamina / fla per case; each alternative against the default; the defaults it would choose."""
    times, timers, left_out, waves = _times(records)
    env = next((r.get("env", {}) for r in records if r.get("kind") == "result"), {})
    lines = [f"delta-rule sweep on {env.get('device_name') or env.get('device') or '?'}, commit "
             f"{(env.get('commit') or '?')[:10]}, torch {env.get('torch')}, triton {env.get('triton')}"
             + (" (CPU: interpreter timings, a dry run, not a result)" if env.get("device") == "cpu" else ""),
             "lamina / fla (time ratio, < 1: lamina faster; targets: forward <= "
             f"{FLA_TARGETS['fwd']:.2f}, forward+backward <= {FLA_TARGETS['fwd+bwd']:.2f}):"]
    if left_out:
        lines.insert(1, f"({left_out} records left out: timed by their first call, which compiled)")
    for case, t in sorted(times.items()):
        op, mode, shape = case
        fla_name = "fla" if "fla" in t else "fla-naive-chunk"
        fla, ours = t.get(fla_name), t.get(LAMINA)
        note = _timer_note(timers[case], LAMINA, fla_name) if ours and fla else ""
        ratio = f"{ours / fla:.2f}{_met(ours / fla, FLA_TARGETS[mode], note)}" if ours and fla else "n/a"
        lines.append(f"  {op:<17} {mode:<8} {shape:<22} lamina {ours or float('nan'):8.3f} ms  "
                     f"fla {fla or float('nan'):8.3f} ms  lamina/fla {ratio}{note}")
    lines.append(f"GDN-2 / KDA, lamina's defaults (time ratio; target <= {GDN2_OVER_KDA_TARGET:.2f}):")
    compared = 0
    for (op, mode, shape), t in sorted(times.items()):
        kda_case = ("kda", mode, shape)
        if op != "gdn2" or LAMINA not in t or LAMINA not in times.get(kda_case, {}):
            continue
        compared += 1
        gdn2, kda = t[LAMINA], times[kda_case][LAMINA]
        note = _timer_note({"gdn2": timers[(op, mode, shape)][LAMINA], "kda": timers[kda_case][LAMINA]},
                           "gdn2", "kda")
        lines.append(f"  {mode:<8} {shape:<22} gdn2 {gdn2:8.3f} ms  kda {kda:8.3f} ms  "
                     f"gdn2/kda {gdn2 / kda:.2f}{_met(gdn2 / kda, GDN2_OVER_KDA_TARGET, note)}{note}")
    if not compared:
        lines.append("  not timed (no shape and mode with both variants' defaults)")
    lines.append("alternatives / default (time ratio, < 1: the alternative is faster):")
    chosen: dict[str, tuple[Any, float]] = {}
    for tuning, _, _ in ALTERNATIVES:
        label = tuning.label()
        name = f"{LAMINA}[{label}]"
        # a default is chosen only from ratios of one timer
        logs = {case: math.log(t[name] / t[LAMINA]) for case, t in times.items()
                if name in t and LAMINA in t and not _timer_note(timers[case], name, LAMINA)}
        for case, t in sorted(times.items()):
            if name in t and LAMINA in t:
                op, mode, shape = case
                wave = waves.get(case) if tuning.output_kernel else None
                sms = f"{wave[1]} multiprocessors" if wave and wave[1] else "not on CUDA"
                programs = f"  (state pass: {wave[0]} programs, {sms})" if wave else ""
                lines.append(f"  {label:<16} {op:<17} {mode:<8} {shape:<22} {t[name] / t[LAMINA]:.3f}"
                             f"{_timer_note(timers[case], name, LAMINA)}{programs}")
        if not logs:
            lines.append(f"  {label:<16} not timed (or only against a default of another timer)")
            continue
        mean = math.exp(sum(logs.values()) / len(logs))
        lines.append(f"  {label:<16} geometric mean over {len(logs)} cases: {mean:.3f}")
        candidates = [(tuning, mean)]
        if tuning.output_kernel:
            # the choice by the state pass's programs: this alternative's time below one wave, the default's
            # above; first, so that it stays chosen where the separate kernel does no better than it (where no
            # case above one wave was timed, or the separate kernel loses or ties there)
            below = [case for case in logs if _below_one_wave(waves.get(case))]
            by_programs = math.exp(sum(logs[case] for case in below) / len(logs))
            lines.append(f"  {BY_PROGRAMS.label():<16} (this one below one wave, in {len(below)} of {len(logs)} "
                         f"cases) geometric mean: {by_programs:.3f}")
            candidates.insert(0, (BY_PROGRAMS, by_programs))
        for candidate, gain in candidates:
            if gain <= 1 - MIN_GAIN:
                key, value = next(iter(candidate.choices().items()))
                if key not in chosen or gain < chosen[key][1]:
                    chosen[key] = (value, gain)
    picked = {key: value for key, (value, _) in chosen.items()}
    lines.append(f"defaults it would choose: DeltaTuning({', '.join(f'{k}={v}' for k, v in picked.items())})"
                 + ("  (no alternative gains " + f"{MIN_GAIN:.0%}; the defaults stay)" if not picked else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dry-run", action="store_true", help="a tiny CPU shape, kernels under the interpreter")
    parser.add_argument("--out", default="sweep_delta.jsonl", help="records (JSON lines, appended)")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds (default 300 on a GPU)")
    parser.add_argument("--report-from", metavar="FILE.jsonl", help="only print the report of saved records")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS),
                        help="the variants to time (one process each on a GPU keeps a fault in one from the rest)")
    parser.add_argument("--baseline-share", type=float, default=BASELINE_SHARE,
                        help=f"share of the budget for the defaults and fla (default {BASELINE_SHARE})")
    parser.add_argument("--no-alternatives", action="store_true", help="time the defaults and fla only")
    parser.add_argument("--alternatives", nargs="+", metavar="LABEL", choices=[t.label() for t, _, _ in ALTERNATIVES],
                        help="time only these alternatives (labels as the report prints them; default all)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the modes to time")
    parser.add_argument("--shapes", nargs="+", type=int, default=None, metavar="INDEX",
                        help="indices of the shapes to time (lamina.bench.specs.SWEEP_DELTA_SHAPES; default all)")
    parser.add_argument("--warm", action="store_true",
                        help="only make each case's first call (compiles and autotuning), no time budget unless "
                             "given: the warm pass before the timed one (records to --out are no result)")
    args = parser.parse_args(argv)
    if args.report_from:
        print(report(read_results([args.report_from])))
        return 0
    if args.dry_run:
        args.device = "cpu"
        _interpreter_provider()
    elif args.device != "cuda":
        parser.error("the sweep times lamina's Triton kernels: --device cuda, or --dry-run on the CPU")
    default_budget = math.inf if args.warm else (120.0 if args.dry_run else GPU_TIME_BUDGET_S)
    budget = args.time_budget if args.time_budget is not None else default_budget
    if not 0 < args.baseline_share <= 1:
        parser.error(f"--baseline-share must be in (0, 1], got {args.baseline_share}")
    n_shapes = 1 if args.dry_run else len(SWEEP_DELTA_SHAPES)
    if args.shapes is not None and not all(0 <= i < n_shapes for i in args.shapes):
        parser.error(f"--shapes: indices from 0 to {n_shapes - 1}, got {args.shapes}")
    alternatives = False if args.no_alternatives else (tuple(args.alternatives) if args.alternatives else True)
    records = run(args.device, args.dry_run, args.out, budget, tuple(args.ops), args.baseline_share,
                  alternatives, tuple(args.modes), WARM_TIMING if args.warm else None,
                  None if args.shapes is None else tuple(args.shapes))
    if args.warm:
        ok = sum(r.get("status") == "ok" for r in records)
        print(f"warm pass: {ok} of {len(records)} cases ran once (compiled and tuned); no timing")
        return 0
    print(report(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
