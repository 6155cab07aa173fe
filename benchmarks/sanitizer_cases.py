"""One small case of every lamina GPU kernel, forward and backward, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitizer_cases.py
    python benchmarks/sanitizer_cases.py --list                    # the cases and the kernels each runs
    python benchmarks/sanitizer_cases.py --only chunk_gdn,prism_d320
    python benchmarks/sanitizer_cases.py --device cpu              # dry run (Triton interpreter, C++ CPU kernels)

Step 3b of ``benchmarks/device_check.sh`` runs this under ``--tool memcheck`` and ``--tool racecheck``.
Every case calls a public op (``backend="triton"``, or the C++ kernels of ``lamina._C`` with
``backend="cuda"``; ``"cpu-ext"`` with ``--device cpu``) on tiny shapes (the sanitizer slows kernels
10-100x) with the awkward parts the kernels must mask: odd head dims (K=48, V=80, attention D=80 and
320), varlen packs with a length-1 sequence, GQA, state pools with a skipped slot, speculative
decoding. It checks that every output and gradient is finite and agrees with the PyTorch path
(``backend="torch"``, float64, on the CPU) within the RMS-ratio bound of ``lamina.testing`` for the
case's dtype (a cheap check: the tests hold the precise ones), and that every Triton kernel module the
case names was launched. One line per case; exit status 1 when a case failed.

Autotuning: lamina has no switch that pins a Triton config on a GPU (``kernels/_utils.autotune``
keeps one config only under the interpreter), so ``pin_autotuners`` reduces every autotuner here to
the first config its own pruning keeps, without timing any (timing every config under the sanitizer
would multiply the run time; the sanitizer checks that first config).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

# Tiny shapes, shared by the cases (module docstring).
K_ODD, V_ODD = 48, 80          # delta-rule head dims that are not powers of two
T_CHUNKS = 70                  # two chunks of 64, the second partial
SEQLENS = (1, 70, 9)           # varlen pack: a length-1 sequence, a two-chunk one, a short one
DECODE_SEQLENS = (1, 3, 9)     # decode step over packed sequences
ATTN_DIMS = (80, 320)          # Prism head dims, not powers of two: one under 128, one over 256 (FlashAttention's cap)
HRM_D = 200                    # not a power of two
CONV_W = 4                     # fla's short-convolution width
DEFAULT_DTYPE = "bfloat16"
EXT = "lamina._C"

# Cases run by device_check.sh's DRY_RUN (--quick): the cheapest under the interpreter (a second or less
# each on an idle core once lamina is imported) and the C++ CPU kernels.
QUICK = ("decode_gdn_pool", "decode_gdn_pool_cuda", "hrm_update_cuda", "rms_norm_gated", "short_conv_update")


@dataclass(frozen=True)
class Setup:
    device: str          # "cuda" or "cpu"
    dtype: object        # torch dtype of the activations
    triton: str          # backend name of the Triton kernels
    ext: str             # backend name of the C++ kernels ("cuda" or "cpu-ext")


@dataclass(frozen=True)
class Case:
    name: str
    kernels: tuple[str, ...]   # Triton kernel modules (lamina.kernels.*) or "lamina._C:<op>"
    run: Callable[[Setup], list[tuple[str, object, object]]]   # -> [(label, actual, expected)]


# --- launch recording and autotuner pinning --------------------------------------------------------

LAUNCHED: set[str] = set()


def record_launches() -> None:
    """Record the module of every Triton kernel launched (compiled or interpreted) in ``LAUNCHED``."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for cls in (JITFunction, InterpretedFunction):
        original = cls.run

        def run(self, *args, grid, warmup, _original=original, **kwargs):
            if not warmup:
                LAUNCHED.add(self.fn.__module__)
            return _original(self, *args, grid=grid, warmup=warmup, **kwargs)

        cls.run = run


def pin_autotuners() -> int:
    """Reduce every autotuner of lamina's kernels to the first config its pruning keeps; never time."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    from lamina.kernels import KERNEL_MODULES

    for name in KERNEL_MODULES:
        importlib.import_module(name)
    tuners = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("lamina.kernels"):
            continue
        for obj in vars(module).values():
            while isinstance(obj, Heuristics):
                obj = obj.fn
            if isinstance(obj, Autotuner) and len(obj.configs) > 1:
                tuners[id(obj)] = obj
    for tuner in tuners.values():
        prune = tuner.prune_configs
        tuner.prune_configs = lambda kwargs, _prune=prune: _prune(kwargs)[:1]
        tuner._bench = lambda *args, config, **kwargs: [0.0, 0.0, 0.0]
    return len(tuners)


# --- running an op on the kernels and on the PyTorch path -----------------------------------------

def _gen(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


def _to_ref(x, keep: bool):
    """The PyTorch path's copy: float64 on the CPU (``keep``: the dtype kept, e.g. a float32 state pool)."""
    import torch

    if not isinstance(x, torch.Tensor):
        return x
    x = x.detach().cpu()
    return x.clone() if keep or not x.is_floating_point() else x.double()


