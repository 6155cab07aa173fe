"""Fixes for the Triton interpreter (``TRITON_INTERPRET=1``), applied in one place.

``tl.dot`` on bfloat16 operands: the interpreter stores bf16 as uint16 and hands
the raw integers to ``np.matmul``. We view the bits as float32 (a bf16 value is
the high half of a float32) before the product; bf16 x bf16 products are exact
in float32, so this is what a GPU computes with fp32 accumulation.

float32 -> bfloat16 casts (``x.to(tl.bfloat16)``): the interpreter truncates the mantissa;
a GPU rounds to nearest even. We round to nearest even, so bf16 kernels see the GPU's error.

Device-function calls (a ``@triton.jit`` helper called from a kernel): the interpreter patches
the whole of ``triton.language`` again on every such call (``_patch_lang``: ``inspect.getmembers``
over the language modules, about 0.9 ms), although the launch around it has patched the same
modules already and restores them only when it ends. A chunked delta-rule test calls helpers tens of
thousands of times, and the repeated patching was a third to a half of its time
(test_separate_output_kernel[kda], Triton 3.9, in the suite's durations on 2 workers: 30.7 s
before this fix, 17.1 s with it). Within a launch we patch each set of language modules once; what
is patched, and what the launch restores, is unchanged.

``_get_np_dtype`` (the NumPy type of a Triton type, asked for by every cast, splat and binary op): the
interpreter builds a dict of 19 types on every call. We look it up in a table filled once per type
(test_training_with_keys_of_512[delta] with test_separate_output_kernel[gdn], one process, Triton 3.9, run
twice: 37.2 s and 39.5 s before, 32.3 s and 33.7 s with it).

A tensor used as an integer (``range(n)`` with ``n`` loaded or computed from ``tl.program_id``): Triton
3.6's interpreter converts it with ``int(data)``, where ``data`` is a one-element NumPy array of one
dimension. NumPy 1.25 to 2.3 warn about that conversion, and NumPy 2.4 refuses it (TypeError), so every
kernel with a runtime loop bound failed under 3.6's interpreter with NumPy 2.4 (tests/test_delta_fwd.py:
75 of 79 failed). Triton 3.9 squeezes the array first; we convert as 3.9 does, under every version.
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
    _patch_language_once_per_launch(interp)
    _np_dtype_by_name(interp)
    _index_from_one_element(interp)
    _APPLIED = True


def _patch_language_once_per_launch(interp) -> None:
    """Skip ``_patch_lang`` for device-function calls whose language modules the running launch patched.

    ``GridExecutor.__call__`` (a launch) patches the modules the kernel sees and restores them when the
    grid is done; ``InterpretedFunction.__call__`` (a device-function call inside it) patches again and
    restores nothing. The modules a call would patch depend only on which of ``tl`` and ``tl.core`` its
    function's globals hold, so a call whose modules the launch (or an earlier call in it) patched gets
    an empty scope; any other call patches as before.
    """
    import triton.language as tl

    original_patch, original_launch = interp._patch_lang, interp.GridExecutor.__call__
    # id(function globals) -> (those globals, kept so that the id stays theirs; ids of the language modules)
    modules: dict[int, tuple[dict, frozenset[int]]] = {}
    patched: list[set[int]] = []  # per running launch: the language modules patched in it

    def languages(fn) -> frozenset[int]:
        key = id(fn.__globals__)
        if key not in modules:
            modules[key] = (fn.__globals__,
                            frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core))
        return modules[key][1]

    def patch_lang(fn):
        langs = languages(fn)
        if patched and langs and langs <= patched[-1]:
            return interp._LangPatchScope()
        scope = original_patch(fn)
        if patched:
            patched[-1].update(langs)
        return scope

    def launch(self, *args, **kwargs):
        patched.append(set())
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            patched.pop()

    interp._patch_lang = patch_lang
    interp.GridExecutor.__call__ = launch


def _np_dtype_by_name(interp) -> None:
    """``_get_np_dtype`` from a table built once: Triton's builds a dict of 19 dtypes on every call."""
    import triton.language as tl

    original = interp._get_np_dtype
    pointer = np.dtype(np.uint64)
    table: dict[str, np.dtype] = {}

    def get_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return pointer
        name = getattr(scalar, "name", None)
        found = table.get(name)
        if found is None:
            found = original(tt_dtype)  # raises as before for a type it has no entry for
            if name is not None:
                table[name] = found
        return found

    get_np_dtype.__wrapped__ = original
    interp._get_np_dtype = get_np_dtype


def _index_from_one_element(interp) -> None:
    """``tensor.__index__`` of the interpreter's language patch reads the one element of a 1-d array."""
    original = interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        # the scope restores in reverse order: this first, then the original's own patch
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    patch_lang_tensor.__wrapped__ = original
    interp._patch_lang_tensor = patch_lang_tensor
