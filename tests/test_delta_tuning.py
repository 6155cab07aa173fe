"""The delta-rule kernels' speed alternatives (``lamina.kernels.delta_tuning``): each gives the float64
reference's gradients under the interpreter for every variant, the launchers use the active choice, and
bad choices raise by name. (The forward's solve alternatives: tests/test_delta_fwd.py.)"""

from __future__ import annotations

import pytest
import torch
from test_delta_bwd import DELTANET, GDN, GDN2, KDA, build_case, check_case, record_bwd_tiles
from test_delta_ops import CALLS, HV, H, check_training_against_float64, rand

from lamina.kernels.delta_chunk_bwd_tiles import bwd_tiles
from lamina.kernels.delta_chunk_common import VARIANT_FLAGS, DecayKind
from lamina.kernels.delta_chunk_fwd import scan_tiles
from lamina.kernels.delta_tuning import ALTERNATIVES, DeltaTuning, active_tuning, delta_tuning

# Value blocks other than the defaults of fp32 at V = 64, K = 64 (prep 32, scan 16, dqk 16). fp32 keeps dH in
# memory, where a per-channel decay caps the scan's block at 16: the wider scan block asks for dH in registers.
BACKWARD_CHOICES = [dict(prep_bv=16, scan_bv=64, dqk_bv=32, dh_in_memory=False), dict(prep_bv=64, dqk_bv=64)]


@pytest.mark.interpret
@pytest.mark.parametrize("choices", BACKWARD_CHOICES, ids=lambda c: DeltaTuning(**c).label())
@pytest.mark.parametrize("kinds", [DELTANET, GDN, KDA, GDN2], ids=["deltanet", "gdn", "kda", "gdn2"])
def test_backward_value_blocks(monkeypatch, kinds, choices):
    used = record_bwd_tiles(monkeypatch)
    with delta_tuning(**choices):
        check_case(*build_case(1, 40, 2, 2, 64, 64, kinds, seqlens=[27, 13]))
    assert len(used) == 1
    want = {"scan_bv": 16, "dh_in_memory": True, **choices}
    assert (used[0].prep_bv, used[0].scan_bv, used[0].dqk_bv, used[0].dh_in_memory) == (
        want["prep_bv"], want["scan_bv"], want["dqk_bv"], want["dh_in_memory"])


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dh_in_memory", [False, True], ids=["dh_in_registers", "dh_in_memory"])
@pytest.mark.parametrize("kinds", [DELTANET, GDN, KDA, GDN2], ids=["deltanet", "gdn", "kda", "gdn2"])
def test_scan_without_stored_dh(monkeypatch, kinds, dh_in_memory, dtype):
    """``store_dh=False``: the reverse scan, with dH in registers (its products formed transposed) or in memory,
    writes dH's products with each chunk as partial sums over its V blocks (two or four: V = 64 at the scan's 32
    or 16 columns), which the dq/dk kernel adds up; every gradient is the float64 reference's, over two sequences of
    27 and 13 tokens in chunks of 16 (the scan's recurrence over a full chunk and a partial one, then a partial one
    alone), with two value heads per qk head and a padded key block (K = 48)."""
    used = record_bwd_tiles(monkeypatch)
    with delta_tuning(store_dh=False, dh_in_memory=dh_in_memory):
        check_case(*build_case(1, 40, 2, 4, 48, 64, kinds, dtype=dtype, seqlens=[27, 13]), chunk_size=16)
    assert [(t.store_dh, t.dh_in_memory, t.scan_bv < 64) for t in used] == [(False, dh_in_memory, True)]


