"""Cross-layer routing (CLVR, CLER): the ops' ``output_v_new`` against the naive token loop's writes,
the layers' routed tensors, LinearLM stacks with routing (exact at initialisation, gradients reach the
routers, training on a recall task, decoding equals the full forward), and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lamina
from lamina.layers import CrossLayerRouter, DeltaNet, GatedDeltaNet, GatedDeltaNet2, KimiDeltaAttention
from lamina.models import LinearLM, LinearLMConfig
from lamina.reference import delta_rule_family_recurrent_ref
from lamina.testing import assert_close, gradient_scale

VARIANTS = ("delta", "gdn", "kda", "gdn2")
LAYERS = {"DeltaNet": DeltaNet, "GatedDeltaNet": GatedDeltaNet, "KimiDeltaAttention": KimiDeltaAttention,
          "GatedDeltaNet2": GatedDeltaNet2}


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _inputs(variant, dtype, B=1, T=40, H=1, HV=2, K=16, V=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = None
    if variant == "gdn":
        g = -torch.rand(B, T, HV, generator=gen)
    elif variant in ("kda", "gdn2"):
        g = -torch.rand(B, T, HV, K, generator=gen)
    b = torch.rand((B, T, HV, K) if variant == "gdn2" else (B, T, HV), generator=gen)
    w = torch.rand(B, T, HV, V, generator=gen) if variant == "gdn2" else None
    N = B if B > 1 else 2
    s0 = torch.randn(N, HV, K, V, generator=gen) * 0.3
    named = dict(q=q, k=k, v=v, g=g, b=b, w=w, s0=s0)
    return {n: None if x is None else x.to(dtype).requires_grad_() for n, x in named.items()}


def _op(variant: str, kind: str, x: dict, cu: torch.Tensor, backend: str):
    common = dict(initial_state=x["s0"], output_final_state=True, cu_seqlens=cu, backend=backend, output_v_new=True)
    if kind == "chunk":
        common["chunk_size"] = 16
    q, k, v = x["q"], x["k"], x["v"]
    if variant == "delta":
        fn = lamina.chunk_delta_rule if kind == "chunk" else lamina.fused_recurrent_delta_rule
        return fn(q, k, v, x["b"], **common)
    if variant == "gdn":
        fn = lamina.chunk_gated_delta_rule if kind == "chunk" else lamina.fused_recurrent_gated_delta_rule
        return fn(q, k, v, g=x["g"], beta=x["b"], **common)
    if variant == "kda":
        fn = lamina.chunk_kda if kind == "chunk" else lamina.fused_recurrent_kda
        return fn(q, k, v, x["g"], x["b"], **common)
    fn = lamina.chunk_gdn2 if kind == "chunk" else lamina.fused_recurrent_gdn2
    return fn(q, k, v, x["g"], x["b"], x["w"], **common)


def _check_writes(variant, kind, backend, dtype):
    x = _inputs(variant, dtype)
    cu = torch.tensor([0, 17, 40])
    o, ht, v_new = _op(variant, kind, x, cu, backend)
    ref_in = {n: None if t is None else t.detach().double().requires_grad_() for n, t in x.items()}
    w = ref_in["w"] if variant == "gdn2" else ref_in["b"]
    r_o, r_ht, r_writes = delta_rule_family_recurrent_ref(
        ref_in["q"], ref_in["k"], ref_in["v"], ref_in["g"], ref_in["b"], w, None, ref_in["s0"], True, cu,
        output_writes=True)
    assert v_new.shape == x["v"].shape and v_new.dtype == x["v"].dtype
    assert_close("o", o, r_o)
    assert_close("final_state", ht, r_ht, dtype=dtype)
    assert_close("v_new", v_new, r_writes)
    # gradients through all three results, v_new's included (what CLER's router sends back)
    gen = torch.Generator().manual_seed(1)
    do, dht, dv_new = (torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (r_o, r_ht, r_writes))
    leaves = [n for n, t in x.items() if t is not None]
    loss = (o * do.to(dtype)).sum() + (ht * dht.to(ht.dtype)).sum() + (v_new * dv_new.to(dtype)).sum()
    grads = torch.autograd.grad(loss, [x[n] for n in leaves], retain_graph=True)
    r_loss = (r_o * do).sum() + (r_ht * dht).sum() + (r_writes * dv_new).sum()
    r_grads = torch.autograd.grad(r_loss, [ref_in[n] for n in leaves])
    scale = gradient_scale(list(r_grads))
    for name, got, want in zip(leaves, grads, r_grads):
        assert_close(f"d{name}", got, want, scale=scale)
    # without the v_new term the gradients are those of (o, final_state) alone: dv_new really enters
    plain = torch.autograd.grad((o * do.to(dtype)).sum() + (ht * dht.to(ht.dtype)).sum(), x["v"])
    assert not torch.allclose(plain[0], grads[leaves.index("v")])


@pytest.mark.parametrize("kind", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_v_new_is_the_token_loops_writes_torch(variant, kind, torch_path):
    _check_writes(variant, kind, "torch", torch.float64)


@pytest.mark.interpret
@pytest.mark.parametrize("variant,kind", [(v, "chunk") for v in VARIANTS] + [("gdn2", "fused_recurrent")])
def test_v_new_is_the_token_loops_writes_triton(variant, kind):
    """The Triton state pass stores v_new from registers; its backward adds dv_new to dU (fp32, varlen, GVA).
    The token-by-token ops reach the same chunked kernels for v_new (one variant, the widest gates)."""
    _check_writes(variant, kind, "triton", torch.float32)


def test_v_new_refused_with_in_place_decoding(torch_path):
    x = _inputs("gdn", torch.float32)
    with torch.no_grad():
        state = torch.zeros(1, 2, 16, 16)
        with pytest.raises(ValueError, match="output_v_new"):
            lamina.fused_recurrent_gated_delta_rule(x["q"][:, :1], x["k"][:, :1], x["v"][:, :1], g=x["g"][:, :1],
                                                    beta=x["b"][:, :1], initial_state=state, output_final_state=True,
                                                    inplace_final_state=True, output_v_new=True)
        with pytest.raises(TypeError, match="output_v_new must be a bool"):
            lamina.chunk_delta_rule(x["q"], x["k"], x["v"], x["b"], output_v_new="yes")


# --- layers ------------------------------------------------------------------------------------

def _layer(name, routing, **kw):
    torch.manual_seed(0)
    args = dict(hidden_size=32, num_heads=2, routing=routing, **kw)
    if name != "DeltaNet":
        args["head_dim"] = 16
    return LAYERS[name](**args).double()


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_routes_its_value_target_and_write_error(name, torch_path):
    """CLVR returns v; CLER the writes. On a sequence's first token the state is zero, so the write is
    the gated value (beta * v, GDN-2: w * v): a check that does not go through the ops."""
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    clvr, cler = _layer(name, "clvr"), _layer(name, "cler")
    cler.load_state_dict(clvr.state_dict())
    o1, _, _, value = clvr(x, output_routed=True)
    o2, _, _, error = cler(x, output_routed=True)
    plain, _, _ = clvr(x)
    assert value.shape == error.shape == (2, 9, clvr.value_dim)
    torch.testing.assert_close(o1, plain, rtol=0, atol=0)
    torch.testing.assert_close(o2, plain, rtol=0, atol=0)
    heads = (clvr.num_v_heads, clvr.head_v_dim)
    if name == "GatedDeltaNet2":
        gate = clvr.w_proj(x).sigmoid().unflatten(-1, heads)
    else:
        gate = clvr.b_proj(x).sigmoid().unsqueeze(-1)
    gated = (gate * value.unflatten(-1, heads)).flatten(-2)
    torch.testing.assert_close(error[:, 0], gated[:, 0])
    # later tokens subtract what the state already predicts: not the gated value any more
    assert not torch.allclose(error[:, 1:], gated[:, 1:], atol=1e-3)


@pytest.mark.parametrize("routing", ["clvr", "cler"])
def test_layer_routed_values_add_to_the_value_target_and_padding(routing, torch_path):
    """routed_values r shifts the value target by r (CLVR returns v + r); with a padding mask each row
    routes what it routes alone, zeros at padding."""
    layer = _layer("GatedDeltaNet", routing)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    r = torch.randn(2, 7, layer.value_dim, dtype=torch.float64)
    _, _, _, base = layer(x, output_routed=True)
    o, _, _, shifted = layer(x, routed_values=r, output_routed=True)
    if routing == "clvr":
        torch.testing.assert_close(shifted, base + r)
    else:
        assert not torch.allclose(shifted, base)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    o_pad, _, _, routed_pad = layer(x, attention_mask=mask, routed_values=r, output_routed=True)
    o_row, _, _, routed_row = layer(x[1:, :4], routed_values=r[1:, :4], output_routed=True)
    torch.testing.assert_close(routed_pad[1, :4], routed_row[0])
    torch.testing.assert_close(o_pad[1, :4], o_row[0])
    assert (routed_pad[1, 4:] == 0).all()
    torch.testing.assert_close(routed_pad[0], shifted[0])


def test_router_and_layer_bad_input(torch_path):
    with pytest.raises(ValueError, match="routing must be None or one of"):
        GatedDeltaNet(hidden_size=32, num_heads=2, head_dim=16, routing="values")
    with pytest.raises(ValueError, match="kind must be"):
        CrossLayerRouter(8, 8, kind=None)
    with pytest.raises(ValueError, match="in_features"):
        CrossLayerRouter(0, 8)
    router = CrossLayerRouter(8, 4)
    assert (router.weight == 0).all() and router.weight.shape == (4, 8)
    with pytest.raises(ValueError, match=r"routed must have shape \[..., in_features=8\]"):
        router(torch.randn(2, 3, 5))
    plain = _layer("GatedDeltaNet", None)
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="output_routed=True needs a layer built with routing"):
        plain(x, output_routed=True)
    with pytest.raises(ValueError, match="routed_values must have shape"):
        plain(x, routed_values=torch.randn(1, 5, 7, dtype=torch.float64))
    with pytest.raises(ValueError, match="routed_values must have shape"):
        plain(x, routed_values=torch.randn(1, 4, plain.value_dim, dtype=torch.float64))
    with pytest.raises(ValueError, match="routing must be None or one of"):
        LinearLMConfig(16, 32, 2, routing="CLVR")


# --- LinearLM with routing -----------------------------------------------------------------------

def _lm(layer, routing, attention_every=0, num_layers=3, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    config = LinearLMConfig(40, 32, num_layers, layer=layer, num_heads=2,
                            head_dim=None if layer == "DeltaNet" else 16, attention_every=attention_every,
                            backend="torch", routing=routing, **kw)
    return LinearLM(config).to(dtype)


@pytest.mark.parametrize("routing", ["clvr", "cler"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_stack_with_routing_equals_the_stack_without_at_initialisation(layer, routing, torch_path):
    """Same seed, same parameters (the routers draw nothing), routers at zero: the logits are equal
    (torch.equal), and one backward gives every router a nonzero gradient."""
    routed, plain = _lm(layer, routing, dtype=torch.float32), _lm(layer, None, dtype=torch.float32)
    assert len(routed.routers) == 2 and all(r.kind == routing for r in routed.routers)
    plain_params = dict(plain.named_parameters())
    for n, p in routed.named_parameters():
        if not n.startswith("routers."):
            assert torch.equal(p, plain_params[n]), n
    ids = torch.randint(0, 40, (2, 13), generator=torch.Generator().manual_seed(4))
    out, ref = routed(ids, labels=ids), plain(ids, labels=ids)
    assert torch.equal(out.logits, ref.logits)
    out.loss.backward()
    for i, router in enumerate(routed.routers):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0, i


def test_hybrid_stack_routes_across_attention_blocks(torch_path):
    model = _lm("GatedDeltaNet", "cler", attention_every=2, num_layers=4)
    # blocks: delta, attention, delta, attention -> one router, from delta layer 0 to delta layer 1
    assert len(model.routers) == 1
    ids = torch.randint(0, 40, (1, 9), generator=torch.Generator().manual_seed(5))
    model(ids, labels=ids).loss.backward()
    assert model.routers[0].weight.grad.abs().sum() > 0


def _recall_batch(gen, batch, pairs=4, keys=8):
    """Key-value pairs, then one of the keys again: the label at the last position is its value.
    Keys are tokens 1..keys, values keys+1..2*keys; only the answer is scored."""
    k = torch.stack([torch.randperm(keys, generator=gen)[:pairs] for _ in range(batch)]) + 1
    v = torch.randint(keys + 1, 2 * keys + 1, (batch, pairs), generator=gen)
    pick = torch.randint(0, pairs, (batch,), generator=gen)
    ids = torch.cat([torch.stack([k, v], dim=-1).flatten(1), k.gather(1, pick[:, None]),
                     torch.zeros(batch, 1, dtype=torch.long)], dim=1)
    labels = torch.full_like(ids, -100)
    labels[:, -1] = v.gather(1, pick[:, None]).squeeze(1)
    return ids, labels


@pytest.mark.parametrize("routing", ["clvr", "cler"])
def test_routed_two_layer_lm_learns_a_recall_task(routing, torch_path):
    """300 Adam steps (fixed seeds, about 13 s on one CPU thread): the answer's loss falls from chance
    (log 17 = 2.83 over the vocabulary) to under a quarter of it (seen: 2.78 -> 0.14 CLVR, 0.16 CLER,
    0.04 without routing), and the routers leave zero."""
    torch.manual_seed(0)
    model = LinearLM(LinearLMConfig(17, 32, 2, layer="GatedDeltaNet", num_heads=2, head_dim=16, backend="torch",
                                    routing=routing, layer_kwargs={"use_short_conv": True}))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(300):
        ids, labels = _recall_batch(gen, 32)
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert first > 1.5, first
    assert last < 0.25 * first, (first, last)
    assert model.routers[0].weight.abs().max() > 0


@pytest.mark.parametrize("routing", ["clvr", "cler"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_decoding_with_routing_equals_the_full_forward(layer, routing, torch_path):
    """Prefill 5 tokens then 3 single steps, routers nonzero: every position's logits equal the full
    forward's (float64, only the order of sums differs); hybrid stack (attention in block 2)."""
    model = _lm(layer, routing, attention_every=2).eval()
    with torch.no_grad():
        for r in model.routers:
            r.weight.normal_(0, 0.3)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        reference = _lm(layer, None, attention_every=2).eval()(ids).logits
        assert not torch.allclose(full, reference, atol=1e-6)  # the routers change the result
        cache = model.new_cache(2, 8)
        steps = [model.decode(ids[:, :5], cache)] + [model.decode(ids[:, t:t + 1], cache) for t in range(5, 8)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.interpret
@pytest.mark.parametrize("routing", ["clvr", "cler"])
def test_routed_stack_under_the_interpreter_matches_pytorch(routing, monkeypatch):
    """The Triton path (fp32, interpreted: the state pass's v_new store and the dv_new term of its backward)
    against the same model in float64 on the PyTorch path: logits and every parameter's gradient within the
    fp32 table, or within 3x the error of the same model's fp32 PyTorch path (FlashAttention's rule,
    ``assert_close(baseline=)``): a whole LM's gradients carry more fp32 roundoff than one op's (measured at
    KDA, 2 blocks: embedding gradient RMS ratio 6.7e-5 on the PyTorch path without routing, 1.4e-4 Triton)."""
    model = _lm("KimiDeltaAttention", routing, dtype=torch.float32)
    with torch.no_grad():
        for r in model.routers:
            r.weight.normal_(0, 0.3)
    ids = torch.randint(0, 40, (1, 9), generator=torch.Generator().manual_seed(3))

    def run(m):
        m.zero_grad()
        out = m(ids, labels=ids)
        out.loss.backward()
        return out.logits.detach().clone(), {n: p.grad.clone() for n, p in m.named_parameters()}

    logits, grads = run(model)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    base_logits, base_grads = run(model)
    ref_model = _lm("KimiDeltaAttention", routing)
    ref_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ref_logits, ref_grads = run(ref_model)
    assert_close("logits", logits, ref_logits, baseline=base_logits)
    scale = gradient_scale(list(ref_grads.values()))
    for name, grad in grads.items():
        assert_close(f"d {name}", grad, ref_grads[name], scale=scale, baseline=base_grads[name])
