"""The two ceilings of the roofline, measured on the machine in the same run.

* Copy bandwidth: ``dst.copy_(src)`` of a buffer far larger than the last-level cache,
  counting the bytes read and the bytes written (2 x size), in GB/s (1e9 bytes).
* Matrix rate: one large square matmul, 2 n^3 FLOPs, in TFLOP/s. bf16 on CUDA (the dtype
  of the standard shapes); float32 on CPU, where bf16 matmuls are not the fast path.

A kernel's roofline fraction is ``max(flops / rate, bytes / bandwidth) / time``: 1.0 is as
fast as the machine can go, whichever resource bounds it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from lamina.bench.timing import TimingConfig, time_fn

# Copy buffers: 1 GiB on CUDA (H200 L2 is 60 MB), 128 MiB on CPU (beyond server LLCs of 32-100 MB).
CUDA_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 1 << 27
# Matmul sizes: 8192^3 bf16 runs ~1.4 ms on an H200 (~790 TFLOP/s); 1024^3 fp32 ~10-40 ms on 2 CPU cores.
CUDA_MATMUL_N = 8192
CPU_MATMUL_N = 1024
# Tests and dry runs: tiny sizes, only to exercise the code path.
TINY_COPY_BYTES = 1 << 22
TINY_MATMUL_N = 128


@dataclass(frozen=True)
class Ceilings:
    copy_gbps: float
    matmul_tflops: float
    matmul_dtype: str
    matmul_n: int
    copy_bytes: int
    device: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_ceilings(device: str, tiny: bool = False, config: TimingConfig | None = None) -> Ceilings:
    """Measure copy bandwidth and matmul rate on ``device`` ("cuda" or "cpu")."""
    cuda = device == "cuda"
    if tiny:
        nbytes, n = TINY_COPY_BYTES, TINY_MATMUL_N
    else:
        nbytes, n = (CUDA_COPY_BYTES, CUDA_MATMUL_N) if cuda else (CPU_COPY_BYTES, CPU_MATMUL_N)
    config = config or TimingConfig(cpu_min_run_s=0.2)
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    dtype_name = "bf16" if cuda else "fp32"
    return Ceilings(_copy_gbps(device, nbytes, gen, config), _matmul_tflops(device, n, dtype_name, gen, config),
                    dtype_name, n, nbytes, device)


def _copy_gbps(device: str, nbytes: int, gen: torch.Generator, config: TimingConfig) -> float:
    src = torch.rand(nbytes // 4, generator=gen, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), device, config=config).median_ms
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _matmul_tflops(device: str, n: int, dtype_name: str, gen: torch.Generator, config: TimingConfig) -> float:
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    a = torch.randn(n, n, generator=gen, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, generator=gen, device=device, dtype=torch.float32).to(dtype)
    ms = time_fn(lambda: torch.matmul(a, b), device, config=config).median_ms
    return 2 * n**3 / (ms * 1e-3) / 1e12


def roofline_fractions(flops: float, nbytes: float, ms: float, ceilings: Ceilings | None) -> dict[str, float | None]:
    """TFLOP/s, GB/s and the fractions of the measured ceilings for one timing."""
    sec = ms * 1e-3
    tflops = flops / sec / 1e12 if sec > 0 else None
    gbps = nbytes / sec / 1e9 if sec > 0 else None
    out: dict[str, float | None] = {"tflops": tflops, "gbps": gbps, "frac_matmul": None,
                                    "frac_bandwidth": None, "roofline_frac": None}
    if ceilings is not None and sec > 0:
        out["frac_matmul"] = tflops / ceilings.matmul_tflops if tflops is not None else None
        out["frac_bandwidth"] = gbps / ceilings.copy_gbps if gbps is not None else None
        bound_s = max(flops / (ceilings.matmul_tflops * 1e12), nbytes / (ceilings.copy_gbps * 1e9))
        out["roofline_frac"] = bound_s / sec
    return out
