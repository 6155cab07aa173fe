"""``prism_attention``: softmax attention for every head dim a Prism schedule needs (16..512).

Paths (``lamina._dispatch.select_backend``): CUDA tensors and CPU tensors under the Triton
interpreter run lamina's Triton kernels (``lamina.kernels.prism_attn_fwd``/``_bwd``) through the
``lamina::prism_attention_fwd``/``_bwd`` custom ops, whose autograd formula is registered with
``torch.library.register_autograd`` (so ``torch.compile(fullgraph=True)`` sees one opaque op). CPU
tensors by default run PyTorch's fused attention with an exact blockwise backward
(``_SDPAExactBackward``, which also gives the lse), or, with a window or softcapping or where a causal
row sees no key, a blockwise PyTorch implementation differentiated by PyTorch's autograd.
With ``backend="auto"`` on CUDA a call may run FlashAttention or one of PyTorch's SDPA backends instead,
where a GPU sweep found it faster and it computes the same thing (``lamina.ops.attention_dispatch``);
without a committed sweep table every call runs lamina's kernel. ``backend="triton"`` always does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange

from lamina._dispatch import select_backend
from lamina._validate import check_bool, check_same_device, check_scale, check_tensor, read_offsets
from lamina.kernels.prism_attn_common import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, MIN_HEAD_DIM

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The PyTorch path also takes float64 (gradcheck, oracles).
TORCH_DTYPES = KERNEL_DTYPES + (torch.float64,)
# Query rows per step of the PyTorch path: bounds its score buffer to [B, H, 1024, S] at a time.
TORCH_QUERY_BLOCK = 1024
# Query rows per step of the CPU backward of the fused path (smaller: causal blocks skip more keys).
EXACT_BACKWARD_BLOCK = 128


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
class Varlen(NamedTuple):
    """Packed sequences of one call, read on the host once: offsets and longest lengths."""

    offsets_q: list[int]
    offsets_k: list[int]
    max_seqlen_q: int
    max_seqlen_k: int


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    layout: Varlen | None = None,
) -> Varlen | None:
    """Raise ValueError/TypeError naming the bad argument; the varlen layout (one host read), if any."""
    check_tensor("q", q, ndim=4, dtypes=TORCH_DTYPES)
    check_tensor("k", k, ndim=4, dtypes=TORCH_DTYPES)
    check_tensor("v", v, ndim=4, dtypes=TORCH_DTYPES)
    check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    batch, _, num_heads, head_dim = q.shape
    if head_dim % HEAD_DIM_MULTIPLE or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"q: head dim must be a multiple of {HEAD_DIM_MULTIPLE} in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], "
            f"got {head_dim} (shape {tuple(q.shape)})"
        )
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"k must have shape [B={batch}, S, HKV, D={head_dim}] to match q {tuple(q.shape)}, got {tuple(k.shape)}"
        )
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[2] == 0 or num_heads % k.shape[2]:
        raise ValueError(
            f"k: the number of key/value heads must divide the query heads H={num_heads} (GQA/MQA), "
            f"got HKV={k.shape[2]}"
        )
    check_scale("scale", scale)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must be given together, got "
            f"cu_seqlens_q={'a tensor' if cu_seqlens_q is not None else None}, "
            f"cu_seqlens_k={'a tensor' if cu_seqlens_k is not None else None}"
        )
    if cu_seqlens_q is None:
        return None
    if layout is not None:  # read and validated by the caller from these offsets
        return layout
    offs = read_offsets(batch, {"cu_seqlens_q": (cu_seqlens_q, q.shape[1]), "cu_seqlens_k": (cu_seqlens_k, k.shape[1])})
    offs_q, offs_k = offs["cu_seqlens_q"], offs["cu_seqlens_k"]
    if len(offs_q) != len(offs_k):
        raise ValueError(
            f"cu_seqlens_k must describe as many sequences as cu_seqlens_q ({len(offs_q) - 1}), got {len(offs_k) - 1}"
        )
    longest = []
    for name, values, given in (("max_seqlen_q", offs_q, max_seqlen_q), ("max_seqlen_k", offs_k, max_seqlen_k)):
        actual = max(b - a for a, b in zip(values[:-1], values[1:]))
        if given is not None and (not isinstance(given, int) or given < actual):
            raise ValueError(f"{name} must be an int >= the longest sequence ({actual}), got {given!r}")
        longest.append(actual if given is None else given)
    return Varlen(offs_q, offs_k, longest[0], longest[1])


# ----------------------------------------------------------------------------------------------
# Triton path: custom ops with a registered autograd formula
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("lamina::prism_attention_fwd", mutates_args=())
def _prism_attention_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    from lamina.kernels.prism_attn_fwd import prism_attn_fwd

    # The forward kernel takes batch, token and head strides: only a strided head dim is copied (a v
    # split from a fused qkv projection is read in place). The backward writes dq, dk, dv with the
    # strides of q, k, v, so it takes contiguous inputs.
    return prism_attn_fwd(_unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v), causal, scale,
                          cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, (window_left, window_right),
                          softcap)


def _unit_stride_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@_prism_attention_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left, window_right,
      softcap):
    batch, seqlen_q, num_heads, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, num_heads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("lamina::prism_attention_bwd", mutates_args=())
def _prism_attention_bwd_op(
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from lamina.kernels.prism_attn_bwd import prism_attn_bwd

    return prism_attn_bwd(do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous(),
                          lse.contiguous(), causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          dlse=dlse, window_size=(window_left, window_right), softcap=softcap)


@_prism_attention_bwd_op.register_fake
def _(do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left,
      window_right, softcap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, *args = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.args = tuple(args)  # max_seqlen_q, max_seqlen_k, causal, scale, window_left, window_right, softcap


def _backward(ctx, do: torch.Tensor, dlse: torch.Tensor | None):
    q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = _prism_attention_bwd_op(do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *ctx.args)
    # One gradient per input: q, k, v, then None for cu_seqlens_q, cu_seqlens_k and the 7 options.
    return dq, dk, dv, *([None] * (2 + len(ctx.args)))


_prism_attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# PyTorch path: blockwise over query rows, autograd by PyTorch
# ----------------------------------------------------------------------------------------------
def _visible(seqlen_q: int, seqlen_k: int, start: int, rows: int, device: torch.device) -> torch.Tensor:
    """Causal mask of query rows ``start .. start + rows`` (bottom-right aligned): [rows, seqlen_k] bool."""
    row = torch.arange(start, start + rows, device=device)[:, None]
    return torch.arange(seqlen_k, device=device)[None, :] <= row + (seqlen_k - seqlen_q)


class _SDPAExactBackward(torch.autograd.Function):
    """PyTorch's fused CPU attention forward (o and lse) with a backward that recomputes the probabilities
    exactly.

    PyTorch's CPU SDPA backward forms its probabilities with a fast exponential: its float32 gradients
    were measured at up to ~8x the error of a plain float32 softmax backward (dv) and nonzero where
    the exact gradient is 0 (dq, dk with one key), against FlashAttention's rule of 3x. This backward
    (``_exact_backward``) runs blockwise over query rows from the saved lse: ``P = exp(s - lse)``,
    ``dv = P^T dO``, ``dP = dO v^T``, ``ds = P * (dP - rowsum(dO * O) + dlse)``, ``dq = ds k * scale``,
    ``dk = ds^T q * scale``. Inputs are [B, H, T, D] (key heads already repeated), and every row sees a
    key. Cost, forward and backward at 1x1024x10x64 float32 on 2 cores (median of 10): 52 ms causal, 84 ms
    not (with SDPA's own backward: 43, 56 ms).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        seqlen_q, seqlen_k = q.shape[2], k.shape[2]
        mask = None
        if causal and seqlen_q != seqlen_k:  # bottom-right aligned, as an additive mask (the op's form)
            visible = _visible(seqlen_q, seqlen_k, 0, seqlen_q, q.device)
            mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal and mask is None, attn_mask=mask, scale=scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        delta = (do * o).sum(-1)
        if dlse is not None:
            delta = delta - dlse
        return (*_exact_backward(q, k, v, do, ctx.causal, ctx.scale, lse, delta), None, None)


def _exact_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool, scale: float,
    lse: torch.Tensor, delta: torch.Tensor, softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of softmax attention, blockwise over query rows, from each row's ``lse`` and
    ``delta = rowsum(dO * O) - dlse`` ([B, H, T]); inputs are [B, H, T, D] (key heads already repeated).
    A caller that holds a part of each row's keys (one block of ring attention) passes the lse and delta of
    the whole rows. ``softcap`` > 0: the scores are ``softcap * tanh(s / softcap)``, and their gradient is
    chained through it.
    """
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for start in range(0, seqlen_q, EXACT_BACKWARD_BLOCK):
        rows = slice(start, start + EXACT_BACKWARD_BLOCK)
        q_blk, do_blk = q[:, :, rows], do[:, :, rows]
        # Causal: keys past the block's last visible one take no part (every row sees key 0).
        keys = seqlen_k if not causal else min(seqlen_k, start + q_blk.shape[2] + seqlen_k - seqlen_q)
        k_blk, v_blk = k[:, :, :keys], v[:, :, :keys]
        s = (q_blk @ k_blk.transpose(-1, -2)).mul_(scale)
        capped = None
        if softcap > 0:
            capped = torch.tanh(s / softcap)
            s = capped * softcap
        if causal:
            s.masked_fill_(~_visible(seqlen_q, seqlen_k, start, q_blk.shape[2], q.device)[:, :keys], float("-inf"))
        p = s.sub_(lse[:, :, rows, None]).exp_()
        dv[:, :, :keys] += p.transpose(-1, -2) @ do_blk
        dp = do_blk @ v_blk.transpose(-1, -2)
        ds = dp.sub_(delta[:, :, rows, None]).mul_(p)
        if capped is not None:
            ds.mul_(1 - capped * capped)
        dq[:, :, rows] = (ds @ k_blk).mul_(scale)
        dk[:, :, :keys] += (ds.transpose(-1, -2) @ q_blk).mul_(scale)
    return dq, dk, dv


def _attention_torch_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, need_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PyTorch's fused attention (any head dim on CPU), without a window or softcapping, where every row
    sees a key: o, and on CPU the lse (None on CUDA, where it is never asked of this path).

    A query row with a NaN gives NaN, as in the blockwise path and the reference. Computes in
    float32 at least, like the blockwise path, so the torch backend's precision does not
    depend on which of the two runs. Measured on 2 CPU cores at 1x1024x10x64 causal fp32: 10 ms here
    against 114 ms for the blockwise path. On CPU the backward is ``_SDPAExactBackward``'s.
    """
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[2] // k.shape[2]
    qt = rearrange(q.to(compute), "b t h d -> b h t d")
    kt = rearrange(k.to(compute), "b s h d -> b h s d").repeat_interleave(group, dim=1)
    vt = rearrange(v.to(compute), "b s h d -> b h s d").repeat_interleave(group, dim=1)
    lse = None
    if q.device.type == "cpu":
        o, lse = _SDPAExactBackward.apply(qt, kt, vt, causal, scale)
    else:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        mask = _visible(seqlen_q, seqlen_k, 0, seqlen_q, q.device) if causal and seqlen_q != seqlen_k else None
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal and mask is None,
                                           scale=scale)
    # SDPA returns 0 for a query row holding a NaN; the reference (and the blockwise path) return NaN.
    # Restored here without a host read: NaN inputs propagate on every path (lamina._validate).
    nan_rows = torch.isnan(qt).any(-1)
    o = torch.where(nan_rows[..., None], torch.nan, o)
    if need_lse:
        lse = torch.where(nan_rows, torch.nan, lse).float()
    return rearrange(o, "b h t d -> b t h d").to(q.dtype), (lse if need_lse else None)


