"""The chunked delta-rule backward kernels (kernels/delta_chunk_bwd.py) under the Triton interpreter.

Every gradient (dq, dk, dv, dg, db, dw, dinitial_state) is compared with torch autograd through the
float64 recurrent reference, run on the same (quantised) inputs, with the RMS-ratio bound of
tests/tolerances.py. ``h`` (the forward's chunk-start states) comes from the float64 recurrence, so
these tests do not depend on the forward kernels.
"""

from __future__ import annotations

import pytest
import torch
from test_delta_bwd_math import chunk_inverses, chunk_start_states, make_inputs, recurrent_ref
from tolerances import assert_close

from lamina.kernels.delta_chunk_bwd_tiles import bwd_tiles

GRAD_NAMES = ("dq", "dk", "dv", "dg", "db", "dw", "dinitial_state")
# Variant flags (decay, erase, write): decay 0 none / 1 scalar / 2 per-K; erase, write 0 scalar / 1 per-channel.
DELTANET, GDN, KDA, GDN2 = (0, 0, 0), (1, 0, 0), (2, 0, 0), (2, 1, 1)


def reference_forward(q, k, v, g, b, w, scale, initial_state, cu_seqlens):
    """(o, final_state) in float64: lamina.reference's recurrence when it is importable, else ours."""
    try:
        from lamina.reference import delta_rule_family_recurrent_ref as ref
    except (ImportError, AttributeError):
        ref = None
    if ref is None:
        o, final, _ = recurrent_ref(q, k, v, g, b, w, scale, initial_state, cu_seqlens)
        return o, final
    return ref(q, k, v, g=g, erase=b, write=w, scale=scale, initial_state=initial_state,
               output_final_state=True, cu_seqlens=cu_seqlens)


def reference_grads(inputs, scale, cu_seqlens, do, dfinal):
    leaves = [None if x is None else x.detach().double().requires_grad_() for x in inputs]
    o, final = reference_forward(*leaves[:6], scale, leaves[6], cu_seqlens)
    outs, grads = [o], [do.double()]
    if dfinal is not None:
        outs.append(final)
        grads.append(dfinal.double())
    torch.autograd.backward(outs, grads)
    return [None if x is None else x.grad for x in leaves]


def run_bwd(inputs, scale, cu_seqlens, do, dfinal, chunk_size):
    from lamina.kernels.delta_chunk_bwd import delta_chunk_bwd

    q, k, v, g, b, w, h0 = inputs
    h = chunk_start_states(q, k, v, g, b, w, scale, h0, cu_seqlens, chunk_size)
    A = chunk_inverses(k, g, b, v.shape[2], cu_seqlens, chunk_size).float()
    return delta_chunk_bwd(q, k, v, g, b, w, scale, h0, h, A, do, dfinal, cu_seqlens, chunk_size)


def build_case(B, T, H, HV, K, V, kinds, dtype=torch.float32, seqlens=None, init=True, final_grad=True,
               gate_scale=1.0, beta=None, device="cpu"):
    decay, erase, write = kinds
    q, k, v, g, b, w = make_inputs(B, T, H, HV, K, V, decay, erase, write, dtype=dtype, gate_scale=gate_scale)
    if beta is not None:
        b, w = torch.full_like(b, beta), torch.full_like(w, beta)
    cu = None
    if seqlens is not None:
        cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), dtype=torch.int32)
    N = B if cu is None else len(seqlens)
    h0 = torch.randn(N, HV, K, V) if init else None
    do = torch.randn(B, T, HV, V).to(dtype)
    dfinal = torch.randn(N, HV, K, V) if final_grad else None
    move = (lambda x: None if x is None else x.to(device))
    inputs = tuple(move(x) for x in (q, k, v, g, b, w, h0))
    return inputs, move(cu), move(do), move(dfinal)


