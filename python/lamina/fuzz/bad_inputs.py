"""Malformed calls of every public op, layer and model: each must raise ValueError/TypeError naming the argument.

``run_bad_inputs()`` starts from one small valid call per op or layer and applies a table of
mutations (wrong rank, mismatched dims, dtypes, another device, non-contiguous or overlapping
outputs, bad ``cu_seqlens``, out-of-range indices, T = 0, ...). A call passes when it raises
``ValueError`` or ``TypeError`` whose message names the expected argument (as a whole word). A
call that raises anything else, returns, or runs past ``call_timeout`` seconds is recorded in
``crashes``. T = 0 mutations (``empty_ok``) may also return an empty result: lamina runs empty
sequences where the op has a meaning for them.

The other device is CUDA <-> CPU when CUDA exists, else the ``meta`` device (a tensor that is not
where the others are, which the ops must refuse before touching its data).
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# A call that runs longer than this counts as a hang (seconds; the valid calls take milliseconds,
# a malformed call that slipped through runs a tiny kernel under the interpreter in about a second).
DEFAULT_CALL_TIMEOUT = 30.0

Kwargs = dict[str, object]


@dataclass(frozen=True)
class Mutation:
    """``apply(kwargs, other_device)`` turns the valid call's arguments into a malformed call naming ``arg``."""

    label: str
    arg: str
    apply: Callable[[Kwargs, torch.device], None]
    empty_ok: bool = False


@dataclass(frozen=True)
class Target:
    """One public op or layer: ``base(device)`` builds a valid call, ``call(kwargs)`` runs it."""

    name: str
    base: Callable[[torch.device], Kwargs]
    call: Callable[[Kwargs], object]
    mutations: tuple[Mutation, ...]


@dataclass
class BadInputReport:
    checked: int = 0
    per_op: dict[str, int] = field(default_factory=dict)
    crashes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.crashes


# --- mutation builders ---------------------------------------------------------------------------

def _mut(label: str, arg: str, fn: Callable[[Kwargs, torch.device], None], empty_ok: bool = False) -> Mutation:
    return Mutation(label, arg, fn, empty_ok)


def set_arg(name: str, value: object, arg: str | None = None, label: str = "") -> Mutation:
    def fn(kw: Kwargs, _dev: torch.device) -> None:
        kw[name] = value(kw) if callable(value) else value
    return _mut(label or f"{name}={value!r}", arg or name, fn)


def drop_dim(name: str) -> Mutation:
    return _mut(f"{name} rank - 1", name, lambda kw, _d: kw.__setitem__(name, kw[name][0]))


def add_dim(name: str) -> Mutation:
    return _mut(f"{name} rank + 1", name, lambda kw, _d: kw.__setitem__(name, kw[name][None]))


def resize(name: str, dim: int, size: int, arg: str | None = None) -> Mutation:
    def fn(kw: Kwargs, _dev: torch.device) -> None:
        x = kw[name]
        shape = list(x.shape)
        shape[dim] = size
        kw[name] = torch.rand(shape, dtype=x.dtype, device=x.device) if x.is_floating_point() else \
            torch.zeros(shape, dtype=x.dtype, device=x.device)
    return _mut(f"{name} dim {dim} -> {size}", arg or name, fn)


def cast(name: str, dtype: torch.dtype) -> Mutation:
    return _mut(f"{name} as {dtype}", name, lambda kw, _d: kw.__setitem__(name, kw[name].to(dtype)))


def move(name: str) -> Mutation:
    return _mut(f"{name} on another device", name, lambda kw, dev: kw.__setitem__(name, kw[name].to(dev)))


def as_list(name: str) -> Mutation:
    return _mut(f"{name} as a list", name, lambda kw, _d: kw.__setitem__(name, kw[name].tolist()))


def strided(name: str) -> Mutation:
    """The same values in a non-contiguous tensor (every other element of the last dim)."""
    def fn(kw: Kwargs, _dev: torch.device) -> None:
        x = kw[name]
        wide = x.new_zeros(*x.shape[:-1], 2 * x.shape[-1])
        wide[..., ::2] = x
        kw[name] = wide[..., ::2]
    return _mut(f"{name} non-contiguous", name, fn)


