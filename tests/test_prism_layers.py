"""Prism layers: rotary embeddings, PrismAttention (GQA, KV cache, varlen), PrismBlock, PrismDecoder.

The layers call ``lamina.prism_attention`` with ``backend="torch"`` here (the PyTorch path on
CPU). While that op is not in the tree, a stand-in built on PyTorch's
``scaled_dot_product_attention`` with the op's signature is installed for these tests only.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange, repeat

import lamina
from lamina.diagnostics import attention_distance, layer_attention_distance
from lamina.layers import PrismAttention, PrismBlock, PrismDecoder, PrismDecoderConfig
from lamina.layers.prism import KVCache, PrismCache
from lamina.layers.rotary import RotaryEmbedding, apply_rotary, rotary_positions
from lamina.reference import attention_ref
from lamina.schedule import PrismSchedule
from tests.tolerances import assert_attention_close, assert_close

OP_MODULE = "lamina.ops.prism_attention"
BACKEND = "torch"


def _sdpa_prism_attention(
    q, k, v, causal=True, scale=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
    max_seqlen_k=None, return_lse=False, backend="auto",
):
    """Stand-in with the op's signature: GQA, bottom-right causal alignment, varlen by a loop."""
    if return_lse:
        raise NotImplementedError("the stand-in does not return the log-sum-exp")
    if cu_seqlens_q is not None:
        offs_q, offs_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        parts = [
            _sdpa_prism_attention(q[:, a:b], k[:, c:d], v[:, c:d], causal, scale)
            for a, b, c, d in zip(offs_q[:-1], offs_q[1:], offs_k[:-1], offs_k[1:])
        ]
        return torch.cat(parts, dim=1)
    T, S, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    mask = None
    if causal:
        pos_k, pos_q = torch.arange(S, device=q.device), torch.arange(T, device=q.device)
        mask = pos_k[None, :] <= pos_q[:, None] + (S - T)
    o = F.scaled_dot_product_attention(
        rearrange(q, "b t h d -> b h t d"),
        repeat(k, "b s hk d -> b (hk g) s d", g=group),
        repeat(v, "b s hk d -> b (hk g) s d", g=group),
        attn_mask=mask,
        scale=scale,
    )
    return rearrange(o, "b h t d -> b t h d")


@pytest.fixture(autouse=True)
def _attention_op(monkeypatch):
    try:
        __import__(OP_MODULE)
    except ModuleNotFoundError as err:
        if err.name != OP_MODULE:
            raise
        monkeypatch.setitem(sys.modules, OP_MODULE, _sdpa_module())
    yield