def _saved_chunk_states(variant: str, t: int, k_dim: int, v_dim: int, chunk: int) -> int:
    """How many tensors of the chunk states' shape ``[chunks, HV, K, V]`` the op's training forward saves for
    its backward, under the active tuning."""
    shapes = []

    def pack(x):
        shapes.append(tuple(x.shape))
        return x

    q, k = rand(1, t, H, k_dim, seed=1), rand(1, t, H, k_dim, seed=2)
    v, g = rand(1, t, HV, v_dim, seed=3), -torch.rand(1, t, HV, k_dim)
    b, w = torch.rand(1, t, HV, k_dim), torch.rand(1, t, HV, v_dim)
    leaves = [x.requires_grad_() for x in (q, k, v, g, b, w)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        CALLS[variant](*leaves, chunk_size=chunk, backend="triton")
    return shapes.count((-(-t // chunk), HV, k_dim, v_dim))


@pytest.mark.grid  # a speed alternative: the oldest-Triton CI leg compiles it (static report), leg 1 runs it
@pytest.mark.interpret
@pytest.mark.parametrize("variant", ["delta", "gdn", "kda", "gdn2"])
def test_recomputed_chunk_states(variant):
    """``recompute_states``: the training forward saves no chunk states (by default it saves one tensor of
    them), and the backward, recomputing them, gives the float64 path's output, state and every gradient."""
    t, k_dim, v_dim, chunk = 40, 32, 16, 16
    # what the forward saves does not depend on the length: counted on two chunks (20 tokens), checked on 40
    assert _saved_chunk_states(variant, 20, k_dim, v_dim, chunk) == 1
    with delta_tuning(recompute_states=True):
        assert _saved_chunk_states(variant, 20, k_dim, v_dim, chunk) == 0
        check_training_against_float64(variant, t, k_dim, v_dim, chunk_size=chunk)


def test_tiles_follow_the_tuning():
    default = bwd_tiles(128, 128, 2, True)
    assert bwd_tiles(128, 128, 2, True, DeltaTuning()) == default
    chosen = bwd_tiles(128, 128, 2, True, DeltaTuning(scan_bv=64, dqk_bv=32))
    assert chosen == default._replace(scan_bv=64, dqk_bv=32)
    # capped at V's power of two: a block wider than V holds only padding
    assert bwd_tiles(64, 16, 0, True, DeltaTuning(prep_bv=64)).prep_bv == 16
    # dH in memory on request; in registers on request only where four key blocks hold it
    assert not default.dh_in_memory and bwd_tiles(128, 128, 2, True, DeltaTuning(dh_in_memory=True)).dh_in_memory
    assert bwd_tiles(256, 64, 1, True).dh_in_memory
    assert not bwd_tiles(256, 64, 1, True, DeltaTuning(dh_in_memory=False)).dh_in_memory
    assert bwd_tiles(512, 64, 1, True, DeltaTuning(dh_in_memory=False)).dh_in_memory
    # a wider scan block is capped where the in-memory scan with per-channel decay spilled
    assert bwd_tiles(512, 64, 2, True, DeltaTuning(scan_bv=32)).scan_bv == 16
    assert bwd_tiles(512, 64, 1, True, DeltaTuning(scan_bv=32)).scan_bv == 32
    # dH stored by default; its products from the scan on request, with every block as it was
    assert default.store_dh and bwd_tiles(128, 128, 2, True, DeltaTuning(store_dh=False)) == default._replace(
        store_dh=False)


def test_tiles_without_warpgroup_products():
    """On mma.sync targets (sm_80) the backward prep's V block is 32 at every K (64 with warpgroup products),
    and the 16-bit state pass keeps its state in memory past K = 256 (in registers on Hopper; fp32 always in
    memory): the choices that keep the sm_80 static report free of spills."""
    for K in (64, 128, 256, 512):
        for decay in (0, 1, 2):
            assert (bwd_tiles(K, 128, decay, False).prep_bv, bwd_tiles(K, 128, decay, True).prep_bv) == (32, 64)
        assert scan_tiles(K, 128, False, False).state_in_memory == (K > 256)
        assert not scan_tiles(K, 128, False, True).state_in_memory
        assert scan_tiles(K, 128, True, False).state_in_memory and scan_tiles(K, 128, True, True).state_in_memory
    # an explicit choice still wins: the register form at K = 512 on request
    assert not scan_tiles(512, 128, False, False, DeltaTuning(state_in_memory=False)).state_in_memory


@pytest.mark.parametrize("warpgroup_mma", [True, False])
def test_fp32_tiles(warpgroup_mma):
    # fp32 activations (tf32x3 products) get narrower blocks and dH in memory; 16-bit ones keep theirs
    for decay in (0, 1, 2):
        wide = bwd_tiles(128, 128, decay, warpgroup_mma)
        narrow = bwd_tiles(128, 128, decay, warpgroup_mma, fp32=True)
        prep_bv = 16 if decay == 2 and not warpgroup_mma else 32  # per-channel on mma.sync targets: 16
        assert (narrow.prep_bk, narrow.prep_bv, narrow.scan_bk, narrow.scan_bv) == (16, prep_bv, 32, 16)
        assert narrow.dh_in_memory and not wide.dh_in_memory
        assert narrow.dqk_bk == (wide.dqk_bk if decay == 2 else 16) and narrow.dqk_bv == wide.dqk_bv
        # dense decays form dk's transposed [BT, BT] gradients as grams of their own in fp32, and on Hopper in
        # 16-bit too (tl.trans of a product's result is the Triton 3.4-3.6 Hopper miscompile)
        assert narrow.dqk_regram == (decay != 2) and wide.dqk_regram == (decay != 2 and warpgroup_mma)
        assert bwd_tiles(128, 128, decay, warpgroup_mma, fp32=False) == wide
    # the tuning still applies on top: dH in registers on request, as four 32-row blocks at K = 128 and
    # not past them
    assert not bwd_tiles(128, 64, 1, True, DeltaTuning(dh_in_memory=False), fp32=True).dh_in_memory
    assert bwd_tiles(256, 64, 1, True, DeltaTuning(dh_in_memory=False), fp32=True).dh_in_memory
    assert bwd_tiles(64, 64, 0, True, DeltaTuning(prep_bv=64), fp32=True).prep_bv == 64


@pytest.mark.parametrize("K", [16, 64, 128, 512])
def test_fp32_warps_keep_tf32_products_sixteen_columns_wide(K):
    """With warpgroup products, fp32 kernels whose narrowest product has 16 columns run one warpgroup (4 warps;
    at 8 such a product is split into tf32 m64n8k8 halves, Triton issue #10629): the forward's state pass and the
    backward's scan, and the dqk kernel with a dense decay (16-column key blocks); the forward's prep kernel
    keeps 8 with 32-column blocks of Y and U, and so do the backward's prep and the per-channel dqk kernel
    (32-column blocks). Every other case keeps the 8 warps (and the state pass its autotuned choice of 8 or 4)."""
    from lamina.kernels.delta_chunk_fwd import prep_store_key_blocks, prep_value_block, prep_warps

    for decay in (0, 1, 2):
        for fp32, warpgroup_mma in ((True, True), (True, False), (False, True), (False, False)):
            narrow = fp32 and warpgroup_mma
            t = bwd_tiles(K, K, decay, warpgroup_mma, fp32=fp32)
            bky, _ = prep_store_key_blocks(K, decay, fp32, warpgroup_mma)
            bv = prep_value_block(K, fp32, warpgroup_mma)
            warps = (prep_warps(bky, bv, fp32, warpgroup_mma), scan_tiles(K, K, fp32, warpgroup_mma).warps,
                     t.prep_warps, t.scan_warps, t.dqk_warps)
            if not narrow:
                assert warps == (8, (8, 4), 8, 8, 8), (decay, fp32, warpgroup_mma)
                continue
            # K = 16: every block is 16 wide, so every kernel runs one warpgroup
            assert (bky, bv) == ((16, 16) if K == 16 else (32, 32)), decay
            dqk = 4 if decay != 2 or K == 16 else 8
            assert warps == ((4, (4,), 4, 4, dqk) if K == 16 else (8, (4,), 8, 4, dqk)), decay
    # a tuning's wider blocks take the 8 warps back
    assert bwd_tiles(64, 64, 1, True, DeltaTuning(scan_bv=32, dh_in_memory=False), fp32=True).scan_warps == 8


def test_nested_choices_and_restore():
    assert active_tuning() == DeltaTuning()
    with delta_tuning(solve_block=16) as outer:
        with delta_tuning(scan_bv=64) as inner:
            assert inner == DeltaTuning(solve_block=16, scan_bv=64) == active_tuning()
            assert inner.label() == "solve_block=16,scan_bv=64"
        assert active_tuning() is outer
    assert active_tuning() == DeltaTuning() and DeltaTuning().label() == "default"
    with pytest.raises(RuntimeError), delta_tuning(dqk_bv=32):
        raise RuntimeError("inside")
    assert active_tuning() == DeltaTuning()


@pytest.mark.parametrize("choices, message", [
    (dict(solve_block=8), "solve_block must be one of"),
    (dict(scan_bv=48), "scan_bv must be None or one of"),
    (dict(prep_bv=128), "prep_bv must be None or one of"),
    (dict(dh_in_memory=1), "dh_in_memory must be None or a bool"),
    (dict(output_kernel="auto"), "output_kernel must be None or a bool"),
    (dict(recompute_states=None), "recompute_states must be a bool"),
    (dict(store_dh=0), "store_dh must be a bool"),
    (dict(block=16), "unknown choices"),
])
def test_bad_choices_raise_by_name(choices, message):
    with pytest.raises(ValueError, match=message), delta_tuning(**choices):
        pass
    assert active_tuning() == DeltaTuning()


# (K, V) of the alternatives' head-dim matrix: K = V up to 128 (48: padded blocks), then 256 and 512 for one
# of the two with the other narrow (the backward's in-memory scan; K = V = 512 takes about 190 s per case here).
ALTERNATIVE_DIMS = [(16, 16), (48, 48), (64, 64), (128, 128), (256, 32), (32, 256), (512, 32), (32, 512)]
# Each alternative with each variant it changes (channel_dots: those with a per-channel decay).
ALTERNATIVE_VARIANTS = [pytest.param(tuning, variant, id=f"{tuning.label()}-{variant}") for tuning in ALTERNATIVES
                        for variant, (decay, _, _) in VARIANT_FLAGS.items()
                        if not tuning.channel_dots or decay == DecayKind.CHANNEL]


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.parametrize("dims", ALTERNATIVE_DIMS, ids=lambda d: f"K{d[0]}-V{d[1]}")
@pytest.mark.parametrize("tuning, variant", ALTERNATIVE_VARIANTS)
def test_every_alternative_variant_and_head_dim(tuning, variant, dims):
    """Each alternative through each variant's op it changes at every (K, V) of ``ALTERNATIVE_DIMS``, bf16 (the
    activations a GPU runs: fp32 takes other tiles, where some alternatives are its defaults and
    ``channel_dots`` does not apply), 70 tokens in a full chunk and a partial one, with an initial state and the
    l2norm of q and k: output, final state and every gradient against the float64 torch path."""
    with delta_tuning(**tuning.choices()):
        check_training_against_float64(variant, 70, *dims, dtype=torch.bfloat16)


@pytest.mark.interpret
@pytest.mark.parametrize("hopper", [False, True], ids=["trans", "regram"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kinds", [KDA, GDN2], ids=["kda", "gdn2"])
def test_channel_dots(monkeypatch, kinds, dtype, hopper):
    """``channel_dots``: the per-channel backward's intra-chunk products with tensor cores between 16-row
    sub-blocks give the float64 reference's gradients. Two sequences of 70 and 30 tokens: full chunks, and tails
    that end inside a sub-block and leave whole sub-blocks of padding. With Hopper's tiles the dqk kernel forms
    the transposes of dP and dM as grams of their own, elsewhere with tl.trans. The launcher picks the products
    for 16-bit activations only; the fp32 case forces them on, to check their algebra at fp32's tolerance."""
    import lamina.kernels.delta_chunk_bwd as bwd

    used = record_bwd_tiles(monkeypatch)
    monkeypatch.setattr(bwd, "has_warpgroup_mma", lambda device: hopper)
    fp32 = dtype == torch.float32
    if fp32:
        chosen = bwd.bwd_tiles
        monkeypatch.setattr(bwd, "bwd_tiles", lambda *a, **kw: chosen(*a, **kw)._replace(
            channel_dots=True, prep_p_product=True, dqk_regram=hopper))
    with delta_tuning(channel_dots=True):
        check_case(*build_case(1, 100, 2, 2, 32, 48, kinds, dtype=dtype, seqlens=[70, 30]))
    assert len(used) == 1
    assert used[0].channel_dots == (not fp32)
    if not fp32:
        assert (used[0].prep_p_product, used[0].dqk_regram) == (True, hopper)


@pytest.mark.interpret
def test_channel_dots_finite_at_minus_20(monkeypatch):
    """``channel_dots`` where half the channels decay by e^-20 per token (in-chunk exponents down to -1280):
    every factor of the sub-block products stays <= 1, and the gradients are finite and the reference's."""
    inputs, cu, do, dfinal = build_case(1, 80, 1, 1, 32, 32, GDN2, dtype=torch.bfloat16)
    g = inputs[3]
    g[..., ::2] = -1e-3 * torch.rand_like(g[..., ::2])
    g[..., 1::2] = -20.0
    used = record_bwd_tiles(monkeypatch)
    with delta_tuning(channel_dots=True):
        got = check_case(inputs, cu, do, dfinal)
    assert used[0].channel_dots
    assert all(bool(torch.isfinite(x).all()) for x in got if x is not None)


@pytest.mark.interpret
@pytest.mark.parametrize("head_dim", [16, 48, 64, 128, pytest.param(256, marks=pytest.mark.slow),
                                      pytest.param(512, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kinds", [KDA, GDN2], ids=["kda", "gdn2"])
def test_channel_dots_head_dims(monkeypatch, kinds, head_dim):
    """``channel_dots`` at K = V from 16 to 512 (48: padded key and value blocks), bf16, Hopper's tiles (the
    transposes as grams), one chunk and a tail of 7 tokens."""
    import lamina.kernels.delta_chunk_bwd as bwd

    used = record_bwd_tiles(monkeypatch)
    monkeypatch.setattr(bwd, "has_warpgroup_mma", lambda device: True)
    with delta_tuning(channel_dots=True):
        check_case(*build_case(1, 71, 1, 1, head_dim, head_dim, kinds, dtype=torch.bfloat16))
    assert used[0].channel_dots