def zero_len(names: Sequence[str], dim: int = 1, arg: str | None = None) -> Mutation:
    """T = 0 on every tensor in ``names`` (a named error or an empty result)."""
    def fn(kw: Kwargs, _dev: torch.device) -> None:
        for n in names:
            kw[n] = kw[n].narrow(dim, 0, 0)
    return _mut(f"{'/'.join(names)} with length 0", arg or names[0], fn, empty_ok=True)


def _device_of(kw: Kwargs) -> torch.device:
    return next(v for v in kw.values() if isinstance(v, torch.Tensor)).device


def offsets(values: Sequence[float], name: str = "cu_seqlens", dtype: torch.dtype = torch.int32,
            label: str = "") -> Mutation:
    def fn(kw: Kwargs, _dev: torch.device) -> None:
        kw[name] = torch.tensor(values, dtype=dtype, device=_device_of(kw))
    return _mut(f"{name}={list(values)}{' ' + label if label else ''}", name, fn)


def cu_seqlens_cases(T: int, name: str = "cu_seqlens") -> tuple[Mutation, ...]:
    """Negative, unsorted, too long, float, 2-d and single-offset ``cu_seqlens`` for a packed length T."""
    return (
        offsets([-1, T], name, label="negative"),
        offsets([0, T - 1, 1, T], name, label="unsorted"),
        offsets([0, T + 3], name, label="too long"),
        offsets([0, T], name, torch.float32),
        _mut(f"{name} 2-d", name, lambda kw, _d: kw.__setitem__(
            name, torch.tensor([[0, T]], dtype=torch.int32, device=_device_of(kw)))),
        offsets([0], name, label="one offset"),
    )


def other_device(device: torch.device) -> torch.device:
    if device.type == "cuda":
        return torch.device("cpu")
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("meta")


# --- running -------------------------------------------------------------------------------------

def _names(arg: str, message: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(arg)}(?!\w)", message) is not None


def _is_empty_result(result: object) -> bool:
    first = result[0] if isinstance(result, (tuple, list)) else result
    return isinstance(first, torch.Tensor) and first.numel() == 0


def _run_one(target: Target, mutation: Mutation, device: torch.device, timeout: float) -> str | None:
    """None when the call failed as it should; otherwise what went wrong."""
    outcome: dict[str, object] = {}

    def body() -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                kw = target.base(device)
                mutation.apply(kw, other_device(device))
                outcome["result"] = target.call(kw)
        except BaseException as e:  # noqa: BLE001 - every outcome is recorded
            outcome["error"] = e

    worker = threading.Thread(target=body, daemon=True, name=f"bad-input {target.name}")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return f"did not return within {timeout:.0f} s (hang)"
    err = outcome.get("error")
    if err is None:
        if mutation.empty_ok and _is_empty_result(outcome.get("result")):
            return None
        return "did not raise"
    if not isinstance(err, (ValueError, TypeError)):
        return f"raised {type(err).__name__}: {err}"
    if not _names(mutation.arg, str(err)):
        return f"raised {type(err).__name__} without naming {mutation.arg!r}: {err}"
    return None


def run_bad_inputs(
    ops: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
    log: Callable[[str], object] | None = print,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
) -> BadInputReport:
    """Run every malformed call of the selected ops and layers (all when ``ops`` is None)."""
    device = torch.device(device)
    table = {t.name: t for t in targets()}
    names = list(table) if ops is None else list(ops)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"ops must name public ops or layers from {sorted(table)}, got unknown {unknown}")
    report = BadInputReport()
    for name in names:
        target = table[name]
        for mutation in target.mutations:
            problem = _run_one(target, mutation, device, call_timeout)
            report.checked += 1
            report.per_op[name] = report.per_op.get(name, 0) + 1
            if problem is not None:
                report.crashes.append(f"{name} [{mutation.label}]: {problem}")
        if log is not None:
            log(f"{name}: {report.per_op.get(name, 0)} malformed calls")
    if log is not None:
        log(f"bad inputs: {report.checked} calls, {len(report.crashes)} failures")
        for line in report.crashes:
            log(f"  {line}")
    return report



# --- the table: one valid call and its malformed variants per public op and layer -------------------

_T = 4  # tokens of every valid call
_R = torch.rand


def _randn(*shape: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype)


