"""The eight delta-rule ops take fla 0.6's signatures: names, positional order, defaults, the keys fla
reads from ``**kwargs`` (keyword-only here), refusals by name; and the fla semantics lamina adds at the
op boundary (``state_v_first``, ``gk``, ``beta=None``, ``cu_seqlens_cpu``).

fla's signatures are read with ``inspect`` from the installed fla-core 0.6.0 (a test extra). Its
import takes ~10 s, so one test compares all eight ops (one xdist worker pays it); the other tests
call lamina's positional parameters, which that test proves are fla's, in fla's order. Numerical
checks run the float64 torch path (the fla layer of lamina is backend-independent) and one small
Triton-interpreter case.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import warnings

import pytest
import torch
from tolerances import assert_close

import lamina
from lamina.ops.delta_rule_core import gate_activation

OPS = ("chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda", "chunk_gdn2", "fused_recurrent_delta_rule",
       "fused_recurrent_gated_delta_rule", "fused_recurrent_kda", "fused_recurrent_gdn2")

# The keys fla 0.6 reads from **kwargs (grep of fla/ops/{delta_rule,gated_delta_rule,kda,gdn2}/*.py);
# the test also derives them from the source, so a regex that stops matching cannot pass silently.
FLA_KWARGS = {
    "chunk_delta_rule": {"head_first", "chunk_size"},
    "chunk_gated_delta_rule": {"transpose_state_layout", "head_first", "chunk_size", "use_gate_in_kernel", "A_log",
                               "dt_bias"},
    "chunk_kda": {"transpose_state_layout", "A_log", "dt_bias", "chunk_size"},
    "chunk_gdn2": {"transpose_state_layout", "A_log", "dt_bias", "chunk_size"},
    "fused_recurrent_delta_rule": set(),
    "fused_recurrent_gated_delta_rule": {"transpose_state_layout"},
    "fused_recurrent_kda": {"transpose_state_layout"},
    "fused_recurrent_gdn2": {"transpose_state_layout"},
}

# fla parameters lamina refuses, with a non-default value each (they change results or outputs).
REFUSED = {
    "chunk_delta_rule": {"head_first": True},
    "chunk_gated_delta_rule": {"head_first": True},
    "chunk_kda": {"return_intermediate_states": True},
    "chunk_gdn2": {"return_intermediate_states": True},
    "fused_recurrent_gated_delta_rule": {"gv": "tensor"},
}

B, T, H, HV, K, V = 2, 12, 1, 2, 8, 4  # K != V: a missed transpose cannot pass
CHUNK = 16


@functools.cache
def _fla_fn(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Triton is not supported on current platform"
        module = importlib.import_module("fla.ops.gdn2" if "gdn2" in name else "fla.ops")
    return inspect.unwrap(getattr(module, name))


def _named(sig: inspect.Signature) -> list[inspect.Parameter]:
    return [p for p in sig.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def _kwargs_keys_in_source(fn) -> set[str]:
    src = inspect.getsource(fn)
    return (set(re.findall(r"kwargs\.(?:get|pop)\(\s*['\"](\w+)['\"]", src))
            | set(re.findall(r"['\"](\w+)['\"]\s+in\s+kwargs", src)))


# --- signatures ----------------------------------------------------------------------------------

def _mismatches(name: str) -> list[str]:
    """How lamina's ``name`` differs from fla 0.6's (empty when it takes fla's calls exactly)."""
    fla_sig, ours = inspect.signature(_fla_fn(name)), inspect.signature(getattr(lamina, name))
    bad = []
    if any(p.kind is p.VAR_KEYWORD for p in ours.parameters.values()):
        bad.append("takes **kwargs")
    positional = [p for p in ours.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    if [p.name for p in positional] != [p.name for p in _named(fla_sig)]:
        bad.append(f"positional {[p.name for p in positional]} != fla's {[p.name for p in _named(fla_sig)]}")
    for fp, lp in zip(_named(fla_sig), positional):
        if not (lp.default is fp.default or lp.default == fp.default):
            bad.append(f"default of {fp.name}: {lp.default!r} != fla's {fp.default!r}")
    bad += [f"{p.name} is neither fla's positional nor keyword-only" for p in ours.parameters.values()
            if p not in positional and p.kind is not p.KEYWORD_ONLY]
    keys = _kwargs_keys_in_source(_fla_fn(name))
    if keys != FLA_KWARGS[name]:
        bad.append(f"fla reads {sorted(keys)} from **kwargs, the table says {sorted(FLA_KWARGS[name])}")
    bad += [f"fla's **kwargs key {key} is not keyword-only" for key in sorted(keys)
            if key not in ours.parameters or ours.parameters[key].kind is not inspect.Parameter.KEYWORD_ONLY]
    if name.startswith("chunk_") and ours.parameters["chunk_size"].default != 64:  # kwargs.pop("chunk_size", 64)
        bad.append("chunk_size default is not fla's 64")
    bad += [f"refused {p} is not an fla parameter" for p in REFUSED.get(name, {})
            if p not in fla_sig.parameters and p not in FLA_KWARGS[name]]
    return bad


def test_signatures_match_fla():
    """All eight ops in one test: only one xdist worker pays fla's import (~10 s)."""
    bad = {name: m for name in OPS if (m := _mismatches(name))}
    assert not bad, "\n".join(f"{name}: {m}" for name, ms in bad.items() for m in ms)


def _inputs(name: str, dtype=torch.float64, batch: int = B, seed: int = 0) -> dict:
    """Small inputs by fla parameter name: gates in range, state, gate parameters."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    lead = (batch, T, HV)
    x = {"q": r(batch, T, H, K), "k": r(batch, T, H, K), "v": r(*lead, V)}
    if "gdn2" in name:
        x.update(g=-u(*lead, K), b=u(*lead, K), w=u(*lead, V))
    elif "kda" in name:
        x.update(g=-u(*lead, K), beta=u(*lead))
    elif "gated" in name:
        x.update(g=-u(*lead), beta=u(*lead))
    else:
        x.update(beta=u(*lead))
    x["initial_state"] = r(batch, HV, K, V).float() if dtype != torch.float64 else r(batch, HV, K, V)
    return x


def _call(name: str, **kw):
    kw.setdefault("backend", "torch")
    if name.startswith("chunk_"):
        kw.setdefault("chunk_size", CHUNK)
    return getattr(lamina, name)(**kw)


@pytest.mark.parametrize("name,param", [(n, p) for n, ps in REFUSED.items() for p in ps])
def test_refused_fla_parameters_name_themselves(name, param):
    x = _inputs(name)
    value = REFUSED[name][param]
    value = torch.zeros(B, T, HV, V, dtype=torch.float64) if value == "tensor" else value
    with pytest.raises(NotImplementedError, match=param):
        _call(name, **x, **{param: value})
    _call(name, **x, **{param: inspect.signature(getattr(lamina, name)).parameters[param].default})


@pytest.mark.parametrize("name", OPS)
def test_unknown_keyword_is_a_type_error(name):
    with pytest.raises(TypeError, match="not_an_fla_keyword"):
        getattr(lamina, name)(**_inputs(name), not_an_fla_keyword=1)


@pytest.mark.parametrize("name", ["fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_per_value_channel_beta_is_refused(name):
    x = _inputs(name)
    x["beta"] = torch.rand(B, T, HV, V, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="beta"):
        _call(name, **x)


# --- semantics -----------------------------------------------------------------------------------

STATE_V_FIRST_OPS = [n for n in OPS if "state_v_first" in inspect.signature(getattr(lamina, n)).parameters]


@pytest.mark.parametrize("name", STATE_V_FIRST_OPS)
def test_state_v_first_transposes_state_and_its_gradient(name):
    x = _inputs(name)
    h0 = x.pop("initial_state")
    kf = h0.clone().requires_grad_()
    vf = h0.transpose(-1, -2).contiguous().requires_grad_()
    ds = torch.randn(B, HV, K, V, dtype=torch.float64)
    o1, s1 = _call(name, **x, initial_state=kf, output_final_state=True)
    o2, s2 = _call(name, **x, initial_state=vf, output_final_state=True, state_v_first=True)
    assert s2.shape == (B, HV, V, K) and s2.is_contiguous()
    assert_close("o", o2, o1)
    assert_close("final_state", s2.transpose(-1, -2), s1)
    (o1.sum() + (s1 * ds).sum()).backward()
    (o2.sum() + (s2 * ds.transpose(-1, -2)).sum()).backward()
    assert_close("dinitial_state", vf.grad.transpose(-1, -2), kf.grad)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        # a state that needs gradients, as for o2, so the alias takes the same (differentiable) path
        o3, s3 = _call(name, **x, initial_state=vf.detach().clone().requires_grad_(), output_final_state=True,
                       transpose_state_layout=True)
    assert torch.equal(o3, o2) and torch.equal(s3, s2)
    with pytest.raises(ValueError, match="transpose_state_layout"):
        _call(name, **x, initial_state=vf.detach(), state_v_first=True, transpose_state_layout=True)
    with pytest.raises(ValueError, match=r"initial_state must have shape .*\[N, HV, V, K\]"):
        _call(name, **x, initial_state=kf.detach(), state_v_first=True)


@pytest.mark.interpret
def test_state_v_first_through_triton_gradients():
    """The transposed (non-contiguous) state through lamina::delta_rule_fwd/bwd under the interpreter,
    against the float64 torch path in the K-first layout."""
    x = _inputs("chunk_gated_delta_rule", dtype=torch.float32, batch=1)
    h0 = x.pop("initial_state")
    vf = h0.transpose(-1, -2).contiguous().requires_grad_()
    kf64 = h0.double().requires_grad_()
    o, s = _call("chunk_gated_delta_rule", **x, initial_state=vf, output_final_state=True, state_v_first=True,
                 backend="triton")
    o64, s64 = _call("chunk_gated_delta_rule", **{n: t.double() for n, t in x.items()}, initial_state=kf64,
                     output_final_state=True)
    assert_close("o", o, o64)
    assert_close("final_state", s.transpose(-1, -2), s64)
    (o.sum() + s.pow(2).sum()).backward()
    (o64.sum() + s64.pow(2).sum()).backward()
    assert_close("dinitial_state", vf.grad.transpose(-1, -2), kf64.grad)


def test_fused_recurrent_gated_delta_rule_gk_is_kda():
    """fla applies exp(g) then exp(gk): KDA with the per-channel log decay g[..., None] + gk."""
    x = _inputs("fused_recurrent_kda")
    gk, beta = x.pop("g"), x.pop("beta")
    g = -torch.rand(B, T, HV, dtype=torch.float64)
    A_log, dt_bias = torch.randn(HV, dtype=torch.float64), torch.randn(HV, dtype=torch.float64)
    kw = dict(**x, output_final_state=True)
    cases = [  # (fused_recurrent_gated_delta_rule gates, the per-channel log decay of KDA)
        (dict(g=g, gk=gk), g[..., None] + gk),
        (dict(gk=gk), gk),
        (dict(g=g, gk=gk, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias),
         gate_activation(g, A_log, dt_bias)[..., None] + gk),
    ]
    for gates, total in cases:
        o, s = _call("fused_recurrent_gated_delta_rule", **gates, beta=beta, **kw)
        o_ref, s_ref = _call("fused_recurrent_kda", g=total, beta=beta, **kw)
        assert_close("o", o, o_ref)
        assert_close("final_state", s, s_ref)
    o, s = _call("fused_recurrent_gated_delta_rule", beta=beta, **kw)  # no decay at all: DeltaNet
    o_ref, s_ref = _call("fused_recurrent_delta_rule", beta=beta, **kw)
    assert_close("o", o, o_ref)
    with pytest.raises(ValueError, match="use_gate_in_kernel"):
        _call("fused_recurrent_gated_delta_rule", gk=gk, beta=beta, use_gate_in_kernel=True, A_log=A_log, **kw)


@pytest.mark.parametrize("name", ["fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_beta_none_is_ones(name):
    x = _inputs(name)
    ones = torch.ones_like(x.pop("beta"))
    o1, s1 = _call(name, **x, output_final_state=True)
    o2, s2 = _call(name, **x, beta=ones, output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    if name == "fused_recurrent_gated_delta_rule":  # fla applies the in-kernel sigmoid to those ones too
        o3, _ = _call(name, **x, use_beta_sigmoid_in_kernel=True)
        sigmoid_1 = torch.sigmoid(torch.tensor(1.0, dtype=torch.float64)).item()
        o4, _ = _call(name, **x, beta=torch.full_like(ones, sigmoid_1))
        assert_close("o", o3, o4)


def _fla_order(name: str) -> list[inspect.Parameter]:
    """lamina's positional parameters: fla's, in fla's order (``test_signatures_match_fla``)."""
    return [p for p in inspect.signature(getattr(lamina, name)).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD]


def _fla_order_values(name: str) -> dict:
    """A non-default value for every fla parameter lamina implements or accepts (varlen, B = 1)."""
    x = _inputs(name, batch=1)
    cu = torch.tensor([0, 5, T], dtype=torch.int32)
    v_first = any(p.name == "state_v_first" for p in _fla_order(name))
    x["initial_state"] = torch.randn(2, HV, *((V, K) if v_first else (K, V)), dtype=torch.float64)  # N = 2
    gate_width = (HV * K,) if ("kda" in name or "gdn2" in name) else (HV,)
    x.update(scale=0.6, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             A_log=torch.randn(HV, dtype=torch.float64), dt_bias=torch.randn(*gate_width, dtype=torch.float64),
             use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True, cu_seqlens=cu,
             cu_seqlens_cpu=cu.clone(), chunk_indices=torch.zeros(3, 2, dtype=torch.int32),
             disable_recompute=True, use_graph=True, max_num_seqs=4, lower_bound=-3.0, safe_gate=True,
             gk=-torch.rand(1, T, HV, K, dtype=torch.float64))
    if name == "fused_recurrent_gated_delta_rule":
        x["g"] = torch.randn(1, T, HV, dtype=torch.float64)  # raw gate input
    return x


# fla's performance hints: passed in the positional call, left at their defaults in the keyword call.
HINTS = {"cu_seqlens_cpu": None, "chunk_indices": None, "disable_recompute": False, "use_graph": False,
         "max_num_seqs": None}


@pytest.mark.parametrize("name", OPS)
def test_positional_call_in_fla_order_equals_keyword_call(name):
    params = _fla_order(name)
    values = _fla_order_values(name)
    refused = REFUSED.get(name, {})
    args = [values.get(p.name, p.default) if p.name not in refused else p.default for p in params]
    extra = {"backend": "torch", **({"chunk_size": CHUNK} if name.startswith("chunk_") else {})}
    if name == "chunk_gated_delta_rule":  # fla reads these from **kwargs: keyword-only
        extra.update(use_gate_in_kernel=True, A_log=values["A_log"], dt_bias=values["dt_bias"])
    elif name in ("chunk_kda", "chunk_gdn2"):
        extra.update(A_log=values["A_log"], dt_bias=values["dt_bias"])
    o1, s1 = getattr(lamina, name)(*args, **extra)
    keywords = {p.name: a for p, a in zip(params, args) if p.name not in HINTS}
    o2, s2 = getattr(lamina, name)(**keywords, **extra)
    assert_close("o", o1, o2)
    assert s1.shape == ((2, HV, V, K) if "state_v_first" in keywords else (2, HV, K, V))
    assert_close("final_state", s1, s2)


def test_cu_seqlens_cpu_is_checked_against_cu_seqlens():
    x = _inputs("chunk_kda", batch=1)
    x["initial_state"] = None
    cu = torch.tensor([0, 5, T])
    with pytest.raises(ValueError, match="cu_seqlens_cpu must have the length of cu_seqlens"):
        _call("chunk_kda", **x, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, T]))
    with pytest.raises(ValueError, match="cu_seqlens_cpu must be a CPU tensor"):
        _call("chunk_kda", **x, cu_seqlens=cu, cu_seqlens_cpu=torch.empty(3, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="without cu_seqlens"):
        _call("chunk_kda", **x, cu_seqlens_cpu=cu)
    with pytest.raises(ValueError, match="cu_seqlens_cpu must end at"):  # the offsets are read from the host copy
        _call("chunk_kda", **x, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 5, T + 1]))
