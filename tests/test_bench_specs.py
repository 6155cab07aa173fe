"""FLOP and byte formulas of the benchmark suite, against values computed by hand."""

from __future__ import annotations

import pytest

from lamina.bench import specs
from lamina.bench.specs import MODES, OPS, get_op, shape_label, shapes_for


def test_delta_rule_flops_and_bytes_by_hand():
    # B=1, T=64, H=HV=1, K=V=64, bf16, chunk C=64. Per token and head:
    # 6KV = 24576, 6CK = 24576, 4CV = 16384, C^2/3 = 1365.33...  -> 66901.33 ; x 64 tokens.
    p = specs.delta_shape(1, 64, 1, 64, "bf16")
    fwd = 64 * (24576 + 24576 + 16384 + 4096 / 3)
    spec = get_op("delta_rule")
    assert spec.flops(p, "fwd") == pytest.approx(fwd)
    assert spec.flops(p, "bwd") == pytest.approx(2 * fwd)
    assert spec.flops(p, "fwd+bwd") == pytest.approx(3 * fwd)
    # q, k: 2 * 64 * 64 = 8192; v: 4096; beta: 64 -> inputs 12352; o: 4096; 2 bytes each.
    assert spec.bytes(p, "fwd") == 2 * (12352 + 4096)
    # backward reads inputs and dO, writes one gradient per input.
    assert spec.bytes(p, "bwd") == 2 * (12352 + 4096 + 12352)
    assert spec.bytes(p, "fwd+bwd") == 2 * (12352 + 4096) + 2 * (12352 + 4096 + 12352)


def test_gdn2_counts_channel_gates_and_value_heads():
    # B=2, T=8, H=2, HV=4, K=16, V=32, fp32.
    p = specs.delta_shape(2, 8, 2, 16, "fp32", HV=4, V=32)
    # per token and value head: 6*16*32 + 6*64*16 + 4*64*32 + 64*64/3 ; 16 tokens x 4 value heads.
    assert get_op("gdn2").flops(p, "fwd") == pytest.approx(64 * (3072 + 6144 + 8192 + 4096 / 3))
    # q, k: 2*2*8*2*16 = 1024; v: 2*8*4*32 = 2048; g, b: 2*8*4*16 = 1024 each; w: 2048; o: 2048.
    assert get_op("gdn2").bytes(p, "fwd") == 4 * (1024 + 2048 + 1024 + 1024 + 2048 + 2048)


def test_gated_and_kda_gate_sizes():
    p = specs.delta_shape(1, 10, 3, 8, "fp32", V=4)
    base = 2 * 10 * 3 * 8 + 10 * 3 * 4 + 10 * 3 * 4  # q, k, v, o
    assert get_op("gated_delta_rule").bytes(p, "fwd") == 4 * (base + 30 + 30)  # g and beta per head
    assert get_op("kda").bytes(p, "fwd") == 4 * (base + 30 * 8 + 30)  # g per K channel, beta per head


def test_varlen_shape_packs_tokens():
    p = specs.delta_shape(0, 0, 2, 16, "fp32", seqlens=(24, 40))
    assert (p["B"], p["T"]) == (1, 64)
    assert shape_label("delta_rule", p) == "varlen2x64x2x16 fp32"
    dense = specs.delta_shape(1, 64, 2, 16, "fp32")
    assert get_op("kda").flops(p, "fwd") == get_op("kda").flops(dense, "fwd")


def test_attention_flops_and_bytes_by_hand():
    # B=1, T=4, H=2, HKV=1, D=8, causal, bf16: 4*5/2 = 10 visible pairs per head.
    p = specs.attn_shape(1, 4, 2, 8, "bf16", HKV=1)
    spec = get_op("prism_attention")
    assert spec.flops(p, "fwd") == 4 * 1 * 2 * 10 * 8
    assert spec.flops(p, "bwd") == 2.5 * 640
    # q = o = 1*4*2*8 = 64 elements; k + v = 2*1*4*1*8 = 64.
    assert spec.bytes(p, "fwd") == 2 * (64 + 64 + 64)
    # q, k, v, o, dO in; dq, dk, dv out; float32 lse [1, 2, 4] read.
    assert spec.bytes(p, "bwd") == 2 * (64 * 3 + 64 + 64 + 64) + 4 * 8


