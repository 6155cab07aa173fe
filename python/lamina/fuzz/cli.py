"""``lamina fuzz``: the command line of ``lamina.fuzz.run``."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from lamina.fuzz.space import DTYPE_NAMES, GROUPS, OPS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lamina fuzz",
        description="Random shapes, dtypes and options of lamina's ops and layers against float64 references; "
                    "failures are shrunk and saved with a runnable reproducer. Exit status 1 on any failure.")
    p.add_argument("--op", nargs="+", default=["all"], metavar="NAME",
                   help=f"ops to fuzz: any of {', '.join(OPS)}, or a group: {', '.join(GROUPS)} (default all)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--seconds", type=float, help="fuzz for this many seconds (round-robin over the ops)")
    budget.add_argument("--cases", "--iters", dest="cases", type=int, help="cases per op (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the run (case i of op X is drawn from (seed, X, i))")
    p.add_argument("--index", type=int, default=0, help="index of the first case (reproducers use it)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "cuda", "torch"],
                   help="auto: on CPU PyTorch, or with --interpret half the cases on the Triton kernels")
    p.add_argument("--interpret", action="store_true",
                   help="CPU: run Triton kernels under the Triton interpreter (small shapes; sets TRITON_INTERPRET=1)")
    p.add_argument("--dtype", nargs="+", choices=DTYPE_NAMES, metavar="DTYPE",
                   help=f"dtypes to draw from ({', '.join(DTYPE_NAMES)}; CPU PyTorch cases are float32)")
    p.add_argument("--out", default="fuzz-failures", help="folder for shrunk failures (default ./fuzz-failures)")
    p.add_argument("--shrink-seconds", type=float, default=None, help="time budget to shrink one failure")
    p.add_argument("--no-grad", action="store_true", help="check forward outputs only")
    p.add_argument("--bad-inputs", action="store_true",
                   help="instead of random cases: call the ops with invalid inputs and check each is refused "
                        "with an error naming the argument")
    p.add_argument("--replay", metavar="FILE", help="run a saved case (JSON) again; exit 1 if it still fails")
    return p


def _ops(parser: argparse.ArgumentParser, names: list[str]) -> list[str]:
    ops: list[str] = []
    for name in names:
        if name in GROUPS:
            ops.extend(op for op in GROUPS[name] if op not in ops)
        elif name in OPS:
            if name not in ops:
                ops.append(name)
        else:
            parser.error(f"--op: {name!r} is not an op or a group; choose from {', '.join((*OPS, *GROUPS))}")
    return ops


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    from lamina.fuzz import runner

    parser = _parser()
    args = parser.parse_args(argv)
    if args.cases is not None and args.cases < 1:
        parser.error(f"--cases must be >= 1, got {args.cases}")
    if args.seconds is not None and args.seconds <= 0:
        parser.error(f"--seconds must be > 0, got {args.seconds}")
    ops = _ops(parser, args.op)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.replay:
        try:
            return _replay(args.replay, log)
        except (OSError, RuntimeError, ValueError) as exc:
            parser.error(f"--replay: {exc}")
    if args.bad_inputs:
        from lamina.fuzz.bad_inputs import run_bad_inputs

        bad = run_bad_inputs(ops=None if args.op == ["all"] else ops, device=args.device, log=log)
        return 0 if bad.ok else 1
    try:
        report = runner.run(ops, seconds=args.seconds, cases=args.cases, seed=args.seed, device=args.device,
                            backend=args.backend, interpret=args.interpret, dtypes=args.dtype, out=args.out,
                            grad=not args.no_grad, log=log, start=args.index,
                            shrink_seconds=runner.SHRINK_SECONDS if args.shrink_seconds is None
                            else args.shrink_seconds)
    except (RuntimeError, ValueError) as exc:
        parser.error(str(exc))
    log(report.table())
    log(f"{report.cases - len(report.failures)} passed, {len(report.failures)} failed in {report.seconds:.1f} s")
    return 0 if report.ok else 1


def _replay(path: str, log: Callable[[str], None]) -> int:
    from lamina.fuzz import runner
    from lamina.fuzz.shrink import describe, first_line, load_case

    case = load_case(path)
    if case["device"] == "cpu" and case["backend"] == "triton":
        runner.ensure_interpreter()
    try:
        runner.run_case(case)
    except Exception as exc:  # noqa: BLE001 - a crash reproduces like a mismatch
        log(f"still fails: {case['op']} {describe(case)}\n      {first_line(exc)}")
        return 1
    log(f"passes now: {case['op']} {describe(case)}")
    return 0
