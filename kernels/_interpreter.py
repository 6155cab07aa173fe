"""Fixes for the Triton interpreter (``TRITON_INTERPRET=1``), applied in one place.

``tl.dot`` on bfloat16 operands: the interpreter stores bf16 as uint16 and hands
the raw integers to ``np.matmul``. We view the bits as float32 (a bf16 value is
the high half of a float32) before the product; bf16 x bf16 products are exact
in float32, so this is what a GPU computes with fp32 accumulation.

float32 -> bfloat16 casts (``x.to(tl.bfloat16)``): the interpreter truncates the mantissa;
a GPU rounds to nearest even. We round to nearest even, so bf16 kernels see the GPU's error.
"""

from __future__ import annotations

import numpy as np

_APPLIED = False


def _bf16_bits_to_f32(data: np.ndarray) -> np.ndarray:
    return (data.astype(np.uint32) << np.uint32(16)).view(np.float32)


def apply_fixes() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from triton.runtime import interpreter as interp

    original = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.is_bf16() or b.dtype.is_bf16():
            a_data = _bf16_bits_to_f32(a.data) if a.dtype.is_bf16() else a.data.astype(np.float32)
            b_data = _bf16_bits_to_f32(b.data) if b.dtype.is_bf16() else b.data.astype(np.float32)
            out = np.matmul(a_data, b_data, dtype=np.float32).astype(d.data.dtype) + d.data
            return interp.TensorHandle(out, d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = create_dot

    original_cast = interp.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar.is_fp32() and dst_type.scalar.is_bf16():
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            out = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded.astype(np.uint16))
            return interp.TensorHandle(out, dst_type.scalar)
        return original_cast(self, src, dst_type)

    interp.InterpreterBuilder.cast_impl = cast_impl
    _APPLIED = True