def test_attention_decode_is_not_causal():
    p = specs.attn_shape(2, 1, 2, 8, "fp32", causal=False, Tk=16)
    assert get_op("attention_decode").flops(p, "fwd") == 4 * 2 * 2 * 16 * 8
    with pytest.raises(ValueError, match="Tq == Tk"):
        get_op("attention_decode").flops({**p, "causal": True}, "fwd")


def test_hrm_fallback_formulas_by_hand():
    p = specs.hrm_shape(4, 8, "fp32")
    # 32 elements x (8 gate/blend + 4 norm) FLOPs.
    assert specs.hrm_flops_fallback(p, "fwd") == 32 * 12
    # h, c, gate in and y out (4 x 32) + bias and weight (16), 4 bytes each.
    assert specs.hrm_bytes_fallback(p, "fwd") == 4 * (128 + 16)
    assert specs.hrm_bytes_fallback(p, "bwd") == 4 * (7 * 32 + 32)


def test_hrm_spec_uses_the_op_modules_counts_when_present():
    ops = pytest.importorskip("lamina.ops.hrm_update", reason="lamina.ops.hrm_update is not importable here")
    import torch

    p = specs.hrm_shape(8192, 4096, "bf16")
    spec = get_op("hrm_update")
    for mode in MODES:
        assert spec.flops(p, mode) == ops.hrm_update_flops((8192, 4096), norm=True, mode=mode)
        assert spec.bytes(p, mode) == ops.hrm_update_bytes((8192, 4096), torch.bfloat16, norm=True, mode=mode,
                                                          param_dtype=torch.bfloat16)


def test_hrm_spec_falls_back_when_the_op_module_is_missing(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "lamina.ops.hrm_update", None)
    p = specs.hrm_shape(4, 8, "fp32")
    assert get_op("hrm_update").flops(p, "fwd") == specs.hrm_flops_fallback(p, "fwd")
    assert get_op("hrm_update").bytes(p, "bwd") == specs.hrm_bytes_fallback(p, "bwd")


def test_gdn_decode_by_hand():
    p = specs.decode_shape(2, 2, 4, "fp32")
    assert get_op("gdn_decode").flops(p, "fwd") == 7 * 2 * 2 * 4 * 4
    # float32 state read and written: 2 * 4 * (2*2*16); q, k, v, o: 4 x 16 elements; g, beta: 2 x 4.
    assert get_op("gdn_decode").bytes(p, "fwd") == 2 * 4 * 64 + 4 * (4 * 16 + 8)


def test_short_conv_by_hand():
    p = specs.conv_shape(2, 3, 4, 5, "bf16")
    spec = get_op("short_conv")
    # 24 outputs x (5 multiply-adds + SiLU 5); backward: recompute (10) + SiLU gradient (9) + dx (10) + dw (10).
    assert spec.flops(p, "fwd") == 24 * 15
    assert spec.flops(p, "bwd") == 24 * 39
    assert spec.flops(p, "fwd+bwd") == 24 * 54
    # x in and y out (2 x 24) + the 4 x 5 weight; backward x, dy in, dx out (3 x 24), weight and dweight; 2 bytes.
    assert spec.bytes(p, "fwd") == 2 * (48 + 20)
    assert spec.bytes(p, "bwd") == 2 * (72 + 40)
    assert shape_label("short_conv", p) == "2x3x4 W=5 bf16"


def test_unknown_names_and_modes_fail_with_a_sentence():
    with pytest.raises(ValueError, match="unknown op 'nope'; known ops: delta_rule"):
        get_op("nope")
    with pytest.raises(ValueError, match="mode must be one of"):
        get_op("kda").flops(specs.delta_shape(1, 8, 1, 8, "fp32"), "backward")
    with pytest.raises(ValueError, match="shape set must be one of"):
        shapes_for("kda", "huge")