def check_case(inputs, cu, do, dfinal, chunk_size=64, scale=None):
    q = inputs[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    got = run_bwd(inputs, scale, cu, do, dfinal, chunk_size)
    want = reference_grads(inputs, scale, cu, do, dfinal)
    for name, x, a, e in zip(GRAD_NAMES, inputs, got, want):
        if x is None:
            assert a is None, f"{name} must be None when its input is None"
            continue
        assert a.shape == x.shape and a.dtype == x.dtype, f"{name}: {a.shape}/{a.dtype} vs {x.shape}/{x.dtype}"
        assert_close(name, a, e, kind="recurrence", dtype=q.dtype)
    return got


# (B, T, H, HV, K, V, kinds, init): T in {1, 17, 64, 100}, K/V in {32, 48, 64}, one K = 128, HV in {2, 4}.
SHAPES = [
    (2, 1, 2, 2, 32, 32, DELTANET, True),
    (1, 17, 2, 4, 48, 32, DELTANET, False),
    (1, 100, 2, 4, 64, 48, DELTANET, True),
    (2, 1, 2, 4, 32, 48, GDN, True),
    (1, 17, 2, 2, 64, 32, GDN, True),
    (1, 100, 2, 2, 48, 64, GDN, True),
    (1, 64, 2, 2, 128, 32, GDN, True),
    (1, 1, 2, 2, 48, 32, KDA, True),
    (1, 17, 2, 4, 32, 32, KDA, True),
    (1, 100, 2, 2, 48, 32, KDA, False),
    (1, 17, 2, 2, 48, 48, GDN2, True),
    (1, 64, 2, 2, 64, 32, GDN2, True),
    (1, 100, 2, 4, 32, 64, GDN2, False),
    # flag combinations outside the four named variants
    (1, 40, 2, 2, 32, 32, (1, 1, 0), True),
    (1, 40, 2, 2, 32, 32, (0, 0, 1), True),
]


@pytest.mark.grid
@pytest.mark.interpret
@pytest.mark.parametrize("B,T,H,HV,K,V,kinds,init", SHAPES)
def test_bwd_fp32(B, T, H, HV, K, V, kinds, init):
    check_case(*build_case(B, T, H, HV, K, V, kinds, init=init))


@pytest.mark.interpret
@pytest.mark.parametrize("kinds", [DELTANET, GDN, KDA, GDN2], ids=["deltanet", "gdn", "kda", "gdn2"])
def test_bwd_varlen(kinds):
    # three unequal sequences: one spans two chunks with a partial tail, one is a single token
    HV = 4 if kinds[0] < 2 else 2
    check_case(*build_case(1, 100, 2, HV, 32, 48, kinds, seqlens=[70, 1, 29]))


def record_bwd_tiles(monkeypatch):
    """The ``BwdTiles`` of every backward launch from now on (a list)."""
    import lamina.kernels.delta_chunk_bwd as bwd

    used = []
    monkeypatch.setattr(bwd, "bwd_tiles", lambda *a, **kw: used.append(bwd_tiles(*a, **kw)) or used[-1])
    return used


# KDA and GDN-2 at K = 512 (37 s and 33 s here) are marked slow for CI's time: test_delta_ops.py's
# test_training_with_keys_of_512[gdn2] runs the per-channel decay's backward kernels at K = 512 through the op.
HEAD_DIM_CASES = [pytest.param(kinds, K, V, id=f"{name}-{K}-{V}",
                               marks=[pytest.mark.slow] if name in ("kda", "gdn2") and K == 512 else [])
                  for K, V in ((16, 16), (256, 48), (512, 32), (32, 512))
                  for name, kinds in (("deltanet", DELTANET), ("gdn", GDN), ("kda", KDA), ("gdn2", GDN2))]


@pytest.mark.grid
@pytest.mark.interpret
@pytest.mark.parametrize("kinds,K,V", HEAD_DIM_CASES)
def test_bwd_head_dims(kinds, K, V):
    # the narrowest tiles, keys whose scan keeps dH in memory for every dtype (K = 256, and 512: past the
    # four register blocks), values over 32 scan programs; two chunks, the second partial
    import lamina.kernels.delta_chunk_bwd as bwd

    assert bwd.bwd_tiles(K, V, kinds[0], False).dh_in_memory == (K > 128)
    check_case(*build_case(1, 70, 1, 2, K, V, kinds))


@pytest.mark.grid  # a speed alternative: the oldest-Triton CI leg compiles it (static report), leg 1 runs it
@pytest.mark.interpret
@pytest.mark.parametrize("kinds", [DELTANET, GDN, KDA, GDN2], ids=["deltanet", "gdn", "kda", "gdn2"])
def test_bwd_scan_with_dh_in_memory(kinds, monkeypatch):
    # the reverse scan's in-memory dH (what K > 128 runs) at a small K, varlen, with and without the
    # final state's gradient and the initial state, V a multiple of the V block and not
    from lamina.kernels.delta_tuning import delta_tuning

    used = record_bwd_tiles(monkeypatch)
    with delta_tuning(dh_in_memory=True):
        check_case(*build_case(1, 100, 2, 2, 64, 32, kinds, seqlens=[70, 1, 29]))
        check_case(*build_case(2, 40, 2, 2, 64, 40, kinds, init=False, final_grad=False))
    assert [t.dh_in_memory for t in used] == [True, True]


@pytest.mark.grid  # a speed alternative: the oldest-Triton CI leg compiles it (static report), leg 1 runs it
@pytest.mark.interpret
@pytest.mark.parametrize("kinds", [DELTANET, GDN, KDA, GDN2], ids=["deltanet", "gdn", "kda", "gdn2"])
def test_bwd_scan_with_dh_in_registers_fp32(kinds, monkeypatch):
    # fp32 keeps dH in memory by default; on request it is held in registers as 32-row key blocks: four
    # of them at K = 128 (every unrolled block of the scan), two at K = 64 with a partial V block
    from lamina.kernels.delta_tuning import delta_tuning

    used = record_bwd_tiles(monkeypatch)
    with delta_tuning(dh_in_memory=False):
        check_case(*build_case(1, 100, 1, 1, 128, 16, kinds, seqlens=[70, 30]))
        check_case(*build_case(1, 70, 2, 2, 64, 24, kinds, init=False))
    assert [(t.dh_in_memory, t.scan_bk) for t in used] == [(False, 32), (False, 32)]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kinds", [DELTANET, GDN, KDA, GDN2], ids=["deltanet", "gdn", "kda", "gdn2"])
def test_bwd_low_precision(kinds, dtype):
    check_case(*build_case(1, 100, 2, 2, 32, 48, kinds, dtype=dtype))


@pytest.mark.interpret
@pytest.mark.parametrize("chunk_size", [16, 32])
def test_bwd_small_chunks(chunk_size):
    check_case(*build_case(1, 70, 2, 4, 32, 32, GDN2, seqlens=[45, 25]), chunk_size=chunk_size)


@pytest.mark.interpret
@pytest.mark.parametrize("kinds", [KDA, GDN2], ids=["kda", "gdn2"])
def test_bwd_strong_channel_decay(kinds):
    check_case(*build_case(1, 100, 2, 2, 32, 32, kinds, gate_scale=8.0))


@pytest.mark.interpret
def test_bwd_mixed_channels_finite_at_minus_20():
    # half the channels barely decay, half decay by e^-20 per token: in-chunk exponents reach -1280
    inputs, cu, do, dfinal = build_case(1, 80, 1, 1, 32, 32, GDN2)
    g = inputs[3]
    g[..., ::2] = -1e-3 * torch.rand_like(g[..., ::2])
    g[..., 1::2] = -20.0
    got = check_case(inputs, cu, do, dfinal)
    assert all(bool(torch.isfinite(x).all()) for x in got if x is not None)


@pytest.mark.interpret
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("kinds", [GDN, GDN2], ids=["gdn", "gdn2"])
def test_bwd_beta_at_bounds(kinds, beta):
    check_case(*build_case(1, 40, 2, 2, 32, 32, kinds, beta=beta))


@pytest.mark.interpret
def test_bwd_optional_inputs():
    # no final-state gradient, no write gate (w = 1), scalar erase
    inputs, cu, do, _ = build_case(1, 40, 2, 4, 32, 32, KDA, init=False)
    q, k, v, g, b, _, h0 = inputs
    check_case((q, k, v, g, b, None, h0), cu, do, None)


@pytest.mark.interpret
def test_bwd_deterministic():
    inputs, cu, do, dfinal = build_case(1, 50, 2, 2, 32, 32, GDN2, seqlens=[30, 20])
    scale = 32**-0.5
    first = run_bwd(inputs, scale, cu, do, dfinal, 64)
    second = run_bwd(inputs, scale, cu, do, dfinal, 64)
    for name, a, c in zip(GRAD_NAMES, first, second):
        assert torch.equal(a, c), f"{name} differs between two runs"


@pytest.mark.interpret
def test_bwd_b_and_w_same_tensor():
    # the ops layer passes beta as both gates and adds db + dw
    inputs, cu, do, dfinal = build_case(1, 40, 2, 2, 32, 32, GDN)
    q, k, v, g, b, _, h0 = inputs
    got = run_bwd((q, k, v, g, b, b, h0), 0.3, cu, do, dfinal, 64)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, g, b, h0)]
    o, final = reference_forward(*leaves[:5], leaves[4], 0.3, leaves[5], cu)
    torch.autograd.backward([o, final], [do.double(), dfinal.double()])
    assert_close("dbeta", got[4] + got[5], leaves[4].grad, kind="recurrence", dtype=q.dtype)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kinds", [DELTANET, GDN, KDA, GDN2], ids=["deltanet", "gdn", "kda", "gdn2"])
