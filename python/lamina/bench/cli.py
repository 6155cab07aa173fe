"""``lamina bench``: run the suite, list providers, measure ceilings, plot and summarise results.

    lamina bench --quick                      # a few ops on this machine, comparison table (< 2 min on CPU)
    lamina bench --op kda --device cpu        # one op, every provider, CPU shapes, all modes
    lamina bench --op layers                  # lamina.layers vs fla.layers (DeltaNet, GatedDeltaNet, KDA, GDN-2)
    lamina bench --op decode                  # the decode step over a state pool (lamina.bench.decode)
    lamina bench --op generation              # tokens/s of generation, HRM-LM vs PrismDecoder
    lamina bench --device cuda --time-budget 300
    lamina bench providers [--device cpu]     # which providers can run here, and why not
    lamina bench ceilings [--device cuda]     # copy bandwidth and matmul rate
    lamina bench summary FILE...              # the table of a results file
    lamina bench plot FILE... [--outdir DIR]  # PNG charts (needs matplotlib: pip install lamina[bench])
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from lamina.bench.providers import PROVIDERS
from lamina.bench.specs import MODES, OP_GROUPS, OPS, RUN_ORDER, SHAPE_SETS, expand_ops

SUBCOMMANDS = ("providers", "ceilings", "summary", "plot")


class UsageError(ValueError):
    """A bad command line or input file: reported in one line, exit status 2."""


def _csv(values: list[str] | None) -> list[str]:
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


def _resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible to torch")
    return name


def _check_names(kind: str, names: list[str], known: list[str] | tuple[str, ...]) -> None:
    bad = [n for n in names if n not in known]
    if bad:
        raise UsageError(f"unknown {kind} {', '.join(repr(b) for b in bad)}; known: {', '.join(known)}")


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lamina bench", description="lamina benchmark suite",
                                epilog="subcommands: " + ", ".join(SUBCOMMANDS) + " (lamina bench SUB --help)")
    p.add_argument("--quick", action="store_true", help="a few ops on this device with the comparison table")
    p.add_argument("--op", action="append", help=f"op(s), comma-separated: {', '.join(OPS)}; groups: "
                   + ", ".join(f"{g} ({', '.join(ops)})" for g, ops in OP_GROUPS.items())
                   + " (default: every kernel op; the layer ops run when named); decode: the decode step "
                   "over a state pool, on its own (lamina.bench.decode); generation: tokens/s of generate, HRM-LM vs "
                   "PrismDecoder (lamina.bench.generation)")
    p.add_argument("--provider", action="append", help=f"provider(s) by exact name: {', '.join(PROVIDERS)}")
    p.add_argument("--exclude", action="append", help="provider(s) to leave out")
    p.add_argument("--mode", action="append", help=f"mode(s): {', '.join(MODES)}")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--shapes", choices=SHAPE_SETS, help="shape set (default: standard on cuda, small on cpu)")
    p.add_argument("--out", help="results file, JSON lines, appended (default: <date>-<device>.jsonl in "
                   "$LAMINA_RESULTS_DIR or ~/.cache/lamina/bench, never inside the checkout)")
    p.add_argument("--no-save", action="store_true", help="do not write a results file")
    p.add_argument("--time-budget", type=float, help="seconds; cases not started in time are recorded as skipped")
    p.add_argument("--warmup-ms", type=float, help="CUDA warm-up per case (do_bench)")
    p.add_argument("--rep-ms", type=float, help="CUDA timed repetitions per case (do_bench)")
    p.add_argument("--cpu-min-run-s", type=float, help="CPU timing per case (torch.utils.benchmark)")
    p.add_argument("--no-ceilings", action="store_true", help="skip the copy and matmul ceilings")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    return p


def _run(argv: list[str]) -> int:
    parser = _run_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and _csv(args.op) != ["generation"]:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from lamina.bench.report import Progress, print_report
    from lamina.bench.results import ResultWriter, default_results_path
    from lamina.bench.suite import SuiteConfig, quick_config, run_suite

    if args.threads:
        torch.set_num_threads(args.threads)
    device = _resolve_device(args.device)
    if device == "cpu":
        # Inductor's pool of compile workers keeps running after a compile and would share the
        # cores with the timed calls that follow: compile in-process on CPU runs.
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    ops, providers, exclude, modes = _csv(args.op), _csv(args.provider), _csv(args.exclude), _csv(args.mode)
    if ops == ["decode"]:  # the decode step's own benchmark (lamina.bench.decode)
        from lamina.bench import decode

        return decode.main(argv, device)
    if ops == ["generation"]:  # tokens/s of generation, HRM-LM vs PrismDecoder (lamina.bench.generation)
        from lamina.bench import generation

        forwarded = ["--device", device] + (["--out", args.out] if args.out else []) \
            + (["--no-save"] if args.no_save else []) + (["--threads", str(args.threads)] if args.threads else [])
        return generation.main(forwarded + extra)  # its own options (--batch-sizes, --new-tokens, ...)
    _check_names("op", ops, (*OPS, *OP_GROUPS))
    ops = expand_ops(ops)
    _check_names("provider", providers + exclude, tuple(PROVIDERS))
    _check_names("mode", modes, MODES)
    if args.quick:  # the quick cases (lamina.bench.suite.quick_config), with the options given on top
        cfg = quick_config(device, ops)
        if modes:
            cfg.op_modes = {op: modes for op in cfg.ops}
        if providers:
            cfg.providers = providers
        if args.shapes is not None:
            cfg.shape_set, cfg.shape_filter = args.shapes, None
        if args.time_budget is not None:
            cfg.time_budget_s = args.time_budget
    else:
        cfg = SuiteConfig(device=device, ops=ops or list(RUN_ORDER), providers=providers or list(PROVIDERS),
                          shape_set=args.shapes or ("standard" if device == "cuda" else "small"),
                          modes=modes or None, time_budget_s=args.time_budget)
    cfg.measure_ceilings, cfg.tiny_ceilings = not args.no_ceilings, args.shapes == "tiny"
    cfg.timing = dataclasses.replace(
        cfg.timing,
        warmup_ms=args.warmup_ms if args.warmup_ms is not None else cfg.timing.warmup_ms,
        rep_ms=args.rep_ms if args.rep_ms is not None else cfg.timing.rep_ms,
        cpu_min_run_s=args.cpu_min_run_s if args.cpu_min_run_s is not None else cfg.timing.cpu_min_run_s,
    )
    cfg.providers = [p for p in cfg.providers if p not in exclude]

    _warn_if_oversubscribed(device)
    out = None if args.no_save else Path(args.out) if args.out else default_results_path(device)
    writer = ResultWriter(out)
    progress = Progress()
    try:
        records, ceilings = run_suite(cfg, writer, progress.update, on_start=progress.start)
    finally:
        progress.close()
        writer.close()
    print_report(records, ceilings.as_dict() if ceilings else None)
    if out is not None:
        print(f"results appended to {out}")
    errors = [r for r in records if r.get("status") == "error"]
    return 1 if errors else 0


def _warn_if_oversubscribed(device: str) -> None:
    """CPU timings are meaningless when other processes hold the cores: say so before running."""
    if device != "cpu" or not hasattr(os, "getloadavg"):
        return
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:
        print(f"lamina bench: warning: load average {load:.1f} on {cores} cores; CPU timings will be noisy, and "
              "multi-threaded ops slow down most (OpenMP threads wait for each other): try --threads 1",
              file=sys.stderr)


def _providers(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lamina bench providers", description="which providers run here, and why not")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--op", action="append", help="op(s) or group(s), comma-separated")
    args = p.parse_args(argv)
    from lamina.bench.providers import availability

    device = _resolve_device(args.device)
    ops = _csv(args.op)
    _check_names("op", ops, (*OPS, *OP_GROUPS))
    ops = expand_ops(ops) or list(OPS)
    print(f"providers on {device}:")
    by_provider: dict[str, dict[str, list[str]]] = {}
    for name, op, reason in availability(device, ops):
        by_provider.setdefault(name, {}).setdefault(reason or "", []).append(op)
    for name, reasons in by_provider.items():
        for reason, which in reasons.items():
            status = "available" if not reason else f"skipped: {reason}"
            print(f"  {name:<15} {status}  [{', '.join(which)}]")
    return 0


def _ceilings(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lamina bench ceilings", description="copy bandwidth and matmul rate")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--tiny", action="store_true", help="tiny sizes (a smoke test, not a measurement)")
    args = p.parse_args(argv)
    from lamina.bench.ceilings import measure_ceilings

    c = measure_ceilings(_resolve_device(args.device), tiny=args.tiny)
    print(f"{c.device}: copy {c.copy_gbps:.1f} GB/s ({c.copy_bytes} bytes), "
          f"{c.matmul_dtype} matmul {c.matmul_tflops:.3f} TFLOP/s (n={c.matmul_n})")
    return 0


def _summary(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lamina bench summary", description="the table of results files")
    p.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    from lamina.bench.report import print_report
    from lamina.bench.results import read_results

    try:
        records = read_results(args.files)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    ceilings = [r for r in records if r["kind"] == "ceiling" and "copy_gbps" in r]
    env = next((r["env"] for r in records if "env" in r), None)
    if env:
        print(f"{env.get('device_name')} | commit {str(env.get('commit'))[:10]} | torch {env.get('torch')} | "
              f"triton {env.get('triton')} | fla {env.get('fla')} | {env.get('date')}")
    print_report(records, ceilings[-1] if ceilings else None)
    return 0


def _plot(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lamina bench plot", description="PNG charts from results files")
    p.add_argument("files", nargs="+")
    p.add_argument("--outdir", help="where to write the PNGs (default: a plots/ folder beside the first file)")
    args = p.parse_args(argv)
    from lamina.bench.plot import MissingMatplotlib, plot_results

    outdir = Path(args.outdir) if args.outdir else Path(args.files[0]).resolve().parent / "plots"
    try:
        written = plot_results(args.files, outdir)
    except MissingMatplotlib as exc:
        print(f"lamina bench plot: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    for path in written:
        print(path)
    if not written:
        print("lamina bench plot: no timed results in the given files", file=sys.stderr)
        return 1
    return 0


def _context_parallel(argv: list[str]) -> int:
    from lamina.bench.context_parallel import CP_OPS, format_table, run_scaling

    p = argparse.ArgumentParser(prog="lamina bench context-parallel",
                                description="time per token and communication vs the number of ranks "
                                            "(processes started here: gloo on CPU, NCCL on CUDA with one GPU each)")
    p.add_argument("--op", action="append", help=f"op(s), comma-separated: {', '.join(CP_OPS)} "
                                                 "(default: chunk_gated_delta_rule,prism_attention)")
    p.add_argument("--ranks", default="1,2", help="rank counts, comma-separated (default 1,2)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the whole sequence (default 4096)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64, help="head dim (K = V = D)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per case (the median counts)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads shared by the ranks (default: every core)")
    p.add_argument("--layout", default="contiguous", choices=("contiguous", "zigzag"),
                   help="the context's layout (zigzag: two segments per rank, causal attention balanced)")
    p.add_argument("--out", help="also append the records to this JSON lines file")
    args = p.parse_args(argv)
    ops = _csv(args.op) or ["chunk_gated_delta_rule", "prism_attention"]
    _check_names("op", ops, CP_OPS)
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        raise UsageError(f"--ranks: comma-separated integers, got {args.ranks!r}") from None
    try:
        records = run_scaling(ops, ranks, _resolve_device(args.device), args.tokens, args.heads, args.dim,
                              args.repeats, args.threads, args.layout)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(format_table(records))
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lamina bench``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    handlers = {"providers": _providers, "ceilings": _ceilings, "summary": _summary, "plot": _plot,
                "context-parallel": _context_parallel}
    try:
        if argv and argv[0] in handlers:
            return handlers[argv[0]](argv[1:])
        return _run(argv)
    except UsageError as exc:
        print(f"lamina bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
