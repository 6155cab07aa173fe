"""prism_attention: validation at the boundary and the CPU PyTorch path (incl. gradcheck, compile)."""

from __future__ import annotations

import pytest
import torch

from lamina import prism_attention
from lamina.reference.attention import attention_ref
from tests.tolerances import assert_attention_close, assert_close


def _qkv(b, t, s, h, hk, d, dtype=torch.float32, grad=False):
    out = (torch.randn(b, t, h, d, dtype=dtype), torch.randn(b, s, hk, d, dtype=dtype),
           torch.randn(b, s, hk, d, dtype=dtype))
    return tuple(x.requires_grad_(grad) for x in out)


def _cu(*lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def _bad_cases():
    q, k, v = _qkv(1, 8, 8, 4, 2, 32)
    q2, k2, v2 = _qkv(2, 8, 8, 4, 2, 32)
    cases = {
        "D not a multiple of 8": (dict(q=q[..., :30], k=k[..., :30], v=v[..., :30]), "q"),
        "D < 16": (dict(q=q[..., :8], k=k[..., :8], v=v[..., :8]), "q"),
        "D > 512": (dict(q=torch.randn(1, 8, 4, 520), k=torch.randn(1, 8, 2, 520),
                         v=torch.randn(1, 8, 2, 520)), "q"),
        "H % HKV != 0": (dict(q=q[:, :, :3], k=k, v=v), "k"),
        "mismatched B": (dict(q=q2, k=k, v=v), "k"),
        "mismatched D": (dict(q=q, k=k[..., :16], v=v[..., :16]), "k"),
        "v shape": (dict(q=q, k=k, v=v[:, :4]), "v"),
        "dtype mismatch": (dict(q=q, k=k.half(), v=v), "k"),
        "bad dtype": (dict(q=q.int(), k=k, v=v), "q"),
        "not 4-d": (dict(q=q[0], k=k, v=v), "q"),
        "cu lengths differ": (dict(q=q, k=k, v=v, cu_seqlens_q=_cu(4, 4), cu_seqlens_k=_cu(2, 2, 4)),
                              "cu_seqlens_k"),
        "cu not at 0": (dict(q=q, k=k, v=v, cu_seqlens_q=torch.tensor([1, 8], dtype=torch.int32),
                             cu_seqlens_k=_cu(8)), "cu_seqlens_q"),
        "cu decreasing": (dict(q=q, k=k, v=v, cu_seqlens_q=_cu(4, 4),
                               cu_seqlens_k=torch.tensor([0, 6, 4, 8], dtype=torch.int32)), "cu_seqlens_k"),
        "cu last != total": (dict(q=q, k=k, v=v, cu_seqlens_q=_cu(4, 3), cu_seqlens_k=_cu(4, 4)),
                             "cu_seqlens_q"),
        "cu with B != 1": (dict(q=q2, k=k2, v=v2, cu_seqlens_q=_cu(8), cu_seqlens_k=_cu(8)), "cu_seqlens_q"),
        "only one cu": (dict(q=q, k=k, v=v, cu_seqlens_q=_cu(8)), "cu_seqlens_k"),
        "cu float": (dict(q=q, k=k, v=v, cu_seqlens_q=_cu(8).float(), cu_seqlens_k=_cu(8)), "cu_seqlens_q"),
        "max_seqlen too small": (dict(q=q, k=k, v=v, cu_seqlens_q=_cu(3, 5), cu_seqlens_k=_cu(4, 4),
                                      max_seqlen_q=4), "max_seqlen_q"),
        "unknown backend": (dict(q=q, k=k, v=v, backend="cudnn"), "backend"),
        "cuda backend": (dict(q=q, k=k, v=v, backend="cuda"), "backend"),
        "device mismatch": (dict(q=q, k=k.to("meta"), v=v), "k"),
    }
    return cases


_CASES = _bad_cases()


@pytest.mark.parametrize("case", sorted(_CASES))
def test_bad_input_raises_naming_the_argument(case):
    kwargs, name = _CASES[case]
    with pytest.raises((ValueError, TypeError)) as info:
        prism_attention(**kwargs)
    assert name in str(info.value), str(info.value)


def test_non_float_scale_is_a_type_error():
    q, k, v = _qkv(1, 8, 8, 2, 2, 16)
    with pytest.raises(TypeError, match="scale"):
        prism_attention(q, k, v, scale="0.1")


# ---------------------------------------------------------------------------------------------
# PyTorch path (CPU default)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "d, t, s, h, hk, causal",
    [(16, 40, 40, 2, 1, True), (96, 30, 70, 4, 2, True), (192, 70, 30, 2, 2, True),
     (320, 33, 47, 2, 1, False), (512, 24, 40, 2, 2, True)],
)
def test_torch_path_matches_reference_float64(d, t, s, h, hk, causal):
    q, k, v = _qkv(2, t, s, h, hk, d, torch.float64, grad=True)
    do = torch.randn(2, t, h, d, dtype=torch.float64)
    dlse = torch.randn(2, h, t, dtype=torch.float64)
    o, lse = prism_attention(q, k, v, causal=causal, return_lse=True, backend="torch")
    grads = torch.autograd.grad((o, lse), (q, k, v), (do, dlse.float()))
    o_ref, lse_ref = attention_ref(q, k, v, causal=causal, return_lse=True)
    grads_ref = torch.autograd.grad((o_ref, lse_ref), (q, k, v), (do, dlse))
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref.float())
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_path_low_precision_within_attention_bound(dtype):
    q, k, v = _qkv(1, 64, 80, 4, 2, 128, torch.float64)
    do = torch.randn(1, 64, 4, 128, dtype=torch.float64)
    low = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    ref = [x.to(dtype).double().requires_grad_() for x in (q, k, v)]
    ref_low = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    o = prism_attention(*low, causal=True, backend="torch")
    o_ref = attention_ref(*ref, causal=True)
    o_low = attention_ref(*ref_low, causal=True)
    assert o.dtype == dtype
    assert_attention_close("o", o, o_ref, o_low)
    g = torch.autograd.grad(o, low, do.to(dtype))
    g_ref = torch.autograd.grad(o_ref, ref, do)
    g_low = torch.autograd.grad(o_low, ref_low, do.to(dtype))
    for name, a, r, p in zip(("dq", "dk", "dv"), g, g_ref, g_low):
        assert_attention_close(name, a, r, p, grad=True)


