"""Malformed calls of lamina's layers (``lamina.layers``), for ``run_bad_inputs``: constructor and call
arguments in one dict per call, split by the target."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch

from lamina.fuzz.bad_inputs import (
    _T,
    Kwargs,
    Mutation,
    Target,
    _mut,
    _randn,
    add_dim,
    as_list,
    cast,
    cu_seqlens_cases,
    drop_dim,
    move,
    other_device,
    resize,
    set_arg,
    zero_len,
)

# --- layers: constructor arguments (init_keys) and call arguments in one dict ---------------------

def _layer_target(name: str, cls: Callable[..., torch.nn.Module], init: Kwargs,
                  inputs: Callable[[torch.device], Kwargs],
                  muts: Sequence[Mutation], call_keys: Sequence[str] = ()) -> Target:
    """``call_keys``: forward arguments that share a name with a constructor argument."""
    keys = set(inspect.signature(cls.__init__).parameters) - {"self", *call_keys}

    def base(dev: torch.device) -> Kwargs:
        return {**init, **inputs(dev), "_device": dev}

    def call(kw: Kwargs) -> object:
        dev = kw.pop("_device")
        module = cls(**{k: kw.pop(k) for k in list(kw) if k in keys}).to(dev)
        return module(**kw)

    return Target(name, base, call, tuple(muts))


def _hidden_cases(x: str, width: int, varlen: bool = True, any_rank_and_dtype: bool = False) -> list[Mutation]:
    """Malformed ``[B, T, width]`` activations of a layer (``[..., width]`` of any float dtype when
    ``any_rank_and_dtype``: the norms and the short convolution compute in float32 for any input)."""
    muts = [as_list(x), resize(x, 2, width + 1), cast(x, torch.int32), cast(x, torch.bool), move(x)]
    if not any_rank_and_dtype:
        muts += [drop_dim(x), add_dim(x), cast(x, torch.float64)]
    if varlen:
        muts += list(cu_seqlens_cases(_T))
    return muts


def _fla_layer_target(name: str, init: Kwargs) -> Target:
    import lamina.layers as L

    D = init["hidden_size"]

    def inputs(dev: torch.device) -> Kwargs:
        return {"hidden_states": _randn(1, _T, D, device=dev)}

    def mask(values: object, arg: str = "attention_mask") -> Mutation:
        return set_arg("attention_mask", lambda kw: torch.tensor(values, device=kw["hidden_states"].device), arg)

    muts = [*_hidden_cases("hidden_states", D), mask([[1, 1]]), mask([[[1, 1, 1, 1]]]), mask([[1.0, 1, 1, 1]]),
            mask([[2, 1, 1, 1]]), set_arg("past_key_values", "abc"), set_arg("hidden_size", 0),
            set_arg("num_heads", 0), set_arg("mode", "bogus"),
            set_arg("expand_k", 0.3) if name == "DeltaNet" else set_arg("num_v_heads", 3)]
    return _layer_target(name, getattr(L, name), init, inputs, muts)


def layer_targets() -> list[Target]:
    import lamina.layers as L

    small = {"hidden_size": 32, "num_heads": 2, "head_dim": 16}
    out = [_fla_layer_target("DeltaNet", {"hidden_size": 32, "num_heads": 2}),
           _fla_layer_target("GatedDeltaNet", {**small, "expand_v": 1}),
           _fla_layer_target("KimiDeltaAttention", {**small}),
           _fla_layer_target("GatedDeltaNet2", {**small})]

    def x_in(width: int, name: str = "x") -> Callable[[torch.device], Kwargs]:
        return lambda dev: {name: _randn(1, _T, width, device=dev)}

    out.append(_layer_target("DeltaRuleAttention", L.DeltaRuleAttention, dict(small), x_in(32), [
        *_hidden_cases("x", 32), set_arg("initial_state", lambda kw: torch.zeros(1, 3, 16, 16), label="state HV=3"),
        set_arg("initial_state", lambda kw: torch.zeros(1, 2, 16, 16, dtype=torch.float16), label="fp16 state"),
        set_arg("hidden_size", 0), set_arg("num_heads", 0), set_arg("mode", "bogus"),
        set_arg("num_v_heads", 3), set_arg("head_dim", -1),
        _mut("conv_size=0", "conv_size", lambda kw, _d: kw.update(use_short_conv=True, conv_size=0))]))
    out.append(_layer_target("ShortConvolution", L.ShortConvolution, {"hidden_size": 8, "kernel_size": 4},
                             x_in(8), [
        *_hidden_cases("x", 8, any_rank_and_dtype=True), set_arg("residual", lambda kw: torch.zeros(1, _T, 7)),
        set_arg("cache", lambda kw: torch.zeros(8, 4), label="2-d cache"), drop_dim("x"),
        set_arg("cache", lambda kw: torch.zeros(1, 8, 3)), set_arg("mask", lambda kw: torch.ones(2, _T)),
        set_arg("hidden_size", 0), set_arg("kernel_size", 0), set_arg("activation", "relu"),
        set_arg("backend", "bogus")]))
    scalar_x = set_arg("x", lambda kw: kw["x"][0, 0, 0], label="0-d x")
    out.append(_layer_target("RMSNorm", L.RMSNorm, {"hidden_size": 16}, x_in(16), [
        *_hidden_cases("x", 16, varlen=False, any_rank_and_dtype=True),
        set_arg("residual", lambda kw: torch.zeros(1, _T, 15)), scalar_x,
        set_arg("eps", float("nan")), set_arg("hidden_size", True),
        set_arg("residual", lambda kw: torch.zeros(1, _T, 16, device=other_device(kw["x"].device))),
        set_arg("prenorm", "yes"), set_arg("hidden_size", 0), set_arg("hidden_size", "16"), set_arg("eps", -1.0),
        set_arg("eps", "abc"), set_arg("residual_in_fp32", 3), set_arg("bias", 2), set_arg("elementwise_affine", "no"),
        set_arg("residual", [1.0]), set_arg("residual", lambda kw: torch.zeros(1, _T, 16, dtype=torch.int32))]))
    gated_in = lambda dev: {"x": _randn(1, _T, 16, device=dev), "g": _randn(1, _T, 16, device=dev)}  # noqa: E731
    out.append(_layer_target("FusedRMSNormGated", L.FusedRMSNormGated, {"hidden_size": 16}, gated_in, [
        *_hidden_cases("x", 16, varlen=False, any_rank_and_dtype=True), resize("g", 2, 15),
        scalar_x, set_arg("eps", float("inf")), cast("g", torch.int32), move("g"), as_list("g"), cast("g", torch.bool),
        set_arg("residual", lambda kw: torch.zeros(1, _T, 15)), set_arg("prenorm", "yes"),
        set_arg("hidden_size", 0), set_arg("eps", -1.0), set_arg("activation", "relu"),
        set_arg("residual_in_fp32", 3), set_arg("eps", "abc"), set_arg("hidden_size", 2.5)]))
    attn = {"d_model": 32, "n_heads": 2}
    prism_muts = [*_hidden_cases("x", 32), set_arg("cache", "abc"), set_arg("causal", "yes"),
                  set_arg("attention_mask", lambda kw: torch.ones(1, _T, dtype=torch.int32)),
                  set_arg("d_model", 0), set_arg("n_heads", 3), set_arg("n_kv_heads", 3), set_arg("backend", "bogus")]
    out.append(_layer_target("PrismAttention", L.PrismAttention, dict(attn), x_in(32), prism_muts))
    out.append(_layer_target("PrismBlock", L.PrismBlock, dict(attn), x_in(32), [
        *prism_muts, set_arg("norm", "bogus"), set_arg("mlp_ratio", -1.0)]))
    out += _hrm_layer_targets()
    out.append(_router_target())
    return out


def _hrm_layer_targets() -> list[Target]:
    import lamina.layers as L

    D = 16
    upd_in = lambda dev: {"h": _randn(1, _T, D, device=dev), "c": _randn(1, _T, D, device=dev),  # noqa: E731
                          "context": _randn(1, _T, D, device=dev)}
    update = _layer_target("HRMGatedUpdate", L.HRMGatedUpdate, {"d_model": D}, upd_in, call_keys=("context",), muts=[
        drop_dim("h"), as_list("h"), resize("h", 2, D + 1), cast("h", torch.int32), move("h"), resize("c", 2, D + 1),
        resize("c", 1, _T + 1), as_list("c"), move("c"), cast("c", torch.int32), resize("context", 2, D + 1),
        as_list("context"), move("context"), set_arg("context", None), set_arg("d_model", 0),
        set_arg("gate", "bogus"), set_arg("eps", -1.0), set_arg("backend", "bogus"), set_arg("norm", "yes"),
        zero_len(["h", "c", "context"])])

    def core(kw: Kwargs) -> object:
        dev = kw.pop("_device")
        init = {k: kw.pop(k) for k in ("fast_block", "slow_block", "d_model", "n_cycles", "steps_per_cycle",
                                        "grad_steps", "mode", "gate", "passes") if k in kw}
        return L.HRMCore(**init).to(dev)(**kw)

    def core_base(dev: torch.device) -> Kwargs:
        return {"fast_block": torch.nn.Linear(D, D), "slow_block": torch.nn.Linear(D, D), "d_model": D,
                "n_cycles": 2, "steps_per_cycle": 2, "grad_steps": 1, "_device": dev,
                "x": _randn(1, _T, D, device=dev)}

    core_target = Target("HRMCore", core_base, core, (
        *_hidden_cases("x", D, varlen=False), set_arg("cache", [None]), set_arg("cache", 3),
        set_arg("fast_block", "abc"), set_arg("slow_block", None), set_arg("d_model", 0), set_arg("n_cycles", 0),
        set_arg("steps_per_cycle", 1.5), set_arg("grad_steps", 9), set_arg("mode", "bogus"), set_arg("gate", "bogus"),
        set_arg("passes", 0), set_arg("grad_steps", 0), zero_len(["x"], arg="x")))
    return [update, core_target]


def _router_target() -> Target:
    import lamina.layers as L

    inputs = lambda dev: {"routed": _randn(1, _T, 8, device=dev)}  # noqa: E731
    return _layer_target("CrossLayerRouter", L.CrossLayerRouter, {"in_features": 8, "out_features": 4,
                                                                  "kind": "cler"}, inputs, muts=[
        as_list("routed"), resize("routed", 2, 9), resize("routed", 2, 0), cast("routed", torch.int32),
        cast("routed", torch.bool), move("routed"), set_arg("routed", None), set_arg("routed", 3.0),
        set_arg("in_features", 0), set_arg("in_features", -1), set_arg("in_features", 2.5),
        set_arg("in_features", True), set_arg("out_features", 0), set_arg("out_features", "4"),
        set_arg("kind", "bogus"), set_arg("kind", None), set_arg("kind", 3), set_arg("dtype", torch.int32),
        set_arg("dtype", "float32"), zero_len(["routed"])])
