"""Benchmark providers, looked up by exact name.

A provider turns an op's canonical inputs (``lamina.bench.inputs``) into a
zero-argument callable that runs the op once. A provider that cannot run a case
(not installed, wrong device, unsupported shape, an import that fails while lamina's
own ops are being written) says so with a reason: ``skip_reason`` before anything
runs, or ``ProviderSkip`` raised by its builder. The suite lists every skip with its
reason; nothing is dropped silently.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lamina.bench import eager
from lamina.bench.specs import ATTENTION_OPS, DELTA_GATES, DELTA_OPS, LAYER_OPS, OPS

Runner = Callable[[], Any]


@dataclass
class Bound:
    """A provider bound to one case: ``fn()`` runs the op once; ``leaves`` receive its gradients
    (None: the canonical inputs' leaves; a provider that re-lays out its inputs names its own)."""

    fn: Runner
    leaves: list[torch.Tensor] | None = None


class ProviderSkip(Exception):
    """A provider cannot run this case; the message is the reason shown in the results."""


# Token loops (reference, torch-eager) on the delta family: skipped above this many
# state-element updates (B * HV * T * K * V). 2^29 admits 8x1024x8x64 (2.7e8, ~0.3 s per call on
# a GPU, launch-bound) and the CPU shapes; at 4x2048x16x128 (2.1e9) a backward would keep a float32
# state per token (8.6 GB) and a call takes seconds.
TOKEN_LOOP_MAX_WORK = 2**29
# Eager attention materialises [B, H, Tq, Tk] float32 scores (plus softmax and its gradient):
# skipped above 2^31 score elements (8 GiB of scores).
EAGER_ATTN_MAX_SCORES = 2**31
# The short convolution's reference is a token loop writing one output row per token: its backward
# replays every write (21.8 s for 2x1024x512 fp32 on a 2-core CPU). Skipped above this many tokens (B * T).
CONV_TOKEN_LOOP_MAX_TOKENS = 512
# FlashAttention 2 supports head dims up to 256, fp16 and bf16 only.
FLASH_ATTN_MAX_HEAD_DIM = 256

# lamina's public functions per op: (module, function).
LAMINA_FUNCS: dict[str, tuple[str, str]] = {
    "delta_rule": ("lamina.ops.delta_rule", "chunk_delta_rule"),
    "gated_delta_rule": ("lamina.ops.delta_rule", "chunk_gated_delta_rule"),
    "kda": ("lamina.ops.delta_rule", "chunk_kda"),
    "gdn2": ("lamina.ops.delta_rule", "chunk_gdn2"),
    "prism_attention": ("lamina.ops.prism_attention", "prism_attention"),
    "attention_decode": ("lamina.ops.prism_attention", "prism_attention"),
    "hrm_update": ("lamina.ops.hrm_update", "hrm_gated_update"),
    "gdn_decode": ("lamina.ops.delta_rule", "fused_recurrent_gated_delta_rule"),
    "short_conv": ("lamina.ops.short_conv", "causal_conv1d"),
}
# fla's chunk (and decoding, and short convolution) functions per op.
FLA_FUNCS: dict[str, tuple[str, str]] = {
    "delta_rule": ("fla.ops.delta_rule", "chunk_delta_rule"),
    "gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "kda": ("fla.ops.kda", "chunk_kda"),
    "gdn2": ("fla.ops.gdn2", "chunk_gdn2"),
    "gdn_decode": ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "short_conv": ("fla.modules.causal_conv1d", "causal_conv1d"),
}
# fla's plain PyTorch forms of the delta family (fla.ops.*.naive), chunked and token by token: the CPU
# baselines of lamina's PyTorch path. (module, function) per form and op.
FLA_NAIVE_FUNCS: dict[str, dict[str, tuple[str, str]]] = {
    "chunk": {"delta_rule": ("fla.ops.delta_rule.naive", "delta_rule_chunkwise"),
              "gated_delta_rule": ("fla.ops.gated_delta_rule.naive", "naive_chunk_gated_delta_rule"),
              "kda": ("fla.ops.kda.naive", "naive_chunk_kda"),
              "gdn2": ("fla.ops.gdn2.naive", "naive_chunk_gdn2")},
    "recurrent": {"delta_rule": ("fla.ops.delta_rule.naive", "delta_rule_recurrence"),
                  "gated_delta_rule": ("fla.ops.gated_delta_rule.naive", "naive_recurrent_gated_delta_rule"),
                  "kda": ("fla.ops.kda.naive", "naive_recurrent_kda"),
                  "gdn2": ("fla.ops.gdn2.naive", "naive_recurrent_gdn2")},
}
# fla's naive chunked DeltaNet and KDA take T divisible by their chunk sizes (their defaults, 32 and 64); its
# other naive chunk forms pad.
FLA_NAIVE_CHUNKS = {"delta_rule": 32, "kda": 64}
REFERENCE_FUNCS: dict[str, str] = {
    **{op: "delta_rule_family_recurrent_ref" for op in DELTA_OPS},
    "gdn_decode": "delta_rule_family_recurrent_ref",
    "prism_attention": "attention_ref",
    "attention_decode": "attention_ref",
    "hrm_update": "hrm_gated_update_ref",
    "short_conv": "causal_conv1d_ref",
}


def _import(module: str, attr: str) -> Any:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to import means the provider cannot run
        raise ProviderSkip(f"cannot import {module}: {type(exc).__name__}: {exc}") from exc
    fn = getattr(mod, attr, None)
    if fn is None:
        raise ProviderSkip(f"{module} has no {attr}")
    return fn


def _primary(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out


# ---- argument conventions --------------------------------------------------------------------


def _delta_gates(op: str, x: dict[str, Any]) -> list[torch.Tensor]:
    """Gate tensors in the positional order of fla's (and lamina's) signature."""
    return [x[name] for name in DELTA_GATES[op]]


def _delta_family_kwargs(op: str, x: dict[str, Any]) -> dict[str, Any]:
    """Gates in the family form of the references: g, erase (b), write (w)."""
    if op == "gdn2":
        return {"g": x["g"], "erase": x["b"], "write": x["w"]}
    return {"g": x.get("g"), "erase": x["beta"], "write": x["beta"]}


def _call_api(fn: Callable, op: str, x: dict[str, Any], **extra: Any) -> Runner:
    """A callable in the fla/lamina functional signature of ``op``."""
    if op in DELTA_OPS:
        cu = x["cu_seqlens"]
        return lambda: fn(x["q"], x["k"], x["v"], *_delta_gates(op, x), cu_seqlens=cu, **extra)
    if op in ATTENTION_OPS:
        return lambda: fn(x["q"], x["k"], x["v"], causal=x["causal"], **extra)
    if op == "hrm_update":
        return lambda: fn(x["h"], x["c"], x["gate_logits"], bias=x["bias"], norm_weight=x["norm_weight"], **extra)
    if op == "gdn_decode":
        # beta by keyword: fla's fused_recurrent_gated_delta_rule takes (q, k, v, g, gk, gv, beta, ...)
        return lambda: fn(x["q"], x["k"], x["v"], x["g"], beta=x["beta"], initial_state=x["state"],
                          output_final_state=True, **extra)
    if op == "short_conv":
        return lambda: fn(x["x"], x["weight"], x["bias"], activation=x["activation"], **extra)
    raise ProviderSkip(f"no calling convention for op {op!r}")


# ---- builders --------------------------------------------------------------------------------


def _layer_bind(side: str, op: str, params: dict[str, Any], x: dict[str, Any]) -> Bound:
    from lamina.bench.layers import bind_layer

    return bind_layer(side, op, params, x)


def _lamina_builder(backend: str) -> Callable[[str, dict, dict], Runner | Bound]:
    def build(op: str, params: dict[str, Any], x: dict[str, Any]) -> Runner | Bound:
        if op in LAYER_OPS:  # the layer at lamina's default dispatch (availability checked the backend)
            return _layer_bind("lamina", op, params, x)
        fn = _import(*LAMINA_FUNCS[op])
        return _call_api(fn, op, x, backend=backend)

    return build


def _fla_build(op: str, params: dict[str, Any], x: dict[str, Any]) -> Runner | Bound:
    if op in LAYER_OPS:
        return _layer_bind("fla", op, params, x)
    return _call_api(_import(*FLA_FUNCS[op]), op, x)


def _fla_naive_builder(form: str) -> Callable[[str, dict, dict], Runner | Bound]:
    def build(op: str, params: dict[str, Any], x: dict[str, Any]) -> Runner | Bound:
        fn = _import(*FLA_NAIVE_FUNCS[form][op])
        q, k, v = x["q"], x["k"], x["v"]
        if op == "delta_rule":
            # head-first [B, H, T, D] (beta [B, H, T]): leaves in that layout, converted outside the timed call
            qh, kh, vh, bh = (t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad)
                              for t in (q, k, v, x["beta"]))
            return Bound(lambda: fn(qh, kh, vh, bh), [t for t in (qh, kh, vh, bh) if t.requires_grad])
        if op == "gated_delta_rule" and form == "recurrent":  # (q, k, v, beta, g) in this one
            return lambda: fn(q, k, v, x["beta"], x["g"])
        return lambda: fn(q, k, v, *_delta_gates(op, x))

    return build


def _flash_attn_build(op: str, params: dict[str, Any], x: dict[str, Any]) -> Runner:
    fn = _import("flash_attn", "flash_attn_func")
    return lambda: fn(x["q"], x["k"], x["v"], causal=x["causal"])


def _sdpa_builder(backend_name: str) -> Callable[[str, dict, dict], Runner | Bound]:
    def build(op: str, params: dict[str, Any], x: dict[str, Any]) -> Bound:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        # sdpa takes [B, H, T, D]: fresh leaves in that layout, converted outside the timed call.
        qh, kh, vh = (t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad)
                      for t in (x["q"], x["k"], x["v"]))
        gqa = {"enable_gqa": True} if qh.shape[1] != kh.shape[1] else {}
        causal = x["causal"]

        def run() -> torch.Tensor:
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, **gqa)

        return Bound(run, [t for t in (qh, kh, vh) if t.requires_grad])

    return build


