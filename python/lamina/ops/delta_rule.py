"""Functional API of the delta-rule family (re-exported by ``lamina``), fla 0.6's names and order.

``chunk_delta_rule``, ``chunk_gated_delta_rule``, ``chunk_kda``, ``chunk_gdn2`` (chunked, for
training and prefill) and their ``fused_recurrent_*`` twins (token by token, for decoding;
same arguments, no ``chunk_size``). All return ``(o [B, T, HV, V] in v.dtype,
final_state [N, HV, K, V] float32 or None)``.

Input transforms: the in-kernel options of fla (``use_qk_l2norm_in_kernel``,
``use_gate_in_kernel`` with ``A_log``/``dt_bias``/``lower_bound``, ``use_beta_sigmoid_in_kernel``
with ``allow_neg_eigval``) are applied here with PyTorch ops, in float32, before the kernels, on
every backend; autograd differentiates them, so ``A_log`` and ``dt_bias`` get gradients.
The results are fla's to float32 rounding (fla fuses the same formulas into its kernels).

Gradients: the chunked ops differentiate through ``kernels.delta_chunk_bwd`` (Triton) or the
PyTorch chunked reference (``backend="torch"``). The ``fused_recurrent_*`` ops share that backward:
on the Triton path it recomputes the chunk states with the chunked forward, on the torch path
autograd runs through the token-loop reference.
"""

from __future__ import annotations

import torch

from lamina.ops.delta_rule_core import (
    DEFAULT_CHUNK_SIZE,
    beta_activation,
    check_flag_args,
    check_gate_params,
    delta_rule_core,
    gate_activation,
    l2norm,
    validate_inputs,
)

# Shape of each gate relative to (B, T, HV, K, V), by variant.
_SCALAR = "scalar"


