"""``lamina info``: versions, devices and backends; ``lamina info --kernels``: the static kernel report.

The static report compiles every registered Triton kernel configuration ahead of
time (no GPU needed) for sm_90 and sm_80 and reads ptxas's log, or the cubin with the
tools that ship in triton's wheel: registers, stack and spill stores (``STL``), shared
memory, and whether Hopper's warpgroup tensor-core instructions (``HGMMA``) are used.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import io
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lamina._versions import triton_status

# Largest dynamic shared memory one block may opt into (CUDA programming guide, compute capabilities table).
SHARED_LIMIT_BYTES = {90: 232448, 80: 166912}
DEFAULT_ARCHS = (90, 80)
# Warp size of every NVIDIA target the report compiles for.
WARP_SIZE = 32


@dataclass
class KernelReport:
    name: str
    config: str
    arch: int
    default: bool
    uses_dot: bool
    registers: int = -1
    stack_bytes: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    shared_bytes: int = -1
    hgmma: bool = False
    # how many warpgroup products of each shape and operand type the PTX has ({"m64n8k8.tf32": 40, ...})
    wgmma: dict = field(default_factory=dict)
    error: str = ""
    module: str = ""
    seconds: float = 0.0  # compile and inspection time (JSON only)

    @property
    def shared_ok(self) -> bool:
        return 0 <= self.shared_bytes <= SHARED_LIMIT_BYTES[self.arch]

    def problems(self) -> list[str]:
        """What makes this configuration unacceptable as a default (empty when it is fine)."""
        if self.error:
            return [f"compile error: {self.error}"]
        out = []
        if self.spill_stores > 0 or self.spill_loads > 0:
            out.append(f"spills ({self.spill_stores} STL, {self.spill_loads} LDL, stack {self.stack_bytes} B)")
        if not self.shared_ok:
            out.append(f"shared memory {self.shared_bytes} B > sm_{self.arch} limit {SHARED_LIMIT_BYTES[self.arch]} B")
        if self.arch == 90 and self.uses_dot and not self.hgmma:
            out.append("matrix kernel without HGMMA on sm_90")
        if self.wgmma.get(WGMMA_TF32_N8):
            out.append(f"{self.wgmma[WGMMA_TF32_N8]} wgmma m64n8k8 tf32 (Triton #10629: reads past its shared operand)")
        return out


WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32\.(\w+)\.")
# A warpgroup product eight columns wide in tf32: Triton (from 3.6, issue #10629) emits it without the padding of
# its shared-memory operand that the instruction needs, and it reads past that operand's end (illegal memory
# accesses and wrong values on an H100 and an H200).
WGMMA_TF32_N8 = "m64n8k8.tf32"


def wgmma_shapes(ptx: str) -> dict[str, int]:
    """How many warpgroup products of each shape and operand type the PTX has (``{"m64n8k8.tf32": 40}``)."""
    return dict(Counter(f"{shape}.{kind}" for shape, kind in WGMMA.findall(ptx)))


def _nvidia_tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{name} not found in triton's wheel at {path}")
    return str(path)


def _load_registry() -> list:
    from lamina.kernels import REPORT_MODULES
    from lamina.kernels._utils import registered_aot

    for module in REPORT_MODULES:
        importlib.import_module(module)
    return registered_aot()


def _parse_resource_usage(text: str) -> tuple[int, int]:
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return (int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1)


def _parse_ptxas_log(text: str) -> tuple[int, int] | None:
    """``(registers, stack frame bytes)`` from ptxas's ``-v`` log of one kernel, or None without one (the
    cubin came from Triton's cache, or the log is not in the form this reads)."""
    regs = re.search(r"Used (\d+) registers", text)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs is None or frame is None:
        return None
    return int(regs.group(1)), int(frame.group(1))