def _eager_fn(op: str) -> Callable:
    if op in DELTA_OPS:
        return eager.delta_family_eager
    if op in ATTENTION_OPS:
        return eager.attention_eager
    return {"hrm_update": eager.hrm_update_eager, "gdn_decode": eager.gdn_decode_eager,
            "short_conv": eager.short_conv_eager}[op]


def _eager_call(fn: Callable, op: str, x: dict[str, Any]) -> Runner:
    if op in DELTA_OPS:
        kw = _delta_family_kwargs(op, x)
        return lambda: fn(x["q"], x["k"], x["v"], **kw, cu_seqlens=x["cu_seqlens"])
    if op == "gdn_decode":
        return lambda: fn(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    return _call_api(fn, op, x)


def _eager_build(op: str, params: dict[str, Any], x: dict[str, Any]) -> Runner:
    return _eager_call(_eager_fn(op), op, x)


def _compile_build(op: str, params: dict[str, Any], x: dict[str, Any]) -> Runner:
    return _eager_call(torch.compile(_eager_fn(op), dynamic=False), op, x)


def _reference_build(op: str, params: dict[str, Any], x: dict[str, Any]) -> Runner:
    fn = _import("lamina.reference", REFERENCE_FUNCS[op])
    if op in DELTA_OPS:
        kw = _delta_family_kwargs(op, x)
        return lambda: fn(x["q"], x["k"], x["v"], **kw, cu_seqlens=x["cu_seqlens"])
    if op == "gdn_decode":
        return lambda: fn(x["q"], x["k"], x["v"], g=x["g"], erase=x["beta"], write=x["beta"],
                          initial_state=x["state"], output_final_state=True)
    return _call_api(fn, op, x)


# ---- availability ----------------------------------------------------------------------------


def _needs_module(module: str, hint: str) -> Callable[[str, str], str | None]:
    def check(op: str, device: str) -> str | None:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001
            return f"{module} is not importable ({type(exc).__name__}: {exc}); {hint}"
        return None

    return check


def _lamina_check(op: str, device: str) -> str | None:
    if op in LAYER_OPS:
        return _layer_check("lamina", op)
    module, attr = LAMINA_FUNCS[op]
    try:
        _import(module, attr)
    except ProviderSkip as exc:
        return str(exc)
    return None


def _layer_check(side: str, op: str) -> str | None:
    from lamina.bench.layers import layer_class

    try:
        layer_class(side, op)
    except ProviderSkip as exc:
        return str(exc)
    return None


# A layer takes no backend argument: it runs lamina's default dispatch, Triton kernels on CUDA and
# the PyTorch path on the CPU (DESIGN.md, "Dispatch contract"); each lamina provider times the
# layer where that dispatch is its own backend.
LAYER_DISPATCH = {"cuda": "triton", "cpu": "torch"}


def _lamina_available(backend: str) -> Callable[[str, str], str | None]:
    def check(op: str, device: str) -> str | None:
        if op in LAYER_OPS:
            from lamina._dispatch import interpreter_enabled

            if LAYER_DISPATCH[device] != backend:
                return (f"a layer runs lamina's default dispatch, {LAYER_DISPATCH[device]} on {device} "
                        f"(provider lamina-{LAYER_DISPATCH[device]}), not {backend}")
            if device == "cpu" and interpreter_enabled():
                return ("TRITON_INTERPRET=1: the layer would run lamina's Triton kernels under the interpreter, "
                        "not the PyTorch path (unset TRITON_INTERPRET)")
        return _lamina_check(op, device)

    return check


def _fla_check(op: str, device: str) -> str | None:
    if op in LAYER_OPS:
        return _layer_check("fla", op)
    return _needs_module("fla", "pip install fla-core==0.6.0")(op, device)


def _lamina_cuda_check(op: str, device: str) -> str | None:
    from lamina._optional import compiled_extension

    ext = compiled_extension()
    if ext is None or not getattr(ext, "WITH_CUDA", False):
        return "lamina._C is not built with CUDA (LAMINA_BUILD_CUDA=1 pip install --no-build-isolation -e .)"
    return _lamina_check(op, device)


def _lamina_cpu_ext_check(op: str, device: str) -> str | None:
    from lamina._optional import compiled_extension

    if compiled_extension() is None:
        return "lamina._C is not built (LAMINA_BUILD_CPU=1 pip install --no-build-isolation -e .)"
    return _lamina_check(op, device)


def _token_loop_limit(op: str, p: dict[str, Any], device: str) -> str | None:
    if op in DELTA_OPS:
        work = p["B"] * p["HV"] * p["T"] * p["K"] * p["V"]
        if work > TOKEN_LOOP_MAX_WORK:
            return (f"token loop: B*HV*T*K*V = {work:.2e} state updates exceeds the limit "
                    f"{TOKEN_LOOP_MAX_WORK:.2e} (TOKEN_LOOP_MAX_WORK)")
    if op in ATTENTION_OPS:
        scores = p["B"] * p["H"] * p["Tq"] * p["Tk"]
        if scores > EAGER_ATTN_MAX_SCORES:
            return (f"materialised scores: {scores:.2e} elements exceed the limit "
                    f"{EAGER_ATTN_MAX_SCORES:.2e} (EAGER_ATTN_MAX_SCORES)")
    return None


def _reference_limit(op: str, p: dict[str, Any], device: str) -> str | None:
    if op == "short_conv" and p["B"] * p["T"] > CONV_TOKEN_LOOP_MAX_TOKENS:
        return (f"token loop: B*T = {p['B'] * p['T']} tokens exceeds the limit {CONV_TOKEN_LOOP_MAX_TOKENS} "
                f"(CONV_TOKEN_LOOP_MAX_TOKENS)")
    return _token_loop_limit(op, p, device)


def _fla_naive_limit(form: str) -> Callable[[str, dict[str, Any], str], str | None]:
    def limit(op: str, p: dict[str, Any], device: str) -> str | None:
        if p["seqlens"] is not None:
            return "fla's naive forms take no cu_seqlens (packed sequences)"
        if p["HV"] != p["H"]:
            return f"fla's naive forms take as many value heads as query heads, got H={p['H']}, HV={p['HV']}"
        if form == "chunk" and op in FLA_NAIVE_CHUNKS and p["T"] % FLA_NAIVE_CHUNKS[op]:
            return f"fla's naive chunked {op} needs T divisible by {FLA_NAIVE_CHUNKS[op]}, got T={p['T']}"
        return _token_loop_limit(op, p, device) if form == "recurrent" else None

    return limit


def _flash_attn_limit(op: str, p: dict[str, Any], device: str) -> str | None:
    if p["D"] > FLASH_ATTN_MAX_HEAD_DIM:
        return f"flash-attn supports head dims up to {FLASH_ATTN_MAX_HEAD_DIM}, got D={p['D']}"
    if p["dtype"] not in ("fp16", "bf16"):
        return f"flash-attn runs fp16 and bf16 only, got {p['dtype']}"
    return None


@dataclass(frozen=True)
class Provider:
    """One implementation of some ops. ``skip_reason`` is None when it can run the case."""

    name: str
    description: str
    ops: tuple[str, ...]
    devices: tuple[str, ...]
    build: Callable[[str, dict[str, Any], dict[str, Any]], Runner | Bound]
    available: Callable[[str, str], str | None] | None = None
    case_limit: Callable[[str, dict[str, Any], str], str | None] | None = None
    ops_note: str = ""
    device_note: str = ""

    def skip_reason(self, op: str, device: str, params: dict[str, Any] | None = None) -> str | None:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; known ops: {', '.join(OPS)}")
        if op not in self.ops:
            return self.ops_note or f"{self.name} does not implement {op}"
        if device not in self.devices:
            note = f": {self.device_note}" if self.device_note else ""
            return f"{self.name} runs on {'/'.join(self.devices)}, not {device}{note}"
        if self.available is not None:
            reason = self.available(op, device)
            if reason:
                return reason
        if params is not None and self.case_limit is not None:
            return self.case_limit(op, params, device)
        return None

    def bind(self, op: str, params: dict[str, Any], inputs: dict[str, Any]) -> Bound:
        """Build the runner for one case (raises ProviderSkip when the provider cannot run it)."""
        built = self.build(op, params, inputs)
        return built if isinstance(built, Bound) else Bound(built)


KERNEL_OPS = tuple(op for op in OPS if op not in LAYER_OPS)
# lamina's layers run where its kernels run; the plain PyTorch baselines and the reference are per kernel op.
LAMINA_OPS = KERNEL_OPS + LAYER_OPS
_ATTN = ATTENTION_OPS
_FLA_OPS = tuple(FLA_FUNCS) + LAYER_OPS
_COMPILED_OPS = ("prism_attention", "attention_decode", "hrm_update", "gdn_decode", "short_conv")
# lamina's CUDA C++ kernels: the short convolution has none (its backend="cuda" is fla's name for a GPU
# path, which lamina serves with its Triton kernels).
_CUDA_OPS = tuple(op for op in KERNEL_OPS if op != "short_conv")
_NO_LAYER_BASELINE = "a kernel-op baseline; the layer ops compare lamina.layers with fla.layers"
_BOTH = ("cpu", "cuda")

PROVIDERS: dict[str, Provider] = {p.name: p for p in (
    Provider("lamina-triton", "lamina's Triton kernels (backend='triton'; layers: lamina.layers on CUDA)",
             LAMINA_OPS, ("cuda",), _lamina_builder("triton"), _lamina_available("triton")),
    Provider("lamina-cuda", "lamina's CUDA C++ kernels (backend='cuda')", _CUDA_OPS, ("cuda",),
             _lamina_builder("cuda"), _lamina_cuda_check, ops_note="no CUDA C++ kernel for this op; layers run "
             "lamina's default dispatch (lamina-triton on CUDA)"),
    Provider("lamina-torch", "lamina's PyTorch path, the CPU default (backend='torch'; layers: lamina.layers "
             "on the CPU)", LAMINA_OPS, _BOTH, _lamina_builder("torch"), _lamina_available("torch")),
    Provider("lamina-cpu-ext", "lamina's C++ CPU kernels in lamina._C (backend='cpu-ext')",
             ("hrm_update",), ("cpu",), _lamina_builder("cpu-ext"), _lamina_cpu_ext_check,
             ops_note="of the suite's ops only hrm_update has a C++ CPU kernel (the delta-rule decode step's "
                      "is timed by `lamina bench --op decode`)"),
    Provider("fla", "flash-linear-attention's Triton kernels (fla.ops.*, fla.modules.causal_conv1d) and layers "
             "(fla.layers.*)",
             _FLA_OPS, ("cuda",), _fla_build, _fla_check, ops_note="fla has no kernel for this op in the suite",
             device_note="fla's Triton kernels need a GPU (lamina.patch_fla() would run fla's layers on "
                         "lamina's kernels: not a comparison)"),
    Provider("fla-naive-chunk", "fla's plain PyTorch chunked forms (fla.ops.*.naive: naive_chunk_*, "
             "delta_rule_chunkwise)", DELTA_OPS, _BOTH, _fla_naive_builder("chunk"), _fla_check,
             _fla_naive_limit("chunk"), ops_note="fla's naive forms cover the delta-rule family"),
    Provider("fla-naive-recurrent", "fla's plain PyTorch token loops (fla.ops.*.naive: naive_recurrent_*, "
             "delta_rule_recurrence)", DELTA_OPS, _BOTH, _fla_naive_builder("recurrent"), _fla_check,
             _fla_naive_limit("recurrent"), ops_note="fla's naive forms cover the delta-rule family"),
    Provider("flash-attn", "FlashAttention 2 (flash_attn_func)", _ATTN, ("cuda",), _flash_attn_build,
             _needs_module("flash_attn", "pip install flash-attn"), _flash_attn_limit,
             ops_note="flash-attn is an attention provider"),
    Provider("sdpa-flash", "torch scaled_dot_product_attention, FLASH_ATTENTION backend", _ATTN, _BOTH,
             _sdpa_builder("FLASH_ATTENTION"), ops_note="sdpa is an attention provider"),
    Provider("sdpa-cudnn", "torch scaled_dot_product_attention, CUDNN_ATTENTION backend", _ATTN, ("cuda",),
             _sdpa_builder("CUDNN_ATTENTION"), ops_note="sdpa is an attention provider"),
    Provider("sdpa-efficient", "torch scaled_dot_product_attention, EFFICIENT_ATTENTION backend", _ATTN,
             ("cuda",), _sdpa_builder("EFFICIENT_ATTENTION"), ops_note="sdpa is an attention provider"),
    Provider("sdpa-math", "torch scaled_dot_product_attention, MATH backend", _ATTN, _BOTH,
             _sdpa_builder("MATH"), ops_note="sdpa is an attention provider"),
    Provider("torch-eager", "the op in plain PyTorch (lamina.bench.eager)", KERNEL_OPS, _BOTH, _eager_build,
             case_limit=_token_loop_limit, ops_note=_NO_LAYER_BASELINE),
    Provider("torch-compile", "torch.compile of the plain PyTorch op", _COMPILED_OPS, _BOTH, _compile_build,
             case_limit=_token_loop_limit,
             ops_note="no compiled baseline for the delta family (its eager form is a token loop over T, which "
                      "torch.compile would unroll) nor for the layer ops"),
    Provider("reference", "lamina.reference (token loop for the delta family)", KERNEL_OPS, _BOTH,
             _reference_build, _needs_module("lamina.reference", "lamina is not installed correctly"),
             _reference_limit, ops_note=_NO_LAYER_BASELINE),
)}


def get_provider(name: str) -> Provider:
    """The provider named exactly ``name``; ValueError listing the known names otherwise."""
    if name not in PROVIDERS:
        raise ValueError(f"unknown provider {name!r}; known providers: {', '.join(PROVIDERS)}")
    return PROVIDERS[name]


def availability(device: str, ops: list[str] | None = None) -> list[tuple[str, str, str | None]]:
    """(provider, op, skip reason or None) for every provider and op, without running anything."""
    rows = []
    for name, prov in PROVIDERS.items():
        for op in ops or list(OPS):
            rows.append((name, op, prov.skip_reason(op, device)))
    return rows


def output_of(out: Any) -> Any:
    """The tensor a provider's result is timed and differentiated through (the first of a tuple)."""
    return _primary(out)