def _sdpa_module() -> types.ModuleType:
    """A stand-in op module: the layer calls ``prism_attention_with_layout`` (the op, positional)."""
    stand_in = types.ModuleType(OP_MODULE)
    stand_in.prism_attention = _sdpa_prism_attention
    stand_in.prism_attention_with_layout = (
        lambda q, k, v, causal, scale, cu_q, cu_k, max_q, max_k, return_lse, backend, layout=None:
        _sdpa_prism_attention(q, k, v, causal, scale, cu_q, cu_k, max_q, max_k, return_lse, backend))
    stand_in.Varlen = tuple
    stand_in.IS_STAND_IN = True
    return stand_in


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """pytest-xdist already runs one worker per core; intra-op threads on top oversubscribe the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- references


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE as a complex rotation: channel pair (i, i + D/2) is the number x_i + 1j x_{i+D/2},
    multiplied by exp(1j * p * base^(-2i/D)). x: [B, T, H, D] float64, positions [T]."""
    D = x.shape[-1]
    freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64, device=x.device) / D)
    angles = positions.to(x.device, torch.float64)[:, None] * freq
    rot = torch.polar(torch.ones_like(angles), angles)
    z = torch.complex(x[..., : D // 2], x[..., D // 2 :]) * rot[None, :, None, :]
    return torch.cat((z.real, z.imag), dim=-1)


def attention_layer_ref(layer: PrismAttention, x: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """PrismAttention in float64, written out: projections, complex RoPE, naive attention."""
    w_qkv = layer.qkv_proj.weight.double()
    qkv = x.double() @ w_qkv.T
    if layer.qkv_proj.bias is not None:
        qkv = qkv + layer.qkv_proj.bias.double()
    d, kv = layer.d_model, layer.kv_dim
    q = rearrange(qkv[..., :d], "b t (h e) -> b t h e", h=layer.n_heads)
    k = rearrange(qkv[..., d : d + kv], "b t (h e) -> b t h e", h=layer.n_kv_heads)
    v = rearrange(qkv[..., d + kv :], "b t (h e) -> b t h e", h=layer.n_kv_heads)
    if layer.rotary is not None:
        pos = torch.arange(x.shape[1], device=x.device)
        q, k = rotary_ref(q, pos, layer.rotary.base), rotary_ref(k, pos, layer.rotary.base)
    o = attention_ref(q, k, v, causal=causal)
    out = rearrange(o, "b t h e -> b t (h e)") @ layer.out_proj.weight.double().T
    if layer.out_proj.bias is not None:
        out = out + layer.out_proj.bias.double()
    return out


# ----------------------------------------------------------------------------- rotary


@pytest.mark.parametrize("head_dim", [8, 96, 320, 512])
def test_rotary_matches_complex_rotation(head_dim):
    rope = RotaryEmbedding(head_dim)
    q = torch.randn(2, 9, 3, head_dim, dtype=torch.float64)
    k = torch.randn(2, 9, 1, head_dim, dtype=torch.float64)
    rq, rk = rope(q, k, offset=5)
    pos = torch.arange(5, 14)
    assert_close("rotary q", rq, rotary_ref(q, pos), kind="elementwise")
    assert_close("rotary k", rk, rotary_ref(k, pos), kind="elementwise")
    # a rotation keeps norms
    assert_close("norm", rq.norm(dim=-1), q.norm(dim=-1), kind="elementwise")


@pytest.mark.parametrize("head_dim", [16, 320])
def test_rotary_scores_depend_on_relative_position(head_dim):
    rope = RotaryEmbedding(head_dim, base=500.0)
    q = torch.randn(1, 1, 1, head_dim, dtype=torch.float64)
    k = torch.randn(1, 1, 1, head_dim, dtype=torch.float64)
    scores = []
    for shift in (0, 7, 100):
        rq, _ = rope(q, q, offset=12 + shift)
        _, rk = rope(k, k, offset=3 + shift)
        scores.append((rq * rk).sum())
    assert_close("shift 7", scores[1], scores[0], kind="elementwise")
    assert_close("shift 100", scores[2], scores[0], kind="elementwise")
    rq_other, _ = rope(q, q, offset=13)
    assert not torch.allclose((rq_other * rope(k, k, offset=3)[1]).sum(), scores[0])


def test_rotary_float32_computes_angles_in_float32():
    rope = RotaryEmbedding(64)
    q = torch.randn(1, 40, 2, 64).to(torch.bfloat16)
    rq, _ = rope(q, q, offset=4000)
    assert rq.dtype == torch.bfloat16
    want = rotary_ref(q.double(), torch.arange(4000, 4040))
    assert_close("rotary bf16", rq, want.to(torch.bfloat16), kind="elementwise")


def test_rotary_positions_restart_per_sequence():
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    assert rotary_positions(9, cu_seqlens=cu).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert rotary_positions(4, offset=6).tolist() == [6, 7, 8, 9]
    cos, sin = RotaryEmbedding(4).cos_sin(torch.tensor([0, 1]), torch.float32)
    x = torch.randn(1, 2, 1, 4)
    assert torch.equal(apply_rotary(x, cos, sin)[:, 0], x[:, 0])  # position 0 is the identity


def test_rotary_bad_arguments():
    with pytest.raises(ValueError, match="even head_dim >= 2, got 9"):
        RotaryEmbedding(9)
    with pytest.raises(TypeError, match="head_dim must be an int"):
        RotaryEmbedding(8.0)
    with pytest.raises(ValueError, match="rope_base must be a number > 1"):
        RotaryEmbedding(8, base=0.5)
    with pytest.raises(ValueError, match="head dim 8"):
        RotaryEmbedding(8)(torch.randn(1, 2, 1, 6), torch.randn(1, 2, 1, 6))
    assert not list(RotaryEmbedding(8).parameters()) and not RotaryEmbedding(8).state_dict()


# ----------------------------------------------------------------------------- PrismAttention

LAYER_CASES = [
    # (d_model, n_heads, n_kv_heads): head dims 64, 16 (GQA), 16 (MQA), 96, 320
    (64, 1, 1),
    (64, 4, 2),
    (64, 4, 1),
    (96, 1, 1),
    (320, 1, 1),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d_model,n_heads,n_kv_heads", LAYER_CASES)
def test_attention_matches_float64_reference(d_model, n_heads, n_kv_heads, causal):
    layer = PrismAttention(d_model, n_heads, n_kv_heads, bias=True, backend=BACKEND)
    x = torch.randn(2, 12, d_model)
    out = layer(x, causal=causal)
    assert out.shape == x.shape and out.dtype == torch.float32
    # one fp32 pass through projections and softmax: element-wise fp32 bounds against float64
    assert_close("PrismAttention", out, attention_layer_ref(layer, x, causal).float(), kind="elementwise")


@pytest.mark.parametrize("n_heads", [1, 2, 4, 8])
def test_projections_do_not_depend_on_head_count(n_heads):
    d = 64
    layer = PrismAttention(d, n_heads, backend=BACKEND)
    assert layer.qkv_proj.weight.shape == (3 * d, d)
    assert layer.out_proj.weight.shape == (d, d)
    assert sum(p.numel() for p in layer.parameters()) == 4 * d * d
    gqa = PrismAttention(d, n_heads * 2, n_heads, backend=BACKEND)  # 2 query heads per key/value head
    assert gqa.qkv_proj.weight.shape == (d + 2 * (d // 2), d)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2)])
def test_kv_cache_decoding_equals_full_forward(n_heads, n_kv_heads):
    layer = PrismAttention(64, n_heads, n_kv_heads, backend=BACKEND)
    x = torch.randn(2, 11, 64)
    full = layer(x)
    cache = KVCache()
    steps = [layer(x[:, :4], cache=cache)]  # prefill
    steps += [layer(x[:, t : t + 1], cache=cache) for t in range(4, 8)]  # one token at a time
    steps.append(layer(x[:, 8:11], cache=cache))  # a chunk: T=3 queries against S=11 keys
    assert cache.seq_len == 11 and cache.k.shape == (2, 11, n_kv_heads, 16)
    assert_close("decode vs full", torch.cat(steps, dim=1), full, kind="elementwise")


@pytest.mark.interpret
def test_kv_cache_decoding_on_triton_kernels():
    """The same decode-vs-full check through the Triton kernels (interpreter on CPU): the cached steps
    are the T != S bottom-right-causal cases of the kernel."""
    layer = PrismAttention(64, 4, 2, backend="triton")
    x = torch.randn(1, 12, 64)
    full = layer(x)
    cache = KVCache()
    steps = [layer(x[:, :5], cache=cache)] + [layer(x[:, t : t + 1], cache=cache) for t in range(5, 8)]
    steps.append(layer(x[:, 8:], cache=cache))
    assert_close("triton decode vs full", torch.cat(steps, dim=1), full, kind="elementwise")
    assert_close("triton vs float64", full, attention_layer_ref(layer, x).float(), kind="elementwise")


def test_varlen_equals_separate_sequences():
    layer = PrismAttention(64, 2, backend=BACKEND)
    lengths = [3, 6, 1, 5]
    seqs = [torch.randn(1, n, 64) for n in lengths]
    cu = torch.tensor([0, 3, 9, 10, 15], dtype=torch.int32)
    packed = layer(torch.cat(seqs, dim=1), cu_seqlens=cu)
    separate = torch.cat([layer(s) for s in seqs], dim=1)
    assert_close("varlen", packed, separate, kind="elementwise")


def test_layer_passes_arguments_to_the_op(monkeypatch):
    from lamina.ops.prism_attention import Varlen

    calls = []

    def spy(q, k, v, causal, scale, cu_q, cu_k, max_q, max_k, return_lse, backend, layout=None):
        calls.append((q.shape, k.shape, causal, scale, cu_q, cu_k, return_lse, backend, layout))
        return torch.zeros_like(q)

    stand_in = types.ModuleType(OP_MODULE)
    stand_in.prism_attention_with_layout, stand_in.Varlen = spy, Varlen
    monkeypatch.setitem(sys.modules, OP_MODULE, stand_in)
    layer = PrismAttention(64, 4, 2, backend=BACKEND)
    layer(torch.randn(1, 7, 64), cu_seqlens=torch.tensor([0, 2, 7]), causal=False)
    q_shape, k_shape, causal, scale, cu_q, cu_k, return_lse, backend, layout = calls[0]
    assert q_shape == (1, 7, 4, 16) and k_shape == (1, 7, 2, 16)
    assert backend == BACKEND and causal is False and scale is None and return_lse is False
    assert layout == Varlen([0, 2, 7], [0, 2, 7], 5, 5)
    assert cu_q.tolist() == cu_k.tolist() == [0, 2, 7]


def test_attention_gradients_reach_every_parameter():
    layer = PrismAttention(64, 4, 2, bias=True, backend=BACKEND)
    x = torch.randn(2, 8, 64, requires_grad=True)
    layer(x).square().sum().backward()
    for name, p in [("x", x), *layer.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "args,kwargs,exc,pattern",
    [
        ((64, 3), {}, ValueError, "n_heads must divide d_model=64, got n_heads=3"),
        ((64, 4, 3), {}, ValueError, "n_kv_heads must divide n_heads=4, got n_kv_heads=3"),
        ((64, 4), dict(backend="cudnn"), ValueError, "backend must be one of"),
        ((36, 4), {}, ValueError, "even head_dim >= 2, got 9"),
        ((64, 0), {}, ValueError, "n_heads must be >= 1"),
        ((64, 2.0), {}, TypeError, "n_heads must be an int"),
    ],
)
def test_attention_bad_construction(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        PrismAttention(*args, **kwargs)


def test_attention_without_rotary():
    layer = PrismAttention(96, 4, rotary=False, backend=BACKEND)
    assert layer.rotary is None
    x = torch.randn(1, 5, 96)
    assert_close("no rotary", layer(x), attention_layer_ref(layer, x).float(), kind="elementwise")


def test_attention_bad_inputs():
    layer = PrismAttention(64, 4, backend=BACKEND)
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, d_model=64\], got \(1, 5, 32\)"):
        layer(torch.randn(1, 5, 32))
    with pytest.raises(ValueError, match="x must have 3 dimensions"):
        layer(torch.randn(5, 64))
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        layer(torch.randn(1, 5, 64), cache={})
    with pytest.raises(ValueError, match="cache and cu_seqlens cannot be combined"):
        layer(torch.randn(1, 5, 64), cache=KVCache(), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="cu_seqlens must end at the packed length T=5"):
        layer(torch.randn(1, 5, 64), cu_seqlens=torch.tensor([0, 4]))
    cache = KVCache()
    layer(torch.randn(2, 3, 64), cache=cache)
    with pytest.raises(ValueError, match="cannot append keys of shape"):
        layer(torch.randn(1, 1, 64), cache=cache)


# ----------------------------------------------------------------------------- block and decoder


def test_block_is_pre_norm_residual():
    block = PrismBlock(64, 4, 2, norm="rmsnorm", backend=BACKEND)
    x = torch.randn(2, 6, 64)
    assert block(x).shape == x.shape
    with torch.no_grad():
        block.attn.out_proj.weight.zero_()
        block.mlp[-1].weight.zero_()
    assert torch.equal(block(x), x)  # both branches add zero: the residual stream passes unchanged
    with pytest.raises(ValueError, match="norm must be one of"):
        PrismBlock(64, 4, norm="batchnorm")


def _count_formula(c: PrismDecoderConfig) -> int:
    """Parameters of the uniform decoder written out (projections do not depend on heads)."""
    d, kv = c.d_model, c.d_model // c.kv_group_size
    hidden = int(round(c.mlp_ratio * d))
    norm = d * (2 if (c.norm == "layernorm" and c.bias) else 1)
    bias = c.bias
    attn = d * (d + 2 * kv) + d * d + bias * (d + 2 * kv + d)
    mlp = 2 * d * hidden + bias * (hidden + d)
    head = 0 if c.tie_embeddings else c.vocab_size * d
    return c.vocab_size * d + c.n_layers * (attn + mlp + 2 * norm) + norm + head


@pytest.mark.parametrize(
    "preset,kv_group_size,tie,bias",
    [
        ("gpt2-small", 1, True, False),
        ("gpt2-medium", 1, True, True),
        ("gpt2-medium", 2, False, False),  # GQA: heads 4, 8, 16 -> key/value heads 2, 4, 8
        ("gpt2-medium", 4, True, False),
        ("gpt2-large", 1, False, True),
    ],
)
def test_preset_parameter_count_equals_uniform(preset, kv_group_size, tie, bias):
    config = PrismDecoderConfig.from_preset(
        preset, vocab_size=50257, kv_group_size=kv_group_size, tie_embeddings=tie, bias=bias, backend=BACKEND
    )
    # shapes only: the large presets would need gigabytes
    prism = PrismDecoder(config, device="meta")
    uniform = PrismDecoder(config.uniform(), device="meta")
    assert all(p.is_meta for p in prism.parameters())
    assert prism.schedule == PrismSchedule.from_preset(preset)
    assert uniform.schedule.is_uniform and not prism.schedule.is_uniform
    assert [b.attn.n_heads for b in prism.blocks] == list(prism.schedule.heads)
    assert prism.num_parameters() == uniform.num_parameters() == _count_formula(config)


def _small_config(**kwargs) -> PrismDecoderConfig:
    base = dict(vocab_size=61, d_model=64, n_layers=4, h_base=4, widths=(2, 2, 4, 4), backend=BACKEND)
    base.update(kwargs)
    return PrismDecoderConfig(**base)


@pytest.mark.parametrize("kv_group_size", [1, 2])
def test_decoder_parameter_count_and_decoding(kv_group_size):
    config = _small_config(kv_group_size=kv_group_size)
    model = PrismDecoder(config).eval()
    assert model.num_parameters() == PrismDecoder(config.uniform()).num_parameters() == _count_formula(config)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :3], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(3, 9)]
    assert full.shape == (2, 9, config.vocab_size) and cache.seq_len == 9
    assert_close("decoder decode vs full", torch.cat(steps, dim=1), full, kind="elementwise")


def test_decoder_varlen_and_training_step():
    model = PrismDecoder(_small_config(tie_embeddings=False, norm="rmsnorm"))
    a, b = torch.randint(0, 61, (1, 5)), torch.randint(0, 61, (1, 7))
    packed = model(torch.cat((a, b), dim=1), cu_seqlens=torch.tensor([0, 5, 12]))
    assert_close("decoder varlen", packed, torch.cat((model(a), model(b)), dim=1), kind="elementwise")
    loss = F.cross_entropy(rearrange(packed, "b t v -> (b t) v"), torch.cat((a, b), dim=1).flatten())
    loss.backward()
    assert math.isfinite(loss.item())
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_decoder_config_errors():
    with pytest.raises(ValueError, match="kv_group_size=2 must divide the head count .* got h=3 at layer 0"):
        PrismDecoderConfig.from_preset("gpt2-small", vocab_size=100, kv_group_size=2)
    with pytest.raises(ValueError, match="'runs of 2-4 layers' violated at layer 0"):
        _small_config(widths=(2, 4, 4, 4))
    with pytest.raises(ValueError, match="backend must be one of"):
        _small_config(backend="fast")
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        _small_config(vocab_size=0)
    with pytest.raises(TypeError, match="config must be a PrismDecoderConfig"):
        PrismDecoder({"d_model": 64})
    model = PrismDecoder(_small_config())
    with pytest.raises(ValueError, match="input_ids must have dtype"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="cache must have 4 layers, got 2"):
        model(torch.zeros(1, 3, dtype=torch.int64), cache=PrismCache(2))


def test_layer_attention_distance_follows_the_schedule():
    model = PrismDecoder(_small_config(kv_group_size=2)).eval()
    ids = torch.randint(0, 61, (2, 20))
    per_layer = layer_attention_distance(model, ids, block_size=8)
    assert [d.shape for d in per_layer] == [(2, h) for h in model.schedule.heads]
    with torch.no_grad():
        first = model.blocks[0]
        q, k, _ = first.attn.project(first.attn_norm(model.embed(ids)))
    assert_close("layer 0 distance", per_layer[0], attention_distance(q, k, causal=True), kind="elementwise")
    with pytest.raises(ValueError, match="no PrismAttention layer"):
        layer_attention_distance(torch.nn.Linear(2, 2), ids)


# ----------------------------------------------------------------------------- GPU (the real kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 256, 320, 512])
def test_attention_layer_on_gpu_bf16(head_dim, monkeypatch):
    """The layer on the real kernels (backend "auto") in bf16, forward and dx, against the float64
    layer reference, within the FlashAttention bound set by PyTorch's own bf16 SDPA on the same layer."""
    if getattr(sys.modules.get(OP_MODULE), "IS_STAND_IN", False):
        pytest.fail("lamina.ops.prism_attention is missing: the GPU test needs the real op")
    d_model = 2 * head_dim
    layer = PrismAttention(d_model, 2, backend="auto", device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 256, d_model, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(x)

    def run(inp):
        leaf = inp.detach().requires_grad_(True)
        out = layer(leaf) if inp.dtype == torch.bfloat16 else attention_layer_ref(layer, leaf)
        out.backward(dout.to(out.dtype))
        return out.detach(), leaf.grad

    out, dx = run(x)
    ref, dx_ref = run(x.double())
    monkeypatch.setitem(sys.modules, OP_MODULE, _sdpa_module())
    lowp, dx_lowp = run(x)
    assert_attention_close(f"out D={head_dim}", out, ref, lowp)
    assert_attention_close(f"dx D={head_dim}", dx, dx_ref, dx_lowp, grad=True)


def _count_host_reads(monkeypatch) -> list[str]:
    """Every read of a tensor's values on the host (tolist, item, int, bool, float, index) is recorded."""
    reads: list[str] = []
    for name in ("tolist", "item", "__int__", "__bool__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpret)])
def test_varlen_call_reads_offsets_once(monkeypatch, backend):
    """A varlen PrismAttention call, forward and backward, reads cu_seqlens to the host once; the op
    reads cu_seqlens_q and cu_seqlens_k in one transfer."""
    layer = PrismAttention(64, 4, 2, backend=backend)
    x = torch.randn(1, 20, 64, requires_grad=True)
    cu = torch.tensor([0, 5, 6, 20], dtype=torch.int32)
    reads = _count_host_reads(monkeypatch)
    layer(x, cu_seqlens=cu).sum().backward()
    assert reads == ["tolist"]
    q = torch.randn(1, 20, 2, 32)
    reads.clear()
    lamina.prism_attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, backend=backend)
    assert reads == ["tolist"]
