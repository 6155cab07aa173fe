"""attention_distance: blockwise online softmax against a naive T x S computation."""

from __future__ import annotations

import math

import pytest
import torch
from einops import repeat

from lamina.diagnostics import attention_distance
from tests.tolerances import assert_close


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """pytest-xdist already runs one worker per core; intra-op threads on top of that oversubscribe the
    cores and make the many small block ops of the T = 8192 case wait on descheduled threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def naive_attention_distance(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None = None):
    """Materialise the [B, H, T, S] probabilities and the |pos_i - j| matrix (float64)."""
    B, T, H, D = q.shape
    S, HKV = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kk = repeat(k.double(), "b s hk d -> b s (hk g) d", g=H // HKV)
    scores = torch.einsum("bthd,bshd->bhts", q.double() * scale, kk)
    q_pos = torch.arange(T, dtype=torch.float64) + (S - T)
    k_pos = torch.arange(S, dtype=torch.float64)
    if causal:
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], -math.inf)
    p = scores.softmax(dim=-1)
    dist = (q_pos[:, None] - k_pos[None, :]).abs()
    return (p * dist).sum(-1).mean(-1)


BLOCKWISE_CASES = [
    # (causal, T, S, H, HKV)
    (True, 300, 300, 2, 2),
    (False, 300, 300, 2, 2),
    (True, 300, 300, 4, 2),  # GQA
    (False, 300, 300, 4, 2),
    (True, 120, 300, 2, 1),  # T < S: queries aligned to the last keys
    (False, 120, 300, 2, 1),
    (False, 300, 130, 2, 2),  # T > S, only without the causal mask
]


@pytest.mark.parametrize("causal,T,S,H,HKV", BLOCKWISE_CASES)
def test_blockwise_matches_naive(causal, T, S, H, HKV):
    q = torch.randn(2, T, H, 16, dtype=torch.float64) * 2.0  # sharper than unit scores: a mix of ranges
    k = torch.randn(2, S, HKV, 16, dtype=torch.float64)
    got = attention_distance(q, k, causal=causal, block_size=64)
    want = naive_attention_distance(q, k, causal)
    assert got.shape == (2, H) and got.dtype == torch.float64
    assert_close("attention_distance", got, want, kind="elementwise")


def test_float32_inputs_and_scale():
    q = torch.randn(1, 200, 3, 24)
    k = torch.randn(1, 200, 3, 24)
    got = attention_distance(q, k, causal=True, scale=0.5, block_size=48)
    assert got.dtype == torch.float32
    want = naive_attention_distance(q, k, True, scale=0.5)
    assert_close("attention_distance fp32", got, want.float(), kind="elementwise")


@pytest.mark.parametrize("block_size", [1, 7, 64, 1000])
def test_block_size_does_not_change_the_result(block_size):
    q = torch.randn(1, 50, 2, 8, dtype=torch.float64)
    k = torch.randn(1, 50, 2, 8, dtype=torch.float64)
    ref = naive_attention_distance(q, k, True)
    assert_close(f"block {block_size}", attention_distance(q, k, block_size=block_size), ref, kind="elementwise")


def test_uniform_attention_has_closed_form():
    # q = 0 gives uniform attention: causal query i averages |i - j| over j <= i, i.e. i / 2;
    # the mean over queries is (T - 1) / 4. Non-causal: mean over i, j of |i - j| = (T^2 - 1) / (3 T).
    T = 257
    q = torch.zeros(1, T, 2, 8, dtype=torch.float64)
    k = torch.randn(1, T, 2, 8, dtype=torch.float64)
    causal = attention_distance(q, k, causal=True, block_size=32)
    full = attention_distance(q, k, causal=False, block_size=32)
    assert_close("uniform causal", causal, torch.full((1, 2), (T - 1) / 4, dtype=torch.float64), kind="elementwise")
    want_full = torch.full((1, 2), (T * T - 1) / (3 * T), dtype=torch.float64)
    assert_close("uniform non-causal", full, want_full, kind="elementwise")


def test_local_heads_have_small_distance():
    # Keys equal to the queries with a large scale: every query attends to itself, distance ~ 0.
    T = 64
    x = torch.nn.functional.normalize(torch.randn(1, T, 1, 32, dtype=torch.float64), dim=-1)
    d = attention_distance(x, x, causal=False, scale=200.0, block_size=16)
    assert d.item() < 1e-3
    # A head that looks only at the first token: query i at distance i, mean (T - 1) / 2.
    k = torch.zeros(1, T, 1, 32, dtype=torch.float64)
    k[0, 0, 0, 0] = 1.0
    q = torch.zeros(1, T, 1, 32, dtype=torch.float64)
    q[..., 0] = 1.0
    d = attention_distance(q, k, causal=True, scale=500.0, block_size=16)
    assert abs(d.item() - (T - 1) / 2) < 1e-6


def test_long_sequence_runs_blockwise():
    # T = 8192 with small H and D: blockwise memory is B * H * block^2, never T x T (which would be
    # 256 MiB per head in float32). Uniform attention (q = 0) gives the exact answer (T - 1) / 4.
    T = 8192
    q = torch.zeros(1, T, 2, 8)
    q[:, :, 1] = torch.randn(T, 8) * 0.1  # second head: near-uniform, distance close to (T - 1) / 4
    k = torch.randn(1, T, 1, 8)
    d = attention_distance(q, k, causal=True, block_size=512)
    assert d.shape == (1, 2)
    assert_close("T=8192 uniform head", d[:, 0], torch.tensor([(T - 1) / 4]), kind="elementwise")
    assert torch.isfinite(d).all()
    assert abs(d[0, 1].item() - (T - 1) / 4) < 0.05 * T


@pytest.mark.parametrize(
    "q_shape,k_shape,kwargs,exc,pattern",
    [
        ((1, 8, 2, 4), (1, 8, 2, 4), dict(block_size=0), ValueError, "block_size must be a positive int"),
        ((1, 8, 2, 4), (1, 8, 2, 5), {}, ValueError, r"k must have shape \[B=1, S, HKV, D=4\]"),
        ((1, 8, 2, 4), (2, 8, 2, 4), {}, ValueError, r"k must have shape \[B=1"),
        ((1, 8, 3, 4), (1, 8, 2, 4), {}, ValueError, "HKV must divide the query heads H=3"),
        ((1, 8, 2, 4), (1, 4, 2, 4), {}, ValueError, "causal attention_distance needs S >= T"),
        ((1, 8, 2), (1, 8, 2, 4), {}, ValueError, "q must have 4 dimensions"),
    ],
)
def test_bad_inputs(q_shape, k_shape, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        attention_distance(torch.randn(q_shape), torch.randn(k_shape), **kwargs)


def test_non_tensor_input():
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        attention_distance([[1.0]], torch.randn(1, 2, 1, 4))


def test_integer_input_rejected():
    with pytest.raises(ValueError, match="k must have dtype"):
        attention_distance(torch.randn(1, 2, 1, 4), torch.ones(1, 2, 1, 4, dtype=torch.int64))


def test_gqa_heads_share_keys_in_order():
    # Query heads 0 and 1 share key head 0, heads 2 and 3 share key head 1 (h // group).
    q = repeat(torch.randn(1, 50, 8, dtype=torch.float64), "b t d -> b t h d", h=4)
    k = torch.randn(1, 50, 2, 8, dtype=torch.float64)
    d = attention_distance(q.contiguous(), k, causal=True, block_size=16)
    per_key_head = attention_distance(q[:, :, :2].contiguous(), k, causal=True, block_size=16)
    assert_close("gqa", d[:, ::2], per_key_head, kind="elementwise")
    assert not torch.allclose(d[:, 0], d[:, 2])