def compare(setup: Setup, call: Callable, inputs: dict, backend: str, grads: tuple[str, ...] = (),
            keep: tuple[str, ...] = (), no_grad: bool = False) -> list[tuple[str, object, object]]:
    """``call(backend=..., **inputs)`` on the kernels (inputs moved to the device) and on the PyTorch
    path (float64 CPU copies); ``call`` returns a tuple of named outputs. With ``grads``, one backward
    of every floating output with the same random cotangents; the gradients of ``grads`` are compared."""
    import torch

    results = []
    for path in (backend, "torch"):
        if path == "torch":
            args = {n: _to_ref(x, n in keep) for n, x in inputs.items()}
        else:
            args = {n: (x.to(setup.device, copy=True) if isinstance(x, torch.Tensor) else x)
                    for n, x in inputs.items()}
        for n in grads:
            args[n] = args[n].detach().requires_grad_()
        with torch.no_grad() if no_grad else torch.enable_grad():
            outs = call(backend=path, **args)
        outs = {n: x for n, x in outs.items() if x is not None}
        if grads:
            diff = [(n, x) for n, x in outs.items() if x.requires_grad]
            cots = [torch.randn(x.shape, generator=_gen(i)).to(x) for i, (_, x) in enumerate(diff)]
            torch.autograd.backward([x for _, x in diff], cots)
            for n in grads:
                if args[n].grad is None:
                    raise AssertionError(f"no gradient reached {n} on the {path} path")
                outs[f"d{n}"] = args[n].grad
        results.append({n: x.detach() for n, x in outs.items()})
    got, want = results
    return [(name, got[name], want[name]) for name in want]


# --- inputs ---------------------------------------------------------------------------------------

def _rand(gen, *shape, lo=0.0, hi=1.0):
    import torch

    return lo + (hi - lo) * torch.rand(*shape, generator=gen)


def _delta_inputs(setup: Setup, variant: str, B: int, T: int, H: int, HV: int, N: int, seed: int) -> dict:
    """q, k L2-normalised; log decays in (-1, 0] (float32, as fla passes them); gates in (0, 1)."""
    import torch
    import torch.nn.functional as F

    gen = _gen(seed)
    dt = setup.dtype
    x = {"q": F.normalize(torch.randn(B, T, H, K_ODD, generator=gen), dim=-1).to(dt),
         "k": F.normalize(torch.randn(B, T, H, K_ODD, generator=gen), dim=-1).to(dt),
         "v": torch.randn(B, T, HV, V_ODD, generator=gen).to(dt)}
    if variant == "gdn":
        x["g"] = -_rand(gen, B, T, HV)
    elif variant in ("kda", "gdn2"):
        x["g"] = -_rand(gen, B, T, HV, K_ODD)
    if variant == "gdn2":
        x["b"] = _rand(gen, B, T, HV, K_ODD).to(dt)
        x["w"] = _rand(gen, B, T, HV, V_ODD).to(dt)
    else:
        x["beta"] = _rand(gen, B, T, HV).to(dt)
    x["initial_state"] = torch.randn(N, HV, K_ODD, V_ODD, generator=gen)
    return x


def _cu(seqlens) -> object:
    import torch

    return torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)


def _delta_op(kind: str, variant: str) -> Callable:
    import lamina

    names = {"delta": "delta_rule", "gdn": "gated_delta_rule", "kda": "kda", "gdn2": "gdn2"}
    return getattr(lamina, f"{kind}_{names[variant]}")


