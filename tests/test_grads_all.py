"""Every output and every gradient of the eight delta-rule ops against a float64 oracle.

The oracle is ``lamina.reference.delta_rule_family_recurrent_ref`` (the token loop) run in float64 on
the same (quantised) inputs, with fla 0.6's input transforms written out below in float64, on their
own, not through lamina's ``delta_rule_core`` helpers:

* ``use_qk_l2norm_in_kernel``: ``x / sqrt(sum(x^2) + 1e-6)`` over the head dim;
* ``use_gate_in_kernel``: ``g = -exp(A_log) * softplus(g + dt_bias)`` (per head, or per channel with
  ``dt_bias [HV * K]``), or with ``lower_bound``: ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``;
* ``use_beta_sigmoid_in_kernel``: ``beta = sigmoid(beta)``, times 2 with ``allow_neg_eigval``;
* ``fused_recurrent_gated_delta_rule``'s ``gk``: total per-channel log decay ``g[..., None] + gk``.

The loss is ``<o, do> + <final_state, ds>`` with random cotangents, so a wrong gradient of the final
state path and of the output path both show. Every leaf that requires grad is compared: q, k, v, g
or gk, beta or b and w, initial_state, A_log, dt_bias. Bounds: ``lamina.testing`` (RMS error ratio
per dtype; ``A_log`` and ``dt_bias``, which sum a term per gate element, relative to the root-sum-square
of their terms, ``reduction_scale``). The option transforms run in PyTorch before the kernels on every
backend, so the Triton path gets one call per op with several options at once; the torch path sweeps each
option.

Also here: Prism attention at head dims 80 and 384 (README: "head dims 16..512 in steps of 8 (incl.
80, 96, 320, 384)") forward and backward under the interpreter, FlashAttention's bound.
"""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import assert_attention_close, assert_close, reduction_scale

import lamina
from lamina.reference import delta_rule_family_recurrent_ref
from lamina.reference.attention import attention_ref

CHUNK = 16
LOWER_BOUND = -3.0

# (decay kind, gate kind) of each op: decay None | "scalar" | "channel"; gates "scalar" (beta) or "channel" (b, w).
OPS = {
    "chunk_delta_rule": (None, "scalar"),
    "chunk_gated_delta_rule": ("scalar", "scalar"),
    "chunk_kda": ("channel", "scalar"),
    "chunk_gdn2": ("channel", "channel"),
    "fused_recurrent_delta_rule": (None, "scalar"),
    "fused_recurrent_gated_delta_rule": ("scalar", "scalar"),
    "fused_recurrent_kda": ("channel", "scalar"),
    "fused_recurrent_gdn2": ("channel", "channel"),
}

# Options each op accepts (fla 0.6's signatures): l2norm everywhere; the rest where the op has the keyword.
_GATED = {"chunk_gated_delta_rule", "chunk_kda", "chunk_gdn2", "fused_recurrent_gated_delta_rule",
          "fused_recurrent_kda", "fused_recurrent_gdn2"}
