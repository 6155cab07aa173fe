"""Properties every correct delta-rule implementation has, checked on the torch backend (hypothesis
draws shapes and split points) and on a small set under the Triton interpreter.

* chunked == token by token (``chunk_*`` against ``fused_recurrent_*``);
* a sequence split in two, the state carried across, equals the whole;
* GVA (HV > H) equals repeating the q/k heads explicitly;
* a varlen pack (``cu_seqlens``) equals separate calls;
* batch invariance: a row's output does not depend on the other rows (fla #671);
* causality: changing inputs after token t leaves outputs up to t unchanged, also with
  ``safe_gate`` and strong gates (fla #1240);
* GDN-2 with ``b = w = beta`` is KDA;
* zero-padding the head dims (K and V) changes nothing in the unpadded part.

Under the interpreter the split and GVA properties are left to tests/test_grads_all.py, whose
Triton cases check the initial and final states and a GVA case against the float64 oracle.

Comparisons between two runs of lamina use the recurrence bound of ``lamina.testing`` for the dtype
(both runs carry float32 rounding); where the property is structural and both runs do the same
arithmetic on the same rows (batch invariance, causality), equality is exact.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import assert_close

import lamina

VARIANTS = ("delta", "gdn", "kda", "gdn2")
# Few examples each (the whole file stays cheap), the same ones on every run (failures reproduce).
PROPERTY = settings(max_examples=8, deadline=None, derandomize=True, database=None)
CHUNK = 16


def make(variant: str, B: int, T: int, H: int, HV: int, K: int, V: int, seed: int = 0,
         gate_scale: float = 1.0) -> dict:
    """Inputs of one variant: keys of norm ~1, log decays in (-gate_scale, 0), gates in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen)
    rand = lambda *s: torch.rand(*s, generator=gen)
    x = {"q": randn(B, T, H, K), "k": randn(B, T, H, K) / K ** 0.5, "v": randn(B, T, HV, V),
         "h0": randn(B, HV, K, V) * 0.5}
    if variant == "gdn":
        x["g"] = -rand(B, T, HV) * gate_scale
    elif variant in ("kda", "gdn2"):
        x["g"] = -rand(B, T, HV, K) * gate_scale
    if variant == "gdn2":
        x["b"], x["w"] = rand(B, T, HV, K), rand(B, T, HV, V)
    else:
        x["beta"] = rand(B, T, HV)
    return x


def run(variant: str, x: dict, backend: str, recurrent: bool = False, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, final_state)`` of the variant's chunked (or ``fused_recurrent_``) op, without gradients."""
    prefix = "fused_recurrent_" if recurrent else "chunk_"
    name = {"delta": "delta_rule", "gdn": "gated_delta_rule", "kda": "kda", "gdn2": "gdn2"}[variant]
    args = {n: t for n, t in x.items() if n != "h0"}
    if not recurrent:
        kw.setdefault("chunk_size", CHUNK)
    with torch.no_grad():
        return getattr(lamina, prefix + name)(**args, initial_state=x.get("h0"), output_final_state=True,
                                              backend=backend, **kw)


def time_slice(x: dict, span: slice) -> dict:
    return {n: (t if n == "h0" else t[:, span]) for n, t in x.items()}


# --- chunked == recurrent ------------------------------------------------------------------------

@PROPERTY
@given(variant=st.sampled_from(VARIANTS), T=st.integers(1, 40), group=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**16))
def test_chunked_equals_recurrent_torch(variant, T, group, seed):
    x = make(variant, 2, T, 1, group, 16, 8, seed)
    o, s = run(variant, x, "torch")
    ro, rs = run(variant, x, "torch", recurrent=True)
    assert_close("o", o, ro)
    assert_close("final_state", s, rs)


@pytest.mark.interpret
def test_chunked_equals_recurrent_triton():
    """The chunked kernels against the decode kernel (no gradients: the fused step runs)."""
    x = make("gdn2", 1, 21, 1, 1, 16, 16, seed=3)
    o, s = run("gdn2", x, "triton")
    ro, rs = run("gdn2", x, "triton", recurrent=True)
    assert_close("o", o, ro)
    assert_close("final_state", s, rs)


# --- split + carried state == whole --------------------------------------------------------------

def check_split(variant: str, x: dict, cut: int, backend: str) -> None:
    T = x["q"].shape[1]
    o, s = run(variant, x, backend)
    first, second = time_slice(x, slice(0, cut)), time_slice(x, slice(cut, T))
    o1, s1 = run(variant, first, backend)
    second["h0"] = s1
    o2, s2 = run(variant, second, backend)
    assert_close("o", torch.cat([o1, o2], dim=1), o)
    assert_close("final_state", s2, s)