def test_bwd_warpgroup_tiles(kinds, dtype, monkeypatch):
    # the wider dqk key blocks Hopper runs with (64, or 32 with per-channel decay), not only the
    # 16-column blocks the interpreter and mma.sync targets use; with a dense decay also Hopper's P^T and
    # transposed dqk grams formed as products of their own (prep_p_product, dqk_regram), in 16-bit too
    import lamina.kernels.delta_chunk_bwd as bwd

    hopper, other = bwd.bwd_tiles(64, 32, kinds[0], True), bwd.bwd_tiles(64, 32, kinds[0], False)
    assert hopper.dqk_bk > other.dqk_bk
    dense = kinds[0] != bwd.DecayKind.CHANNEL
    assert (hopper.prep_p_product, hopper.dqk_regram, other.prep_p_product, other.dqk_regram) == (dense, dense,
                                                                                                  False, False)
    monkeypatch.setattr(bwd, "has_warpgroup_mma", lambda device: True)
    check_case(*build_case(1, 40, 2, 2, 64, 32, kinds, dtype=dtype))


def test_fp32_report_rows_regram_with_a_dense_decay(monkeypatch):
    # the fp32 rows (full grid) compile the dqk kernel as the launcher runs it: dk's transposed gradients as
    # grams of their own with a dense decay, tl.trans of dP and dM with a per-channel one and in 16-bit
    import lamina.kernels._utils as utils
    from lamina.kernels.delta_chunk_common import DecayKind
    from lamina.kernels.delta_report import _register_bwd

    monkeypatch.setattr(utils, "_REGISTRY", [])
    for dtype in ("fp32", "bf16"):
        _register_bwd(64, dtype, False)
    rows = [s for s in utils.registered_aot() if s.name == "_delta_chunk_bwd_dqk_kernel"]
    assert len(rows) >= 8
    for spec in rows:
        # Hopper (sm_90) regrams in 16-bit too: tl.trans of a product's result is the Triton 3.4-3.6 miscompile
        hopper_only = spec.meta.get("archs") == [90]
        want = (spec.signature["k"] == "*fp32" or hopper_only) and spec.constexprs["DECAY"] != DecayKind.CHANNEL
        assert spec.constexprs["REGRAM"] == want, spec.config
    prep = [s for s in utils.registered_aot() if s.name == "_delta_chunk_bwd_prep_kernel"]
    for spec in prep:  # P^T as a product of its own: dense decays on Hopper
        want = spec.meta.get("archs") == [90] and spec.constexprs["DECAY"] != DecayKind.CHANNEL
        assert spec.constexprs["P_PRODUCT"] == want, spec.config