def test_standard_shapes_are_the_issue_shapes():
    labels = [shape_label("kda", p) for p in shapes_for("kda", "standard")]
    for b, t, h, d in ((1, 8192, 96, 128), (2, 16384, 16, 128), (4, 2048, 16, 128), (4, 4096, 64, 128),
                       (8, 2048, 32, 256), (8, 1024, 8, 64)):
        assert f"{b}x{t}x{h}x{d} bf16" in labels
    assert any(label.startswith("varlen") for label in labels)
    assert [p["D"] for p in shapes_for("prism_attention", "standard")] == [64, 128, 256, 320, 512]
    assert all((p["B"], p["Tq"], p["causal"]) == (4, 4096, True) for p in shapes_for("prism_attention", "standard"))
    assert [(p["N"], p["D"]) for p in shapes_for("hrm_update", "standard")] == [(8192, 4096)]
    assert [p["B"] for p in shapes_for("gdn_decode", "standard")] == [1, 16, 64]
    assert [(p["B"], p["T"], p["D"], p["W"]) for p in shapes_for("short_conv", "standard")] == [
        (8, 2048, 2048, 4), (8, 2048, 4096, 4)]


@pytest.mark.parametrize("op", list(OPS))
def test_every_op_has_every_shape_set_and_positive_counts(op):
    spec = get_op(op)
    for shape_set in specs.SHAPE_SETS:
        shapes = shapes_for(op, shape_set)
        assert shapes, f"{op} has no {shape_set} shapes"
        for p in shapes:
            for mode in spec.modes:
                assert spec.flops(p, mode) > 0 and spec.bytes(p, mode) > 0
    for shape_set in specs.SWEEP_SHAPE_SETS:
        if op in specs.SWEEP_OPS:
            assert shapes_for(op, shape_set), f"{op} has no {shape_set} shapes"
        else:
            with pytest.raises(ValueError, match=f"has no '{shape_set}' shapes"):
                shapes_for(op, shape_set)


def test_attention_sweep_shapes_have_equal_flops_at_every_head_dim():
    """4 x 4096 with H x D = 2048: the FLOPs of every head dim equal up to the rounding of the heads (H x D from
    1920 at D = 320 and 384 to 2112 at D = 192: within 10%)."""
    shapes = shapes_for("prism_attention", "sweep")
    assert sorted({p["D"] for p in shapes}) == list(specs.SWEEP_ATTN_DIMS)
    assert {p["causal"] for p in shapes} == {True, False} and len(shapes) == 2 * len(specs.SWEEP_ATTN_DIMS)
    flops = [get_op("prism_attention").flops(p, "fwd") for p in shapes if p["causal"]]
    assert max(flops) / min(flops) < 1.101
    assert next(p for p in shapes if p["D"] == 128)["H"] == 16

# ---- the layer ops ---------------------------------------------------------------------------


def test_layer_flops_and_bytes_by_hand():
    # GatedDeltaNet, hidden 64, head_dim 16, 2 heads, expand_v 2 (key width 32, value width 64), B=1, T=32, fp32.
    p = specs.layer_shape(1, 32, "fp32", hidden_size=64, head_dim=16, num_heads=2, expand_v=2)
    # Linears (in x out): q, k 64x32; v 64x64; a, b 64x2; g 64x64; o 64x64 -> 16640 MACs per token.
    linear = 2 * (2 * 64 * 32 + 64 * 64 + 2 * 64 * 2 + 64 * 64 + 64 * 64)
    conv = 2 * (32 + 32 + 64) * 4  # depthwise, 4 taps
    # recurrence per token and value head (K=16, V=32, C=64): 6KV + 6CK + 4CV + C^2/3; 2 value heads.
    recurrence = 2 * (6 * 16 * 32 + 6 * 64 * 16 + 4 * 64 * 32 + 64 * 64 / 3)
    fwd = 32 * (linear + conv + recurrence)
    spec = get_op("layer_gated_deltanet")
    assert spec.modes == ("fwd", "fwd+bwd")
    assert spec.flops(p, "fwd") == pytest.approx(fwd)
    assert spec.flops(p, "fwd+bwd") == pytest.approx(3 * fwd)
    # the recurrence term is the delta-rule op's own formula
    rec = specs.delta_shape(1, 32, 2, 16, "fp32", V=32)
    assert spec.flops(p, "fwd") == pytest.approx(32 * (linear + conv) + get_op("gated_delta_rule").flops(rec, "fwd"))
    # weights: 16640 (linears) + 128 * 4 (convs) + A_log 2 + dt_bias 2 + norm weight 32 = 17188
    assert specs.layer_dims("layer_gated_deltanet", p["layer"]).params == 17188
    x = 32 * 64
    assert spec.bytes(p, "fwd") == 4 * (x + 17188 + x)  # x and the weights in, o out
    # backward: x, weights and dO in; dx and the weight gradients out
    assert spec.bytes(p, "fwd+bwd") == 4 * (x + 17188 + x) + 4 * (3 * x + 2 * 17188)