def delta_case(variant: str, kind: str, varlen: bool) -> Callable:
    """Chunked (``kind="chunk"``) or token-loop (``"fused_recurrent"``, which takes the chunked backward)
    forward and backward, with an initial state and the final state, GVA (HV = 2H)."""
    def run(setup: Setup):
        B, T = (1, sum(SEQLENS)) if varlen else (2, T_CHUNKS)
        N = len(SEQLENS) if varlen else B
        x = _delta_inputs(setup, variant, B, T, 1, 2, N, seed=len(variant))
        x["cu_seqlens"] = _cu(SEQLENS) if varlen else None
        op = _delta_op(kind, variant)

        def call(backend, **kw):
            o, ht = op(output_final_state=True, backend=backend, **kw)
            return {"o": o, "final_state": ht}

        grads = tuple(n for n, t in x.items() if t is not None and n != "cu_seqlens")
        return compare(setup, call, x, setup.triton, grads=grads)
    return run


def decode_case(variant: str, mode: str, ext: bool = False) -> Callable:
    """The decode step (no autograd): ``pool``: a V-first float32 pool updated in place through
    ``ssm_state_indices`` (one slot -1: skipped) with fla's in-kernel gate, l2norm and beta options;
    ``spec``: speculative decoding (three draft tokens, ``num_accepted_tokens``); ``varlen``: packed
    sequences (one of length 1) from initial states, the final states returned."""
    def run(setup: Setup):
        import torch

        gen = _gen(7)
        if mode == "varlen":
            x = _delta_inputs(setup, variant, 1, sum(DECODE_SEQLENS), 2, 4, len(DECODE_SEQLENS), seed=3)
            x["cu_seqlens"] = _cu(DECODE_SEQLENS)
            kw = dict(output_final_state=True)
        else:
            B, T = (3, 1) if mode == "pool" else (2, 3)
            x = _delta_inputs(setup, variant, B, T, 2, 4, 2 * B * T, seed=4)
            # fused_recurrent_delta_rule has fla's signature: no state_v_first, no beta options
            v_first = variant != "delta"
            if v_first:
                x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()  # [P, HV, V, K]
            slots = torch.randperm(2 * B * T, generator=gen)[:B * T].to(torch.int32).view(B, T)
            if mode == "pool":
                slots[1, 0] = -1
                x["ssm_state_indices"] = slots.view(B)
            else:
                x["ssm_state_indices"] = slots
                x["num_accepted_tokens"] = torch.tensor([1, 3], dtype=torch.int32)
            kw = dict(inplace_final_state=True, output_final_state=True, use_qk_l2norm_in_kernel=True)
            if v_first:
                kw.update(state_v_first=True)
            if variant in ("gdn", "kda"):
                hv = x["v"].shape[2]
                x["A_log"] = torch.randn(hv, generator=gen) * 0.3
                x["dt_bias"] = torch.randn(hv if variant == "gdn" else hv * K_ODD, generator=gen)
                x["g"] = torch.randn(x["g"].shape, generator=gen)  # the raw gate input
                kw.update(use_gate_in_kernel=True)
            if variant in ("gdn", "kda"):
                kw.update(use_beta_sigmoid_in_kernel=True)
        op = _delta_op("fused_recurrent", variant)

        def call(backend, **inputs):
            o, state = op(backend=backend, **kw, **inputs)
            return {"o": o, "state": state}

        return compare(setup, call, x, setup.ext if ext else setup.triton, keep=("initial_state",), no_grad=True)
    return run


def prism_case(D: int, varlen: bool, causal: bool, H: int, HKV: int, window_size: tuple[int, int] = (-1, -1),
               softcap: float = 0.0) -> Callable:
    def run(setup: Setup):
        import torch

        import lamina

        gen = _gen(D)
        if varlen:
            B, T, S = 1, sum(SEQLENS), sum(SEQLENS)
        else:
            B, T, S = 2, 37, (37 if causal else 53)
        x = {"q": torch.randn(B, T, H, D, generator=gen).to(setup.dtype),
             "k": torch.randn(B, S, HKV, D, generator=gen).to(setup.dtype),
             "v": torch.randn(B, S, HKV, D, generator=gen).to(setup.dtype)}
        if varlen:
            x["cu_seqlens_q"] = x["cu_seqlens_k"] = _cu(SEQLENS)

        def call(backend, **kw):
            return {"o": lamina.prism_attention(causal=causal, backend=backend, window_size=window_size,
                                                softcap=softcap, **kw)}

        return compare(setup, call, x, setup.triton, grads=("q", "k", "v"))
    return run


