"""The C++ backends of ``decode_step`` (``"cpu-ext"``, ``"cuda"``): ``lamina_C::delta_decode_step``.

``ext_step`` takes exactly the positional arguments of ``lamina.ops.delta_decode._torch_step``
(the contract is that module's docstring), brings them to what the kernels read and calls the op:

* q, k, v contiguous in their dtype (float32, float16 or bfloat16);
* g, b, w, A_log, dt_bias as contiguous float32 (``A_log [HV]``, ``dt_bias [HV]`` or ``[HV * K]``);
* state_indices, num_accepted_tokens, cu_seqlens contiguous, int32 or int64 as given (other
  integer dtypes become int64; anything else reaches the op, which refuses it by name);
* out and final_state written in place; when one is not a contiguous tensor of the kernel's dtype
  (final_state: float32), the kernel writes a temporary that is then copied into it.

The kernels are ``csrc/delta_decode_cpu.cpp`` (OpenMP over sequences x value heads) and
``csrc/delta_decode_kernel.cu`` (one launch per call). They check every argument again and never
read or write outside the given tensors, whatever the slot indices say.
"""

from __future__ import annotations

import torch

from lamina._optional import require_compiled_extension

_INDEX_DTYPES = (torch.int32, torch.int64)


def _float32(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.to(torch.float32).contiguous()


def _flat_float32(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else _float32(x).reshape(-1)


def _index(x: torch.Tensor | None) -> torch.Tensor | None:
    if x is None:
        return None
    if x.dtype not in _INDEX_DTYPES and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool:
        x = x.to(torch.int64)
    return x.contiguous()


def has_op() -> bool:
    """True when the compiled extension is importable here and has ``delta_decode_step``."""
    from lamina._optional import compiled_extension

    return compiled_extension() is not None and hasattr(torch.ops.lamina_C, "delta_decode_step")


def ext_step(q, k, v, g, b, w, A_log, dt_bias, state, state_indices, num_accepted_tokens, cu_seqlens, out,
             final_state, scale: float, lower_bound: float, gate_act: int, beta_act: int, l2norm: bool,
             state_v_first: bool, inplace: bool) -> None:
    """``decode_step`` on the C++ kernels of ``lamina._C`` (module docstring); writes ``out``, the
    pool ``state`` (with ``inplace``) and ``final_state``."""
    require_compiled_extension()
    out_k = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    final_k = final_state
    if final_state is not None and (final_state.dtype != torch.float32 or not final_state.is_contiguous()):
        final_k = torch.empty(final_state.shape, dtype=torch.float32, device=final_state.device)
    torch.ops.lamina_C.delta_decode_step(
        q.contiguous(), k.contiguous(), v.contiguous(), _float32(g), _float32(b), _float32(w), _flat_float32(A_log),
        _flat_float32(dt_bias), state, _index(state_indices), _index(num_accepted_tokens), _index(cu_seqlens), out_k,
        final_k, float(scale), float(lower_bound), int(gate_act), int(beta_act), bool(l2norm), bool(state_v_first),
        bool(inplace))
    if out_k is not out:
        out.copy_(out_k)
    if final_k is not final_state:
        final_state.copy_(final_k)