def test_bwd_report_matches_launch():
    # every registered configuration is what the launcher runs on the targets it is registered for: the
    # defaults, and (non-default rows) under the speed alternative the row names
    import lamina.kernels.delta_chunk_bwd as bwd
    import lamina.kernels.delta_report  # noqa: F401 - registers the family's rows
    from lamina.kernels._utils import registered_aot
    from lamina.kernels.delta_chunk_common import BetaAct, DecayKind, GateAct, GateKind
    from lamina.kernels.delta_report import BETA_ROW, GATE_ROW, L2NORM_ARCHS, L2NORM_ROW
    from lamina.kernels.delta_tuning import ALTERNATIVE_ARCHS, ALTERNATIVES

    specs = [s for s in registered_aot() if s.name.startswith("_delta_chunk_bwd_")]
    assert {s.name for s in specs} == {"_delta_chunk_bwd_prep_kernel", "_delta_chunk_bwd_dh_kernel",
                                       "_delta_chunk_bwd_dqk_kernel"}
    field = {"_delta_chunk_bwd_prep_kernel": "prep", "_delta_chunk_bwd_dh_kernel": "scan",
             "_delta_chunk_bwd_dqk_kernel": "dqk"}
    covered = set()
    for spec in specs:
        assert spec.num_stages == bwd.NUM_STAGES, spec.config
        assert spec.meta.get("attrs"), f"{spec.config}: compiled without the JIT's pointer alignment"
        c = spec.constexprs
        tuning = None
        # the gate activation fused in (with the beta sigmoid where beta is a scalar), default blocks
        gated = spec.config.endswith((" " + GATE_ROW, f" {GATE_ROW} {BETA_ROW}"))
        assert c["GATE_ACT"] == (GateAct.SOFTPLUS if gated else GateAct.NONE), spec.config
        sigmoid = gated and c["ERASE"] == GateKind.SCALAR
        assert spec.config.endswith(BETA_ROW) == sigmoid, spec.config
        assert c["BETA_ACT"] == (BetaAct.SIGMOID if sigmoid else BetaAct.NONE), spec.config
        # the l2norm of q and k fused in (with the gate activation and beta sigmoid where the variant has them)
        normed = L2NORM_ROW in spec.config
        assert c.get("L2NORM", False) == normed, spec.config
        if normed:
            assert spec.config.endswith((f" {L2NORM_ROW}", f" {L2NORM_ROW} {GATE_ROW}",
                                         f" {L2NORM_ROW} {GATE_ROW} {BETA_ROW}")), spec.config
            assert gated == (c["DECAY"] != DecayKind.NONE), spec.config
            assert not spec.default and set(spec.meta["archs"]) <= set(L2NORM_ARCHS), spec.config
            assert all(spec.signature[n] == "*fp32" for n in ("rq", "rk") if n in spec.signature), spec.config
            assert spec.signature.get("kn", spec.signature["k"]) == spec.signature["k"], spec.config
            assert spec.signature.get("qn", spec.signature["q"]) == spec.signature["q"], spec.config
        elif gated:
            assert not spec.default and set(spec.meta["archs"]) <= set(ALTERNATIVE_ARCHS), spec.config
        elif not spec.default:
            named = [t for t in ALTERNATIVES if spec.config.endswith(" " + t.label())]
            assert len(named) == 1, f"{spec.config}: a non-default row names one alternative"
            tuning = named[0]
        for arch in spec.meta.get("archs", (90, 80)):
            tiles = bwd.bwd_tiles(c["K"], c["V"], c["DECAY"], arch == 90, tuning, fp32=spec.signature["k"] == "*fp32")
            want = (getattr(tiles, field[spec.name] + "_bk"), getattr(tiles, field[spec.name] + "_bv"))
            assert (c["BK"], c["BV"]) == want, f"{spec.name} {spec.config} sm_{arch}"
            assert spec.num_warps == getattr(tiles, field[spec.name] + "_warps"), f"{spec.config} sm_{arch}"
            if spec.name in ("_delta_chunk_bwd_dh_kernel", "_delta_chunk_bwd_dqk_kernel"):
                assert c["STORE_DH"] == tiles.store_dh, spec.config
            if spec.name == "_delta_chunk_bwd_dh_kernel":
                assert c["DH_IN_MEMORY"] == tiles.dh_in_memory, spec.config
            if spec.name == "_delta_chunk_bwd_prep_kernel":
                assert c["P_PRODUCT"] == tiles.prep_p_product, f"{spec.config} sm_{arch}"
            if spec.name == "_delta_chunk_bwd_dqk_kernel":
                assert c["REGRAM"] == tiles.dqk_regram, spec.config
                assert c["BY_COLUMN"] == tiles.dqk_by_column, f"{spec.config} sm_{arch}"
                assert c["CHANNEL_DOTS"] == tiles.channel_dots, f"{spec.config} sm_{arch}"
            if spec.default:
                covered.add((spec.name, c["DECAY"], c["ERASE"], arch, c["K"]))
    assert len(covered) == 3 * 4 * 2 * 2, "every kernel, variant and target has a default at K = 128 and 512"
    assert any(s.constexprs.get("DH_IN_MEMORY") for s in specs), "the scan with dH in memory is in the report"
    normed = {(s.name, s.constexprs["DECAY"], s.constexprs["ERASE"]) for s in specs if s.constexprs.get("L2NORM")}
    assert len(normed) == 4, "the prep kernel of every variant has a row with the l2norm fused in"
    unstored = {(s.name, s.constexprs["DECAY"], s.constexprs["ERASE"]) for s in specs if not s.constexprs.get(
        "STORE_DH", True)}
    assert len(unstored) == 2 * 4, "the scan and dqk kernels of every variant have rows without dH stored"
    dots = {(s.name, s.constexprs["ERASE"]) for s in specs if s.config.endswith(" channel_dots=True")}
    assert len(dots) == 2 * 2, "the prep and dqk kernels of KDA and GDN-2 have rows with the tensor-core products"
    gated = {(s.name, s.constexprs["DECAY"], s.constexprs["ERASE"]) for s in specs if s.constexprs["GATE_ACT"]}
    assert len(gated) == 3 * 3, "every kernel of the three decayed variants has a fused-gate row"