def prism_decode_case(D: int, paged: bool) -> Callable:
    """Queries against a KV cache with new keys appended in place: paged (block table, split-KV over
    3 programs) or contiguous (the heuristic split, two queries and two new keys per sequence)."""
    def run(setup: Setup):
        import torch

        import lamina

        gen = _gen(D + paged)
        B, HKV, H = 2, 2, 4
        T = 1 if paged else 2
        if paged:
            block, blocks = 16, 7
            cache_shape = (blocks, block, HKV, D)
            table = torch.randperm(blocks, generator=gen)[:6].to(torch.int32).view(B, 3)
            lens = torch.tensor([20, 33], dtype=torch.int32)
        else:
            cache_shape = (3, 64, HKV, D)
            table, lens = None, torch.tensor([5, 40], dtype=torch.int32)
        x = {"q": torch.randn(B, T, H, D, generator=gen).to(setup.dtype),
             "k_cache": torch.randn(*cache_shape, generator=gen).to(setup.dtype),
             "v_cache": torch.randn(*cache_shape, generator=gen).to(setup.dtype),
             "k": torch.randn(B, T, HKV, D, generator=gen).to(setup.dtype),
             "v": torch.randn(B, T, HKV, D, generator=gen).to(setup.dtype),
             "cache_seqlens": lens, "block_table": table}

        def call(backend, k_cache, v_cache, **kw):
            o = lamina.prism_attention_with_kvcache(k_cache=k_cache, v_cache=v_cache, causal=True,
                                                    num_splits=3 if paged else 0, backend=backend, **kw)
            return {"o": o, "k_cache": k_cache, "v_cache": v_cache}

        return compare(setup, call, x, setup.triton, no_grad=True)
    return run


def hrm_case(token_gate: bool, ext: bool = False) -> Callable:
    """Gated update, forward and backward: per-channel gate with bias and RMS norm, or a per-token gate
    with its bias and the norm."""
    def run(setup: Setup):
        import torch

        import lamina

        gen = _gen(11 + token_gate)
        shape = (3, 5, HRM_D)
        x = {"h": torch.randn(*shape, generator=gen).to(setup.dtype),
             "c": torch.randn(*shape, generator=gen).to(setup.dtype),
             "gate_logits": torch.randn(*shape[:-1], 1 if token_gate else HRM_D, generator=gen).to(setup.dtype),
             "bias": torch.randn(1 if token_gate else HRM_D, generator=gen),
             "norm_weight": 1 + 0.1 * torch.randn(HRM_D, generator=gen)}

        def call(backend, **kw):
            return {"y": lamina.hrm_gated_update(backend=backend, **kw)}

        return compare(setup, call, x, setup.ext if ext else setup.triton, grads=tuple(x))
    return run


def short_conv_case(step: bool) -> Callable:
    """Depthwise causal conv: varlen forward and backward with initial and final windows, SiLU, bias and a
    residual; or one decoding step updating the window cache in place."""
    def run(setup: Setup):
        import torch

        import lamina

        gen = _gen(13 + step)
        D = 96
        x = {"weight": torch.randn(D, CONV_W, generator=gen), "bias": torch.randn(D, generator=gen)}
        N = len(SEQLENS)
        if step:
            x.update(x=torch.randn(N, D, generator=gen).to(setup.dtype),
                     cache=torch.randn(N, D, CONV_W, generator=gen).to(setup.dtype))

            def call(backend, **kw):
                y, cache = lamina.causal_conv1d_update(activation="silu", backend=backend, **kw)
                return {"y": y, "cache": cache}

            return compare(setup, call, x, setup.triton, no_grad=True)
        T = sum(SEQLENS)
        x.update(x=torch.randn(1, T, D, generator=gen).to(setup.dtype),
                 residual=torch.randn(1, T, D, generator=gen).to(setup.dtype),
                 initial_state=torch.randn(N, D, CONV_W, generator=gen).to(setup.dtype), cu_seqlens=_cu(SEQLENS))

        def call(backend, **kw):
            y, final = lamina.causal_conv1d(output_final_state=True, activation="silu", backend=backend, **kw)
            return {"y": y, "final_state": final}

        return compare(setup, call, x, setup.triton, grads=("x", "weight", "bias", "residual"))
    return run