def _attention_torch_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, need_lse: bool = True,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One batch of equal-length sequences: q [B, T, H, D], k/v [B, S, HKV, D] -> o, lse [B, H, T]."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    plain = window_size == (-1, -1) and softcap == 0
    # Fused path unless a window or softcapping is asked for, the lse on CUDA, or some causal row sees no
    # key (T > S): those rows must give 0.
    fused_lse = not need_lse or q.device.type == "cpu"
    if plain and fused_lse and seqlen_q > 0 and seqlen_k > 0 and (not causal or seqlen_q <= seqlen_k):
        return _attention_torch_sdpa(q, k, v, causal, scale, need_lse)
    left, right = window_size
    if causal:
        right = 0
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[2] // k.shape[2]
    qg = rearrange(q.to(compute), "b t (hk g) d -> b hk g t d", g=group)
    kg = rearrange(k.to(compute), "b s hk d -> b hk s d")
    vg = rearrange(v.to(compute), "b s hk d -> b hk s d")
    keys = torch.arange(seqlen_k, device=q.device)
    outs, lses = [], []
    for start in range(0, seqlen_q, TORCH_QUERY_BLOCK):
        q_blk = qg[:, :, :, start:start + TORCH_QUERY_BLOCK]
        scores = torch.einsum("bhgtd,bhsd->bhgts", q_blk, kg) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if left >= 0 or right >= 0:
            at = torch.arange(start, start + q_blk.shape[3], device=q.device)[:, None] + (seqlen_k - seqlen_q)
            visible = torch.ones(q_blk.shape[3], seqlen_k, dtype=torch.bool, device=q.device)
            if right >= 0:
                visible &= keys[None, :] <= at + right
            if left >= 0:
                visible &= keys[None, :] >= at - left
            scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        # Rows without a visible key: lse = -inf, probabilities 0, output 0.
        lse_shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        probs = torch.exp(scores - lse_shift[..., None])
        outs.append(torch.einsum("bhgts,bhsd->bhgtd", probs, vg))
        lses.append(lse)
    if not outs:  # T == 0: an empty output (a clone, so that autograd reaches q)
        return q.clone(), q.new_zeros((q.shape[0], q.shape[2], 0), dtype=torch.float32)
    o = rearrange(torch.cat(outs, dim=3), "b hk g t d -> b t (hk g) d").to(q.dtype)
    lse = rearrange(torch.cat(lses, dim=3), "b hk g t -> b (hk g) t").float()
    return o, lse