# Non-default options too: grouped value heads, no short convolutions, gates off, expand_k.
LAYER_OPTIONS = {
    "layer_deltanet": [dict(hidden_size=64, num_heads=2, use_gate=True, expand_v=2.0, conv_bias=True),
                       dict(d_model=64, num_heads=4, use_short_conv=False, use_beta=False, expand_k=0.5)],
    "layer_gated_deltanet": [dict(hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4, expand_v=1,
                                  use_gate=False, conv_bias=True)],
    "layer_kda": [dict(hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4, expand_v=2, conv_bias=True)],
    "layer_gdn2": [dict(hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4),
                   dict(hidden_size=64, head_dim=32, num_heads=2, expand_v=0.5, use_short_conv=False, conv_size=2)],
}


@pytest.mark.parametrize("op", specs.LAYER_OPS)
def test_layer_dims_are_those_of_the_modules(op):
    import torch

    import lamina.layers
    from lamina.layers.short_conv import ShortConvolution

    cases = [p["layer"] for s in ("tiny", "small", "standard") for p in shapes_for(op, s)] + LAYER_OPTIONS[op]
    for kwargs in cases:
        layer = getattr(lamina.layers, specs.LAYER_CLASSES[op])(**kwargs)
        d = specs.layer_dims(op, kwargs)
        linears = [(m.in_features, m.out_features, m.bias is not None) for m in layer.modules()
                   if isinstance(m, torch.nn.Linear)]
        assert sorted(linears) == sorted(d.linears), kwargs
        convs = [m for m in layer.modules() if isinstance(m, ShortConvolution)]
        assert [m.weight.shape[0] for m in convs] == list(d.convs), kwargs
        assert all(m.kernel_size[0] == d.conv_size for m in convs)
        assert sum(p.numel() for p in layer.parameters()) == d.params, kwargs
        heads = layer.num_v_heads if op == "layer_gdn2" else layer.num_heads  # GDN-2 repeats q, k to HV heads
        assert (d.H, d.HV, d.K, d.V) == (heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim), kwargs


def test_layer_standard_shapes_are_fla_widths():
    for op in specs.LAYER_OPS:
        shapes = shapes_for(op, "standard")
        assert [(p["B"], p["T"], p["dtype"]) for p in shapes] == [(2, 2048, "bf16"), (8, 2048, "bf16")]
        assert all(p["layer"]["hidden_size"] == 2048 for p in shapes)
        for s in ("small", "quick", "tiny"):
            assert all(64 <= p["layer"]["hidden_size"] <= 256 and 32 <= p["T"] <= 256 for p in shapes_for(op, s))
    labels = {op: shape_label(op, shapes_for(op, "standard")[0]) for op in specs.LAYER_OPS}
    assert labels == {"layer_deltanet": "2x2048 d2048 h16x128 bf16",
                      "layer_gated_deltanet": "2x2048 d2048 h6x256/512 bf16",  # fla's defaults
                      "layer_kda": "2x2048 d2048 h16x128 bf16", "layer_gdn2": "2x2048 d2048 h16x128 bf16"}


def test_op_groups_expand_in_order_without_repeats():
    assert specs.expand_ops(["layers"]) == list(specs.LAYER_OPS)
    assert specs.expand_ops(["kda", "layer_kda", "layers"]) == ["kda", "layer_kda", "layer_deltanet",
                                                                "layer_gated_deltanet", "layer_gdn2"]
    assert not set(specs.LAYER_OPS) & set(specs.RUN_ORDER)  # the default run is the kernel ops