@PROPERTY
@given(variant=st.sampled_from(VARIANTS), T=st.integers(2, 48), data=st.data())
def test_split_sequence_with_carried_state_torch(variant, T, data):
    cut = data.draw(st.integers(1, T - 1), label="cut")
    check_split(variant, make(variant, 2, T, 1, 2, 16, 8, seed=T), cut, "torch")


# --- GVA == explicit repetition ------------------------------------------------------------------

def check_gva(variant: str, backend: str, H: int, HV: int) -> None:
    x = make(variant, 1, 20, H, HV, 16, 8, seed=7)
    o, s = run(variant, x, backend)
    rep = dict(x)
    rep["q"], rep["k"] = (x[n].repeat_interleave(HV // H, dim=2) for n in ("q", "k"))
    ro, rs = run(variant, rep, backend)
    assert_close("o", o, ro)
    assert_close("final_state", s, rs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gva_equals_repeated_heads_torch(variant):
    check_gva(variant, "torch", H=2, HV=4)


# --- varlen pack == separate calls ---------------------------------------------------------------

def check_varlen(variant: str, lengths: list[int], backend: str, recurrent: bool = False, HV: int = 2) -> None:
    T = sum(lengths)
    N = len(lengths)
    x = make(variant, 1, T, 1, HV, 16, 8, seed=T)
    x["h0"] = torch.randn(N, HV, 16, 8, generator=torch.Generator().manual_seed(11))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    o, s = run(variant, x, backend, recurrent=recurrent, cu_seqlens=cu)
    for n in range(N):
        part = time_slice(x, slice(int(cu[n]), int(cu[n + 1])))
        part["h0"] = x["h0"][n:n + 1]
        on, sn = run(variant, part, backend, recurrent=recurrent)
        assert_close(f"o of sequence {n}", o[:, cu[n]:cu[n + 1]], on)
        assert_close(f"final_state of sequence {n}", s[n:n + 1], sn)


@PROPERTY
@given(variant=st.sampled_from(VARIANTS), lengths=st.lists(st.integers(1, 35), min_size=1, max_size=4),
       recurrent=st.booleans())
def test_varlen_pack_equals_separate_calls_torch(variant, lengths, recurrent):
    check_varlen(variant, lengths, "torch", recurrent)


@pytest.mark.interpret
def test_varlen_pack_equals_separate_calls_triton():
    check_varlen("gdn", [5, 18], "triton", HV=1)


# --- batch invariance (fla #671) -----------------------------------------------------------------

def check_batch_invariance(variant: str, backend: str) -> None:
    """Row 0 is the same bits whatever row 1 holds; against a batch of one, within rounding."""
    x = make(variant, 2, 23, 1, 2, 16, 8, seed=13)
    other = make(variant, 2, 23, 1, 2, 16, 8, seed=14, gate_scale=4.0)
    y = {n: torch.cat([x[n][:1], other[n][1:]]) for n in x}
    o, s = run(variant, x, backend)
    oy, sy = run(variant, y, backend)
    assert torch.equal(o[0], oy[0]) and torch.equal(s[0], sy[0]), "row 0 changed with the content of row 1"
    o1, s1 = run(variant, {n: t[:1] for n, t in x.items()}, backend)
    assert_close("o, batch of one", o1, o[:1])
    assert_close("final_state, batch of one", s1, s[:1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_invariance_torch(variant):
    check_batch_invariance(variant, "torch")


@pytest.mark.interpret
def test_batch_invariance_triton():
    """One program per (sequence, head): row 0 of a batch of two is the bits of a batch of one."""
    x = make("kda", 2, 19, 1, 1, 16, 16, seed=13, gate_scale=4.0)
    o, s = run("kda", x, "triton")
    o1, s1 = run("kda", {n: t[:1] for n, t in x.items()}, "triton")
    assert torch.equal(o[:1], o1) and torch.equal(s[:1], s1), "row 0 depends on the batch it is in"


# --- causality (fla #1240: safe_gate) ------------------------------------------------------------

def check_causality(variant: str, x: dict, t: int, backend: str, **kw) -> None:
    """Outputs at tokens <= t do not change when every input after t changes (strong gates there)."""
    T = x["q"].shape[1]
    late = make(variant, x["q"].shape[0], T, x["q"].shape[2], x["v"].shape[2], x["q"].shape[3], x["v"].shape[3],
                seed=99, gate_scale=5.0)
    late["v"] = late["v"] * 3
    y = {n: (v if n == "h0" else torch.cat([v[:, :t + 1], late[n][:, t + 1:]], dim=1)) for n, v in x.items()}
    if "g" in y and kw.get("use_gate_in_kernel"):  # raw gate inputs: large late values drive the gate to its bound
        y["g"] = torch.cat([x["g"][:, :t + 1], late["g"][:, t + 1:] * 40], dim=1)
    o, _ = run(variant, x, backend, **kw)
    oy, _ = run(variant, y, backend, **kw)
    assert torch.isfinite(oy).all()
    assert torch.equal(o[:, :t + 1], oy[:, :t + 1]), \
        f"outputs up to token {t} changed with later inputs: max diff {(o[:, :t + 1] - oy[:, :t + 1]).abs().max():.3e}"


@PROPERTY
@given(variant=st.sampled_from(VARIANTS), T=st.integers(2, 40), data=st.data())
def test_causality_torch(variant, T, data):
    t = data.draw(st.integers(0, T - 2), label="t")
    check_causality(variant, make(variant, 1, T, 1, 2, 16, 8, seed=T), t, "torch")


def _safe_gate_inputs(variant: str, T: int) -> tuple[dict, dict]:
    x = make(variant, 1, T, 1, 1, 16, 16, seed=21)
    x["g"] = torch.randn(x["g"].shape, generator=torch.Generator().manual_seed(22))  # raw gate input
    gen = torch.Generator().manual_seed(23)
    kw = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=torch.randn(1, generator=gen),
              dt_bias=torch.randn(16, generator=gen))
    return x, kw


@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_causality_with_safe_gate_torch(variant):
    x, kw = _safe_gate_inputs(variant, 40)
    for t in (0, 7, 15, 16, 30):
        check_causality(variant, x, t, "torch", **kw)


@pytest.mark.interpret
def test_causality_with_safe_gate_triton():
    x, kw = _safe_gate_inputs("kda", 24)
    check_causality("kda", x, 9, "triton", **kw)  # mid-chunk: the rest of the chunk and the next one change


# --- GDN-2 with b = w = beta is KDA --------------------------------------------------------------

def check_gdn2_is_kda(backend: str, recurrent: bool, HV: int = 2) -> None:
    x = make("kda", 1, 22, 1, HV, 16, 8, seed=31)
    K, V = 16, 8
    beta = x["beta"]
    y = {n: t for n, t in x.items() if n != "beta"}
    y["b"], y["w"] = beta[..., None].expand(-1, -1, -1, K), beta[..., None].expand(-1, -1, -1, V)
    o, s = run("kda", x, backend, recurrent=recurrent)
    o2, s2 = run("gdn2", y, backend, recurrent=recurrent)
    assert_close("o", o2, o)
    assert_close("final_state", s2, s)


@pytest.mark.parametrize("recurrent", [False, True])
def test_gdn2_with_equal_gates_is_kda_torch(recurrent):
    check_gdn2_is_kda("torch", recurrent)


@pytest.mark.interpret
def test_gdn2_with_equal_gates_is_kda_triton():
    check_gdn2_is_kda("triton", recurrent=False, HV=1)


# --- zero-padded head dims change nothing --------------------------------------------------------

def check_padding(variant: str, backend: str, K: int = 20, V: int = 12, KP: int = 32, VP: int = 16,
                  HV: int = 2, **kw) -> None:
    """q, k, gates and state padded from K to KP, v and w from V to VP (zeros; g padded with 0)."""
    x = make(variant, 1, 19, 1, HV, K, V, seed=41)
    pad = {}
    for n, t in x.items():
        if n in ("q", "k") or (n in ("g", "b") and t.dim() == 4):
            pad[n] = torch.nn.functional.pad(t, (0, KP - K))
        elif n in ("v", "w"):
            pad[n] = torch.nn.functional.pad(t, (0, VP - V))
        elif n == "h0":
            pad[n] = torch.nn.functional.pad(t, (0, VP - V, 0, KP - K))
        else:
            pad[n] = t
    o, s = run(variant, x, backend, scale=K ** -0.5, **kw)
    op, sp = run(variant, pad, backend, scale=K ** -0.5, **kw)
    assert_close("o", op[..., :V], o)
    assert_close("final_state", sp[..., :K, :V], s)
    assert torch.equal(op[..., V:], torch.zeros_like(op[..., V:])), "padded value channels of o are not zero"
    assert torch.equal(sp[..., K:, :], torch.zeros_like(sp[..., K:, :])), "padded key rows of the state"
    assert torch.equal(sp[..., V:], torch.zeros_like(sp[..., V:])), "padded value columns of the state"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("l2", [False, True])
def test_zero_padded_head_dims_change_nothing_torch(variant, l2):
    check_padding(variant, "torch", use_qk_l2norm_in_kernel=l2)


@pytest.mark.interpret
def test_zero_padded_head_dims_change_nothing_triton():
    check_padding("gdn2", "triton", HV=1, use_qk_l2norm_in_kernel=True)