def _delta_target(name: str, gates: dict[str, str], chunked: bool, gate_params: bool) -> Target:
    """A delta-rule op: q, k [1, T, 2, 16], v [1, T, 2, 16], its gates (kind "scalar", "key" or "value"), a zero
    initial state."""
    import lamina

    fn = getattr(lamina, name)
    B, H, HV, K, V = 1, 2, 2, 16, 16
    shapes = {"scalar": (B, _T, HV), "key": (B, _T, HV, K), "value": (B, _T, HV, V)}

    def base(dev: torch.device) -> Kwargs:
        kw: Kwargs = {"q": _randn(B, _T, H, K, device=dev), "k": _randn(B, _T, H, K, device=dev),
                      "v": _randn(B, _T, HV, V, device=dev),
                      "initial_state": torch.zeros(B, HV, K, V, device=dev), "output_final_state": True}
        for gate, kind in gates.items():
            x = _R(*shapes[kind], device=dev)
            kw[gate] = -x if gate == "g" else x  # log decays <= 0; beta, b, w in [0, 1)
        return kw

    muts = [
        drop_dim("q"), as_list("q"), cast("q", torch.int32), resize("k", 3, 8), cast("k", torch.float16),
        resize("v", 1, _T + 1), resize("v", 2, 3), cast("v", torch.float16), move("k"), move("v"),
        resize("initial_state", 1, 3), cast("initial_state", torch.float16), move("initial_state"),
        set_arg("scale", "abc"), set_arg("scale", True), set_arg("backend", "bogus"),
        zero_len(["q", "k", "v", *gates]), *cu_seqlens_cases(_T),
    ]
    for gate in gates:
        muts += [resize(gate, 2, 3), cast(gate, torch.float64), move(gate), as_list(gate)]
    if "g" in gates:
        muts.append(_mut("g > 0", "g", lambda kw, _d: kw.__setitem__("g", kw["g"].abs() + 0.5)))
    if chunked:
        muts.append(set_arg("chunk_size", 7))
    else:
        dev = _device_of
        muts += [
            _mut("inplace_final_state with a non-contiguous state", "initial_state", lambda kw, d: (
                strided("initial_state").apply(kw, d), kw.update(inplace_final_state=True))),
            set_arg("out", lambda kw: torch.empty(B, _T, HV, V + 1, device=dev(kw)), label="out of the wrong shape"),
            set_arg("out", lambda kw: torch.empty(B, _T, HV, 2 * V, device=dev(kw))[..., ::2],
                    label="out non-contiguous"),
            set_arg("out", lambda kw: kw["v"], label="out is v"),
            set_arg("out", lambda kw: torch.empty(B, _T, HV, V, dtype=torch.float64, device=dev(kw)),
                    label="out float64"),
            set_arg("ssm_state_indices", lambda kw: torch.tensor([5], device=dev(kw)), label="slot 5 of a pool of 1"),
            set_arg("ssm_state_indices", lambda kw: torch.tensor([0, 0], device=dev(kw)), label="two rows for N=1"),
            set_arg("ssm_state_indices", lambda kw: torch.tensor([0.0], device=dev(kw)), label="float slots"),
            set_arg("num_accepted_tokens", lambda kw: torch.tensor([1], device=dev(kw)),
                    label="num_accepted_tokens without ssm_state_indices"),
        ]
        muts.append(_mut("inplace_final_state without a state", "initial_state", lambda kw, _d: kw.update(
            inplace_final_state=True, initial_state=None)))
    if gate_params:
        width = 1 if gates.get("g") == "scalar" else K
        muts += [
            _mut("A_log wrong size", "A_log", lambda kw, _d: kw.update(
                use_gate_in_kernel=True, A_log=torch.zeros(HV + 1, device=kw["q"].device),
                dt_bias=torch.zeros(HV * width, device=kw["q"].device))),
            _mut("dt_bias wrong size", "dt_bias", lambda kw, _d: kw.update(
                use_gate_in_kernel=True, A_log=torch.zeros(HV, device=kw["q"].device),
                dt_bias=torch.zeros(HV * width + 1, device=kw["q"].device))),
        ]
    return Target(name, base, lambda kw: fn(**kw), tuple(muts))


