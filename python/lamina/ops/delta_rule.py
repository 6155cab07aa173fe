"""Functional API of the delta-rule family (re-exported by ``lamina``), fla 0.6's names and order.

``chunk_delta_rule``, ``chunk_gated_delta_rule``, ``chunk_kda``, ``chunk_gdn2`` (chunked, for
training and prefill) and their ``fused_recurrent_*`` twins (token by token, for decoding). All
return ``(o [B, T, HV, V] in v.dtype, final_state float32 or None)``; the state is
``[N, HV, K, V]``, or ``[N, HV, V, K]`` with ``state_v_first=True``.

fla compatibility (an fla 0.6 call runs unchanged after changing the import):

* Every named parameter of fla's function of the same name, in fla's positional order and with
  fla's default. The keys fla reads from ``**kwargs`` are explicit keyword-only parameters here
  (``chunk_size``; ``use_gate_in_kernel``/``A_log``/``dt_bias`` of ``chunk_gated_delta_rule``;
  ``A_log``/``dt_bias`` of ``chunk_kda``/``chunk_gdn2``; ``transpose_state_layout``, the deprecated
  alias of ``state_v_first``; ``head_first``), as are lamina's own (``backend``, and ``safe_gate``
  where fla lacks it). There is no ``**kwargs``: an unknown keyword is Python's TypeError.
* ``state_v_first=True``: the initial and final states are ``[N, HV, V, K]`` (transposed at the
  op boundary; gradients reach ``initial_state`` in that layout).
* Accepted, results unchanged: ``cu_seqlens_cpu`` (a CPU copy of ``cu_seqlens`` of the same
  length; the offsets are validated on it instead of being read back from the device; the chunked
  Triton launchers still read their chunk count from the device once),
  ``chunk_indices`` (lamina computes its own), ``disable_recompute``, ``use_graph``,
  ``max_num_seqs`` (performance hints of fla's kernels). Lamina's training forward saves the chunk
  states and each chunk's triangular inverse for the backward, whatever ``disable_recompute`` says;
  ``delta_tuning(recompute_states=True)`` (``lamina.kernels.delta_tuning``) has the backward recompute them
  instead, as fla does by default.
* Refused when not at fla's default (NotImplementedError naming the parameter):
  ``return_intermediate_states=True``, ``head_first=True``, ``gv`` not None, and a
  per-value-channel ``beta [B, T, HV, V]``. ``cp_context`` takes lamina's own
  ``lamina.distributed.ContextParallel`` (fla's context objects: TypeError).
* lamina is wider where it can be: float32 inputs, any chunk size of 16/32/64, gradients of the
  ``fused_recurrent_*`` ops.

Input transforms: ``use_gate_in_kernel`` (with ``A_log``/``dt_bias``/``lower_bound``) is fused into the
chunked Triton kernels: they read the raw gate and apply the activation where they load it, forward and
backward, and the backward returns the gradients of the raw gate, ``A_log`` and ``dt_bias`` (with ``gk``
or ``cp_context``, and on the torch path, it is applied with PyTorch ops in float32 first, as below).
``use_qk_l2norm_in_kernel`` is fused into the chunked Triton forward on Hopper (and under the interpreter):
its kernels take the rows' inverse norms and scale the rows of q and k they load by them, without a pass of
their own (fla runs its l2norm kernel over q and k before its chunked ones); so do the backward's kernels (the
first stores the normalised rows for the others), and ``lamina.l2_norm``'s backward takes dq and dk back to the
raw rows (one pass). The token-by-token Triton kernel normalises each raw row in float32 there too (as fla's
fused_recurrent kernels do), and its backward takes the raw rows as the chunked one does. On
other GPUs (``kernels.delta_chunk_common.l2norm_in_kernels``),
with ``cp_context`` and on the torch path ``lamina.l2_norm`` runs on q and k first (PyTorch ops with
``backend="torch"``), computed in float32. ``use_beta_sigmoid_in_kernel`` (with ``allow_neg_eigval``) is
fused into the chunked Triton kernels, forward and backward: they read the raw beta, apply the sigmoid in float32
where they load it, and the backward's kernels store the raw beta's gradient (fla applies it to beta with PyTorch
ops before its kernels). On the token-by-token Triton path (with gradients), with ``cp_context`` and on the torch
path it is applied with PyTorch ops, in float32, first; autograd differentiates it. The results are fla's to
float32 rounding.

Gradients: the chunked ops differentiate through ``kernels.delta_chunk_bwd`` (Triton) or, with
``backend="torch"``, autograd through the vectorised chunked PyTorch path ``lamina.ops.delta_rule_cpu``
(tested against the naive references, not one of them). The ``fused_recurrent_*`` ops share that
backward: on the Triton path it recomputes the chunk states with the chunked forward, on the torch
path they run the same chunked PyTorch form (the token-by-token map up to rounding).
"""