def _attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    varlen: Varlen | None,
    need_lse: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if varlen is None:
        return _attention_torch_dense(q, k, v, causal, scale, need_lse, window_size, softcap)
    offs_q, offs_k = varlen.offsets_q, varlen.offsets_k
    outs, lses = [], []
    for n in range(len(offs_q) - 1):
        o_n, lse_n = _attention_torch_dense(
            q[:, offs_q[n]:offs_q[n + 1]], k[:, offs_k[n]:offs_k[n + 1]], v[:, offs_k[n]:offs_k[n + 1]],
            causal, scale, need_lse, window_size, softcap,
        )
        outs.append(o_n)
        lses.append(lse_n)
    return torch.cat(outs, dim=1), (torch.cat(lses, dim=2) if need_lse else None)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def prism_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    cp_context: object | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention for head dims 16..512 (multiples of 8), forward and backward.

    Args:
        q: [B, T, H, D] queries (float16, bfloat16 or float32; float64 on the torch backend).
        k: [B, S, HKV, D] keys, H % HKV == 0 (GQA/MQA: query head h uses key head h // (H / HKV)).
        v: [B, S, HKV, D] values.
        causal: mask key j for query i unless j <= i + S - T (aligned bottom-right, as
            FlashAttention >= 2.1 does; per sequence when varlen).
        scale: score scale, default D ** -0.5.
        cu_seqlens_q: [N + 1] int32/int64 offsets of N packed query sequences (B == 1).
        cu_seqlens_k: [N + 1] offsets of the matching key/value sequences.
        max_seqlen_q: longest query sequence (read from cu_seqlens_q when None).
        max_seqlen_k: longest key sequence (read from cu_seqlens_k when None).
        return_lse: also return the log-sum-exp of the scaled scores.
        backend: "auto", "triton" or "torch" (see ``lamina._dispatch``); "auto" on CUDA follows the
            dispatch table (``lamina.ops.attention_dispatch``, printed by ``lamina info``).
        window_size: ``(left, right)``, FlashAttention's sliding window: query i, at key position
            ``c = i + S - T``, sees only keys ``c - left <= j <= c + right``; -1 is no bound (with
            ``causal`` the right bound is 0). Keyword-only.
        softcap: FlashAttention's logit softcapping: scores become ``softcap * tanh(scores / softcap)``
            before the softmax; 0 is off. Keyword-only. lse is that of the capped scores.
        cp_context: a ``lamina.distributed.ContextParallel`` (keyword-only): q, k and v hold this rank's
            tokens of self-attention over sequences split across its ranks (``cp.shard``; T == S, the
            packed layout is the context's, so no ``cu_seqlens_*``; either of its layouts). Ring
            attention: the keys and values pass around the ranks and each segment attends to those up to
            its last query (all of them without ``causal``); gradients reach the ranks the keys came from.
            Packed sequences and windows gather the keys and values instead. Windows need ``causal``.

    Returns:
        o: [B, T, H, D] in q's dtype, and with ``return_lse`` lse: [B, H, T] float32 (natural log).
        A query row that sees no key (causal with T > S, or outside its window) has o = 0 and lse = -inf.
    """
    if cp_context is not None:
        from lamina.distributed import attention_context_parallel

        for name, given in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                            ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if given is not None:
                raise ValueError(f"prism_attention: {name} cannot be combined with cp_context (the packed "
                                 "layout is the context's: ContextParallel(cu_seqlens=...))")
        return attention_context_parallel(cp_context, prism_attention, q, k, v, causal, scale, return_lse,
                                          backend, window_size, softcap)
    return prism_attention_with_layout(q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, return_lse, backend, window_size=window_size, softcap=softcap)


def prism_attention_with_layout(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    return_lse: bool,
    backend: str,
    layout: Varlen | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``prism_attention``, positional, where a caller that already read and validated the offsets passes
    them as ``layout`` (a layer reads its ``cu_seqlens`` once per call; nothing here reads them again)."""
    varlen = _check_inputs(q, k, v, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout)
    causal = check_bool("causal", causal)
    window_size, softcap = _check_window(window_size, softcap)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    path = select_backend("prism_attention", backend, [q, k, v, cu_seqlens_q, cu_seqlens_k])
    if q.shape[1] == 0 or k.shape[1] == 0:  # nothing to attend: no kernel launch (same result: empty, or o = 0)
        path = "torch"
    if path == "torch":
        o, lse = _attention_torch(q, k, v, bool(causal), scale, varlen, return_lse, window_size, softcap)
    else:
        if q.dtype not in KERNEL_DTYPES:
            raise ValueError(f"q: the triton backend takes dtypes float16, bfloat16, float32, got {q.dtype}")
        # outside paths are available on CUDA only (attention_dispatch.available)
        if backend == "auto":
            from lamina.ops import attention_dispatch as dispatch

            case = dispatch.case_of(q, k, v, causal, varlen is not None, return_lse, window_size, softcap)
            chosen = dispatch.choose(case, dispatch.load_table(), dispatch.available(q.device.type))
            if chosen != "lamina":
                return dispatch.run(chosen, q, k, v, causal, scale, window_size, softcap)
        max_q, max_k = (q.shape[1], k.shape[1]) if varlen is None else (varlen.max_seqlen_q, varlen.max_seqlen_k)
        o, lse = _prism_attention_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, bool(causal), scale,
                                         *window_size, softcap)
    return (o, lse) if return_lse else o


def _check_window(window_size: object, softcap: object) -> tuple[tuple[int, int], float]:
    """``window_size``: two ints >= -1 (FlashAttention's convention); ``softcap``: a finite number >= 0."""
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
        isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    if not ok:
        raise ValueError(f"window_size must be (left, right), two ints >= -1 (-1: no bound), got {window_size!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < float("inf"):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    return (int(window_size[0]), int(window_size[1])), float(softcap)


# ----------------------------------------------------------------------------------------------
# Blocks of ring attention (lamina.distributed): one query block over one key block, no autograd
# ----------------------------------------------------------------------------------------------
def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                    softcap: float, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, D] over k, v [B, S, HKV, D] (validated by the caller): o in q's dtype and lse [B, H, T]
    float32, on ``path`` ("triton": the forward kernel; "torch": the PyTorch path, PyTorch's fused CPU kernel
    or, with softcapping or off the CPU, the blockwise form)."""
    if path == "triton":
        return _prism_attention_fwd_op(q, k, v, None, None, q.shape[1], k.shape[1], causal, scale, -1, -1, softcap)
    return _attention_torch_dense(q, k, v, causal, scale, True, (-1, -1), softcap)


def attention_block_backward(
    do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, causal: bool, scale: float, softcap: float, path: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block given the output ``o``, ``lse`` and their gradients ``do``, ``dlse`` of whole
    rows (every key block of the rows merged): with ``P = exp(s - lse)`` the block's gradients are its share
    of the whole rows' (the backward kernel's formulas, which read ``o`` and ``lse`` rather than recompute
    them). Gradients in float32 on the PyTorch path, in the inputs' dtypes on the kernel path."""
    if path == "triton":
        return _prism_attention_bwd_op(do, dlse, q, k, v, o, lse, None, None, q.shape[1], k.shape[1], causal,
                                       scale, -1, -1, softcap)
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[2] // k.shape[2]
    qt, dot = (rearrange(x.to(compute), "b t h d -> b h t d") for x in (q, do))
    kt, vt = (rearrange(x.to(compute), "b s h d -> b h s d").repeat_interleave(group, dim=1) for x in (k, v))
    delta = rearrange((do.to(compute) * o.to(compute)).sum(-1), "b t h -> b h t")
    if dlse is not None:
        delta = delta - dlse
    dq, dk, dv = _exact_backward(qt, kt, vt, dot, causal, scale, lse.to(compute), delta, softcap)
    dk, dv = (rearrange(x, "b (hk g) s d -> b s hk g d", g=group).sum(3) for x in (dk, dv))
    return rearrange(dq, "b h t d -> b t h d"), dk, dv


__all__ = ["attention_block", "attention_block_backward", "prism_attention"]