def _attention_target() -> Target:
    import lamina

    def base(dev: torch.device) -> Kwargs:
        return {"q": _randn(1, _T, 2, 16, device=dev), "k": _randn(1, _T, 1, 16, device=dev),
                "v": _randn(1, _T, 1, 16, device=dev)}

    def varlen(q_offs: list[int], k_offs: list[int], arg: str, **extra: object) -> Mutation:
        def fn(kw: Kwargs, _d: torch.device) -> None:
            dev = kw["q"].device
            kw.update(cu_seqlens_q=torch.tensor(q_offs, dtype=torch.int32, device=dev),
                      cu_seqlens_k=torch.tensor(k_offs, dtype=torch.int32, device=dev), **extra)
        return _mut(f"cu_seqlens_q={q_offs} cu_seqlens_k={k_offs} {extra}", arg, fn)

    muts = (
        drop_dim("q"), add_dim("k"), as_list("q"), cast("q", torch.int64), cast("k", torch.float16),
        cast("v", torch.float16), resize("v", 1, _T + 1), resize("k", 3, 24), resize("q", 3, 12),
        resize("q", 3, 8), resize("k", 2, 3), resize("v", 0, 2), move("k"), move("v"),
        set_arg("scale", "abc"), set_arg("scale", True), set_arg("backend", "bogus"),
        zero_len(["q"]), zero_len(["q", "k", "v"]),
        set_arg("cu_seqlens_q", lambda kw: torch.tensor([0, _T], dtype=torch.int32, device=kw["q"].device)),
        varlen([-1, _T], [0, _T], "cu_seqlens_q"), varlen([0, 3, 1, _T], [0, 1, 2, _T], "cu_seqlens_q"),
        varlen([0, _T], [0, _T + 2], "cu_seqlens_k"), varlen([0, 1, _T], [0, _T], "cu_seqlens_k"),
        varlen([0, _T], [0, _T], "max_seqlen_q", max_seqlen_q=1),
        varlen([0, _T], [0, _T], "max_seqlen_k", max_seqlen_k="x"),
        set_arg("window_size", (-2, 3)), set_arg("window_size", (4,)), set_arg("window_size", 4),
        set_arg("window_size", (1.5, -1)), set_arg("softcap", -1.0), set_arg("softcap", float("nan")),
        set_arg("softcap", "big"),
    )
    return Target("prism_attention", base, lambda kw: lamina.prism_attention(**kw), muts)


def _kvcache_target() -> Target:
    import lamina

    def base(dev: torch.device) -> Kwargs:
        return {"q": _randn(1, 1, 2, 16, device=dev), "k_cache": _randn(1, 8, 1, 16, device=dev),
                "v_cache": _randn(1, 8, 1, 16, device=dev), "k": _randn(1, 1, 1, 16, device=dev),
                "v": _randn(1, 1, 1, 16, device=dev), "cache_seqlens": 3}

    def seqlens(values: list[float], dtype: torch.dtype = torch.int32) -> Mutation:
        return set_arg("cache_seqlens", lambda kw: torch.tensor(values, dtype=dtype, device=kw["q"].device))

    def paged(table: list[list[float]], dtype: torch.dtype = torch.int32) -> Mutation:
        def fn(kw: Kwargs, _d: torch.device) -> None:
            kw["block_table"] = torch.tensor(table, dtype=dtype, device=kw["q"].device)
        return _mut(f"block_table={table} {dtype}", "block_table", fn)

    muts = (
        drop_dim("q"), drop_dim("k_cache"), as_list("k_cache"), cast("k_cache", torch.float16),
        cast("k", torch.float16), resize("v_cache", 1, 9), resize("k_cache", 3, 24), resize("k_cache", 2, 3),
        set_arg("v", None, "k"), move("k_cache"), move("v"), set_arg("cache_seqlens", -1),
        set_arg("cache_seqlens", 8), set_arg("cache_seqlens", "3"), seqlens([-1]), seqlens([3.0], torch.float32),
        seqlens([3, 3]), paged([[9, 0]]), paged([[0.0]], torch.float32), paged([[0], [0]]),
        set_arg("softmax_scale", "abc"), set_arg("num_splits", -1), set_arg("backend", "bogus"),
        _mut("k_cache head dim strided", "k_cache", lambda kw, _d: kw.__setitem__(
            "k_cache", kw["k_cache"].new_zeros(1, 8, 1, 32)[..., ::2])),
        set_arg("v_cache", lambda kw: kw["k_cache"], "v_cache"),  # keys and values written to one buffer
    )
    return Target("prism_attention_with_kvcache", base, lambda kw: lamina.prism_attention_with_kvcache(**kw), muts)