from __future__ import annotations

import torch

from lamina._delta_spec import BetaAct
from lamina._validate import (
    check_gate_dtype,
    check_no_overlap,
    check_nonpositive,
    check_same_device,
    check_scale,
)
from lamina.ops.delta_rule_core import (
    DEFAULT_CHUNK_SIZE,
    KERNEL_DTYPES,
    beta_activation,
    check_flag_args,
    check_gate_params,
    delta_rule_core,
    gate_activation,
    l2norm,
    refuse,
    state_layout,
    validate_inputs,
)

# (o, final_state), or with output_v_new=True (o, final_state, v_new).
OpResult = tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]

# Gate kinds: one scalar per (token, value head), or one value per key/value channel.
_SCALAR = "scalar"
_CHANNEL = "channel"

# What lamina supports instead, for the fla parameters it refuses (the sentence after "not supported").
_ONLY_STATES = "lamina returns (o, final_state) only (return_intermediate_states=False)"
_NO_HEAD_FIRST = "inputs are [B, T, H, ...] (head_first=False), as in fla 0.6"


def _run(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    b: torch.Tensor | None,
    w: torch.Tensor | None,
    *,
    g_kind: str | None,
    gate_kind: str,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: torch.Tensor | None,
    recurrent: bool,
    backend: str,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    decode: dict | None = None,
    output_v_new: bool = False,
    cp_context: object | None = None,
) -> OpResult:
    """Validate, transform and dispatch.

    ``g_kind``: None | "scalar" | "channel" (the decay ``g``); ``gk``: an extra per-K log decay added
    to ``g`` (fla's ``fused_recurrent_gated_delta_rule``). ``gate_kind``: "scalar" (one beta for
    erase and write; ``b`` None means ones) or "channel" (GDN-2's ``b`` and ``w``).
    ``output_v_new``: a third result, the writes (``OpResult``). ``cp_context``: a
    ``lamina.distributed.ContextParallel`` (chunked ops; this rank's tokens of split sequences).
    """
    if not isinstance(output_v_new, bool):
        raise TypeError(f"{op}: output_v_new must be a bool, got {type(output_v_new).__name__}")
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
    if gk is not None:
        gates["gk"] = (gk, (*lead, K))
    if gate_kind == _SCALAR:
        if isinstance(b, torch.Tensor) and b.dim() == 4:
            raise NotImplementedError(f"{op}: beta of shape {tuple(b.shape)} (per value channel, [B, T, HV, V]) "
                                      "is not supported by lamina; beta must be [B, T, HV] or None (ones)")
        gates["beta"] = (b, lead)
    else:
        gates["b"] = (b, (*lead, K))
        gates["w"] = (w, (*lead, V))
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v, g, b, w, gk, initial_state, A_log, dt_bias))
    if decode is not None and decode["used"] and needs_grad:
        raise ValueError(f"{op}: inplace_final_state, ssm_state_indices, num_accepted_tokens and out are for "
                         "inference; run under torch.no_grad() or pass tensors that do not require grad")
    pool = decode is not None and decode["ssm_state_indices"] is not None
    n_context = None
    if cp_context is not None:
        from lamina.distributed import ContextParallel

        if not isinstance(cp_context, ContextParallel):
            raise TypeError(f"{op}: cp_context must be a lamina.distributed.ContextParallel, "
                            f"got {type(cp_context).__name__}")
        if cu_seqlens is not None or cu_seqlens_cpu is not None:
            raise ValueError(f"{op}: with cp_context pass the packed layout to the context "
                             "(ContextParallel(cu_seqlens=...)), not cu_seqlens")
        n_context = B if cp_context.cu_seqlens is None else len(cp_context.cu_seqlens) - 1
    N = validate_inputs(op, q, k, v, gates, None if pool else initial_state, cu_seqlens, chunk_size,
                        cu_seqlens_cpu=cu_seqlens_cpu, state_v_first=state_v_first, n_sequences=n_context)
    _check_dtypes_and_ranges(q, v, gates, scale, raw_gate=use_gate_in_kernel)
    if decode is not None:
        check_no_overlap("out", decode["out"], q=q, k=k, v=v, initial_state=initial_state,
                         **{n: x for n, (x, _) in gates.items()})
    if output_v_new and decode is not None and decode["used"]:
        raise ValueError(f"{op}: output_v_new is not available with inplace_final_state, ssm_state_indices, "
                         "num_accepted_tokens or out (the decode kernels do not form the writes)")
    writes = (v.clone(),) if output_v_new else ()
    if T == 0 and (decode is None or not decode["used"]) and cp_context is None:
        # nothing to run: an empty output, and each state passes through unchanged (identity gradient)
        if not output_final_state:
            return v.clone(), None, *writes
        if initial_state is not None:
            return v.clone(), initial_state.clone(), *writes
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        return (v.clone(), q.new_zeros(shape, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32),
                *writes)
    if recurrent and not needs_grad and not output_v_new:
        if use_gate_in_kernel:
            if g is None:
                raise ValueError(f"{op}: g (the raw gate input) is required with use_gate_in_kernel=True")
            check_gate_params(HV, None if g_kind == _SCALAR else K, A_log, dt_bias, need_A_log=lower_bound is None)
        return _decode(op, q, k, v, g, b, w, gk, gate_kind, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, cu_seqlens, backend, use_gate_in_kernel, A_log, dt_bias,
                       use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, N,
                       decode or _decode_keywords())
    gate = None
    if use_gate_in_kernel:
        if g is None:
            raise ValueError(f"{op}: g (the raw gate input) is required with use_gate_in_kernel=True")
        check_gate_params(HV, None if g_kind == _SCALAR else K, A_log, dt_bias, need_A_log=lower_bound is None)
        if gk is None and cp_context is None:  # activated inside the kernels (or by the torch path)
            gate = (A_log, dt_bias, lower_bound)
        else:
            g = gate_activation(g, A_log, dt_bias, lower_bound)
    if gk is not None:  # fla applies exp(g) then exp(gk): one per-channel log decay g + gk
        if g is not None:
            acc = torch.promote_types(torch.promote_types(g.dtype, gk.dtype), torch.float32)
            gk = g.to(acc)[..., None] + gk.to(acc)
        g = gk
    if use_qk_l2norm_in_kernel and cp_context is not None:  # else delta_rule_core normalises them
        q, k = l2norm(q, backend), l2norm(k, backend)
    beta_act = BetaAct.NONE
    if gate_kind == _SCALAR:
        # beta None is ones, then the in-kernel options apply to it, as in fla
        b = q.new_ones(lead) if b is None else b
        if cp_context is not None:
            b = beta_activation(b, use_beta_sigmoid_in_kernel, allow_neg_eigval)
        else:  # delta_rule_core activates it (inside the chunked kernels)
            beta_act = BetaAct.of(use_beta_sigmoid_in_kernel, allow_neg_eigval)
        w = b
    if scale is None:
        scale = K ** -0.5
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    if cp_context is not None:
        from lamina.distributed import delta_rule_context_parallel

        o, ht, v_new = delta_rule_context_parallel(cp_context, delta_rule_core, op, q, k, v, g, b, w, scale,
                                                   initial_state, output_final_state, chunk_size, backend,
                                                   output_v_new)
    else:
        o, ht, v_new = delta_rule_core(op, q, k, v, g, b, w, scale, initial_state, output_final_state, cu_seqlens,
                                       chunk_size, recurrent, backend, output_v_new=output_v_new, gate=gate,
                                       l2norm_qk=use_qk_l2norm_in_kernel, beta_act=beta_act)
    if state_v_first and ht is not None:
        ht = ht.transpose(-1, -2).contiguous()
    return (o, ht, v_new) if output_v_new else (o, ht)