def rms_norm_case(gated: bool) -> Callable:
    """RMSNorm forward and backward with weight, bias and a residual (prenorm: the sum returned too),
    gated by ``swish(g)``; or plain, without a residual."""
    def run(setup: Setup):
        import torch

        import lamina

        gen = _gen(17 + gated)
        D = HRM_D if gated else 72
        x = {"x": torch.randn(2, 7, D, generator=gen).to(setup.dtype),
             "weight": 1 + 0.1 * torch.randn(D, generator=gen), "bias": 0.1 * torch.randn(D, generator=gen)}
        if gated:
            x.update(g=torch.randn(2, 7, D, generator=gen).to(setup.dtype),
                     residual=torch.randn(2, 7, D, generator=gen).to(setup.dtype))

            def call(backend, **kw):
                y, res = lamina.rms_norm_gated(prenorm=True, backend=backend, **kw)
                return {"y": y, "residual_out": res}
        else:
            def call(backend, **kw):
                return {"y": lamina.rms_norm(backend=backend, **kw)}

        return compare(setup, call, x, setup.triton, grads=tuple(x))
    return run


# --- the cases ------------------------------------------------------------------------------------

_FWD, _BWD, _DQK = ("lamina.kernels.delta_chunk_fwd", "lamina.kernels.delta_chunk_bwd",
                    "lamina.kernels.delta_chunk_bwd_dqk")
_REC = "lamina.kernels.delta_recurrent_fwd"
_ATTN = ("lamina.kernels.prism_attn_fwd", "lamina.kernels.prism_attn_bwd")
_DEC = "lamina.kernels.prism_attn_decode"
_NARROW, _WIDE = ATTN_DIMS

CASES: list[Case] = []
for _v in ("delta", "gdn", "kda", "gdn2"):
    CASES.append(Case(f"chunk_{_v}", (_FWD, _BWD, _DQK), delta_case(_v, "chunk", varlen=False)))
    CASES.append(Case(f"chunk_{_v}_varlen", (_FWD, _BWD, _DQK), delta_case(_v, "chunk", varlen=True)))
for _v in ("delta", "gdn", "kda", "gdn2"):
    CASES.append(Case(f"fused_recurrent_{_v}", (_REC, _FWD, _BWD, _DQK),
                      delta_case(_v, "fused_recurrent", varlen=_v in ("gdn", "gdn2"))))
CASES += [
    Case("decode_gdn_pool", (_REC,), decode_case("gdn", "pool")),
    Case("decode_kda_spec", (_REC,), decode_case("kda", "spec")),
    Case("decode_gdn2_varlen", (_REC,), decode_case("gdn2", "varlen")),
    Case("decode_delta_spec", (_REC,), decode_case("delta", "spec")),
    Case("decode_gdn_pool_cuda", (f"{EXT}:delta_decode_step",), decode_case("gdn", "pool", ext=True)),
    Case("decode_kda_spec_cuda", (f"{EXT}:delta_decode_step",), decode_case("kda", "spec", ext=True)),
    Case("decode_gdn2_varlen_cuda", (f"{EXT}:delta_decode_step",), decode_case("gdn2", "varlen", ext=True)),
    Case(f"prism_d{_NARROW}_gqa", _ATTN, prism_case(_NARROW, varlen=False, causal=True, H=4, HKV=2)),
    Case(f"prism_d{_WIDE}", _ATTN, prism_case(_WIDE, varlen=False, causal=False, H=2, HKV=2)),
    Case(f"prism_d{_NARROW}_varlen_gqa", _ATTN, prism_case(_NARROW, varlen=True, causal=True, H=4, HKV=1)),
    Case(f"prism_d{_WIDE}_varlen", _ATTN, prism_case(_WIDE, varlen=True, causal=True, H=2, HKV=1)),
    # sliding window and softcap: key/query ranges cut on both sides, masked and unmasked blocks
    Case(f"prism_d{_NARROW}_window_softcap", _ATTN,
         prism_case(_NARROW, varlen=True, causal=False, H=4, HKV=2, window_size=(9, 4), softcap=5.0)),
    Case(f"prism_decode_paged_d{_NARROW}", (_DEC,), prism_decode_case(_NARROW, paged=True)),
    Case(f"prism_decode_d{_WIDE}", (_DEC,), prism_decode_case(_WIDE, paged=False)),
    Case("hrm_update", ("lamina.kernels.hrm_update",), hrm_case(token_gate=False)),
    Case("hrm_update_token_gate", ("lamina.kernels.hrm_update",), hrm_case(token_gate=True)),
    Case("hrm_update_cuda", (f"{EXT}:hrm_update_fwd", f"{EXT}:hrm_update_bwd"), hrm_case(False, ext=True)),
    Case("hrm_update_token_gate_cuda", (f"{EXT}:hrm_update_fwd", f"{EXT}:hrm_update_bwd"), hrm_case(True, ext=True)),
    Case("short_conv_varlen", ("lamina.kernels.short_conv",), short_conv_case(step=False)),
    Case("short_conv_update", ("lamina.kernels.short_conv",), short_conv_case(step=True)),
    Case("rms_norm_gated", ("lamina.kernels.rms_norm_gated",), rms_norm_case(gated=True)),
    Case("rms_norm", ("lamina.kernels.rms_norm_gated",), rms_norm_case(gated=False)),
]


