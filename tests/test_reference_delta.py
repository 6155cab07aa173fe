"""The delta-rule references: the chunked form against the token loop, dtypes, wrappers, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lamina.reference.delta_rule import (
    delta_rule_family_chunk_ref,
    delta_rule_family_recurrent_ref,
    delta_rule_ref,
    gated_delta_rule_ref,
    gdn2_ref,
    kda_ref,
)
from tests.tolerances import assert_close

F64 = torch.float64
TOKEN_ARGS = ("q", "k", "v", "g", "erase", "write")


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """These shapes are too small to gain from intra-op threads, and under ``pytest -n 2`` on two
    cores the spinning OpenMP threads of both workers slowed each test down 10-40x (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_inputs(
    T: int,
    decay: str | None,
    erase: str | None,
    write: str | None,
    B: int = 2,
    H: int = 2,
    HV: int | None = None,
    K: int = 32,
    V: int = 32,
    g_max: float = 2.0,
    beta: float | None = None,
    initial_state: bool = True,
    seqlens: list[int] | None = None,
    dtype: torch.dtype = F64,
) -> dict:
    """Random inputs of the family. decay: None / "head" / "channel"; erase, write: None / "head" / "channel".

    Keys are L2-normalised and gates lie in [0, 1], so the recurrence is a contraction.
    ``g_max``: log decays drawn from -U(0, g_max) (0 gives a present but zero decay).
    ``beta``: a constant for both gates instead of U(0, 1). ``seqlens``: packed varlen (B must be 1).
    """
    HV = HV or H
    if seqlens is not None:
        B, T = 1, sum(seqlens)
    N = B if seqlens is None else len(seqlens)
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, dtype=F64), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, dtype=dtype)

    def gate(kind: str | None, width: int) -> torch.Tensor | None:
        if kind is None:
            return None
        shape = (B, T, HV) if kind == "head" else (B, T, HV, width)
        return torch.full(shape, beta, dtype=dtype) if beta is not None else torch.rand(shape, dtype=dtype)

    g = None
    if decay is not None:
        g = -g_max * torch.rand((B, T, HV) if decay == "head" else (B, T, HV, K), dtype=dtype)
    out = dict(q=q, k=k, v=v, g=g, erase=gate(erase, K), write=gate(write, V))
    out["initial_state"] = torch.randn(N, HV, K, V, dtype=dtype) if initial_state else None
    out["cu_seqlens"] = None
    if seqlens is not None:
        out["cu_seqlens"] = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    return out


def check_chunk_matches_recurrent(inputs: dict, chunk_size: int, dtype: torch.dtype = F64) -> None:
    o_ref, s_ref = delta_rule_family_recurrent_ref(**inputs, output_final_state=True)
    o, s = delta_rule_family_chunk_ref(**inputs, output_final_state=True, chunk_size=chunk_size)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert_close("o", o, o_ref, dtype=dtype)
    assert_close("final_state", s, s_ref, dtype=dtype)


VARIANTS = [
    # (decay, erase, write): DeltaNet, Gated DeltaNet, KDA, GDN-2, and the mixed combinations.
    (None, "head", "head"),
    (None, None, None),
    (None, "channel", "channel"),
    ("head", "head", "head"),
    ("head", "channel", "head"),
    ("head", "head", "channel"),
    ("channel", "head", "head"),
    ("channel", "channel", "channel"),
    ("channel", None, "channel"),
]


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("decay,erase,write", VARIANTS)
def test_chunk_matches_recurrent_variants(decay, erase, write, chunk_size):
    check_chunk_matches_recurrent(make_inputs(100, decay, erase, write), chunk_size)


SHAPES = {
    # name: (make_inputs kwargs, chunk size)
    "T=1": (dict(T=1), 16),
    "T<chunk": (dict(T=10), 32),
    "T=2 chunks exactly": (dict(T=64), 32),
    "ragged last chunk": (dict(T=77), 16),
    "K=48,V=96": (dict(T=40, K=48, V=96), 16),
    "K=96,V=48": (dict(T=40, K=96, V=48), 32),
    "K!=V small": (dict(T=33, K=8, V=24), 16),
    "GVA H=2 HV=4": (dict(T=50, H=2, HV=4), 16),
    "no initial state": (dict(T=50, initial_state=False), 32),
    "varlen 3 seqs": (dict(T=0, seqlens=[37, 13, 64]), 32),
    "varlen GVA empty seq": (dict(T=0, seqlens=[20, 0, 45], H=1, HV=2), 16),
    "strong decay": (dict(T=96, g_max=8.0), 32),
    "zero decay": (dict(T=70, g_max=0.0), 32),
    "beta 0": (dict(T=50, beta=0.0), 16),
    "beta 1": (dict(T=50, beta=1.0), 16),
    "chunk 48 (not a power of 2)": (dict(T=100), 48),
}