def _check_dtypes_and_ranges(q: torch.Tensor, v: torch.Tensor, gates: dict, scale: object, raw_gate: bool) -> None:
    """What ``validate_inputs`` leaves to the op: v's dtype, the gates' dtypes, ``scale``, and ``g <= 0``.

    Gates (``g``, ``gk``, ``beta``, ``b``, ``w``) are in q's dtype or float32. The log decays ``g``
    and ``gk`` must be <= 0 (``exp(g)`` is a decay; the chunked kernels take exponents relative to a
    row of the same sub-chunk, exact only for non-positive gates): checked on CPU tensors, where it
    costs no device sync; on CUDA it is the caller's contract, as in fla. With
    ``use_gate_in_kernel`` ``g`` is the raw gate input (any sign) and is not checked. A log decay of -inf
    (a decay of 0) forgets the state at its token; the chunked forms floor log decays at
    ``LOG_DECAY_FLOOR`` (-40), where the token loops take them as they are.
    """
    if v.dtype != q.dtype:
        raise ValueError(f"v must have the dtype of q ({str(q.dtype).replace('torch.', '')}), "
                         f"got {str(v.dtype).replace('torch.', '')}")
    for name, (x, _) in gates.items():
        if x is not None:
            check_gate_dtype(name, x, q.dtype)
    check_scale("scale", scale)
    for name in ("g", "gk"):
        x = gates.get(name, (None, None))[0]
        if x is not None and not (raw_gate and name == "g"):
            check_nonpositive(name, x)


