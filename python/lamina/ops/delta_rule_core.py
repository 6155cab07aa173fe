"""Core of the delta-rule ops: validation, input transforms, the Triton custom ops and dispatch.

The public functions (``lamina.chunk_delta_rule`` and friends, ``lamina.ops.delta_rule``) all
reduce to one call, ``delta_rule_core``, on transformed inputs:

* ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``;
* ``g``: ``None`` | ``[B, T, HV]`` | ``[B, T, HV, K]`` log decay (after any gate activation);
* ``b`` (erase) ``[B, T, HV] | [B, T, HV, K]`` and ``w`` (write) ``[B, T, HV] | [B, T, HV, V]``,
  the same tensor for DeltaNet, GDN and KDA (the raw beta with ``beta_act``, the chunked kernels' beta sigmoid).

Paths (``lamina._dispatch.select_backend``):

* ``"triton"``: ``lamina::delta_rule_fwd`` / ``lamina::delta_rule_bwd``, two
  ``torch.library.custom_op`` s with fake implementations and ``register_autograd``, wrapping
  ``kernels.delta_chunk_fwd`` (chunked or token-by-token forward) and
  ``kernels.delta_chunk_bwd``. The token-by-token forward keeps no chunk states; its backward
  first recomputes them (and the chunks' inverses) with the chunked forward, so both forwards share one
  backward.
* ``"torch"``: ``lamina.ops.delta_rule_cpu`` (``delta_rule_family_chunk_torch``, and
  ``delta_rule_family_recurrent_torch`` for the token-by-token ops: the same chunked form),
  vectorised differentiable PyTorch, tested against the naive references in ``lamina.reference``.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from lamina._delta_spec import CHUNK_SIZES, CPU_CHUNK_SIZE, DEFAULT_CHUNK_SIZE, L2NORM_EPS, MAX_K, MAX_V, BetaAct
from lamina._dispatch import select_backend
from lamina._validate import FLOAT_DTYPES, check_cu_seqlens, check_same_device, check_shape, check_tensor
from lamina.ops.rms_norm_gated import l2_norm

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- validation ----------------------------------------------------------------------------------

def validate_inputs(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gates: dict[str, tuple[torch.Tensor | None, tuple[int, ...] | None]],
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
    cu_seqlens_cpu: torch.Tensor | None = None,
    state_v_first: bool = False,
    n_sequences: int | None = None,
) -> int:
    """Check shapes, dtypes and devices at the public boundary; returns N (number of sequences).

    ``n_sequences``: N when the sequences are not those of this call's tensors (a context-parallel
    call: every sequence of the context, ``lamina.distributed``).
    ``gates`` maps an argument name to ``(tensor, expected shape)``; a None tensor is skipped.
    ``cu_seqlens_cpu`` (fla's host copy of ``cu_seqlens``): when given, the offsets are checked on it,
    so validation does not read ``cu_seqlens`` back from the device. ``state_v_first``: the
    initial state is expected as ``[N, HV, V, K]`` instead of ``[N, HV, K, V]``.
    """
    check_tensor("q", q, ndim=4)
    check_tensor("k", k, ndim=4)
    check_tensor("v", v, ndim=4)
    B, T, H, K = q.shape
    check_shape("k", k, (B, T, H, K), "like q [B, T, H, K]")
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v must have shape [B={B}, T={T}, HV, V] like q, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"v: the number of value heads HV={HV} must be a multiple of H={H} (q/k heads)")
    if k.dtype != q.dtype:
        raise ValueError(f"k must have the dtype of q ({q.dtype}), got {k.dtype}")
    if K > MAX_K or K < 1:
        raise ValueError(f"q/k head dim K must be in [1, {MAX_K}], got {K}")
    if V > MAX_V or V < 1:
        raise ValueError(f"v head dim V must be in [1, {MAX_V}], got {V}")
    for name, (x, shape) in gates.items():
        if x is None:
            continue
        check_tensor(name, x)
        if shape is not None:
            check_shape(name, x, shape)
    check_same_device(q=q, k=k, v=v, initial_state=initial_state, cu_seqlens=cu_seqlens,
                      **{n: x for n, (x, _) in gates.items()})
    if cu_seqlens_cpu is None:
        N = check_cu_seqlens(cu_seqlens, B, T)
    else:
        N = check_cu_seqlens(_host_offsets(cu_seqlens, cu_seqlens_cpu), B, T, name="cu_seqlens_cpu")
    N = N if n_sequences is None else n_sequences
    if initial_state is not None:
        allowed = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
        check_tensor("initial_state", initial_state, ndim=4, dtypes=allowed)
        if state_v_first:
            check_shape("initial_state", initial_state, (N, HV, V, K), "[N, HV, V, K] with state_v_first=True")
        else:
            check_shape("initial_state", initial_state, (N, HV, K, V), "[N, HV, K, V]")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
    return N


def _host_offsets(cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: object) -> torch.Tensor:
    """``cu_seqlens_cpu`` checked against ``cu_seqlens`` without a device read: a CPU tensor of the same length."""
    if cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu is given without cu_seqlens; pass both (cu_seqlens_cpu is its host copy)")
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64))
    check_tensor("cu_seqlens_cpu", cu_seqlens_cpu, ndim=1, dtypes=(torch.int32, torch.int64))
    if cu_seqlens_cpu.device.type != "cpu":
        raise ValueError(f"cu_seqlens_cpu must be a CPU tensor (the host copy of cu_seqlens), "
                         f"got a tensor on {cu_seqlens_cpu.device}")
    if cu_seqlens_cpu.numel() != cu_seqlens.numel():
        raise ValueError(f"cu_seqlens_cpu must have the length of cu_seqlens ({cu_seqlens.numel()}), "
                         f"got {cu_seqlens_cpu.numel()}")
    return cu_seqlens_cpu


def check_flag_args(op: str, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> None:
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{op}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")


# --- fla 0.6 keywords lamina does not implement, and the state layout ------------------------------

def refuse(op: str, name: str, value: object, default: object, supported: str) -> None:
    """Accept an fla parameter at its default; any other value raises NotImplementedError naming it."""
    if value is default or (isinstance(default, bool) and isinstance(value, int) and bool(value) == default):
        return
    raise NotImplementedError(f"{op}: {name}={value!r} is not supported by lamina; {supported}")


def state_layout(op: str, state_v_first: bool, transpose_state_layout: bool | None) -> bool:
    """fla's ``state_v_first``, with ``transpose_state_layout`` as its deprecated alias (fla's rules)."""
    if transpose_state_layout is None:
        return bool(state_v_first)
    if state_v_first:
        raise ValueError(f"{op}: pass state_v_first or the deprecated transpose_state_layout, not both")
    warnings.warn("transpose_state_layout is deprecated and renamed to state_v_first", DeprecationWarning,
                  stacklevel=3)
    return bool(transpose_state_layout)


# --- input transforms (PyTorch ops or lamina's L2-norm op: autograd differentiates them on every backend) --

def l2norm(x: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """``x / sqrt(sum(x^2, -1) + eps)`` over the head dim, computed in fp32, returned in x.dtype.

    ``lamina.l2_norm``: its one-pass Triton kernel, forward and backward, unless ``backend`` is "torch"
    (then PyTorch ops, differentiated by autograd; float64 always takes that path)."""
    return l2_norm(x, L2NORM_EPS, "torch" if backend == "torch" else "auto")


def beta_activation(beta: torch.Tensor, use_sigmoid: bool, allow_neg_eigval: bool) -> torch.Tensor:
    """``sigmoid(beta)`` (times 2 with ``allow_neg_eigval``) when ``use_sigmoid``, else ``beta``."""
    if not use_sigmoid:
        return beta
    out = torch.sigmoid(beta.float() if beta.dtype != torch.float64 else beta)
    return out * 2 if allow_neg_eigval else out


def gate_activation(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """fla 0.6's gates, in float32 (float64 for float64 input), broadcast over the last dims of g.

    ``g [B, T, HV]`` (GDN): ``-exp(A_log) * softplus(g + dt_bias)``, ``A_log, dt_bias [HV]``.
    ``g [B, T, HV, K]`` (KDA, GDN-2): the same per channel with ``A_log [HV]``,
    ``dt_bias [HV * K]``; with ``lower_bound``: ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
    (``A_log`` optional there).
    """
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    x = g.to(acc)
    if dt_bias is not None:
        x = x + dt_bias.to(acc).view(g.shape[2:])
    a = None if A_log is None else A_log.to(acc).view(-1, *([1] * (g.dim() - 3)))
    if lower_bound is not None:
        if a is not None:
            x = a.exp() * x
        return lower_bound * torch.sigmoid(x)
    return -a.exp() * F.softplus(x)


def check_gate_params(
    HV: int, width: int | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
    need_A_log: bool,
) -> None:
    """``A_log [HV]``; ``dt_bias [HV]`` (scalar gate) or ``HV * width`` elements (per-channel gate)."""
    if A_log is None:
        if need_A_log:
            raise ValueError("A_log must be given when use_gate_in_kernel=True (shape [HV])")
    else:
        check_tensor("A_log", A_log)
        if A_log.numel() != HV:
            raise ValueError(f"A_log must have HV={HV} elements, got shape {tuple(A_log.shape)}")
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias)
        n = HV if width is None else HV * width
        if dt_bias.numel() != n:
            raise ValueError(f"dt_bias must have {n} elements ([HV] or [HV * K]), got shape {tuple(dt_bias.shape)}")


# --- Triton path: custom ops ---------------------------------------------------------------------

def _none_if_empty(x: torch.Tensor) -> torch.Tensor | None:
    return None if x.numel() == 0 and x.dim() == 1 else x


def _n_sequences(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


@torch.library.custom_op(
    "lamina::delta_rule_fwd", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor b, Tensor w, float scale, Tensor? initial_state, "
           "bool output_final_state, Tensor? cu_seqlens, int chunk_size, bool recurrent, bool save_states, "
           "bool output_v_new, bool gate_in_kernel, Tensor? A_log, Tensor? dt_bias, float? lower_bound, "
           "bool l2norm_qk, int beta_act) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def _fwd_op(q, k, v, g, b, w, scale, initial_state, output_final_state, cu_seqlens, chunk_size, recurrent,
            save_states, output_v_new, gate_in_kernel, A_log, dt_bias, lower_bound, l2norm_qk, beta_act):
    """(o, final_state or [0], h or [0], v_new or [0], A or [0]): empty 1-d tensors stand for None (ops return
    tensors). ``h`` and ``A`` (the chunk-start states and each chunk's inverse) are what the backward reads.

    ``v_new`` (the writes, for cross-layer error routing) comes from the chunked state pass; the token-by-token
    kernel does not form it, so a call that asks for it runs the chunked forward (the same map).
    ``gate_in_kernel``: ``g`` is the raw gate input, activated with ``A_log``, ``dt_bias`` and ``lower_bound``
    inside the chunked kernels (before the token-by-token kernel, which takes the log decay).
    ``l2norm_qk``: q and k are the raw rows, l2-normalised inside the kernels (each row in float32 by the
    token-by-token one).
    ``beta_act`` (a ``BetaAct``): ``b`` and ``w`` are the raw scalar beta, activated inside the chunked kernels
    (the token-by-token path is given it activated).
    """
    from lamina.kernels.delta_chunk_fwd import delta_chunk_fwd
    from lamina.kernels.delta_recurrent_fwd import delta_recurrent_fwd

    h = v_new = solve = None
    if recurrent and not output_v_new:
        if gate_in_kernel:
            g = gate_activation(g, A_log, dt_bias, lower_bound)
        o, ht = delta_recurrent_fwd(q, k, v, g, b, w, scale, initial_state, output_final_state, cu_seqlens,
                                    l2norm=l2norm_qk)
    else:
        o, ht, h, v_new, solve = delta_chunk_fwd(q, k, v, g, b, w, scale, initial_state, output_final_state,
                                                 cu_seqlens, chunk_size=chunk_size, save_states=save_states,
                                                 output_v_new=output_v_new,
                                                 gate=_gate_input(gate_in_kernel, A_log, dt_bias, lower_bound),
                                                 l2norm_qk=l2norm_qk, beta_act=beta_act)
    empty = q.new_zeros(0, dtype=torch.float32)
    return (o, (empty if ht is None else ht), (empty.clone() if h is None else h),
            (empty.clone() if v_new is None else v_new), (empty.clone() if solve is None else solve))


def _gate_input(gate_in_kernel: bool, A_log, dt_bias, lower_bound):
    from lamina.kernels.delta_chunk_common import GateInput

    return GateInput(A_log, dt_bias, lower_bound) if gate_in_kernel else None


@_fwd_op.register_fake
def _fwd_fake(q, k, v, g, b, w, scale, initial_state, output_final_state, cu_seqlens, chunk_size, recurrent,
              save_states, output_v_new, gate_in_kernel, A_log, dt_bias, lower_bound, l2norm_qk, beta_act):
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = _n_sequences(q, cu_seqlens)
    o = torch.empty_like(v)
    ht = q.new_empty(N, HV, K, V, dtype=torch.float32) if output_final_state else q.new_empty(0, dtype=torch.float32)
    if (recurrent and not output_v_new) or not save_states:
        h = q.new_empty(0, dtype=torch.float32)
        solve = q.new_empty(0, dtype=torch.float32)
    else:
        n_chunks = B * (-(-T // chunk_size)) if cu_seqlens is None else torch.library.get_ctx().new_dynamic_size()
        h = q.new_empty(n_chunks, HV, K, V, dtype=torch.float32)
        solve = q.new_empty(B, T, HV, chunk_size, dtype=torch.float32)
    v_new = torch.empty_like(v) if output_v_new else q.new_empty(0, dtype=torch.float32)
    return o, ht, h, v_new, solve


@torch.library.custom_op(
    "lamina::delta_rule_bwd", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor b, Tensor w, float scale, Tensor? initial_state, "
           "Tensor h, Tensor solve, Tensor do, Tensor? dht, Tensor? cu_seqlens, int chunk_size, Tensor? dv_new, "
           "bool gate_in_kernel, Tensor? A_log, Tensor? dt_bias, float? lower_bound, bool l2norm_qk, int beta_act) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def _bwd_op(q, k, v, g, b, w, scale, initial_state, h, solve, do, dht, cu_seqlens, chunk_size, dv_new,
            gate_in_kernel, A_log, dt_bias, lower_bound, l2norm_qk, beta_act):
    """(dq, dk, dv, dg or [0], db, dw, dinitial_state or [0], dA_log or [0], ddt_bias or [0]); ``dv_new``:
    gradient of the returned writes; with ``gate_in_kernel`` ``dg`` is the raw gate input's gradient.

    ``l2norm_qk``: the forward normalised the raw q and k inside its kernels, and so do the backward's: its first
    kernel forms the rows' inverse norms on its way through them, scales the rows it loads and stores the
    normalised rows for the later kernels. The L2-norm kernel's backward
    then takes dq and dk back to the raw rows (one pass; fla runs its l2norm's forward pass too, before its
    kernels). Nothing but the raw q and k is kept between forward and backward.
    ``beta_act``: ``b`` and ``w`` are the raw scalar beta; ``db`` and ``dw`` are its gradients (the kernels take
    the activation's derivative where they store them)."""
    from lamina.kernels.delta_chunk_bwd import delta_chunk_bwd
    from lamina.kernels.delta_chunk_fwd import delta_chunk_fwd

    gate = _gate_input(gate_in_kernel, A_log, dt_bias, lower_bound)
    if _none_if_empty(h) is None:  # token-by-token forward or recompute_states: the states and inverses again
        _, _, h, _, solve = delta_chunk_fwd(q, k, v, g, b, w, scale, initial_state, False, cu_seqlens,
                                            chunk_size=chunk_size, save_states=True, gate=gate, beta_act=beta_act,
                                            l2norm_qk=l2norm_qk)
    dq, dk, dv, dg, db, dw, dh0, *dgate = delta_chunk_bwd(q, k, v, g, b, w, scale, initial_state, h, solve,
                                                          do.contiguous(), dht, cu_seqlens, chunk_size, dv_new=dv_new,
                                                          gate=gate, beta_act=beta_act, l2norm_qk=l2norm_qk)
    empty = q.new_zeros(0, dtype=torch.float32)
    dA_log, ddt_bias = dgate or (None, None)
    return (dq, dk, dv, empty if dg is None else dg, db, dw,
            empty.clone() if (dh0 is None or initial_state is None) else dh0,
            empty.clone() if dA_log is None else dA_log, empty.clone() if ddt_bias is None else ddt_bias)


@_bwd_op.register_fake
def _bwd_fake(q, k, v, g, b, w, scale, initial_state, h, solve, do, dht, cu_seqlens, chunk_size, dv_new,
              gate_in_kernel, A_log, dt_bias, lower_bound, l2norm_qk, beta_act):
    empty = q.new_empty(0, dtype=torch.float32)
    like = lambda x, used: torch.empty_like(x) if used and x is not None else empty.clone()  # noqa: E731
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            empty if g is None else torch.empty_like(g), torch.empty_like(b), torch.empty_like(w),
            like(initial_state, True), like(A_log, gate_in_kernel), like(dt_bias, gate_in_kernel))


def _setup_context(ctx, inputs, output):
    (q, k, v, g, b, w, scale, initial_state, _, cu_seqlens, chunk_size, _, _, output_v_new, gate_in_kernel, A_log,
     dt_bias, lower_bound, l2norm_qk, beta_act) = inputs
    ctx.save_for_backward(q, k, v, g, b, w, initial_state, cu_seqlens, output[2], output[4], A_log, dt_bias)
    ctx.scale, ctx.chunk_size, ctx.output_v_new = scale, chunk_size, output_v_new
    ctx.gate_in_kernel, ctx.lower_bound, ctx.l2norm_qk, ctx.beta_act = gate_in_kernel, lower_bound, l2norm_qk, beta_act


def _backward(ctx, do, dht, _dh, dv_new, _solve):
    # one gradient per input of lamina::delta_rule_fwd: q, k, v, g, b, w, scale, initial_state,
    # output_final_state, cu_seqlens, chunk_size, recurrent, save_states, output_v_new, gate_in_kernel, A_log,
    # dt_bias, lower_bound, l2norm_qk, beta_act
    q, k, v, g, b, w, initial_state, cu_seqlens, h, solve, A_log, dt_bias = ctx.saved_tensors
    dht = _none_if_empty(dht) if dht is not None else None
    dv_new = dv_new if ctx.output_v_new else None
    do = torch.zeros_like(v) if do is None else do
    dq, dk, dv, dg, db, dw, dh0, dA_log, ddt_bias = _bwd_op(
        q, k, v, g, b, w, ctx.scale, initial_state, h, solve, do, dht, cu_seqlens, ctx.chunk_size, dv_new,
        ctx.gate_in_kernel, A_log, dt_bias, ctx.lower_bound, ctx.l2norm_qk, ctx.beta_act)
    return (dq, dk, dv, _none_if_empty(dg) if g is not None else None, db, dw, None,
            dh0 if initial_state is not None else None, None, None, None, None, None, None, None,
            _none_if_empty(dA_log) if A_log is not None else None,
            _none_if_empty(ddt_bias) if dt_bias is not None else None, None, None, None)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# --- dispatch ------------------------------------------------------------------------------------

# Where the float32 chunked Triton kernels have not been shown right on the device: CUDA. On an H200 (Triton 3.6)
# the float32 backward gave wrong dq, dk, dg (RMS error ratios about 0.6 against float64, Gated DeltaNet) and
# illegal memory accesses (DeltaNet, KDA) (benchmarks/results/2026-12-04-nvidia-h200/README.md); on an H100
# (Triton 3.6) the float32 KDA forward ended in one (benchmarks/results/2026-12-06-nvidia-h100/README.md). For
# sm_90, Triton 3.6 and 3.9 compiled those float32 chunked kernels (tf32x3 products) to the warpgroup product of
# Triton issue #10629, ``wgmma m64n8k8`` in tf32, which reads its shared-memory operand past its end; the
# static report flags it. The bf16/fp16 kernels and the token-by-token forward have no such product and
# matched float64 there. Under the interpreter on CPU the float32 kernels are right. The float32 kernels now
# run such products at 4 warps (``matrix_warps``; the static report finds none at K = 64 to 512), but no GPU
# has run them since: the fence stays until one does (benchmarks/gpu_diag/fp32_warps.sh asks it).
UNTRUSTED_FP32_DEVICES = ("cuda",)


def training_path(op: str, path: str, backend: str, device_type: str, dtype: torch.dtype, needs_grad: bool,
                  chunked: bool = True) -> str:
    """``path`` unless it would run float32 chunked Triton kernels where they are not trusted
    (``UNTRUSTED_FP32_DEVICES``): the forward (``chunked``: the chunked forward, not the token-by-token one) or
    the backward (``needs_grad``). Then "auto" takes the PyTorch path and an explicit "triton" raises."""
    if not (path == "triton" and (needs_grad or chunked) and dtype == torch.float32
            and device_type in UNTRUSTED_FP32_DEVICES):
        return path
    if backend == "auto":
        return "torch"
    what = "that need gradients" if needs_grad else "in the chunked forward"
    raise ValueError(
        f"{op}: backend='triton' with float32 inputs {what} on {device_type}: the float32 chunked Triton kernels "
        "gave wrong gradients and illegal memory accesses on an H200 and an H100 (Triton 3.6); run in "
        "bfloat16/float16, or use backend='auto' or 'torch' (PyTorch) for float32")


def _l2norm_in_kernels(device: torch.device) -> bool:
    from lamina.kernels.delta_chunk_common import l2norm_in_kernels

    return l2norm_in_kernels(device)


def delta_rule_core(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    b: torch.Tensor,
    w: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
    recurrent: bool,
    backend: str,
    output_v_new: bool = False,
    gate: tuple[torch.Tensor | None, torch.Tensor | None, float | None] | None = None,
    l2norm_qk: bool = False,
    beta_act: int = BetaAct.NONE,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run the family on transformed inputs (module docstring) with the backend chosen for ``op``.

    ``l2norm_qk`` (fla's ``use_qk_l2norm_in_kernel``): q and k are raw and l2-normalised here: inside the
    Triton forward kernels where ``kernels.delta_chunk_common.l2norm_in_kernels`` allows (no pass of their
    own in the forward; the token-by-token kernel normalises each row in float32 as fla's does; the backward
    runs the L2-norm kernel), else by ``l2norm`` first (the PyTorch path, GPUs other than Hopper).

    ``beta_act`` (a ``BetaAct``, fla's ``use_beta_sigmoid_in_kernel`` with ``allow_neg_eigval``): ``b`` and ``w``
    are the raw scalar beta (DeltaNet, GDN and KDA pass one tensor as both), activated inside the chunked Triton
    kernels, forward and backward (no pass of its own), else by ``beta_activation`` first (the token-by-token
    Triton path, the PyTorch path).

    ``gate``: ``(A_log, dt_bias, lower_bound)`` of fla's ``use_gate_in_kernel`` (validated by the caller):
    ``g`` is then the raw gate input, activated inside the Triton kernels, forward and backward, or by
    ``gate_activation`` on the torch path.

    Returns ``(o, final_state or None, v_new or None)``; ``v_new`` (with ``output_v_new``) is the writes
    ``w_t * v_t - (D_t S_{t-1})^T (b_t k_t)`` ``[B, T, HV, V]`` in v.dtype, differentiable.
    """
    path = select_backend(op, backend, (q, k, v, g, b, w, initial_state, cu_seqlens))
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, b, w, initial_state, *(gate or ())[:2]))
    path = training_path(op, path, backend, q.device.type, q.dtype, needs_grad, chunked=not recurrent)
    if l2norm_qk and (path == "torch" or not _l2norm_in_kernels(q.device)):
        q, k, l2norm_qk = l2norm(q, backend), l2norm(k, backend), False
    if beta_act != BetaAct.NONE and (path == "torch" or recurrent):
        same = w is b
        b = beta_activation(b, True, beta_act == BetaAct.SIGMOID2)
        w = b if same else beta_activation(w, True, beta_act == BetaAct.SIGMOID2)
        beta_act = BetaAct.NONE
    if path == "torch" and gate is not None:
        g = gate_activation(g, *gate)
    if path == "torch":
        from lamina.ops.delta_rule_cpu import delta_rule_family_chunk_torch, delta_rule_family_recurrent_torch

        if recurrent:
            out = delta_rule_family_recurrent_torch(q, k, v, g, b, w, scale, initial_state, output_final_state,
                                                    cu_seqlens, output_v_new=output_v_new)
        else:
            # on CPU its own chunk length, not the kernels' chunk_size (the same map up to rounding)
            size = CPU_CHUNK_SIZE if q.device.type == "cpu" else chunk_size
            out = delta_rule_family_chunk_torch(q, k, v, g, b, w, scale, initial_state, output_final_state,
                                                cu_seqlens, size, output_v_new=output_v_new)
        return out if output_v_new else (*out, None)
    if q.dtype not in KERNEL_DTYPES or v.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{op}: the Triton kernels take float32/float16/bfloat16 q, k, v, got {q.dtype}; "
                         "use backend='torch' for float64")
    if initial_state is not None:
        initial_state = initial_state.float()
    from lamina.kernels.delta_tuning import active_tuning

    # the chunk states for the backward: saved by a chunked training forward unless the tuning asks the backward
    # to recompute them (as it does after the token-by-token forward)
    save_states = needs_grad and (output_v_new or not recurrent) and not active_tuning().recompute_states
    A_log, dt_bias, lower_bound = gate or (None, None, None)
    o, ht, _, v_new, _ = _fwd_op(q, k, v, g, b, w, float(scale), initial_state, output_final_state, cu_seqlens,
                              chunk_size, recurrent, save_states, output_v_new, gate is not None, A_log, dt_bias,
                              None if lower_bound is None else float(lower_bound), l2norm_qk, int(beta_act))
    return o, (ht if output_final_state else None), (v_new if output_v_new else None)


__all__ = [
    "CHUNK_SIZES", "DEFAULT_CHUNK_SIZE", "FLOAT_DTYPES", "beta_activation", "check_flag_args", "check_gate_params",
    "delta_rule_core", "gate_activation", "l2norm", "refuse", "state_layout", "training_path", "validate_inputs",
]