@contextlib.contextmanager
def _ptxas_log_on_stdout() -> Iterator[None]:
    """Triton prints ptxas's ``-v`` log (which it always asks for) to stdout inside this block."""
    from triton import knobs

    old = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        yield
    finally:
        knobs.nvidia.dump_ptxas_log = old


def _compile_one(index: int, arch: int) -> KernelReport:
    return compile_spec(_load_registry()[index], arch)


def _read_cubin(report: KernelReport, cubin: bytes) -> None:
    """Registers and stack (``cuobjdump``), STL/LDL and HGMMA (``nvdisasm``) of a cubin into ``report``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run(
            [_nvidia_tool("cuobjdump"), "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [_nvidia_tool("nvdisasm"), "-c", str(path)], capture_output=True, text=True, check=True
        ).stdout
    report.registers, report.stack_bytes = _parse_resource_usage(usage)
    report.spill_stores = len(re.findall(r"\bSTL(\.\w+)*\b", sass))
    report.spill_loads = len(re.findall(r"\bLDL(\.\w+)*\b", sass))
    report.hgmma = "HGMMA" in sass


def compile_spec(spec, arch: int) -> KernelReport:
    """Compile one ``AotSpec`` for ``sm_<arch>`` and read its resource usage.

    Where ptxas ran and its log shows no stack frame, there is no local memory, so no spill
    instruction (STL/LDL): registers come from the log and HGMMA from the PTX's warpgroup products.
    Otherwise (a stack frame, or a cubin from Triton's cache, which comes without a log) the cubin is
    read: its resource usage (``cuobjdump``) and its disassembly (``nvdisasm``), where STL/LDL and HGMMA
    are counted."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lamina.kernels._utils import fp_fusion, raw_jit

    report = KernelReport(spec.name, spec.config, arch, spec.default, spec.uses_dot)
    started = time.perf_counter()
    try:
        fn = raw_jit(spec.fn)
        report.module = getattr(fn, "__module__", "") or getattr(getattr(fn, "fn", None), "__module__", "")
        # meta["attrs"]: argument specialisations (e.g. 16-divisible pointers/strides) the runtime would apply.
        src = ASTSource(fn=fn, signature=spec.signature, constexprs=spec.constexprs, attrs=spec.meta.get("attrs"))
        log = io.StringIO()
        with _ptxas_log_on_stdout(), contextlib.redirect_stdout(log):
            compiled = triton.compile(
                src,
                target=GPUTarget("cuda", arch, WARP_SIZE),
                options={"num_warps": spec.num_warps, "enable_fp_fusion": fp_fusion(),
                         **({} if spec.num_stages is None else {"num_stages": spec.num_stages}),
                         **({} if spec.maxnreg is None else {"maxnreg": spec.maxnreg})},
            )
        report.shared_bytes = int(compiled.metadata.shared)
        report.wgmma = wgmma_shapes(compiled.asm["ptx"])
        usage = _parse_ptxas_log(log.getvalue())
        if usage is not None and usage[1] == 0:
            report.registers, report.stack_bytes = usage
            report.spill_stores = report.spill_loads = 0
            report.hgmma = "wgmma.mma_async" in compiled.asm["ptx"]
        else:
            _read_cubin(report, compiled.asm["cubin"])
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row of the report
        report.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    report.seconds = round(time.perf_counter() - started, 2)
    return report


def kernel_report(archs: tuple[int, ...] = DEFAULT_ARCHS, name_filter: str = "", jobs: int | None = None,
                  shard: tuple[int, int] = (1, 1), defaults_only: bool = False):
    """Compile every registered configuration for each arch; returns a list of KernelReport.

    ``shard=(k, n)`` compiles the k-th of n parts (1 <= k <= n): the configurations whose registration
    index is k - 1 modulo n, each for every arch, so n runs together compile each configuration once.
    ``defaults_only``: leave out the non-default rows (the delta-rule family's speed alternatives and fused
    options).
    """
    part, parts = shard
    specs = _load_registry()
    # meta["archs"]: a configuration that is the default on some targets only is compiled for those
    work = [(i, arch) for i, s in enumerate(specs)
            if name_filter in s.name and i % parts == part - 1 and (s.default or not defaults_only)
            for arch in archs if arch in s.meta.get("archs", archs)]
    jobs = jobs or max(1, min(len(work), os.cpu_count() or 1))
    if jobs == 1 or len(work) <= 1:
        return [_compile_one(i, a) for i, a in work]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_compile_one, *zip(*work)))