def _hrm_target() -> Target:
    import lamina

    def base(dev: torch.device) -> Kwargs:
        return {"h": _randn(2, 3, 16, device=dev), "c": _randn(2, 3, 16, device=dev),
                "gate_logits": _randn(2, 3, 16, device=dev), "bias": _randn(16, device=dev),
                "norm_weight": _randn(16, device=dev)}

    muts = (
        as_list("h"), cast("h", torch.int32), resize("h", 2, 0), resize("c", 1, 4), cast("c", torch.float64),
        resize("gate_logits", 2, 5), cast("gate_logits", torch.float16), drop_dim("gate_logits"),
        resize("bias", 0, 3), add_dim("bias"), resize("norm_weight", 0, 3), move("c"), move("norm_weight"),
        set_arg("eps", -1.0), set_arg("eps", "abc"), set_arg("backend", "bogus"),
        set_arg("out", lambda kw: torch.empty(2, 3, 17, device=kw["h"].device)),
        set_arg("out", lambda kw: torch.empty(2, 3, 16, device=kw["h"].device, dtype=torch.float64)),
        set_arg("out", lambda kw: torch.empty(2, 3, 32, device=kw["h"].device)[..., ::2]),
        set_arg("out", lambda kw: kw["h"].detach().requires_grad_()),
        _mut("out overlapping h, h needs grad", "out", lambda kw, _d: kw.update(
            h=kw["h"].requires_grad_(), out=kw["h"].detach())),
        zero_len(["h", "c", "gate_logits"]),
    )
    return Target("hrm_gated_update", base, lambda kw: lamina.hrm_gated_update(**kw), muts)


def _conv_target() -> Target:
    import lamina

    def base(dev: torch.device) -> Kwargs:
        return {"x": _randn(1, 6, 8, device=dev), "weight": _randn(8, 4, device=dev), "bias": _randn(8, device=dev),
                "activation": "silu"}

    muts = (
        drop_dim("x"), as_list("x"), cast("x", torch.int32), set_arg("weight", None), drop_dim("weight"),
        resize("weight", 0, 5), resize("bias", 0, 3), set_arg("residual", lambda kw: torch.zeros(1, 5, 8)),
        set_arg("activation", "relu"), set_arg("initial_state", lambda kw: torch.zeros(1, 8, 3)),
        set_arg("initial_state", lambda kw: torch.zeros(8, 4)), set_arg("output_final_state", "yes"),
        set_arg("backend", "bogus"), move("weight"), move("bias"), *cu_seqlens_cases(6),
        set_arg("cu_seqlens_cpu", lambda kw: torch.tensor([0, 6], dtype=torch.int32)),
        zero_len(["x"]),
    )
    return Target("causal_conv1d", base, lambda kw: lamina.causal_conv1d(**kw), muts)


def _conv_update_target() -> Target:
    import lamina

    def base(dev: torch.device) -> Kwargs:
        return {"x": _randn(2, 8, device=dev), "cache": _randn(2, 8, 4, device=dev),
                "weight": _randn(8, 4, device=dev), "bias": _randn(8, device=dev)}

    muts = (
        as_list("x"), drop_dim("x"), resize("x", 1, 7), resize("x", 0, 3),
        set_arg("x", lambda kw: torch.zeros(2, 2, 8, device=kw["x"].device)), cast("x", torch.int32),
        drop_dim("cache"), resize("cache", 2, 5), resize("cache", 1, 7), cast("cache", torch.int32), move("cache"),
        set_arg("weight", None), drop_dim("weight"), resize("bias", 0, 3),
        set_arg("residual", lambda kw: torch.zeros(2, 7, device=kw["x"].device)),
        set_arg("activation", "relu"), set_arg("backend", "bogus"), move("x"),
        set_arg("x", lambda kw: kw["cache"][:, :, 3], "cache"),  # the new token is a view of the window it shifts
        zero_len(["x", "cache"], dim=0, arg="cache"),
    )
    return Target("causal_conv1d_update", base, lambda kw: lamina.causal_conv1d_update(**kw), muts)


