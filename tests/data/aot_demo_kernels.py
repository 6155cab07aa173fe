"""Two matmul tiles for testing the static report: one that fits, one that spills on sm_90."""

import triton
import triton.language as tl

from lamina.kernels._utils import AotSpec


@triton.jit
def _demo_mm_kernel(a, b, c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    rk = tl.arange(0, K)
    x = tl.load(a + rm[:, None] * K + rk[None, :])
    y = tl.load(b + rk[:, None] * N + rn[None, :])
    tl.store(c + rm[:, None] * N + rn[None, :], tl.dot(x, y))


SIGNATURE = {"a": "*bf16", "b": "*bf16", "c": "*fp32", "M": "constexpr", "N": "constexpr", "K": "constexpr"}
FITS = AotSpec("demo_mm", "128x128x64", _demo_mm_kernel, SIGNATURE, {"M": 128, "N": 128, "K": 64})
# 128x256x128 bf16 with 4 warps: 255 registers and spill stores (TRITON_ON_CPU.md section 2).
SPILLS = AotSpec("demo_mm", "128x256x128", _demo_mm_kernel, SIGNATURE, {"M": 128, "N": 256, "K": 128})
# A float32 (tf32) product 64 x 16: with 8 warps (two warpgroups) each takes 8 columns, the wgmma m64n8k8 tf32 of
# Triton issue #10629; with 4 warps it is one m64n16k8.
F32_SIGNATURE = {**SIGNATURE, "a": "*fp32", "b": "*fp32"}
TF32_N8 = AotSpec("demo_mm", "64x16x32 fp32 w8", _demo_mm_kernel, F32_SIGNATURE, {"M": 64, "N": 16, "K": 32},
                  num_warps=8)
TF32_N16 = AotSpec("demo_mm", "64x16x32 fp32 w4", _demo_mm_kernel, F32_SIGNATURE, {"M": 64, "N": 16, "K": 32},
                   num_warps=4)


@triton.jit
def _demo_axpy_kernel(a, x, y, N: tl.constexpr):
    # a multiply and an add: one fma.rn.f32 per element in the PTX where FP fusion is on, mul and add where off
    o = tl.arange(0, N)
    tl.store(y + o, tl.load(a) * tl.load(x + o) + tl.load(y + o))


AXPY = AotSpec("demo_axpy", "128 fp32", _demo_axpy_kernel, {"a": "*fp32", "x": "*fp32", "y": "*fp32", "N": "constexpr"},
               {"N": 128}, uses_dot=False)