def _format_table(rows: list[KernelReport]) -> str:
    head = ["kernel", "config", "arch", "regs", "stack", "STL", "LDL", "shared", "HGMMA", "status"]
    lines = []
    for r in rows:
        status = "; ".join(r.problems()) if r.default else ("(non-default) " + "; ".join(r.problems()))
        lines.append([
            r.name, r.config, f"sm_{r.arch}", str(r.registers), str(r.stack_bytes), str(r.spill_stores),
            str(r.spill_loads), str(r.shared_bytes), ("yes" if r.hgmma else "no") if r.arch == 90 else "-",
            status.strip() or "ok",
        ])
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = "  ".join("{:<" + str(w) + "}" for w in widths)
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*line) for line in lines]
    return "\n".join(out)


# What `lamina info` lists: name shown -> installed distribution. Read from the package metadata, not by
# importing (`import fla` with flash-linear-attention installed imports its layers, models and transformers).
_LISTED_DISTRIBUTIONS = {
    "torch": "torch", "triton": "triton", "numpy": "numpy", "einops": "einops", "fla": "fla-core",
    "fla layers": "flash-linear-attention", "transformers": "transformers", "flash_attn": "flash-attn",
}


def _module_version(mod: str) -> str | None:
    """Installed version of the distribution shown as ``mod`` (see ``_LISTED_DISTRIBUTIONS``), or None."""
    try:
        return importlib.metadata.version(_LISTED_DISTRIBUTIONS.get(mod, mod))
    except importlib.metadata.PackageNotFoundError:
        return None


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for mod in _LISTED_DISTRIBUTIONS:
        out[mod] = _module_version(mod) or "not installed"
    # the Triton line says whether this version is one lamina is tested with
    out["triton"] = triton_status(_module_version("triton"))
    return out