# --- main -----------------------------------------------------------------------------------------

def _ext_missing(case: Case, setup: Setup) -> str | None:
    """Why a C++ case cannot run here (``lamina._C`` not built, or built without CUDA), or None."""
    ops = [k.split(":", 1)[1] for k in case.kernels if k.startswith(f"{EXT}:")]
    if not ops:
        return None
    import torch

    from lamina._optional import compiled_extension

    ext = compiled_extension()
    if ext is None:
        return "lamina._C is not built"
    if setup.ext == "cuda" and not getattr(ext, "WITH_CUDA", False):
        return "lamina._C is built without CUDA (LAMINA_BUILD_CUDA=1)"
    missing = [op for op in ops if not hasattr(torch.ops.lamina_C, op)]
    return f"lamina._C has no {', '.join(missing)}" if missing else None


def run_case(case: Case, setup: Setup) -> tuple[str, str]:
    """(status, detail): "ok", "skip" or "FAIL"."""
    from lamina.testing import assert_close

    reason = _ext_missing(case, setup)
    if reason:
        return "skip", reason
    LAUNCHED.clear()
    try:
        checks = case.run(setup)
        if setup.device == "cuda":
            import torch

            torch.cuda.synchronize()
        worst = 0.0
        for label, got, want in checks:
            if not bool(got.isfinite().all()):
                raise AssertionError(f"{label}: {int((~got.isfinite()).sum())} non-finite elements")
            assert_close(f"{case.name} {label}", got, want, kind="recurrence", dtype=setup.dtype)
            num = (got.double().cpu() - want.double()).pow(2).mean().sqrt()
            worst = max(worst, (num / want.double().pow(2).mean().sqrt().clamp_min(1e-30)).item())
    except Exception as exc:  # one failed case must not hide the others
        return "FAIL", f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    declared = {k for k in case.kernels if not k.startswith(EXT)}
    if declared - LAUNCHED:
        return "FAIL", f"launched no kernel of {sorted(declared - LAUNCHED)} (launched: {sorted(LAUNCHED)})"
    return "ok", f"{len(checks)} tensors finite and within the {setup.dtype} bound (worst RMS ratio {worst:.1e})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="cuda (default when available) or cpu: the dry run, Triton under the interpreter")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=DEFAULT_DTYPE)
    parser.add_argument("--list", action="store_true", help="print the cases and the kernels each runs, then exit")
    parser.add_argument("--only", default=None, help="comma-separated case names")
    parser.add_argument("--quick", action="store_true", help=f"the reduced set of the CPU dry run: {', '.join(QUICK)}")
    args = parser.parse_args(argv)
    names = [c.name for c in CASES]
    if args.list:
        for case in CASES:
            print(f"{case.name:28s} {' '.join(case.kernels)}")
        return 0
    chosen = list(QUICK) if args.quick else names
    if args.only:
        chosen = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in names]
    if unknown:
        parser.error(f"--only: unknown case(s) {unknown}; --list prints the {len(names)} cases")

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (use --device cpu for the dry run)")
    if device == "cpu":
        from lamina._dispatch import enable_interpreter

        enable_interpreter()  # before lamina.kernels (and triton's @jit) is imported
    setup = Setup(device, getattr(torch, args.dtype), "triton", "cuda" if device == "cuda" else "cpu-ext")
    record_launches()
    pinned = pin_autotuners()
    print(f"sanitizer cases: {len(chosen)} of {len(names)} on {device} ({args.dtype}), "
          f"{pinned} autotuners pinned to one config", flush=True)
    counts = {"ok": 0, "skip": 0, "FAIL": 0}
    start = time.perf_counter()
    for case in CASES:
        if case.name not in chosen:
            continue
        t0 = time.perf_counter()
        status, detail = run_case(case, setup)
        counts[status] += 1
        print(f"{case.name:28s} {status:4s} {time.perf_counter() - t0:6.1f} s  {detail}", flush=True)
    print(f"sanitizer cases: {counts['ok']} ok, {counts['FAIL']} failed, {counts['skip']} skipped "
          f"in {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