_LOWER_BOUND = {"chunk_kda", "chunk_gdn2", "fused_recurrent_kda", "fused_recurrent_gdn2"}
_BETA_SIGMOID = {"chunk_gated_delta_rule", "chunk_kda", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda"}


def _allowed(op: str, opts: frozenset) -> bool:
    if "reset" in opts and op not in _GATED:
        return False
    if "gate" in opts or "lower_bound" in opts or "lower_bound_no_A_log" in opts:
        if op not in _GATED:
            return False
    if ("lower_bound" in opts or "lower_bound_no_A_log" in opts) and op not in _LOWER_BOUND:
        return False
    if "beta_sigmoid" in opts and op not in _BETA_SIGMOID:
        return False
    if ("gk" in opts or "gk_only" in opts) and op != "fused_recurrent_gated_delta_rule":
        return False
    if "beta_none" in opts and op not in ("fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule"):
        return False
    return True


def make_inputs(op: str, opts: frozenset, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> dict:
    """Leaves of one call (float32 masters; q, k, v, gates in ``dtype``; state and gate parameters fp32)."""
    B, T, H, HV, K, V = shape
    decay, gates = OPS[op]
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen)
    rand = lambda *s: torch.rand(*s, generator=gen)
    x = {"q": randn(B, T, H, K).to(dtype), "k": randn(B, T, H, K).to(dtype), "v": randn(B, T, HV, V).to(dtype)}
    if not ({"l2norm"} & opts):  # raw keys of norm ~sqrt(K) would make the recurrence explode
        x["k"] = (x["k"].float() / math.sqrt(K)).to(dtype)
    gate_input = bool({"gate", "lower_bound", "lower_bound_no_A_log"} & opts)
    if decay is not None and "gk_only" not in opts:
        width = () if decay == "scalar" else (K,)
        x["g"] = (randn(B, T, HV, *width) if gate_input else -rand(B, T, HV, *width)).to(dtype)
    if "reset" in opts:
        _reset(x["g"])
    if "gk" in opts or "gk_only" in opts:
        x["gk"] = (-rand(B, T, HV, K) * 0.5).to(dtype)
    if gates == "scalar":
        if "beta_none" not in opts:
            x["beta"] = (randn(B, T, HV) if "beta_sigmoid" in opts else rand(B, T, HV)).to(dtype)
    else:
        x["b"] = (rand(B, T, HV, K) * 1.5).to(dtype)
        x["w"] = rand(B, T, HV, V).to(dtype)
    if "no_h0" not in opts:
        x["initial_state"] = randn(B, HV, K, V) * 0.5
    if gate_input:
        if "lower_bound_no_A_log" not in opts:
            x["A_log"] = randn(HV) * 0.5
        x["dt_bias"] = randn(HV * K if decay == "channel" else HV) * 0.5
    return x


def _reset(g: torch.Tensor) -> None:
    """Log decays of -inf (a decay of 0: the state forgotten at that token; the chunked forms floor them at
    ``LOG_DECAY_FLOOR``) in ``g [B, T, HV(, K)]``: at the end of the first chunk of 16 and the start of the
    second; on the first token of the last sequence, or with one sequence of its first head or half its key
    channels (that part of the initial state then has no gradient: the floor leaves exp(-40) of it, judged
    against the rest's); on token 7 of the first sequence in its first head (half its key channels where the
    decay is per channel)."""
    g[:, [CHUNK - 1, CHUNK]] = float("-inf")
    if g.shape[0] > 1:
        g[-1, 0] = float("-inf")
    elif g.dim() == 4:
        g[0, 0, :, : g.shape[-1] // 2] = float("-inf")
    else:
        assert g.shape[2] > 1, "one sequence of one head reset on its first token leaves no initial-state gradient"
        g[0, 0, 0] = float("-inf")
    if g.dim() == 4:
        g[0, 7, 0, : g.shape[-1] // 2] = float("-inf")
    else:
        g[0, 7, 0] = float("-inf")


def call_op(op: str, opts: frozenset, x: dict, backend: str):
    kw = dict(x)
    kw["use_qk_l2norm_in_kernel"] = "l2norm" in opts
    if "gate" in opts or "lower_bound" in opts or "lower_bound_no_A_log" in opts:
        kw["use_gate_in_kernel"] = True
    if "lower_bound" in opts or "lower_bound_no_A_log" in opts:
        kw["lower_bound"] = LOWER_BOUND
        kw["safe_gate"] = True
    if "beta_sigmoid" in opts:
        kw["use_beta_sigmoid_in_kernel"] = True
        kw["allow_neg_eigval"] = True
    if op.startswith("chunk_"):
        kw["chunk_size"] = CHUNK
    return getattr(lamina, op)(output_final_state=True, backend=backend, **kw)


# --- the oracle: fla's transforms in float64, then the token loop --------------------------------

def _l2(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _softplus64(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 20, x, torch.log1p(torch.exp(torch.clamp(x, max=20))))


def oracle(op: str, opts: frozenset, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``(o, final_state)`` of ``op`` on the leaves ``x`` (already float64, differentiable)."""
    decay, gates = OPS[op]
    q, k, v = x["q"], x["k"], x["v"]
    HV, K = v.shape[2], q.shape[3]
    if "l2norm" in opts:
        q, k = _l2(q), _l2(k)
    g = x.get("g")
    if g is not None and ({"gate", "lower_bound", "lower_bound_no_A_log"} & opts):
        per_channel = g.dim() == 4
        # [HV] / [HV * K] parameters, or (for their terms, check_op) one value per gate element
        bias = x["dt_bias"].view(HV, K) if per_channel and x["dt_bias"].dim() == 1 else x["dt_bias"]
        a = x.get("A_log")
        a = None if a is None else (a[:, None] if per_channel and a.dim() == 1 else a)
        if "gate" in opts:
            g = -torch.exp(a) * _softplus64(g + bias)
        else:
            arg = g + bias if a is None else torch.exp(a) * (g + bias)
            g = LOWER_BOUND / (1 + torch.exp(-arg))
    if "gk" in opts:
        g = g[..., None] + x["gk"]
    elif "gk_only" in opts:
        g = x["gk"]
    if gates == "scalar":
        beta = x.get("beta")
        if beta is None:
            beta = torch.ones(v.shape[:3], dtype=torch.float64)
        elif "beta_sigmoid" in opts:
            beta = 2 / (1 + torch.exp(-beta))
        erase = write = beta
    else:
        erase, write = x["b"], x["w"]
    return delta_rule_family_recurrent_ref(q, k, v, g, erase, write, K ** -0.5, x.get("initial_state"), True)


def check_op(op: str, opts: frozenset, shape: tuple[int, ...], dtype: torch.dtype, backend: str,
             seed: int = 0) -> None:
    """Forward and every gradient of ``op`` against the float64 oracle."""
    base = make_inputs(op, opts, shape, dtype, seed)
    ours = {n: t.clone().requires_grad_() for n, t in base.items()}
    ref = {n: t.detach().double().requires_grad_() for n, t in base.items()}
    o, s = call_op(op, opts, ours, backend)
    ro, rs = oracle(op, opts, ref)
    assert o.dtype == base["v"].dtype and s.dtype == torch.float32
    assert_close("o", o, ro, dtype=dtype)
    assert_close("final_state", s, rs, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1000)
    do, ds = torch.randn(o.shape, generator=gen, dtype=torch.float64), torch.randn(s.shape, generator=gen,
                                                                                      dtype=torch.float64)
    torch.autograd.backward((o, s), (do.to(o.dtype), ds.float()))
    torch.autograd.backward((ro, rs), (do, ds))
    scales = _parameter_scales(op, opts, ref, (do, ds))
    for name in base:
        assert ours[name].grad is not None, f"d{name} is missing ({op}, {sorted(opts)})"
        assert ours[name].grad.dtype == ours[name].dtype, name
        assert_close(f"d{name}", ours[name].grad, ref[name].grad, dtype=dtype, scale=scales.get(name))


def _parameter_scales(op: str, opts: frozenset, ref: dict, cotangents: tuple) -> dict[str, float]:
    """``A_log`` and ``dt_bias`` sum one term per gate element (token, head, channel): their gradients are
    compared relative to the root-sum-square of those terms (``lamina.testing.reduction_scale``, the table's
    rule for a per-head or per-channel parameter), which are the float64 gradients of the same parameters
    broadcast to the gate's shape."""
    names = [n for n in ("A_log", "dt_bias") if n in ref]
    if not names:
        return {}
    shape = ref["g"].shape  # [B, T, HV] or [B, T, HV, K]
    per_head = {n: ref[n].detach().view(shape[2], -1) if len(shape) == 4 else ref[n].detach() for n in names}
    full = {n: p.expand(shape).clone().requires_grad_() for n, p in per_head.items()}
    x = {n: t.detach() for n, t in ref.items()} | full
    torch.autograd.backward(oracle(op, opts, x), cotangents)
    return {n: reduction_scale(full[n].grad, (1, 1, *per_head[n].shape)) for n in names}


# --- backend "torch": every op with every option it accepts, one at a time -------------------------

TORCH_SHAPE = (2, 20, 1, 2, 16, 24)  # B, T, H, HV (GVA), K, V: two chunks of 16, the second partial
OPTION_SETS = [frozenset(s) for s in (
    (), ("l2norm",), ("no_h0",), ("gate",), ("lower_bound",), ("lower_bound_no_A_log",), ("beta_sigmoid",),
    ("gk",), ("gk_only",), ("beta_none",), ("reset",),
)]
# The state-less start and the l2norm are branches of the ops' shared input handling: two ops each suffice.
_SHARED_OPTION_OPS = {"no_h0": ("chunk_gdn2", "fused_recurrent_delta_rule"),
                      "l2norm": ("chunk_delta_rule", "fused_recurrent_kda")}
TORCH_CASES = [(op, opts) for op in OPS for opts in OPTION_SETS
               if _allowed(op, opts) and all(op in _SHARED_OPTION_OPS.get(o, (op,)) for o in opts)]


@pytest.mark.parametrize("op, opts", TORCH_CASES, ids=[f"{op}-{'+'.join(sorted(o)) or 'plain'}"
                                                       for op, o in TORCH_CASES])
def test_torch_backend_every_gradient(op, opts):
    check_op(op, opts, TORCH_SHAPE, torch.float32, "torch")


# --- backend "triton" (interpreter): each op once with its options combined; fp16 on a subset ------

TRITON_SHAPE = (1, 20, 1, 1, 16, 32)  # K != V, so a transposed state or gradient fails
GVA_SHAPE = (1, 20, 1, 2, 16, 32)  # two value heads read one q/k head: dq, dk sum over both
TRITON_CASES = [
    ("chunk_delta_rule", ("l2norm",), torch.float32),
    ("chunk_gated_delta_rule", ("l2norm", "gate", "beta_sigmoid", "gva"), torch.float32),
    ("chunk_kda", ("l2norm", "lower_bound", "beta_sigmoid"), torch.float32),
    ("chunk_gdn2", ("l2norm", "gate"), torch.float32),
    ("fused_recurrent_delta_rule", ("l2norm",), torch.float32),
    ("fused_recurrent_gated_delta_rule", ("gk", "gate", "beta_sigmoid"), torch.float32),
    ("fused_recurrent_kda", ("gate", "beta_sigmoid"), torch.float32),
    ("fused_recurrent_gdn2", ("l2norm", "lower_bound_no_A_log"), torch.float32),
    # fp16: the token-by-token forward, the chunked recompute and the chunked backward in one case
    ("fused_recurrent_gdn2", ("l2norm", "lower_bound"), torch.float16),
    # decays of 0 (g = -inf), a scalar and a per-channel gate
    ("chunk_gated_delta_rule", ("reset", "gva"), torch.float32),
    ("chunk_kda", ("reset",), torch.float32),
    ("chunk_gdn2", ("reset", "l2norm"), torch.float16),
]


@pytest.mark.interpret
@pytest.mark.parametrize("op, opts, dtype", TRITON_CASES,
                         ids=[f"{op}-{'+'.join(o)}-{str(d)[6:]}" for op, o, d in TRITON_CASES])
def test_triton_backend_every_gradient(op, opts, dtype):
    check_op(op, frozenset(opts) - {"gva"}, GVA_SHAPE if "gva" in opts else TRITON_SHAPE, dtype, "triton")


# --- Prism attention at the README's non-power-of-two head dims 80 and 384 ------------------------

@pytest.mark.interpret
@pytest.mark.parametrize("d, dtype, causal, t, s", [(80, torch.float16, True, 20, 24),
                                                    (384, torch.float32, False, 12, 10)])
def test_prism_attention_head_dims_80_and_384(d, dtype, causal, t, s):
    """o, lse, dq, dk, dv of the Triton path within 2x/3x PyTorch's own error in ``dtype`` (GQA 2:1)."""
    gen = torch.Generator().manual_seed(d)
    q64, k64, v64 = (torch.randn(1, n, h, d, generator=gen, dtype=torch.float64)
                     for n, h in ((t, 2), (s, 1), (s, 1)))
    do = torch.randn(1, t, 2, d, generator=gen, dtype=torch.float64)

    def run(fn, tensors, out_dtype):
        ins = [x.requires_grad_() for x in tensors]
        o, lse = fn(*ins, causal=causal, return_lse=True)
        return o, lse, torch.autograd.grad((o * do.to(out_dtype)).sum(), ins)

    low = [x.to(dtype) for x in (q64, k64, v64)]
    ours = run(lambda *a, **kw: lamina.prism_attention(*a, backend="triton", **kw), [x.clone() for x in low], dtype)
    ref = run(attention_ref, [x.double() for x in low], torch.float64)
    ref_low = run(attention_ref, [x.clone() for x in low], dtype)
    assert ours[0].dtype == dtype
    assert_attention_close("o", ours[0], ref[0], ref_low[0])
    assert_attention_close("lse", ours[1], ref[1], ref_low[1].float(), dtype=dtype)
    for name, a, r, p in zip(("dq", "dk", "dv"), ours[2], ref[2], ref_low[2]):
        assert_attention_close(name, a, r, p, grad=True)
