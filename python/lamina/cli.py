"""The ``lamina`` command: ``lamina info``, ``lamina bench``, ``lamina fuzz``, ``lamina diagnose``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="lamina",
                                     description="lamina kernels: info, benchmarks, fuzzing, diagnostics")
    parser.add_argument("command", choices=["info", "bench", "fuzz", "diagnose"], help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args, rest = parser.parse_known_args(argv[:1])
    rest = argv[1:]
    if args.command == "info":
        from lamina.info import main as info_main

        return info_main(rest)
    if args.command == "bench":
        from lamina.bench.cli import main as bench_main

        return bench_main(rest)
    if args.command == "diagnose":
        from lamina.diagnostics.plots import main as diagnose_main

        return diagnose_main(rest)
    from lamina.fuzz import main as fuzz_main

    return fuzz_main(rest)


if __name__ == "__main__":
    sys.exit(main())
