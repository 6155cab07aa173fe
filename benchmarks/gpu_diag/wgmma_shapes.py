"""The warpgroup product shapes (``wgmma m64nNkK`` and operand type) in the sm_90 PTX of every registered kernel
configuration for sm_90 whose name and config contain each argument, compiled ahead of time on the CPU; rows
with a tf32 ``m64n8k8`` (Triton issue #10629) start with ``N8``.

    LAMINA_REPORT_GRID=full python benchmarks/gpu_diag/wgmma_shapes.py delta_chunk fp32 "K=64 " [--warps 4] \
        [--defaults-only]

``--warps W`` compiles each configuration at W warps instead of its own (an experiment: the launchers do not).
"""
import argparse
import dataclasses
import os
from concurrent.futures import ProcessPoolExecutor

from lamina import info


def _one(job: tuple[int, int | None]) -> str:
    index, warps = job
    spec = info._load_registry()[index]
    if warps is not None:
        spec = dataclasses.replace(spec, num_warps=warps)
    report = info.compile_spec(spec, 90)
    mark = "N8" if report.wgmma.get(info.WGMMA_TF32_N8) else "ok"
    return (f"{mark} {spec.name} | {spec.config} | {'default' if spec.default else 'alternative'} | "
            f"warps {spec.num_warps} | regs {report.registers} | STL {report.spill_stores} | "
            f"shared {report.shared_bytes} | {report.wgmma}{' | ' + report.error if report.error else ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("words", nargs="*", help="substrings of the kernel name and config, all required")
    parser.add_argument("--warps", type=int, default=None)
    parser.add_argument("--defaults-only", action="store_true", help="leave out the non-default rows")
    args = parser.parse_args()
    specs = info._load_registry()
    # the rows that run on sm_90 (a row registered for other targets only is not compiled)
    jobs = [(i, args.warps) for i, s in enumerate(specs)
            if all(w in f"{s.name} {s.config}" for w in args.words) and (s.default or not args.defaults_only)
            and 90 in s.meta.get("archs", (90,))]
    print(f"{len(jobs)} configurations", flush=True)
    with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        for line in pool.map(_one, jobs):
            print(line, flush=True)


if __name__ == "__main__":
    main()