def _norm_target(gated: bool) -> Target:
    import lamina

    fn = lamina.rms_norm_gated if gated else lamina.rms_norm

    def base(dev: torch.device) -> Kwargs:
        kw: Kwargs = {"x": _randn(2, 3, 16, device=dev), "weight": _randn(16, device=dev),
                      "bias": _randn(16, device=dev)}
        if gated:
            kw["g"] = _randn(2, 3, 16, device=dev)
        return kw

    muts = [
        as_list("x"), cast("x", torch.int32), resize("x", 2, 0), set_arg("x", lambda kw: kw["x"][0, 0, 0]),
        resize("weight", 0, 3), add_dim("weight"), cast("weight", torch.int32), as_list("weight"),
        resize("bias", 0, 5), cast("bias", torch.int64), move("weight"), move("bias"),
        set_arg("residual", lambda kw: torch.zeros(2, 3, 15, device=kw["x"].device)),
        set_arg("residual", lambda kw: torch.zeros(2, 3, 16, dtype=torch.int32, device=kw["x"].device)),
        set_arg("residual", lambda kw: torch.zeros(2, 3, 16, device=other_device(kw["x"].device))),
        set_arg("eps", -1.0), set_arg("eps", "abc"), set_arg("prenorm", "yes"), set_arg("residual_in_fp32", 2),
        set_arg("backend", "bogus"), zero_len(["x", "g"] if gated else ["x"]),
    ]
    if gated:
        muts += [resize("g", 1, 4), cast("g", torch.int32), as_list("g"), move("g"), set_arg("activation", "relu")]
    return Target("rms_norm_gated" if gated else "rms_norm", base, lambda kw: fn(**kw), tuple(muts))


def _l2_norm_target() -> Target:
    import lamina

    def base(dev: torch.device) -> Kwargs:
        return {"x": _randn(2, 3, 16, device=dev)}

    muts = (
        as_list("x"), cast("x", torch.int32), cast("x", torch.int64), cast("x", torch.bool), resize("x", 2, 0),
        set_arg("x", lambda kw: kw["x"][0, 0, 0], label="x as a 0-d tensor"), set_arg("x", None),
        set_arg("x", 3.0), set_arg("x", "abc"),
        set_arg("eps", -1.0), set_arg("eps", "abc"), set_arg("eps", float("nan")), set_arg("eps", float("inf")),
        set_arg("eps", None), set_arg("eps", True),
        set_arg("backend", "bogus"), set_arg("backend", None), set_arg("backend", 3), set_arg("backend", "cuda"),
        zero_len(["x"]), zero_len(["x"], dim=0),
    )
    return Target("l2_norm", base, lambda kw: lamina.l2_norm(**kw), muts)


def targets() -> list[Target]:
    """Every public op and layer with its malformed calls."""
    g, beta = "scalar", "scalar"
    ops = [
        _delta_target("chunk_delta_rule", {"beta": beta}, chunked=True, gate_params=False),
        _delta_target("chunk_gated_delta_rule", {"g": g, "beta": beta}, chunked=True, gate_params=True),
        _delta_target("chunk_kda", {"g": "key", "beta": beta}, chunked=True, gate_params=True),
        _delta_target("chunk_gdn2", {"g": "key", "b": "key", "w": "value"}, chunked=True, gate_params=True),
        _delta_target("fused_recurrent_delta_rule", {"beta": beta}, chunked=False, gate_params=False),
        _delta_target("fused_recurrent_gated_delta_rule", {"g": g, "beta": beta}, chunked=False, gate_params=True),
        _delta_target("fused_recurrent_kda", {"g": "key", "beta": beta}, chunked=False, gate_params=True),
        _delta_target("fused_recurrent_gdn2", {"g": "key", "b": "key", "w": "value"}, chunked=False,
                      gate_params=True),
        _attention_target(), _kvcache_target(), _hrm_target(), _conv_target(), _conv_update_target(),
        _norm_target(gated=False), _norm_target(gated=True),
        _l2_norm_target(),
    ]
    from lamina.fuzz.bad_layers import layer_targets
    from lamina.fuzz.bad_models import model_targets

    return ops + layer_targets() + model_targets()

__all__ = ["BadInputReport", "Mutation", "Target", "run_bad_inputs"]