def _decode_keywords(inplace_final_state: bool = False, ssm_state_indices: torch.Tensor | None = None,
                     num_accepted_tokens: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     check_indices: bool = True) -> dict:
    return {"inplace_final_state": bool(inplace_final_state), "ssm_state_indices": ssm_state_indices,
            "num_accepted_tokens": num_accepted_tokens, "out": out, "check_indices": bool(check_indices),
            "used": bool(inplace_final_state) or any(x is not None for x in (ssm_state_indices, num_accepted_tokens,
                                                                              out))}


def _decode(op, q, k, v, g, b, w, gk, gate_kind, scale, initial_state, output_final_state, l2norm, cu_seqlens,
            backend, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
            state_v_first, N, kw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused decode step (forward only): transforms in the kernel, states updated in place on request."""
    from lamina.ops import delta_decode as dd

    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    inplace = kw["inplace_final_state"]
    check_same_device(q=q, initial_state=initial_state)
    idx = dd.check_pool(op, initial_state, N, HV, K, V, state_v_first, kw["ssm_state_indices"],
                        kw["num_accepted_tokens"], inplace, kw["check_indices"], q.dtype)
    dd.check_out(op, kw["out"], v)
    path = dd.resolve_backend(op, backend, q.device)
    if path != "torch" and (q.dtype not in KERNEL_DTYPES or v.dtype not in KERNEL_DTYPES):
        if backend == "auto":  # float64 (oracles, gradcheck): the PyTorch step, which takes any float dtype
            path = "torch"
        else:
            raise ValueError(f"{op}: the decode kernels take float32/float16/bfloat16 q, k, v, got {q.dtype}; "
                             "use backend='torch' for float64")
    gate_act = dd.GATE_NONE
    if use_gate_in_kernel:
        gate_act = dd.GATE_LOWER_BOUND if lower_bound is not None else dd.GATE_SOFTPLUS
    if gk is not None:  # one per-channel log decay g + gk, activated here (fla: exp(g) then exp(gk))
        if g is not None:
            if use_gate_in_kernel:
                g = gate_activation(g, A_log, dt_bias, lower_bound)
            acc = torch.promote_types(torch.promote_types(g.dtype, gk.dtype), torch.float32)
            gk = g.to(acc)[..., None] + gk.to(acc)
        g, gate_act = gk, dd.GATE_NONE
    if gate_act == dd.GATE_NONE:
        A_log = dt_bias = None
    else:
        A_log = None if A_log is None else A_log.reshape(-1).contiguous()
        dt_bias = None if dt_bias is None else dt_bias.reshape(-1).contiguous()
    beta_act = dd.BETA_NONE
    if gate_kind == _SCALAR:
        if b is None:
            b = q.new_ones(B, T, HV)
        beta_act = BetaAct.of(use_beta_sigmoid_in_kernel, allow_neg_eigval)
        w = None
    state = initial_state
    if state is not None and not dd.slot_contiguous(state):  # read only (inplace needs it contiguous)
        state = state.contiguous()
    final = None
    if output_final_state and not inplace:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        final = q.new_empty(shape, dtype=torch.float64 if (q.dtype == torch.float64 and path == "torch")
                            else torch.float32)
    o = dd.decode_step(q, k, v, g, b, w, scale=K ** -0.5 if scale is None else scale, A_log=A_log, dt_bias=dt_bias,
                       state=state, state_indices=idx, num_accepted_tokens=kw["num_accepted_tokens"],
                       cu_seqlens=cu_seqlens, out=kw["out"], final_state=final,
                       lower_bound=0.0 if lower_bound is None else lower_bound, gate_act=gate_act,
                       beta_act=beta_act, l2norm=l2norm, state_v_first=state_v_first, inplace=inplace,
                       backend=path)
    if inplace:
        return o, (initial_state if output_final_state else None)
    return o, final


def _kda_gate_checks(use_gate_in_kernel: bool, safe_gate: bool, lower_bound: float | None) -> None:
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("lower_bound must be given when safe_gate=True and use_gate_in_kernel=True")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"lower_bound must be in [-5, 0) with safe_gate=True, got {lower_bound}")


def _refuse_chunk_extras(op: str, return_intermediate_states: bool) -> None:
    refuse(op, "return_intermediate_states", return_intermediate_states, False, _ONLY_STATES)


_COMMON_ARGS = """
    Args (shared; each op has the subset of fla's signature shown above):
        q, k: ``[B, T, H, K]`` queries and keys, ``K <= 512`` (forward and backward).
        v: ``[B, T, HV, V]`` values, ``HV % H == 0`` (value head j reads q/k head ``j // (HV // H)``),
            in q's dtype.
        g, gk, beta, b, w: gates in q's dtype or float32. The log decays ``g``/``gk`` must be ``<= 0``:
            refused with a ValueError when they are CPU tensors; on CUDA not checked (a device sync),
            so a positive decay there is the caller's error, as in fla. With ``use_gate_in_kernel``
            ``g`` is the raw gate input (any sign).
        scale: query scale, a finite number, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` float32 (``[N, HV, V, K]`` with ``state_v_first``),
            N = B or the number of sequences of ``cu_seqlens``.
        output_final_state: also return the final states (float32, layout as ``initial_state``).
        use_qk_l2norm_in_kernel: l2-normalise q and k over K first (``x / sqrt(sum x^2 + 1e-6)``).
        state_v_first: states in fla's V-first layout ``[N, HV, V, K]``; ``transpose_state_layout``
            is its deprecated alias (DeprecationWarning; passing both with state_v_first=True is an error).
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of sequences packed along T (then B == 1).
        cu_seqlens_cpu: optional CPU copy of ``cu_seqlens`` (same length); validation reads it
            instead of ``cu_seqlens``.
        chunk_size: 16, 32 or 64 tokens per chunk of the Triton kernels (chunked ops only; keyword-only,
            as fla reads it from ``**kwargs``). On CPU the PyTorch path cuts its own chunks
            (``lamina._delta_spec.CPU_CHUNK_SIZE``, 32): the same map, up to rounding.
        backend: "auto" (CUDA: Triton; CPU: Triton under TRITON_INTERPRET=1, else PyTorch),
            "triton" or "torch".
        cp_context: a ``lamina.distributed.ContextParallel`` (chunked ops): q, k, v and the gates hold this
            rank's tokens of sequences split across the ranks of a process group (``cp.shard``); outputs,
            writes and gradients are those of the whole sequences, final states are every sequence's, on
            every rank; ``initial_state`` is every sequence's too. The packed layout is the context's
            (``cu_seqlens`` must be None). ``chunk_delta_rule`` takes it keyword-only (lamina's own there).
        output_v_new: lamina's own (keyword-only): also return the writes ``v_new [B, T, HV, V]`` (v.dtype),
            per token ``w_t * v_t - (D_t S_{t-1})^T (b_t k_t)`` after the in-kernel transforms (for DeltaNet,
            GDN and KDA ``beta_t (v_t - (D_t S_{t-1})^T k_t)``: the write error that cross-layer error
            routing passes on, ``lamina.layers.CrossLayerRouter``). The chunked state pass stores it from
            registers; it is differentiable. The ``fused_recurrent_*`` ops run the chunked kernels for it
            (same map), and refuse it with the in-place decoding arguments.

    Returns:
        ``(o [B, T, HV, V] in v.dtype, final_state float32 or None)``, and ``v_new`` third with
        ``output_v_new``. T = 0 returns an empty ``o`` and
        the initial state (zeros without one). NaN/inf inputs propagate (``lamina._validate``): an output
        the token loop makes non-finite is non-finite; the chunked forms can spread it over the chunk.
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
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    head_first: bool = False,
    backend: str = "auto",
    output_v_new: bool = False,
    cp_context: object | None = None,
) -> OpResult:
    """DeltaNet: ``S <- S + beta_t k_t (v_t - S^T k_t)^T``, ``o_t = S^T (scale q_t)``; ``beta: [B, T, HV]``.

    fla: all parameters accepted; ``head_first=True`` refused.
    """
    refuse("chunk_delta_rule", "head_first", head_first, False, _NO_HEAD_FIRST)
    return _run("chunk_delta_rule", q, k, v, None, beta, None, g_kind=None, gate_kind=_SCALAR, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                chunk_size=chunk_size, recurrent=False, backend=backend, output_v_new=output_v_new,
                cp_context=cp_context)


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
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context: object | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    transpose_state_layout: bool | None = None,
    head_first: bool = False,
    backend: str = "auto",
    output_v_new: bool = False,
) -> OpResult:
    """Gated DeltaNet: DeltaNet with ``S <- exp(g_t) S`` first; ``g, beta: [B, T, HV]``.

    ``g`` is the log decay, or with ``use_gate_in_kernel`` the raw input of
    ``g = -exp(A_log) * softplus(g + dt_bias)`` (``A_log, dt_bias: [HV]``).
    ``use_beta_sigmoid_in_kernel``: ``beta = sigmoid(beta)`` (``2 * sigmoid`` with ``allow_neg_eigval``).

    fla: ``chunk_indices`` accepted and unused (lamina indexes its own chunks); ``head_first=True``
    refused.
    """
    op = "chunk_gated_delta_rule"
    v_first = state_layout(op, state_v_first, transpose_state_layout)
    refuse(op, "head_first", head_first, False, _NO_HEAD_FIRST)
    return _run(op, q, k, v, g, beta, None, g_kind=_SCALAR, gate_kind=_SCALAR, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, state_v_first=v_first,
                cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size, recurrent=False,
                backend=backend, output_v_new=output_v_new, cp_context=cp_context)


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
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context: object | None = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    transpose_state_layout: bool | None = None,
    backend: str = "auto",
    output_v_new: bool = False,
) -> OpResult:
    """Kimi Delta Attention: per-channel decay ``S <- Diag(exp(g_t)) S``; ``g: [B, T, HV, K]``, ``beta: [B, T, HV]``.

    With ``use_gate_in_kernel``: ``g = -exp(A_log) * softplus(g + dt_bias)`` per channel
    (``A_log: [HV]``, ``dt_bias: [HV * K]``), or with ``lower_bound`` set
    ``g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` optional).
    ``safe_gate`` only checks ``lower_bound`` in ``[-5, 0)``: the kernels are exact for any gate
    ``<= 0`` (every exponent is taken relative to a row of the same 16-token sub-block).

    fla: ``disable_recompute``, ``use_graph``, ``max_num_seqs`` accepted and unused (fla's memory and
    launch options); ``return_intermediate_states=True`` refused.
    """
    op = "chunk_kda"
    v_first = state_layout(op, state_v_first, transpose_state_layout)
    _refuse_chunk_extras(op, return_intermediate_states)
    _kda_gate_checks(use_gate_in_kernel, safe_gate, lower_bound)
    return _run(op, q, k, v, g, beta, None, g_kind=_CHANNEL, gate_kind=_SCALAR, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound if use_gate_in_kernel else None,
                state_v_first=v_first, cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size, recurrent=False, backend=backend,
                output_v_new=output_v_new, cp_context=cp_context)


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
    cu_seqlens_cpu: torch.Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cp_context: object | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    transpose_state_layout: bool | None = None,
    backend: str = "auto",
    output_v_new: bool = False,
) -> OpResult:
    """Gated DeltaNet-2: ``S_t = (I - k_t (b_t * k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T``.

    ``g: [B, T, HV, K]`` per-channel log decay (gate options as ``chunk_kda``);
    ``b: [B, T, HV, K]`` erase gate on the key axis; ``w: [B, T, HV, V]`` write gate on the value
    axis. With ``b = w = beta`` (broadcast) it is KDA.

    fla: ``disable_recompute`` accepted and unused; ``return_intermediate_states=True`` refused.
    Chunk sizes 16 and 32 work too (fla: 64 only).
    """
    op = "chunk_gdn2"
    v_first = state_layout(op, state_v_first, transpose_state_layout)
    _refuse_chunk_extras(op, return_intermediate_states)
    _kda_gate_checks(use_gate_in_kernel, safe_gate, lower_bound)
    return _run(op, q, k, v, g, b, w, g_kind=_CHANNEL, gate_kind=_CHANNEL, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound if use_gate_in_kernel else None,
                state_v_first=v_first, cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size, recurrent=False, backend=backend,
                output_v_new=output_v_new, cp_context=cp_context)


def fused_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    inplace_final_state: bool = False,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check_indices: bool = True,
    backend: str = "auto",
    output_v_new: bool = False,
) -> OpResult:
    """Token-by-token ``chunk_delta_rule`` (decoding). ``beta: [B, T, HV]``, or None for ones (fla's default)."""
    return _run("fused_recurrent_delta_rule", q, k, v, None, beta, None, g_kind=None, gate_kind=_SCALAR,
                scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, recurrent=True,
                backend=backend, output_v_new=output_v_new,
                decode=_decode_keywords(inplace_final_state, ssm_state_indices,
                                                         num_accepted_tokens, out, check_indices))


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    inplace_final_state: bool = False,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check_indices: bool = True,
    transpose_state_layout: bool | None = None,
    backend: str = "auto",
    output_v_new: bool = False,
) -> OpResult:
    """Token-by-token ``chunk_gated_delta_rule`` (decoding), with fla's optional decays.

    ``g: [B, T, HV]`` scalar log decay or None (no scalar decay; with ``use_gate_in_kernel`` it is
    the raw gate input and required); ``gk: [B, T, HV, K]`` per-key-channel log decay or None,
    applied after ``g`` as in fla's kernel: the total per-channel log decay is ``g[..., None] + gk``
    (the gate activation applies to ``g`` only), computed by the KDA path. ``beta: [B, T, HV]`` or
    None (ones). In fla's order beta is the seventh positional argument (``q, k, v, g, gk, gv, beta``):
    pass it by keyword.

    fla: ``gv`` (per-value-channel decay) not None refused; per-value-channel ``beta [B, T, HV, V]``
    refused.
    """
    op = "fused_recurrent_gated_delta_rule"
    v_first = state_layout(op, state_v_first, transpose_state_layout)
    refuse(op, "gv", gv, None, "decays are g [B, T, HV] and gk [B, T, HV, K] (gv=None)")
    return _run(op, q, k, v, g, beta, None, g_kind=None if g is None else _SCALAR, gate_kind=_SCALAR, gk=gk,
                scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, state_v_first=v_first,
                cu_seqlens=cu_seqlens, recurrent=True, backend=backend, output_v_new=output_v_new,
                decode=_decode_keywords(inplace_final_state, ssm_state_indices, num_accepted_tokens, out,
                                        check_indices))


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    safe_gate: bool = False,
    inplace_final_state: bool = False,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check_indices: bool = True,
    transpose_state_layout: bool | None = None,
    backend: str = "auto",
    output_v_new: bool = False,
) -> OpResult:
    """Token-by-token ``chunk_kda`` (decoding); ``A_log, dt_bias`` come sixth and seventh, as in fla.

    ``safe_gate`` is lamina's (keyword-only; the check of ``chunk_kda``).
    """
    op = "fused_recurrent_kda"
    v_first = state_layout(op, state_v_first, transpose_state_layout)
    _kda_gate_checks(use_gate_in_kernel, safe_gate, lower_bound)
    return _run(op, q, k, v, g, beta, None, g_kind=_CHANNEL, gate_kind=_SCALAR, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound if use_gate_in_kernel else None,
                state_v_first=v_first, cu_seqlens=cu_seqlens,
                recurrent=True, backend=backend, output_v_new=output_v_new,
                decode=_decode_keywords(inplace_final_state, ssm_state_indices, num_accepted_tokens, out,
                                        check_indices))


def fused_recurrent_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    safe_gate: bool = False,
    inplace_final_state: bool = False,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check_indices: bool = True,
    transpose_state_layout: bool | None = None,
    backend: str = "auto",
    output_v_new: bool = False,
) -> OpResult:
    """Token-by-token ``chunk_gdn2`` (decoding); ``A_log, dt_bias`` come seventh and eighth, as in fla.

    ``safe_gate`` is lamina's (keyword-only; the check of ``chunk_gdn2``). Differentiable (fla's is
    inference-only).
    """
    op = "fused_recurrent_gdn2"
    v_first = state_layout(op, state_v_first, transpose_state_layout)
    _kda_gate_checks(use_gate_in_kernel, safe_gate, lower_bound)
    return _run(op, q, k, v, g, b, w, g_kind=_CHANNEL, gate_kind=_CHANNEL, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound if use_gate_in_kernel else None,
                state_v_first=v_first, cu_seqlens=cu_seqlens,
                recurrent=True, backend=backend, output_v_new=output_v_new,
                decode=_decode_keywords(inplace_final_state, ssm_state_indices, num_accepted_tokens, out,
                                        check_indices))


for _fn in (chunk_delta_rule, chunk_gated_delta_rule, chunk_kda, chunk_gdn2, fused_recurrent_delta_rule,
            fused_recurrent_gated_delta_rule, fused_recurrent_kda, fused_recurrent_gdn2):
    _fn.__doc__ = (_fn.__doc__ or "") + "\n" + _COMMON_ARGS

__all__ = [
    "chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda", "chunk_gdn2", "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule", "fused_recurrent_kda", "fused_recurrent_gdn2",
]