def environment_summary() -> dict[str, object]:
    """Versions, devices and which backends can run here."""
    import torch

    from lamina import __version__
    from lamina._dispatch import interpreter_enabled
    from lamina._optional import compiled_extension
    from lamina.kernels._utils import TRITON_ENV, fp_fusion_enabled
    from lamina.ops.attention_dispatch import load_table

    ext = compiled_extension()
    table = load_table()
    outside = {key: path for key, path in sorted(table.entries.items()) if path != "lamina"}
    cuda = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    return {
        "lamina": __version__,
        **_versions(),
        "cuda_devices": devices or "none",
        "backends": {
            "triton (CUDA)": "available" if cuda else "no CUDA device",
            "triton (interpreter)": "on (TRITON_INTERPRET=1)" if interpreter_enabled() else "off",
            "torch": "available",
            "cuda (lamina._C)": ("available" if ext is not None and getattr(ext, "WITH_CUDA", False)
                                 else "not built (LAMINA_BUILD_CUDA=1)"),
            "cpu-ext (lamina._C)": "available" if ext is not None else "not built (LAMINA_BUILD_CPU=1)",
        },
        # how Triton compiles lamina's kernels here: FP fusion as resolved, and each variable set that changes it
        "triton_compile": {"fp fusion": "on" if fp_fusion_enabled() else "off",
                           **{name: os.environ[name] for name in TRITON_ENV if name in os.environ}},
        # prism_attention(backend="auto") on CUDA: the cases the sweep table sends to another path
        "attention_dispatch": {"table": table.source, **outside,
                               "every other case": "lamina's kernel"},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lamina info", description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", action="store_true", help="compile every kernel config ahead of time")
    parser.add_argument("--arch", default=",".join(str(a) for a in DEFAULT_ARCHS),
                        help="comma-separated SM versions, e.g. 90,80")
    parser.add_argument("--filter", default="", help="only kernels whose name contains this")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--defaults-only", action="store_true",
                        help="only the default configurations (not the delta-rule family's speed alternatives and "
                             "fused options, its non-default rows)")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile processes")
    parser.add_argument("--shard", default="1/1", metavar="K/N",
                        help="compile only the K-th of N parts of the configurations (1 <= K <= N); "
                             "N runs with K = 1..N together compile each configuration once")
    from lamina.kernels._utils import REPORT_GRID_ENV, REPORT_GRIDS

    parser.add_argument("--grid", choices=REPORT_GRIDS, default=None,
                        help="shapes of the registrations that have a grid (the delta-rule family): default (what CI "
                             "compiles) or full (K in 64..512 x bf16/fp16/fp32, every alternative; long: "
                             "pass one --arch)")
    parser.add_argument("--from-json", metavar="FILE", nargs="+",
                        help="with --kernels: print the table of one or more reports saved by `--kernels --json` "
                             "(e.g. one per --shard) instead of compiling again (same exit status)")
    args = parser.parse_args(argv)

    if args.kernels and args.from_json:
        fields = {f for f in KernelReport.__dataclass_fields__}
        rows = []
        for path in args.from_json:
            try:
                saved = json.loads(Path(path).read_text())
            except (OSError, ValueError) as exc:
                parser.error(f"--from-json: cannot read a saved report from {path!r}: {exc}")
            rows += [KernelReport(**{k: v for k, v in r.items() if k in fields}) for r in saved]
        return _print_report(rows, as_json=args.json)

    shard = re.fullmatch(r"(\d+)/(\d+)", args.shard)
    if not shard or not 1 <= int(shard.group(1)) <= int(shard.group(2)):
        parser.error(f"--shard: expected K/N with 1 <= K <= N (e.g. 2/4), got {args.shard!r}")

    if not args.kernels:
        summary = environment_summary()
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            for key, value in summary.items():
                if isinstance(value, dict):
                    print(f"{key}:")
                    width = max([22, *map(len, value)])  # a longer name (a Triton variable) widens its section
                    for k, v in value.items():
                        print(f"  {k:<{width}} {v}")
                else:
                    print(f"{key:<24} {value}")
        return 0

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        # Interpreted kernels cannot be compiled: rerun without the interpreter.
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-m", "lamina.info", *(argv if argv is not None else sys.argv[1:])]
        return subprocess.run(cmd, env=env).returncode

    if args.grid:  # read by the registering modules when the registry loads (here and in the workers)
        os.environ[REPORT_GRID_ENV] = args.grid
    archs = tuple(int(a) for a in args.arch.split(",") if a)
    bad_arch = [a for a in archs if a not in SHARED_LIMIT_BYTES]
    if bad_arch:
        parser.error(f"--arch: supported SM versions are {sorted(SHARED_LIMIT_BYTES)}, got {bad_arch}")
    part = (int(shard.group(1)), int(shard.group(2)))
    return _print_report(kernel_report(archs, args.filter, args.jobs, part, args.defaults_only), as_json=args.json)


def _print_report(rows: list[KernelReport], as_json: bool) -> int:
    """Print the report (table or JSON); exit status 1 when a default configuration has a problem."""
    if as_json:
        print(json.dumps([{**asdict(r), "problems": r.problems()} for r in rows], indent=1))
    else:
        print(f"triton {triton_status(_module_version('triton'))}")
        print(_format_table(rows))
        bad = [r for r in rows if r.default and r.problems()]
        print(f"\n{len(rows)} compiled configurations, {len(bad)} default configurations with problems")
    return 1 if any(r.default and r.problems() for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
