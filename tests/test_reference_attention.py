"""attention_ref, the oracle of Prism attention, against independent PyTorch formulations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lamina.reference.attention import attention_ref


def _qkv(b, t, s, h, hk, d, dtype=torch.float64):
    return (torch.randn(b, t, h, d, dtype=dtype), torch.randn(b, s, hk, d, dtype=dtype),
            torch.randn(b, s, hk, d, dtype=dtype))


def _sdpa(q, k, v, causal, mask=None):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, is_causal=causal and mask is None)
    return out.transpose(1, 2)


@pytest.mark.parametrize("causal", [True, False])
def test_matches_sdpa_when_lengths_equal(causal):
    q, k, v = _qkv(2, 37, 37, 3, 3, 40)
    torch.testing.assert_close(attention_ref(q, k, v, causal=causal), _sdpa(q, k, v, causal))


@pytest.mark.parametrize("t, s", [(20, 50), (50, 45)])
def test_causal_is_aligned_bottom_right(t, s):
    q, k, v = _qkv(1, t, s, 2, 2, 24)
    i = torch.arange(t)[:, None]
    j = torch.arange(s)[None, :]
    visible = j <= i + (s - t)
    expected = _sdpa(q, k, v, True, mask=visible)
    rows = visible.any(dim=1)  # SDPA gives NaN for rows without a visible key
    out = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out[:, rows], expected[:, rows])


def test_rows_without_keys_give_zero_and_minus_inf_lse():
    q, k, v = _qkv(1, 30, 10, 2, 1, 16)
    out, lse = attention_ref(q, k, v, causal=True, return_lse=True)
    empty = torch.arange(30) + (10 - 30) < 0
    assert empty.sum() == 20
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.isneginf(lse[..., empty]).all() and torch.isfinite(lse[..., ~empty]).all()


def test_lse_is_logsumexp_of_scaled_scores():
    q, k, v = _qkv(2, 12, 17, 2, 2, 32)
    _, lse = attention_ref(q, k, v, causal=False, scale=0.3, return_lse=True)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * 0.3
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))


def test_gqa_equals_repeated_kv_heads():
    q, k, v = _qkv(2, 19, 23, 6, 2, 24)
    rep = lambda x: x.repeat_interleave(3, dim=2)
    torch.testing.assert_close(attention_ref(q, k, v, causal=True), attention_ref(q, rep(k), rep(v), causal=True))


def test_varlen_equals_separate_sequences():
    lens_q, lens_k = [5, 0, 17, 9], [8, 4, 11, 9]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()])
    q, k, v = _qkv(1, sum(lens_q), sum(lens_k), 4, 2, 16)
    out, lse = attention_ref(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    for n in range(len(lens_q)):
        sq, sk = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        o_n, l_n = attention_ref(q[:, sq], k[:, sk], v[:, sk], causal=True, return_lse=True)
        torch.testing.assert_close(out[:, sq], o_n)
        torch.testing.assert_close(lse[..., sq], l_n)


def test_computes_in_the_input_dtype():
    q, k, v = _qkv(1, 64, 64, 2, 2, 64)
    ref = attention_ref(q, k, v)
    low = attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert low.dtype == torch.bfloat16
    err = (low.double() - ref).abs().max().item()
    # bf16 keeps 8 bits: a bf16 computation is visibly off, but by no more than a few percent.
    assert 1e-4 < err < 0.1


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window_size, softcap", [((-1, -1), 0.0), ((2, 1), 0.0), ((-1, -1), 3.0)])
@pytest.mark.parametrize("varlen", [False, True])
def test_grads_ref_equals_autograd_of_the_oracle(causal, window_size, softcap, varlen):
    # FlashAttention's backward formulas written out (P from the log-sum-exp, dS = P (dP - rowsum(dO O)))
    # against autograd through attention_ref, in float64; GQA folds dk and dv over the query heads; a row
    # without a visible key (causal, 9 queries on 4 keys) gives nothing
    from lamina.reference.attention import attention_grads_ref

    q, k, v = _qkv(1 if varlen else 2, 9, 4 if not varlen else 9, 4, 2, 16)
    cu = dict(cu_seqlens_q=torch.tensor([0, 3, 9]), cu_seqlens_k=torch.tensor([0, 5, 9])) if varlen else {}
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    kw = dict(causal=causal, window_size=window_size, softcap=softcap, **cu)
    o = attention_ref(*leaves, **kw)
    do = torch.randn_like(o)
    expected = torch.autograd.grad(o, leaves, do)
    for name, got, want in zip("qkv", attention_grads_ref(q, k, v, do, **kw), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"d{name}")