@pytest.mark.parametrize("decay", [None, "head", "channel"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_chunk_matches_recurrent_shapes(name, decay):
    kwargs, chunk_size = SHAPES[name]
    erase = write = "channel" if decay == "channel" else "head"
    check_chunk_matches_recurrent(make_inputs(decay=decay, erase=erase, write=write, **kwargs), chunk_size)


def test_varlen_equals_separate_sequences():
    """Each packed sequence gives what it gives alone, from its own initial state."""
    inputs = make_inputs(0, "channel", "channel", "channel", seqlens=[37, 13, 64])
    o, s = delta_rule_family_chunk_ref(**inputs, output_final_state=True, chunk_size=32)
    bounds = inputs["cu_seqlens"].tolist()
    for n in range(3):
        span = slice(bounds[n], bounds[n + 1])
        alone = {key: None if inputs[key] is None else inputs[key][:, span] for key in TOKEN_ARGS}
        o_n, s_n = delta_rule_family_recurrent_ref(
            **alone, initial_state=inputs["initial_state"][n : n + 1], output_final_state=True
        )
        assert_close(f"o[seq {n}]", o[:, span], o_n)
        assert_close(f"final_state[seq {n}]", s[n : n + 1], s_n)


@pytest.mark.parametrize("decay", ["head", "channel"])
def test_chunk_float32_close_to_float64(decay):
    """The float32 chunk path against the float64 token loop on the same inputs (float32 row)."""
    inputs = make_inputs(256, decay, "channel", "channel", B=1, g_max=4.0, dtype=torch.float32)
    o32, s32 = delta_rule_family_chunk_ref(**inputs, output_final_state=True)
    assert o32.dtype == torch.float32 and s32.dtype == torch.float32
    as64 = {key: None if x is None or key == "cu_seqlens" else x.double() for key, x in inputs.items()}
    o64, s64 = delta_rule_family_recurrent_ref(**as64, output_final_state=True)
    assert_close("o", o32, o64)
    assert_close("final_state", s32, s64)


def test_scale_argument():
    inputs = make_inputs(20, "head", "head", "head")
    o_half, _ = delta_rule_family_recurrent_ref(**inputs, scale=0.5)
    o_one, _ = delta_rule_family_recurrent_ref(**inputs, scale=1.0)
    assert_close("o(scale) is linear in scale", o_half, 0.5 * o_one)
    o_default, _ = delta_rule_family_chunk_ref(**inputs)
    o_explicit, _ = delta_rule_family_chunk_ref(**inputs, scale=32**-0.5)
    assert_close("default scale is K ** -0.5", o_default, o_explicit)


def test_one_token_by_hand():
    """One token from S0: S1 = exp(g) S0 + k (w v - (exp(g) S0)^T (b k))^T, o = S1^T (scale q)."""
    inputs = make_inputs(1, "channel", "channel", "channel", B=1, H=1, K=4, V=3)
    q, k, v, g, b, w = (inputs[key][0, 0, 0] for key in TOKEN_ARGS)
    s0 = inputs["initial_state"][0, 0]
    decayed = g.exp()[:, None] * s0
    s1 = decayed + torch.outer(k, w * v - decayed.T @ (b * k))
    expected = s1.T @ (q * 4**-0.5)
    for fn in (delta_rule_family_recurrent_ref, delta_rule_family_chunk_ref):
        o, s = fn(**inputs, output_final_state=True)
        assert_close(f"{fn.__name__} o", o[0, 0, 0], expected)
        assert_close(f"{fn.__name__} state", s[0, 0], s1)


@pytest.mark.parametrize("fn", [delta_rule_family_recurrent_ref, delta_rule_family_chunk_ref])
def test_output_dtypes(fn):
    inputs = make_inputs(20, "channel", "head", "head", dtype=torch.bfloat16)
    o, s = fn(**inputs, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert fn(**inputs)[1] is None
    inputs = make_inputs(20, "channel", "head", "head", dtype=torch.float32)
    inputs["g"] = inputs["g"].double()  # any float64 input switches the computation to float64
    o, s = fn(**inputs, output_final_state=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float64


WRAPPERS = {
    "delta_rule_ref": (delta_rule_ref, None, "head", "head"),
    "gated_delta_rule_ref": (gated_delta_rule_ref, "head", "head", "head"),
    "kda_ref": (kda_ref, "channel", "head", "head"),
    "gdn2_ref": (gdn2_ref, "channel", "channel", "channel"),
}


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_wrappers(name):
    fn, decay, erase, write = WRAPPERS[name]
    inputs = make_inputs(0, decay, erase, write, seqlens=[30, 41], H=1, HV=2)
    if name == "gdn2_ref":
        gates = (inputs["g"], inputs["erase"], inputs["write"])
    else:
        inputs["write"] = inputs["erase"]  # one beta for both gates
        gates = (inputs["erase"],) if decay is None else (inputs["g"], inputs["erase"])
    rest = dict(initial_state=inputs["initial_state"], output_final_state=True, cu_seqlens=inputs["cu_seqlens"])
    o_ref, s_ref = delta_rule_family_recurrent_ref(**inputs, output_final_state=True)
    for chunked in (False, True):
        o, s = fn(inputs["q"], inputs["k"], inputs["v"], *gates, **rest, chunked=chunked)
        assert_close(f"{name}(chunked={chunked}) o", o, o_ref)
        assert_close(f"{name}(chunked={chunked}) final_state", s, s_ref)


BAD_INPUTS = {
    "k shape": (lambda d: d.update(k=d["k"][:, :, :, :-1]), "k must have shape"),
    "v length": (lambda d: d.update(v=d["v"][:, :-1]), "v must have batch and length"),
    "v heads": (lambda d: d.update(v=torch.randn(2, 10, 3, 8, dtype=F64)), "multiple of q's"),
    "q ndim": (lambda d: d.update(q=d["q"][0]), "q must have 4 dimensions"),
    "g width": (lambda d: d.update(g=torch.zeros(2, 10, 2, 5, dtype=F64)), "g must have shape"),
    "erase width": (lambda d: d.update(erase=torch.zeros(2, 10, 2, 8 + 1, dtype=F64)), "erase must have shape"),
    "write width": (lambda d: d.update(write=torch.zeros(2, 10, 2, 4, dtype=F64)), "write must have shape"),
    "initial_state": (lambda d: d.update(initial_state=torch.zeros(3, 2, 8, 8, dtype=F64)), "initial_state must"),
    "cu_seqlens with B=2": (lambda d: d.update(cu_seqlens=torch.tensor([0, 10])), "batch size 1"),
    "cu_seqlens end": (
        lambda d: d.update(cu_seqlens=torch.tensor([0, 4]), initial_state=None, **{x: d[x][:1] for x in TOKEN_ARGS}),
        "must end at",
    ),
}


@pytest.mark.parametrize("fn", [delta_rule_family_recurrent_ref, delta_rule_family_chunk_ref])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_shapes_raise(case, fn):
    inputs = make_inputs(10, "channel", "head", "channel", K=8, V=8)
    fn(**inputs)  # the unmodified inputs are accepted
    mutate, message = BAD_INPUTS[case]
    mutate(inputs)
    with pytest.raises(ValueError, match=message):
        fn(**inputs)


def test_bad_arguments_raise():
    inputs = make_inputs(10, "channel", "head", "head", K=8, V=8)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        delta_rule_family_recurrent_ref(**{**inputs, "q": inputs["q"].tolist()})
    with pytest.raises(ValueError, match="chunk_size"):
        delta_rule_family_chunk_ref(**inputs, chunk_size=0)
    q, k, v, g, beta = inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["erase"]
    with pytest.raises(ValueError, match="g must be"):
        gated_delta_rule_ref(q, k, v, g, beta)
    with pytest.raises(ValueError, match="g must be"):
        kda_ref(q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError, match="beta must be"):
        delta_rule_ref(q, k, v, g)