def _run(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    b: torch.Tensor,
    w: torch.Tensor | None,
    *,
    g_kind: str | None,
    gate_kind: str,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    lower_bound: float | None,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
    recurrent: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate, transform and dispatch. ``g_kind``: None | "scalar" | "channel" (decay);
    ``gate_kind``: "scalar" (one beta for erase and write) or "channel" (GDN-2's b and w)."""
    check_flag_args(op, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4 and v.dim() == 4):
        validate_inputs(op, q, k, v, {}, initial_state, cu_seqlens, chunk_size)  # raises the right error
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    lead = (B, T, HV)
    gates: dict[str, tuple[torch.Tensor | None, tuple[int, ...] | None]] = {}
    if g_kind is not None:
        if g is None:
            raise ValueError(f"{op}: g (log decay) is required")
        gates["g"] = (g, lead if g_kind == _SCALAR else (*lead, K))
    if gate_kind == _SCALAR:
        gates["beta"] = (b, lead)
    else:
        gates["b"] = (b, (*lead, K))
        gates["w"] = (w, (*lead, V))
    validate_inputs(op, q, k, v, gates, initial_state, cu_seqlens, chunk_size)
    if use_gate_in_kernel:
        check_gate_params(HV, None if g_kind == _SCALAR else K, A_log, dt_bias,
                          need_A_log=lower_bound is None)
        g = gate_activation(g, A_log, dt_bias, lower_bound)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if gate_kind == _SCALAR:
        b = w = beta_activation(b, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if scale is None:
        scale = K ** -0.5
    return delta_rule_core(op, q, k, v, g, b, w, scale, initial_state, output_final_state, cu_seqlens,
                           chunk_size, recurrent, backend)


def _kda_gate_checks(use_gate_in_kernel: bool, safe_gate: bool, lower_bound: float | None) -> None:
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("lower_bound must be given when safe_gate=True and use_gate_in_kernel=True")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"lower_bound must be in [-5, 0) with safe_gate=True, got {lower_bound}")


_COMMON_ARGS = """
    Args:
        q, k: ``[B, T, H, K]`` queries and keys (``K <= 256`` with gradients, ``<= 512`` forward only).
        v: ``[B, T, HV, V]`` values, ``HV % H == 0`` (value head j reads q/k head ``j // (HV // H)``).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` float32, N = B or the number of sequences of ``cu_seqlens``.
        output_final_state: also return the ``[N, HV, K, V]`` float32 final states.
        use_qk_l2norm_in_kernel: l2-normalise q and k over K first (``x / sqrt(sum x^2 + 1e-6)``).
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of sequences packed along T (then B == 1).
        chunk_size: 16, 32 or 64 tokens per chunk (chunked ops only).
        backend: "auto" (CUDA: Triton; CPU: Triton under TRITON_INTERPRET=1, else PyTorch),
            "triton" or "torch".

    Returns:
        ``(o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] float32 or None)``.
"""


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeltaNet: ``S <- S + beta_t k_t (v_t - S^T k_t)^T``, ``o_t = S^T (scale q_t)``; ``beta: [B, T, HV]``."""
    return _run("chunk_delta_rule", q, k, v, None, beta, None, g_kind=None, gate_kind=_SCALAR, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=False, A_log=None,
                dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                cu_seqlens=cu_seqlens, chunk_size=chunk_size, recurrent=False, backend=backend)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet: DeltaNet with ``S <- exp(g_t) S`` first; ``g, beta: [B, T, HV]``.

    ``g`` is the log decay, or with ``use_gate_in_kernel`` the raw input of
    ``g = -exp(A_log) * softplus(g + dt_bias)`` (``A_log, dt_bias: [HV]``).
    ``use_beta_sigmoid_in_kernel``: ``beta = sigmoid(beta)`` (``2 * sigmoid`` with ``allow_neg_eigval``).
    """
    return _run("chunk_gated_delta_rule", q, k, v, g, beta, None, g_kind=_SCALAR, gate_kind=_SCALAR, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, lower_bound=None, cu_seqlens=cu_seqlens,
                chunk_size=chunk_size, recurrent=False, backend=backend)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention: per-channel decay ``S <- Diag(exp(g_t)) S``; ``g: [B, T, HV, K]``, ``beta: [B, T, HV]``.

    With ``use_gate_in_kernel``: ``g = -exp(A_log) * softplus(g + dt_bias)`` per channel
    (``A_log: [HV]``, ``dt_bias: [HV * K]``), or with ``lower_bound`` set
    ``g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` optional).
    ``safe_gate`` only checks ``lower_bound`` in ``[-5, 0)``: the kernels are exact for any gate
    ``<= 0`` (every exponent is taken relative to a row of the same 16-token sub-block).
    """
    _kda_gate_checks(use_gate_in_kernel, safe_gate, lower_bound)
    return _run("chunk_kda", q, k, v, g, beta, None, g_kind="channel", gate_kind=_SCALAR, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound if use_gate_in_kernel else None,
                cu_seqlens=cu_seqlens, chunk_size=chunk_size, recurrent=False, backend=backend)


def chunk_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet-2: ``S_t = (I - k_t (b_t * k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T``.

    ``g: [B, T, HV, K]`` per-channel log decay (gate options as ``chunk_kda``);
    ``b: [B, T, HV, K]`` erase gate on the key axis; ``w: [B, T, HV, V]`` write gate on the value
    axis. With ``b = w = beta`` (broadcast) it is KDA.
    """
    _kda_gate_checks(use_gate_in_kernel, safe_gate, lower_bound)
    return _run("chunk_gdn2", q, k, v, g, b, w, g_kind="channel", gate_kind="channel", scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                lower_bound=lower_bound if use_gate_in_kernel else None, cu_seqlens=cu_seqlens,
                chunk_size=chunk_size, recurrent=False, backend=backend)


def fused_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token ``chunk_delta_rule`` (decoding)."""
    return _run("fused_recurrent_delta_rule", q, k, v, None, beta, None, g_kind=None, gate_kind=_SCALAR,
                scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=False, A_log=None,
                dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                cu_seqlens=cu_seqlens, chunk_size=DEFAULT_CHUNK_SIZE, recurrent=True, backend=backend)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token ``chunk_gated_delta_rule`` (decoding)."""
    return _run("fused_recurrent_gated_delta_rule", q, k, v, g, beta, None, g_kind=_SCALAR, gate_kind=_SCALAR,
                scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, lower_bound=None, cu_seqlens=cu_seqlens,
                chunk_size=DEFAULT_CHUNK_SIZE, recurrent=True, backend=backend)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token ``chunk_kda`` (decoding)."""
    _kda_gate_checks(use_gate_in_kernel, safe_gate, lower_bound)
    return _run("fused_recurrent_kda", q, k, v, g, beta, None, g_kind="channel", gate_kind=_SCALAR, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound if use_gate_in_kernel else None,
                cu_seqlens=cu_seqlens, chunk_size=DEFAULT_CHUNK_SIZE, recurrent=True, backend=backend)


def fused_recurrent_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token ``chunk_gdn2`` (decoding)."""
    _kda_gate_checks(use_gate_in_kernel, safe_gate, lower_bound)
    return _run("fused_recurrent_gdn2", q, k, v, g, b, w, g_kind="channel", gate_kind="channel", scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                lower_bound=lower_bound if use_gate_in_kernel else None, cu_seqlens=cu_seqlens,
                chunk_size=DEFAULT_CHUNK_SIZE, recurrent=True, backend=backend)


for _fn in (chunk_delta_rule, chunk_gated_delta_rule, chunk_kda, chunk_gdn2, fused_recurrent_delta_rule,
            fused_recurrent_gated_delta_rule, fused_recurrent_kda, fused_recurrent_gdn2):
    _fn.__doc__ = (_fn.__doc__ or "") + "\n" + _COMMON_ARGS

__all__ = [
    "chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda", "chunk_gdn2", "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule", "fused_recurrent_kda", "fused_recurrent_gdn2",
]