def test_beta_act_takes_a_scalar_beta():
    """The kernels' beta activation (fla's use_beta_sigmoid_in_kernel) applies to a scalar beta: a per-channel b or
    w, an unknown activation, or a beta left out (None, a gate of 1) is refused before any launch, forward and
    backward."""
    from lamina.kernels.delta_chunk_bwd import delta_chunk_bwd
    from lamina.kernels.delta_chunk_common import BetaAct
    from lamina.kernels.delta_chunk_fwd import delta_chunk_fwd

    q, k, v, g, b, w = make_inputs(1, 16, 1, 1, 16, 16, 2, 1, 1)[:6]
    with pytest.raises(ValueError, match=r"beta_act applies to a scalar beta \[B, T, HV\]"):
        delta_chunk_fwd(q, k, v, g, b, w, 0.25, None, False, None, beta_act=BetaAct.SIGMOID)
    q, k, v, g, b, w = make_inputs(1, 16, 1, 1, 16, 16, 1, 0, 0)[:6]
    with pytest.raises(ValueError, match="beta_act must be one of"):
        delta_chunk_fwd(q, k, v, g, b, w, 0.25, None, False, None, beta_act=3)
    h = torch.zeros(1, 1, 16, 16)
    A = torch.zeros(1, 16, 1, 64)
    with pytest.raises(ValueError, match="beta_act needs the raw b and w"):
        delta_chunk_bwd(q, k, v, g, None, w, 0.25, None, h, A, v, None, None, beta_act=BetaAct.SIGMOID2)