def test_torch_path_varlen_and_empty_rows():
    cu_q, cu_k = _cu(10, 25, 7), _cu(20, 5, 0)
    q, k, v = _qkv(1, 42, 25, 2, 1, 48, torch.float64, grad=True)
    o, lse = prism_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True, backend="torch")
    o_ref, lse_ref = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    torch.testing.assert_close(o, o_ref)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    assert torch.isneginf(lse[..., 35:]).all()  # the third sequence has no keys
    assert torch.isneginf(lse[..., 10:30]).all()  # causal, 25 queries on 5 keys: the first 20 see none
    assert torch.equal(o[:, 35:], torch.zeros_like(o[:, 35:]))
    (o * torch.randn_like(o)).sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_torch_path_gradcheck_float64():
    q, k, v = _qkv(1, 6, 9, 2, 1, 16, torch.float64, grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: prism_attention(a, b, c, causal=True, backend="torch"),
                                    (q, k, v))


@pytest.mark.parametrize("causal", [True, False])
def test_torch_path_window_and_softcap_float64(causal):
    """The CPU path's blockwise form with FlashAttention's window and softcap equals the reference in float64
    (forward, lse and gradients, GQA, T < S and T > S, varlen), and gradcheck holds."""
    from lamina.reference import attention_ref

    for t, s, window, softcap in ((9, 14, (3, -1), 2.0), (14, 9, (2, 4), 0.0), (12, 12, (-1, 1), 5.0)):
        q, k, v = _qkv(2, t, s, 4, 2, 16, torch.float64, grad=True)
        kw = dict(causal=causal, window_size=window, softcap=softcap, return_lse=True)
        o, lse = prism_attention(q, k, v, backend="torch", **kw)
        ro, rlse = attention_ref(q, k, v, **kw)
        torch.testing.assert_close(o, ro, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, rlse.float(), rtol=1e-6, atol=1e-6)
        grads = torch.autograd.grad(o.square().sum(), (q, k, v))
        refs = torch.autograd.grad(ro.square().sum(), (q, k, v))
        for a, b in zip(grads, refs):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    cu_q, cu_k = torch.tensor([0, 5, 12]), torch.tensor([0, 8, 14])
    q, k, v = _qkv(1, 12, 14, 2, 1, 16, torch.float64, grad=True)
    kw = dict(causal=causal, window_size=(2, 1), softcap=3.0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(prism_attention(q, k, v, backend="torch", **kw), attention_ref(q, k, v, **kw))
    q, k, v = _qkv(1, 6, 9, 2, 1, 16, torch.float64, grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: prism_attention(a, b, c, causal=causal, backend="torch",
                                                                     window_size=(2, -1), softcap=1.5), (q, k, v))


def test_window_and_softcap_change_the_result():
    """A window and a cap each change what plain attention gives (the options reach the computation)."""
    q, k, v = _qkv(1, 16, 16, 2, 2, 16, torch.float64)
    plain = prism_attention(q, k, v, causal=True, backend="torch")
    assert not torch.allclose(prism_attention(q, k, v, causal=True, backend="torch", window_size=(3, -1)), plain)
    assert not torch.allclose(prism_attention(q, k, v, causal=True, backend="torch", softcap=0.5), plain)
    # a window wider than the sequence is no window
    torch.testing.assert_close(prism_attention(q, k, v, causal=True, backend="torch", window_size=(16, 16)), plain)


@pytest.mark.versions
def test_torch_compile_fullgraph_torch_backend():
    q, k, v = _qkv(2, 24, 40, 4, 2, 64, grad=True)
    fn = lambda a, b, c: prism_attention(a, b, c, causal=True, backend="torch")
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    o = compiled(q, k, v)
    torch.testing.assert_close(o, fn(q, k, v))
    g = torch.autograd.grad(o.sum(), (q, k, v))
    g_ref = torch.autograd.grad(fn(q, k, v).sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("causal, T, S", [(True, 33, 33), (True, 20, 47), (False, 47, 20), (True, 47, 20)])
def test_torch_path_fused_and_blockwise_agree(causal, T, S):
    """Without a window the torch backend may take PyTorch's fused attention; with one, the blockwise path (a
    window wider than both sequences bounds nothing). Both compute in float32 and must agree, lse too (and
    the T > S causal rows with no key stay 0)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, T, 4, 96, generator=gen, dtype=torch.float64)
    k = torch.randn(2, S, 2, 96, generator=gen, dtype=torch.float64)
    v = torch.randn(2, S, 2, 96, generator=gen, dtype=torch.float64)
    fused, lse = prism_attention(q.float(), k.float(), v.float(), causal=causal, return_lse=True, backend="torch")
    wide = (T + S, T + S)
    blockwise, lse_blockwise = prism_attention(q.float(), k.float(), v.float(), causal=causal, return_lse=True,
                                               window_size=wide, backend="torch")
    o_ref, lse_ref = attention_ref(q, k, v, causal=causal, return_lse=True)
    assert_close("o", fused, o_ref, kind="recurrence", dtype=torch.float32)
    assert_close("lse", lse, lse_ref, kind="recurrence", dtype=torch.float32)
    assert_close("o fused vs blockwise", fused, blockwise.double(), kind="recurrence", dtype=torch.float32)
    assert_close("lse fused vs blockwise", lse, lse_blockwise.double(), kind="recurrence", dtype=torch.float32)


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
def test_launch_configs_follow_the_call_options(kernel, monkeypatch):
    """The autotune pruning of each attention kernel keeps, per head-dim bucket, the plain table's configs
    for plain and causal calls and the option table's for calls with a window or softcapping: the configs
    the static report compiles (its registrations read the same ``launch_configs``)."""
    from lamina.kernels import prism_attn_bwd, prism_attn_common, prism_attn_fwd
    from lamina.kernels._utils import registered_aot

    tables = {"fwd": prism_attn_fwd.FWD_TABLES, "dkdv": prism_attn_bwd.DKDV_TABLES,
              "dq": prism_attn_bwd.DQ_TABLES}[kernel]
    monkeypatch.setattr(prism_attn_common, "INTERPRET", False)  # pruning is off under the interpreter
    prune = prism_attn_common.keep_bucket_configs(tables)
    every = prism_attn_common.all_configs(tables)
    assert len({id(c) for c in every}) == len(every)
    for head_dim in (16, 64, 80, 128, 192, 256, 320, 512):
        for causal, window, softcap, plain in [(True, (-1, -1), 0.0, True), (False, (-1, -1), 0.0, True),
                                               (True, (64, -1), 0.0, False), (False, (-1, 3), 0.0, False),
                                               (False, (-1, -1), 5.0, False), (True, (-1, -1), 5.0, False)]:
            flags = prism_attn_common.window_args(causal, window, softcap)[1]
            kept = prune(every, {}, HEAD_DIM=head_dim, CAUSAL=causal, **flags)
            bucket = prism_attn_common.head_dim_bucket(head_dim)
            assert kept == tables[0 if plain else 1][bucket], (head_dim, causal, window, softcap)
    # the static report compiles, for each registered head dim, the option table's configs with the flags on
    name = {"fwd": "prism_attn_fwd", "dkdv": "prism_attn_bwd_dkdv", "dq": "prism_attn_bwd_dq"}[kernel]
    for spec in registered_aot():
        if spec.name != name:
            continue
        options = spec.config.endswith("-window-softcap")
        assert spec.constexprs["SOFTCAP"] is options
        tiles = {k: spec.constexprs[k] for k in ("BLOCK_M", "BLOCK_N")}
        table = tables[int(options)][prism_attn_common.head_dim_bucket(spec.constexprs["HEAD_DIM"])]
        assert any(c.kwargs == tiles and c.num_stages == spec.num_stages for c in table), spec.config
