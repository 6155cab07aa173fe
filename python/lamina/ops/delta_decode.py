"""The decode step of the delta-rule family: in place, over a pool of states, forward only.

``fused_recurrent_*`` take this path whenever no gradient is needed; fla's decode keywords
(``inplace_final_state``, ``ssm_state_indices``, ``num_accepted_tokens``, ``out``) need it.
Every backend implements one contract, ``decode_step``:

Inputs (raw, before any transform; the transforms run inside the step):

* ``q, k [B, T, H, K]``, ``v [B, T, HV, V]`` (one float dtype), ``out [B, T, HV, V]`` (v's dtype,
  contiguous; written).
* ``g``: None | ``[B, T, HV]`` | ``[B, T, HV, K]``; with ``gate_act`` it is the raw gate input:
  ``GATE_SOFTPLUS``: ``-exp(A_log[h]) * softplus(g + dt_bias)``; ``GATE_LOWER_BOUND``:
  ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias))`` (``A_log`` None: factor 1).
  ``A_log [HV]``, ``dt_bias [HV]`` (scalar g) or ``[HV * K]`` (per-channel g), each optional.
* ``b``: ``[B, T, HV]`` or ``[B, T, HV, K]`` (erase strength); ``w``: None (``w = b``, one beta)
  or ``[B, T, HV]`` / ``[B, T, HV, V]`` (write strength). ``beta_act``: ``BETA_SIGMOID`` applies
  ``sigmoid`` to ``b`` (and so to ``w = b``), ``BETA_SIGMOID2`` ``2 * sigmoid``.
* ``l2norm``: q and k divided by ``sqrt(sum(x^2) + 1e-6)`` over K; then ``q *= scale``.
* ``state``: float32 pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` with ``state_v_first``), each slot
  contiguous (any slot stride). ``state_indices``: None (sequence n uses slot n, P >= N) or int
  ``[N, S]``. ``num_accepted_tokens``: None or int ``[N]`` (needs ``state_indices``).
* ``cu_seqlens``: None (N = B sequences of T tokens) or ``[N + 1]`` offsets (B == 1).

Per sequence n (tokens ``bos .. eos - 1``), per value head:

* read slot ``r = state_indices[n, a - 1]`` with ``a = num_accepted_tokens[n]`` (``a = 1``
  without it), ``r = n`` without ``state_indices``. ``r < 0`` or ``r >= P`` (or ``a`` outside
  ``1..S``): the sequence is *skipped*: its ``out`` rows are zero, no slot is read or written,
  ``final_state[n]`` (if given) is zero. Without ``state`` the sequence starts from zeros.
* each token: ``S <- diag(exp(g_t)) S``; ``r_t = S^T (b_t * k_t)``;
  ``S <- S + k_t (w_t * v_t - r_t)^T``; ``out_t = S^T (scale * q_t)`` (rows of K, columns of V).
* writes, with ``inplace``: ``S = 1``: the final S to slot ``r``; ``S > 1`` (speculative
  decoding): the S after token ``t`` of the sequence to slot ``state_indices[n, t]`` for every
  ``t < S`` whose slot is in ``0 .. P-1`` (others are not written). ``final_state [N, HV, ...]``
  (not None, a separate tensor) receives the final S of each sequence.

Backends: ``"torch"`` (PyTorch, vectorised over sequences and heads: ``_torch_step``),
``"triton"`` (``kernels/delta_recurrent_fwd.py``), ``"cuda"`` and ``"cpu-ext"`` (the C++ kernels
of ``lamina._C``: ``csrc/delta_decode*``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina._delta_spec import L2NORM_EPS, BetaAct

GATE_NONE, GATE_SOFTPLUS, GATE_LOWER_BOUND = 0, 1, 2
BETA_NONE, BETA_SIGMOID, BETA_SIGMOID2 = BetaAct.NONE, BetaAct.SIGMOID, BetaAct.SIGMOID2


def _per_sequence(x: torch.Tensor, cu_seqlens: torch.Tensor | None, lengths: list[int]) -> torch.Tensor:
    """``[B, T, ...]`` -> ``[N, Tmax, ...]`` (varlen packs gathered per sequence, zero padded)."""
    if cu_seqlens is None:
        return x
    tmax = max(lengths, default=0)
    out = x.new_zeros(len(lengths), tmax, *x.shape[2:])
    starts = cu_seqlens.tolist()
    for n, length in enumerate(lengths):
        out[n, :length] = x[0, starts[n]:starts[n] + length]
    return out


def _torch_step(q, k, v, g, b, w, A_log, dt_bias, state, state_indices, num_accepted_tokens, cu_seqlens, out,
                final_state, scale: float, lower_bound: float, gate_act: int, beta_act: int, l2norm: bool,
                state_v_first: bool, inplace: bool) -> None:
    """``decode_step`` in PyTorch (module docstring): a loop over token positions, vectorised over
    sequences and heads; float32 math (float64 for float64 inputs)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if cu_seqlens is None:
        N, lengths = B, [T] * B
    else:
        offsets = cu_seqlens.tolist()
        N, lengths = len(offsets) - 1, [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)]
    tmax = max(lengths, default=0)
    dev = q.device
    length_t = torch.tensor(lengths, device=dev)

    def seq(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else _per_sequence(x, cu_seqlens, lengths).to(acc)

    qs, ks, vs, gs, bs, ws = (seq(x) for x in (q, k, v, g, b, w))
    if HV != H:
        qs, ks = (x.repeat_interleave(HV // H, dim=2) for x in (qs, ks))
    if l2norm:
        qs, ks = (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS) for x in (qs, ks))
    qs = qs * scale
    if gs is not None and gate_act != GATE_NONE:
        shape = (1, 1, HV) + ((1,) if gs.dim() == 4 else ())
        x = gs if dt_bias is None else gs + dt_bias.to(acc).view(1, 1, *gs.shape[2:])
        a = 1.0 if A_log is None else A_log.to(acc).view(shape).exp()
        if gate_act == GATE_SOFTPLUS:
            gs = -a * F.softplus(x)
        else:
            gs = lower_bound * torch.sigmoid(a * x)
    if beta_act != BETA_NONE:
        bs = torch.sigmoid(bs) * (2.0 if beta_act == BETA_SIGMOID2 else 1.0)
    if ws is None:
        ws = bs
    if bs.dim() == 3:
        bs = bs[..., None]
    if ws.dim() == 3:
        ws = ws[..., None]

    # read slots and which sequences run
    P = 0 if state is None else state.shape[0]
    if state_indices is None:
        slot = torch.arange(N, device=dev)
        active = slot < P if state is not None else torch.ones(N, dtype=torch.bool, device=dev)
    else:
        Sidx = state_indices.shape[1]
        a = (torch.ones(N, dtype=torch.long, device=dev) if num_accepted_tokens is None
             else num_accepted_tokens.long())
        a_ok = (a >= 1) & (a <= Sidx)
        slot = state_indices.long().gather(1, (a.clamp(1, Sidx) - 1)[:, None])[:, 0]
        active = a_ok & (slot >= 0) & (slot < P)
    if state is None:
        S = torch.zeros(N, HV, K, V, dtype=acc, device=dev)
    else:
        S = state.index_select(0, slot.clamp(0, max(P - 1, 0))).to(acc)
        if state_v_first:
            S = S.transpose(-1, -2)
        if not bool(active.all()):
            S = torch.where(active[:, None, None, None], S, torch.zeros_like(S))
    per_token = inplace and state_indices is not None and state_indices.shape[1] > 1
    o = torch.zeros(N, tmax, HV, V, dtype=acc, device=dev)
    every_row = bool(active.all()) and all(n == tmax for n in lengths)
    for t in range(tmax):
        live = (t < length_t) & active
        kt, et, zt = ks[:, t], ks[:, t] * bs[:, t], vs[:, t] * ws[:, t]
        if every_row:  # all rows advance: update S in place, batched over (sequence, head)
            if gs is not None:
                decay = gs[:, t].exp()
                S.mul_(decay[..., None, None] if decay.dim() == 2 else decay[..., None])
            r = torch.matmul(et[..., None, :], S).squeeze(-2)
            S.add_(kt[..., :, None] * (zt - r)[..., None, :])
            o[:, t] = torch.matmul(qs[:, t][..., None, :], S).squeeze(-2)
        else:
            m = live[:, None, None, None]
            S_dec = S
            if gs is not None:
                decay = gs[:, t].exp()
                S_dec = S * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
            r = torch.matmul(et[..., None, :], S_dec).squeeze(-2)
            S = torch.where(m, S_dec + kt[..., :, None] * (zt - r)[..., None, :], S)
            o[:, t] = torch.where(live[:, None, None], torch.matmul(qs[:, t][..., None, :], S).squeeze(-2), 0.0)
        if per_token and t < state_indices.shape[1]:
            dst = state_indices[:, t].long()
            ok = live & (dst >= 0) & (dst < P)
            if bool(ok.any()):
                St = S[ok].transpose(-1, -2) if state_v_first else S[ok]
                state[dst[ok]] = St.to(state.dtype)
    if inplace and not per_token and state is not None:
        rows = active.nonzero().squeeze(1)
        St = S.index_select(0, rows)
        St = St.transpose(-1, -2) if state_v_first else St
        state.index_copy_(0, slot.index_select(0, rows), St.to(state.dtype))
    if final_state is not None:
        St = S.transpose(-1, -2) if state_v_first else S
        final_state.copy_(torch.where(active[:, None, None, None], St, torch.zeros_like(St)).to(final_state.dtype))
    if cu_seqlens is None:
        out.copy_(o.to(out.dtype))
    else:
        offsets = cu_seqlens.tolist()
        for n, length in enumerate(lengths):
            out[0, offsets[n]:offsets[n] + length] = o[n, :length].to(out.dtype)


def _ext_step(*args) -> None:
    from lamina.ops.delta_decode_ext import ext_step

    ext_step(*args)


def _triton_step(*args) -> None:
    from lamina.kernels.delta_recurrent_fwd import delta_decode_step

    delta_decode_step(*args)


_STEPS = {"torch": _torch_step, "triton": _triton_step, "cuda": _ext_step, "cpu-ext": _ext_step}


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    b: torch.Tensor,
    w: torch.Tensor | None,
    *,
    scale: float,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    final_state: torch.Tensor | None = None,
    lower_bound: float = 0.0,
    gate_act: int = GATE_NONE,
    beta_act: int = BETA_NONE,
    l2norm: bool = False,
    state_v_first: bool = False,
    inplace: bool = False,
    backend: str = "torch",
) -> torch.Tensor:
    """Run ``decode_step`` (module docstring) on already validated inputs with a resolved backend
    ("torch", "triton", "cuda" or "cpu-ext"); ``state_indices`` is 2-d or None. Returns ``out``."""
    if out is None:
        out = torch.empty_like(v)
    _STEPS[backend](q, k, v, g, b, w, A_log, dt_bias, state, state_indices, num_accepted_tokens, cu_seqlens, out,
                    final_state, float(scale), float(lower_bound), int(gate_act), int(beta_act), bool(l2norm),
                    bool(state_v_first), bool(inplace))
    return out


# --- the op boundary: fla's decode keywords ------------------------------------------------------

DECODE_BACKENDS = ("auto", "triton", "cuda", "cpu-ext", "torch")
# On CUDA, "auto" takes the Triton step: the CUDA C++ step replaces it once a committed GPU sweep
# (lamina bench --op decode) shows it faster.
CUDA_AUTO = "triton"


def _ext_has_decode() -> bool:
    from lamina._optional import compiled_extension

    ext = compiled_extension()
    return ext is not None and hasattr(torch.ops.lamina_C, "delta_decode_step")


def resolve_backend(op: str, backend: str, device: torch.device) -> str:
    """The decode step's path on ``device``: "auto" is Triton on CUDA (``CUDA_AUTO``); on CPU Triton
    under ``TRITON_INTERPRET=1``, else the C++ CPU kernel when ``lamina._C`` has it, else PyTorch."""
    from lamina._dispatch import interpreter_enabled

    if backend not in DECODE_BACKENDS:
        raise ValueError(f"{op}: backend must be one of {DECODE_BACKENDS}, got {backend!r}")
    on_cuda = device.type == "cuda"
    if backend == "auto":
        if on_cuda:
            return CUDA_AUTO
        if interpreter_enabled():
            return "triton"
        return "cpu-ext" if _ext_has_decode() else "torch"
    if backend == "triton" and not on_cuda and not interpreter_enabled():
        raise ValueError(f"{op}: backend='triton' on CPU tensors needs the Triton interpreter; set "
                         "TRITON_INTERPRET=1 before importing lamina")
    if backend in ("cuda", "cpu-ext"):
        want = "cuda" if backend == "cuda" else "cpu"
        if device.type != want:
            raise ValueError(f"{op}: backend={backend!r} needs {want} tensors, got {device.type} tensors")
        if not _ext_has_decode():
            from lamina._optional import require_compiled_extension

            require_compiled_extension()
            raise ValueError(f"{op}: backend={backend!r}: the installed lamina._C has no delta_decode_step; "
                             "rebuild it (LAMINA_BUILD_CPU=1 or LAMINA_BUILD_CUDA=1 pip install "
                             "--no-build-isolation -e .)")
        from lamina._optional import compiled_extension

        if backend == "cuda" and not getattr(compiled_extension(), "WITH_CUDA", False):
            raise ValueError(f"{op}: backend='cuda': lamina._C was built without CUDA (LAMINA_BUILD_CUDA=1)")
    return backend


def slot_contiguous(state: torch.Tensor) -> bool:
    """Each ``state[p]`` is one contiguous block (the pool itself may be strided along P)."""
    return state[0].is_contiguous() if state.shape[0] else True


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_pool(op: str, state: torch.Tensor | None, N: int, HV: int, K: int, V: int, state_v_first: bool,
               ssm_state_indices: torch.Tensor | None, num_accepted_tokens: torch.Tensor | None,
               inplace: bool, check_indices: bool, dtype: torch.dtype) -> torch.Tensor | None:
    """Validate the state (pool) and the slot tables; returns the indices as ``[N, S]`` or None."""
    inner = (HV, V, K) if state_v_first else (HV, K, V)
    layout = "[P, HV, V, K] with state_v_first=True" if state_v_first else "[P, HV, K, V]"
    if inplace and state is None:
        raise ValueError(f"{op}: inplace_final_state=True needs initial_state (the states to update in place)")
    if ssm_state_indices is None:
        if num_accepted_tokens is not None:
            raise ValueError(f"{op}: num_accepted_tokens needs ssm_state_indices [N, S] (the slot of each draft token)")
    elif state is None:
        raise ValueError(f"{op}: ssm_state_indices needs initial_state (the pool of states [P, ...] it indexes)")
    if state is not None:
        if not isinstance(state, torch.Tensor) or state.dim() != 4:
            raise ValueError(f"{op}: initial_state must be a 4-d tensor {layout}, got "
                             f"{tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__}")
        if tuple(state.shape[1:]) != inner:
            raise ValueError(f"{op}: initial_state must have shape {layout} = [P, {', '.join(map(str, inner))}], "
                             f"got {tuple(state.shape)}")
        allowed = (torch.float32, torch.float64) if dtype == torch.float64 and not inplace else (torch.float32,)
        if state.dtype not in allowed:
            raise ValueError(f"{op}: initial_state must be float32{' (it is updated in place)' if inplace else ''}, "
                             f"got {str(state.dtype).replace('torch.', '')}")
        if ssm_state_indices is None and state.shape[0] != N:
            raise ValueError(f"{op}: initial_state must hold one state per sequence, N={N}, got {state.shape[0]} "
                             "(pass ssm_state_indices to index a pool of states)")
        if inplace and not slot_contiguous(state):
            raise ValueError(f"{op}: initial_state must be contiguous within each state (strides "
                             f"{tuple(state.stride())}) to be updated in place with inplace_final_state=True")
    if ssm_state_indices is None:
        return None
    idx = ssm_state_indices
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64) or idx.dim() not in (1, 2):
        raise ValueError(f"{op}: ssm_state_indices must be an int32/int64 tensor [N] or [N, S], got "
                         f"{(idx.dtype, tuple(idx.shape)) if isinstance(idx, torch.Tensor) else type(idx).__name__}")
    if idx.device != state.device:
        raise ValueError(f"{op}: ssm_state_indices must be on {state.device} like initial_state, got {idx.device}")
    if idx.shape[0] != N:
        raise ValueError(f"{op}: ssm_state_indices must have N={N} rows (one per sequence), got {tuple(idx.shape)}")
    idx = idx.view(N, 1) if idx.dim() == 1 else idx
    if idx.shape[1] < 1:
        raise ValueError(f"{op}: ssm_state_indices [N, S] needs S >= 1, got {tuple(idx.shape)}")
    if idx.stride(1) != 1:
        idx = idx.contiguous()
    acc = num_accepted_tokens
    if acc is not None:
        if not isinstance(acc, torch.Tensor) or acc.dtype not in (torch.int32, torch.int64) or acc.shape != (N,):
            got = (acc.dtype, tuple(acc.shape)) if isinstance(acc, torch.Tensor) else type(acc).__name__
            raise ValueError(f"{op}: num_accepted_tokens must be an int32/int64 tensor [N={N}], got {got}")
        if acc.device != state.device:
            raise ValueError(f"{op}: num_accepted_tokens must be on {state.device}, got {acc.device}")
    if check_indices and not _capturing(state.device):  # one read of the tables to the host, checked there
        P = state.shape[0]
        host = idx.cpu()
        hi = int(host.max()) if host.numel() else -1
        if hi >= P:
            raise ValueError(f"{op}: ssm_state_indices holds slot {hi}, outside the pool of P={P} states "
                             "(initial_state.shape[0]); negative slots mark skipped rows")
        if inplace and host.numel():  # sequences run in parallel: one must not write a slot another one uses
            rows = torch.arange(N).repeat_interleave(host.shape[1])
            flat = host.reshape(-1).long()
            used = flat >= 0
            pairs = torch.unique(torch.stack([rows[used], flat[used]]), dim=1)
            slots, counts = torch.unique(pairs[1], return_counts=True)
            if bool((counts > 1).any()):
                shared = int(slots[counts > 1][0])
                raise ValueError(f"{op}: ssm_state_indices gives slot {shared} to more than one sequence; with "
                                 "inplace_final_state=True each slot belongs to one sequence of the call")
        if acc is not None and acc.numel():
            acc_host = acc.cpu()
            lo_a, hi_a = int(acc_host.min()), int(acc_host.max())
            if lo_a < 1 or hi_a > idx.shape[1]:
                raise ValueError(f"{op}: num_accepted_tokens must be in [1, S={idx.shape[1]}], got values in "
                                 f"[{lo_a}, {hi_a}]")
    return idx


def check_out(op: str, out: torch.Tensor | None, v: torch.Tensor) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != v.shape or out.dtype != v.dtype or out.device != v.device or not out.is_contiguous():
        raise ValueError(f"{op}: out must be a contiguous {str(v.dtype).replace('torch.', '')} tensor of shape "
                         f"{tuple(v.shape)} on {v.device} (like v), got {str(out.dtype).replace('torch.', '')} "
                         f"{tuple(out.shape)} on {out.device}{'' if out.is_contiguous() else ', not contiguous'}")
