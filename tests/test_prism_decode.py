"""Prism attention against a KV cache: ``prism_attention_with_kvcache`` (PyTorch path and the Triton
split-KV kernels under the interpreter), the preallocated ``KVCache`` of the layers, and generation.

The oracle is written here: for every sequence, head and query, an explicit softmax in float64 over
the keys gathered slot by slot from the (contiguous or paged) cache. Bounds: fp32 element-wise
(``ELEMENTWISE``); fp16/bf16 FlashAttention's rule (at most 2x the error of the same oracle computed
in the low precision, ``assert_attention_close``).
"""

from __future__ import annotations

import pytest
import torch

from lamina import prism_attention_with_kvcache
from lamina.layers import PrismAttention, PrismDecoder, PrismDecoderConfig
from lamina.layers.prism import GROWTH_GRANULE, KVCache
from tests.tolerances import assert_attention_close, assert_close

HEAD_DIMS = (16, 80, 128, 192, 320, 512)


# ----------------------------------------------------------------------------- oracle and inputs


def kvcache_ref(q, k_cache, v_cache, lengths, block_table=None, scale=None, causal=False):
    """o [B, T, H, D] and lse [B, H, T] of q over the first ``lengths[b]`` slots of each sequence.

    Computed in the inputs' dtype (float64 inputs: the oracle; low-precision inputs: PyTorch's own
    error at that precision). Query t sees ``min(L, L - T + t + 1)`` keys when causal.
    """
    B, T, H, D = q.shape
    group = H // k_cache.shape[2]
    scale = D**-0.5 if scale is None else scale
    out = torch.zeros_like(q)
    lse = torch.full((B, H, T), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(B):
        L = int(lengths[b])
        j = torch.arange(L, device=q.device)
        if block_table is None:
            keys_b, values_b = k_cache[b, :L], v_cache[b, :L]
        else:  # slot j of sequence b: block block_table[b, j // page], row j % page
            page = k_cache.shape[1]
            blocks = block_table[b].long()[j // page]
            keys_b, values_b = k_cache[blocks, j % page], v_cache[blocks, j % page]
        for h in range(H):
            for t in range(T):
                seen = max(0, min(L, L - T + t + 1)) if causal else L
                if seen == 0:
                    continue
                keys, values = keys_b[:seen, h // group], values_b[:seen, h // group]
                scores = (keys @ q[b, t, h]) * scale
                top = scores.max()
                weights = torch.exp(scores - top)
                out[b, t, h] = (weights @ values) / weights.sum()
                lse[b, h, t] = top.double() + torch.log(weights.sum().double())
    return out, lse


def paged_copy(k_cache, v_cache, block_size, generator):
    """The same keys in a paged pool: blocks in a random order among spare blocks, unused table
    entries -1. Returns (k_pool, v_pool, block_table)."""
    B, S, HKV, D = k_cache.shape
    per_seq = -(-S // block_size)
    num_blocks = B * per_seq + 3  # spare blocks hold garbage that must never be read
    order = torch.randperm(num_blocks, generator=generator)[: B * per_seq].view(B, per_seq)
    k_pool = torch.randn(num_blocks, block_size, HKV, D, dtype=k_cache.dtype)
    v_pool = torch.randn(num_blocks, block_size, HKV, D, dtype=k_cache.dtype)
    for b in range(B):
        for j in range(S):
            k_pool[order[b, j // block_size], j % block_size] = k_cache[b, j]
            v_pool[order[b, j // block_size], j % block_size] = v_cache[b, j]
    table = torch.cat((order, torch.full((B, 1), -1)), dim=1).to(torch.int32)
    return k_pool, v_pool, table


def _inputs(B, T, H, HKV, D, S, dtype, new=True):
    g = torch.Generator().manual_seed(1234 + D)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    q = make(B, T, H, D)
    k_cache, v_cache = make(B, S, HKV, D), make(B, S, HKV, D)
    k, v = (make(B, T, HKV, D), make(B, T, HKV, D)) if new else (None, None)
    return q, k_cache, v_cache, k, v, g


def _written(k_cache, v_cache, k, v, seqlens, block_table=None):
    """The caches after writing k, v at seqlens[b] + t (what the op must do in place)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    if k is None:
        return k_cache, v_cache
    for b in range(k.shape[0]):
        for t in range(k.shape[1]):
            j = int(seqlens[b]) + t
            i, s = (b, j) if block_table is None else (int(block_table[b, j // k_cache.shape[1]]), j % k_cache.shape[1])
            k_cache[i, s], v_cache[i, s] = k[b, t], v[b, t]
    return k_cache, v_cache


def check_op(B, T, H, HKV, D, S, seqlens, dtype, causal, backend, new=True, block_size=None, num_splits=0):
    """Run the op and hold its output, lse and cache writes to the oracle."""
    q, k_cache, v_cache, k, v, g = _inputs(B, T, H, HKV, D, S, dtype, new)
    table = None
    if block_size is not None:
        k_cache, v_cache, table = paged_copy(k_cache, v_cache, block_size, g)
    seqlens_t = torch.tensor(seqlens, dtype=torch.int32)
    want_k, want_v = _written(k_cache, v_cache, k, v, seqlens, table)
    o, lse = prism_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens_t, block_table=table,
                                          causal=causal, num_splits=num_splits, return_softmax_lse=True,
                                          backend=backend)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), "cache not written exactly in place"
    assert torch.equal(seqlens_t, torch.tensor(seqlens, dtype=torch.int32)), "cache_seqlens must not change"
    lengths = [n + (T if new else 0) for n in seqlens]
    ref, ref_lse = kvcache_ref(q.double(), want_k.double(), want_v.double(), lengths, table, causal=causal)
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (B, H, T)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows without a visible key differ"
    finite = lambda x: torch.where(torch.isneginf(ref_lse), 0.0, x.double())  # noqa: E731
    if dtype in (torch.float32, torch.float64):
        assert_close("o", o, ref.to(dtype), kind="elementwise")
        assert_close("lse", finite(lse), finite(ref_lse), kind="elementwise", dtype=torch.float32)
    else:
        low, low_lse = kvcache_ref(q, want_k, want_v, lengths, table, causal=causal)
        assert_attention_close("o", o, ref, low)
        assert_attention_close("lse", finite(lse), finite(ref_lse), finite(low_lse), dtype=dtype)
    return o


# ----------------------------------------------------------------------------- the PyTorch path


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_torch_path_decode_step(d):
    # one query, GQA 4:2, rows holding 0, 9 and 20 tokens (row 0: only its new key)
    check_op(3, 1, 4, 2, d, 24, [0, 9, 20], torch.float32, causal=True, backend="torch")


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_torch_path_causal_block_paged(d):
    check_op(2, 3, 4, 1, d, 32, [5, 17], torch.float32, causal=True, backend="torch", block_size=8)


def test_torch_path_without_new_keys_and_low_precision():
    # no k/v: bottom-right causal over cache_seqlens keys; a row with 0 keys gets o = 0, lse = -inf
    check_op(3, 2, 2, 2, 64, 16, [0, 1, 11], torch.float32, causal=True, backend="torch", new=False)
    check_op(2, 1, 2, 1, 96, 16, [3, 12], torch.bfloat16, causal=False, backend="torch")
    check_op(2, 2, 2, 1, 96, 16, [3, 12], torch.float16, causal=True, backend="torch", block_size=4)


# ----------------------------------------------------------------------------- the Triton kernels


@pytest.mark.interpret
@pytest.mark.parametrize("d, dtype, block_size, splits", [
    (16, torch.float16, None, 1),
    (80, torch.bfloat16, 16, 3),
    (128, torch.float32, None, 2),
    (320, torch.bfloat16, 8, 1),
    (512, torch.float16, None, 2),
])
def test_kernel_decode_step(d, dtype, block_size, splits):
    check_op(2, 1, 4, 2, d, 40, [7, 33], dtype, causal=True, backend="triton", block_size=block_size,
             num_splits=splits)


@pytest.mark.interpret
def test_kernel_causal_block_gqa_splits_and_m_tiles():
    # T = 5 queries x G = 4 heads = 20 rows: two 16-row M tiles. 4 splits asked for 46 keys = 3 tiles of
    # 16 give 3 splits, two of them empty for the shorter row (7 keys). Block size 5 does not divide
    # the 16-key tiles.
    check_op(2, 5, 4, 1, 32, 48, [2, 41], torch.float32, causal=True, backend="triton", block_size=5, num_splits=4)


@pytest.mark.interpret
def test_kernel_without_new_keys_non_causal():
    check_op(3, 2, 2, 2, 48, 24, [0, 6, 24], torch.float32, causal=False, backend="triton", new=False,
             num_splits=2)


@pytest.mark.interpret
def test_kernel_prefill_goes_through_the_varlen_forward():
    # T = 20 > 16 queries: the cache is gathered into a packed batch for prism_attn_fwd
    check_op(2, 20, 2, 1, 16, 48, [0, 13], torch.float32, causal=True, backend="triton", block_size=8)


@pytest.mark.interpret
def test_kernel_paged_equals_contiguous_and_splits_agree():
    q, k_cache, v_cache, k, v, g = _inputs(2, 2, 4, 2, 64, 64, torch.float32)
    k_pool, v_pool, table = paged_copy(k_cache, v_cache, 16, g)
    seqlens = torch.tensor([30, 50], dtype=torch.int32)
    run = lambda kc, vc, bt, splits: prism_attention_with_kvcache(  # noqa: E731
        q, kc, vc, k, v, cache_seqlens=seqlens, block_table=bt, causal=True, num_splits=splits, backend="triton")
    contiguous = run(k_cache.clone(), v_cache.clone(), None, 3)
    paged = run(k_pool, v_pool, table, 3)
    # the same keys in the same tiles and order: the same bits
    assert torch.equal(paged, contiguous)
    assert_close("1 split vs 3", run(k_cache.clone(), v_cache.clone(), None, 1), contiguous, kind="elementwise")


def test_split_heuristic():
    from lamina.kernels.prism_attn_decode import MIN_KEYS_PER_SPLIT, num_splits_heuristic, split_plan

    # enough (sequence, kv head) programs for 2 per SM: no split
    assert num_splits_heuristic(programs=64 * 8, max_seqlen_k=32768, sms=132) == 1
    # one sequence, 8 kv heads: 33 splits reach 264 programs
    assert num_splits_heuristic(programs=8, max_seqlen_k=32768, sms=132) == 33
    # short sequences: every split reads at least MIN_KEYS_PER_SPLIT keys
    assert num_splits_heuristic(programs=8, max_seqlen_k=3 * MIN_KEYS_PER_SPLIT, sms=132) == 3
    assert num_splits_heuristic(programs=1, max_seqlen_k=10, sms=132) == 1
    # whole key tiles per split; no split starts past the keys
    assert split_plan(3, 100, 16) == (3, 48)
    assert split_plan(10, 40, 16) == (3, 16)
    assert split_plan(1, 0, 16) == (1, 16)


@pytest.mark.versions
@pytest.mark.interpret
def test_custom_op_schema_and_fake():
    q, k_cache, v_cache, k, v, _ = _inputs(2, 1, 2, 1, 32, 16, torch.float32)
    args = (q, k_cache, v_cache, k, v, torch.tensor([3, 9], dtype=torch.int32), None, 0.2, True, 2, 10)
    torch.library.opcheck(torch.ops.lamina.prism_attention_with_kvcache.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.versions
@pytest.mark.interpret
def test_compiles_fullgraph_and_writes_the_cache():
    q, k_cache, v_cache, k, v, _ = _inputs(2, 1, 4, 2, 32, 16, torch.float32)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    fn = lambda kc, vc: prism_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,  # noqa: E731
                                                     causal=True, backend="triton")
    compiled_k, compiled_v = k_cache.clone(), v_cache.clone()
    o = torch.compile(fn, fullgraph=True, backend="aot_eager")(compiled_k, compiled_v)
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    assert torch.equal(o, fn(eager_k, eager_v))
    assert torch.equal(compiled_k, eager_k) and torch.equal(compiled_v, eager_v)


# ----------------------------------------------------------------------------- bad input


def _good(**change):
    q, k_cache, v_cache, k, v, _ = _inputs(2, 1, 4, 2, 32, 16, torch.float32)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=torch.tensor([3, 5], dtype=torch.int32))
    args.update(change)
    return args


@pytest.mark.parametrize("change, exc, pattern", [
    (dict(q=torch.randn(2, 4, 32)), ValueError, "q must have 4 dimensions"),
    (dict(q=torch.randn(2, 1, 4, 20)), ValueError, "q: head dim must be a multiple of 8"),
    (dict(k_cache=torch.randn(2, 16, 2, 32, dtype=torch.float16)), ValueError, "k_cache must have q's dtype"),
    (dict(k_cache=torch.randn(2, 16, 2, 64)), ValueError, r"k_cache must have shape \[B_cache, S_max, HKV, D\]"),
    (dict(v_cache=torch.randn(2, 12, 2, 32)), ValueError, "v_cache must have k_cache's shape"),
    (dict(k_cache=torch.randn(2, 16, 3, 32), v_cache=torch.randn(2, 16, 3, 32)), ValueError,
     "key/value heads must divide the query heads H=4"),
    (dict(k_cache=torch.randn(1, 16, 2, 32), v_cache=torch.randn(1, 16, 2, 32)), ValueError,
     "k_cache must hold at least B=2 sequences"),
    (dict(v=None), ValueError, "k and v must be given together"),
    (dict(k=torch.randn(2, 1, 1, 32)), ValueError, r"k must have shape \[B=2, T_new, HKV=2, D=32\]"),
    (dict(cache_seqlens=torch.tensor([3, 5, 1], dtype=torch.int32)), ValueError,
     r"cache_seqlens must have shape \[B=2\]"),
    (dict(cache_seqlens=torch.tensor([3.0, 5.0])), ValueError, "cache_seqlens must have dtype in"),
    (dict(cache_seqlens="3"), TypeError, "cache_seqlens must be an int"),
    (dict(cache_seqlens=-1), ValueError, "cache_seqlens must be >= 0"),
    (dict(cache_seqlens=torch.tensor([3, 16], dtype=torch.int32)), ValueError,
     "cache too short: sequence 1 has cache_seqlens=16 and 1 new keys, the cache holds 16"),
    (dict(cache_seqlens=None), ValueError, "cache too short"),
    (dict(k_cache=torch.randn(2, 16, 2, 32, device="meta")), ValueError, "all tensors must be on the same device"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float"),
    (dict(num_splits=-1), ValueError, "num_splits must be an int >= 0"),
    (dict(backend="fast"), ValueError, "backend must be one of"),
])
def test_bad_inputs(change, exc, pattern):
    with pytest.raises(exc, match=pattern):
        backend = change.pop("backend", "torch")
        prism_attention_with_kvcache(**_good(**change), backend=backend)


def test_bad_block_tables():
    q, k_cache, v_cache, k, v, g = _inputs(2, 1, 2, 1, 16, 16, torch.float32)
    k_pool, v_pool, table = paged_copy(k_cache, v_cache, 4, g)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    call = lambda bt, **kw: prism_attention_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=seqlens,  # noqa: E731
                                                         block_table=bt, **kw)
    bad = table.clone()
    bad[1, 2] = k_pool.shape[0]  # block 2 of sequence 1 holds its position 9, the new key's slot
    with pytest.raises(ValueError, match=rf"block_table\[1, 2\] = {k_pool.shape[0]} is not a block of k_cache"):
        call(bad)
    bad = table.clone()
    bad[0, 3] = -7  # a block that sequence 0 (4 keys) does not use: allowed
    call(bad)
    with pytest.raises(ValueError, match="block_table must have dtype in"):
        call(table.long())
    with pytest.raises(ValueError, match=r"block_table must have shape \[B=2, max_blocks_per_seq\]"):
        call(table[:1])
    with pytest.raises(ValueError, match="cache too short.*block_table shape"):
        call(table[:, :2])


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpret)])
def test_inference_only(backend):
    q, k_cache, v_cache, k, v, _ = _inputs(1, 1, 2, 1, 16, 8, torch.float32)
    q.requires_grad_()
    k.requires_grad_()
    o = prism_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=2, backend=backend)
    assert not o.requires_grad and not k_cache.requires_grad


@pytest.mark.interpret
def test_triton_backend_refuses_float64():
    q, k_cache, v_cache, _, _, _ = _inputs(1, 1, 2, 1, 16, 8, torch.float64)
    with pytest.raises(ValueError, match="the triton backend takes dtypes float16, bfloat16, float32"):
        prism_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, backend="triton")


# ----------------------------------------------------------------------------- layers and generation


def _decode_in_steps(layer, x, cache, chunks, **kwargs):
    outs, start = [], 0
    for n in chunks:
        outs.append(layer(x[:, start:start + n], cache=cache, **kwargs))
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("block_size", [None, 4])
def test_attention_decoding_with_a_preallocated_cache(block_size):
    layer = PrismAttention(64, 4, 2, backend="torch")
    x = torch.randn(2, 11, 64)
    cache = KVCache(2, 11, 2, 16, torch.float32, "cpu", block_size=block_size)
    k_pool = cache.k_cache
    with torch.no_grad():
        full = layer(x)
        steps = _decode_in_steps(layer, x, cache, [4, 1, 1, 1, 1, 3])
    assert cache.k_cache is k_pool, "a preallocated cache is written in place, never reallocated"
    assert cache.seq_len == 11 and cache.cache_seqlens.tolist() == [11, 11]
    assert_close("decode vs full", steps, full, kind="elementwise")
    with pytest.raises(ValueError, match="max_length=11 tokens per sequence, cannot append 1 to a sequence of 11"):
        layer(x[:, :1], cache=cache)


@pytest.mark.parametrize("block_size", [None, 16])
def test_cache_without_max_length_grows(block_size):
    layer = PrismAttention(32, 2, backend="torch")
    n = GROWTH_GRANULE + 6
    x = torch.randn(1, n, 32)
    cache = KVCache(block_size=block_size)
    with torch.no_grad():
        full = layer(x)
        steps = _decode_in_steps(layer, x, cache, [GROWTH_GRANULE - 2] + [1] * 8)
    assert cache.capacity >= 2 * GROWTH_GRANULE and cache.seq_len == n
    assert_close("grown cache vs full", steps, full, kind="elementwise")
    assert_close("keys held", cache.k, layer.project(x)[1], kind="elementwise")


def test_rows_of_different_lengths_follow_their_own_positions():
    """Right-padded prefill (attention_mask), then one token per row: each row equals its own forward."""
    layer = PrismAttention(48, 3, backend="torch")
    lengths = [5, 2, 7]
    x = torch.randn(3, 10, 48)
    mask = (torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]).long()
    cache = KVCache(3, 10, block_size=3)
    with torch.no_grad():
        first = layer(x[:, :7], cache=cache, attention_mask=mask)
        assert cache.cache_seqlens.tolist() == lengths
        nxt = [layer(torch.stack([x[b, lengths[b] + i] for b in range(3)])[:, None], cache=cache) for i in range(3)]
        for b, n in enumerate(lengths):
            own = layer(torch.cat((x[b:b + 1, :n], torch.stack([x[b, n + i] for i in range(3)])[None]), dim=1))
            got = torch.cat((first[b:b + 1, :n], *[o[b:b + 1] for o in nxt]), dim=1)
            assert_close(f"row {b}", got, own, kind="elementwise")


def test_layer_cache_errors():
    layer = PrismAttention(32, 2, backend="torch")
    with pytest.raises(ValueError, match="attention_mask needs a cache"):
        layer(torch.randn(1, 3, 32), attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="ones first in every row"):
        layer(torch.randn(1, 3, 32), cache=KVCache(max_length=4), attention_mask=torch.tensor([[0, 1, 1]]))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \[B, T\] = \(1, 3\)"):
        layer(torch.randn(1, 3, 32), cache=KVCache(max_length=4), attention_mask=torch.ones(1, 2))
    cache = KVCache(1, 8, 1, 16, torch.float64)
    with pytest.raises(ValueError, match="cannot append keys of shape"):
        layer(torch.randn(1, 3, 32), cache=cache)
    cache = KVCache(1, 8, 2, 16, torch.float64)
    with pytest.raises(ValueError, match="cache holds torch.float64 keys on cpu, cannot append torch.float32"):
        layer(torch.randn(1, 3, 32), cache=cache)
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        KVCache(max_length=0)


def _small_decoder(backend, dtype=torch.float32, **kwargs):
    config = PrismDecoderConfig(vocab_size=37, d_model=64, n_layers=4, h_base=4, widths=(2, 2, 4, 4),
                                kv_group_size=2, backend=backend, **kwargs)
    return PrismDecoder(config, dtype=dtype).eval()


def _greedy_without_cache(model, prompts, n):
    """Argmax of the last position of full forwards over prompt + tokens so far, one row at a time."""
    rows = []
    for prompt in prompts:
        ids = prompt[None]
        for _ in range(n):
            with torch.no_grad():
                ids = torch.cat((ids, model(ids)[:, -1].argmax(-1, keepdim=True)), dim=1)
        rows.append(ids[0, len(prompt):])
    return torch.stack(rows)


def test_generate_greedy_equals_full_forwards():
    # float64: greedy choices compared exactly, so no rounding tie may flip an argmax
    model = _small_decoder("torch", torch.float64)
    prompts = [torch.randint(0, 37, (n,)) for n in (6, 3, 9)]
    ids = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding
        ids[b, 9 - len(p):], mask[b, 9 - len(p):] = p, 1
    out = model.generate(ids, 5, attention_mask=mask)
    assert torch.equal(out, _greedy_without_cache(model, prompts, 5))


def test_decode_protocol_and_new_cache():
    model = _small_decoder("torch", torch.float64)
    ids = torch.randint(0, 37, (2, 7))
    cache = model.new_cache(2, 7, block_size=2)
    assert [c.k_cache.shape for c in cache.layers] == [(8, 2, 1, 32)] * 2 + [(8, 2, 2, 16)] * 2
    with torch.no_grad():
        full = model(ids)
        steps = [model.decode(ids[:, :4], cache)] + [model.decode(ids[:, t:t + 1], cache) for t in range(4, 7)]
    assert_close("decode vs full", torch.cat(steps, dim=1), full, kind="elementwise")
    assert model.new_cache().layers[0].k_cache is None  # allocated on first use
    with pytest.raises(TypeError, match="cache must be a PrismCache"):
        model.decode(ids, cache=None)


@pytest.mark.interpret
def test_generate_on_triton_kernels():
    """Generation through the split-KV kernels (interpreter) picks the tokens of full forwards on
    the PyTorch path, for prompts of different lengths."""
    model = _small_decoder("triton", tie_embeddings=False)
    reference = _small_decoder("torch", tie_embeddings=False)
    reference.load_state_dict(model.state_dict())
    prompts = [torch.randint(0, 37, (n,)) for n in (4, 2)]
    ids = torch.zeros(2, 4, dtype=torch.long)
    mask = torch.zeros(2, 4, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)], mask[b, :len(p)] = p, 1  # right padding
    out = model.generate(ids, 3, attention_mask=mask)
    assert torch.equal(out, _greedy_without_cache(reference, prompts, 3))


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 192, 256, 320, 512])
@pytest.mark.parametrize("paged", [False, True])
def test_kernels_on_gpu_bf16(d, paged):
    """The split-KV kernels on a GPU (heuristic splits) in bf16 against the float64 oracle, within
    FlashAttention's bound; 1, 4 and 16 queries (the decode kernel) and 40 (the varlen forward)."""
    B, H, HKV, S = 4, 8, 2, 2048
    g = torch.Generator(device="cuda").manual_seed(d)
    make = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    seqlens = torch.tensor([0, 17, S // 2, S - 40], dtype=torch.int32, device="cuda")
    for T in (1, 4, 16, 40):
        q, k, v = make(B, T, H, d), make(B, T, HKV, d), make(B, T, HKV, d)
        k_cache, v_cache, table = make(B, S, HKV, d), make(B, S, HKV, d), None
        if paged:
            block = 16
            per_seq = S // block
            order = torch.randperm(B * per_seq, generator=g, device="cuda").view(B, per_seq)
            table = order.to(torch.int32)
            pool_k, pool_v = (torch.empty(B * per_seq, block, HKV, d, device="cuda", dtype=torch.bfloat16)
                              for _ in range(2))
            pool_k[order.flatten()] = k_cache.view(-1, block, HKV, d)
            pool_v[order.flatten()] = v_cache.view(-1, block, HKV, d)
            k_cache, v_cache = pool_k, pool_v
        want_k, want_v = k_cache.clone(), v_cache.clone()
        o, lse = prism_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                              causal=True, return_softmax_lse=True)
        torch.cuda.synchronize()
        pos = seqlens.long()[:, None] + torch.arange(T, device="cuda")
        if paged:
            first, second = table.long().gather(1, pos // block), pos % block
        else:
            first, second = torch.arange(B, device="cuda")[:, None].expand_as(pos), pos
        want_k[first, second], want_v[first, second] = k, v
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), f"T={T}: cache writes"
        lengths = (seqlens + T).tolist()
        ref, ref_lse = kvcache_ref(q.double(), want_k.double(), want_v.double(), lengths, table, causal=True)
        low, _ = kvcache_ref(q, want_k, want_v, lengths, table, causal=True)
        assert_attention_close(f"o D={d} T={T}", o, ref, low)
        assert torch.isfinite(lse).all()
        assert_close(f"lse D={d} T={T}", lse, ref_lse.float(), kind="elementwise", dtype=torch.float32)


@pytest.mark.gpu
def test_decode_step_captured_in_a_cuda_graph():
    """A PrismDecoder decode step with a preallocated paged cache is captured in a CUDA graph (no host
    reads while capturing) and its replays give the eager steps' logits."""
    model = _small_decoder("auto", tie_embeddings=False).cuda()
    B, prompt, steps = 2, 5, 4
    ids = torch.randint(0, 37, (B, prompt + steps), device="cuda")
    eager_cache = model.new_cache(B, prompt + steps, block_size=4)
    graph_cache = model.new_cache(B, prompt + steps, block_size=4)
    with torch.no_grad():
        model.decode(ids[:, :prompt], eager_cache)
        eager = [model.decode(ids[:, prompt + i:prompt + i + 1], eager_cache) for i in range(steps)]
        model.decode(ids[:, :prompt], graph_cache)
        static_ids = ids[:, prompt:prompt + 1].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the first step eagerly: compiles the kernels before capture
            first = model.decode(static_ids, graph_cache)
        torch.cuda.current_stream().wait_stream(side)
        assert_close("step 0", first, eager[0], kind="elementwise")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records the next step (writes at cache_seqlens, then advances it)
            static_logits = model.decode(static_ids, graph_cache)
        for i in range(1, steps):
            static_ids.copy_(ids[:, prompt + i:prompt + i + 1])
            graph.replay()
            assert_close(f"step {i}", static_logits, eager[i], kind="elementwise")
    assert graph_cache.layers[0].cache_seqlens.tolist() == [prompt + steps] * B
