"""Forward kernels of the delta-rule family (kernels/delta_chunk_fwd.py) under the Triton interpreter.

Outputs, final states and chunk-start states of the chunked and token-by-token kernels are
compared with the float64 recurrent reference (``lamina.reference.delta_rule_family_recurrent_ref``)
run on the same quantised inputs, with the RMS-ratio bounds of tests/tolerances.py. The shape
matrix is a covering set (not the full product): every T in {1, 17, 64, 100}, K/V in
{32, 48, 64} plus one K = 128, HV in {2, 4} with H = 2, varlen with 3 unequal sequences, with
and without initial state, fp32/fp16/bf16, and all four variants.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close

pytestmark = pytest.mark.interpret

# (decay, erase, write) kinds of the kernel family per variant: 0 none / 1 scalar / 2 per-K decay;
# 0 scalar / 1 per-channel gates.
VARIANTS = {"delta": (0, 0, 0), "gdn": (1, 0, 0), "kda": (2, 0, 0), "gdn2": (2, 1, 1)}
# One variant per decay kind: the state pass and the separate output kernel see the decay kind and nothing else
# of a variant (the preparation kernel folds the erase and write gates into Y and U), so GDN-2 runs KDA's.
DECAY_VARIANTS = ["delta", "gdn", "kda"]


def make_inputs(variant, B, T, H, HV, K, V, dtype=torch.float32, decay=(0.0, 1.0), varlen=None, h0=False,
                seed=0, key_overlap=0.0):
    """q, k (l2-normalised), v in ``dtype``; gates in float32; g ~ -U(decay); b, w ~ U(0, 1).

    ``key_overlap`` a > 0 adds a times one shared random direction to every key before the norm (cosine
    between keys about a^2 / (1 + a^2)): large entries of the chunk's L, so that the high powers of L in
    its inverse matter."""
    gen = torch.Generator().manual_seed(seed)
    d, e, wr = VARIANTS[variant]
    q = torch.randn(B, T, H, K, generator=gen).to(dtype)
    k = torch.randn(B, T, H, K, generator=gen)
    if key_overlap:  # drawn only then, so that every other case keeps its inputs
        k = k + key_overlap * torch.randn(H, K, generator=gen)
    k = torch.nn.functional.normalize(k, dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, generator=gen).to(dtype)
    lo, hi = decay
    g = None
    if d:
        shape = (B, T, HV) if d == 1 else (B, T, HV, K)
        g = -(lo + (hi - lo) * torch.rand(shape, generator=gen))
    b = torch.rand((B, T, HV) if e == 0 else (B, T, HV, K), generator=gen)
    w = b if variant != "gdn2" else torch.rand(B, T, HV, V, generator=gen)
    cu = None if varlen is None else torch.tensor(varlen, dtype=torch.int32)
    N = B if cu is None else len(varlen) - 1
    s0 = torch.randn(N, HV, K, V, generator=gen) if h0 else None
    return q, k, v, g, b, w, s0, cu


def reference(q, k, v, g, b, w, scale, s0, cu):
    from lamina.reference import delta_rule_family_recurrent_ref

    f64 = lambda x: None if x is None else x.double()
    return delta_rule_family_recurrent_ref(f64(q), f64(k), f64(v), f64(g), f64(b), f64(w), scale, f64(s0), True, cu)


def chunk_fwd(*args, **kw):
    """(o, final_state, h) of the chunked forward (its fourth output, v_new, is tested in test_routing.py)."""
    from lamina.kernels.delta_chunk_fwd import delta_chunk_fwd

    return delta_chunk_fwd(*args, **kw)[:3]


def recurrent_fwd(*args, **kw):
    from lamina.kernels.delta_recurrent_fwd import delta_recurrent_fwd

    return delta_recurrent_fwd(*args, **kw)


def check_against_reference(variant, B, T, H, HV, K, V, dtype=torch.float32, chunk_size=64, **kw):
    q, k, v, g, b, w, s0, cu = make_inputs(variant, B, T, H, HV, K, V, dtype, **kw)
    scale = K ** -0.5
    ref_o, ref_s = reference(q, k, v, g, b, w, scale, s0, cu)
    o, s, h = chunk_fwd(q, k, v, g, b, w, scale, s0, True, cu, chunk_size=chunk_size)
    assert o.dtype == v.dtype and s.dtype == torch.float32
    assert_close("o", o, ref_o, dtype=dtype)
    assert_close("final_state", s, ref_s, dtype=dtype)
    return (q, k, v, g, b, w, s0, cu), h


# variant, B, T, H, HV, K, V, dtype, extra
CHUNK_CASES = [
    ("delta", 1, 1, 2, 2, 32, 32, torch.float32, {"h0": True}),
    ("delta", 2, 17, 2, 4, 48, 32, torch.float32, {}),
    ("delta", 1, 100, 2, 2, 64, 48, torch.float16, {"varlen": [0, 13, 77, 100], "h0": True}),
    ("gdn", 1, 64, 2, 2, 64, 64, torch.float32, {"h0": True}),
    ("gdn", 1, 100, 2, 4, 32, 48, torch.float16, {"varlen": [0, 40, 41, 100]}),
    ("gdn", 2, 100, 2, 4, 48, 32, torch.bfloat16, {"h0": True}),
    ("kda", 1, 17, 2, 4, 32, 64, torch.float32, {}),
    ("kda", 1, 100, 2, 2, 48, 32, torch.float32, {"varlen": [0, 30, 31, 100], "h0": True}),
    ("kda", 1, 64, 2, 2, 128, 32, torch.float32, {"h0": True}),
    ("kda", 1, 100, 2, 2, 32, 32, torch.bfloat16, {"decay": (0.0, 8.0)}),
    ("gdn2", 1, 100, 2, 2, 64, 48, torch.float32, {"h0": True}),
    ("gdn2", 2, 17, 2, 4, 32, 32, torch.float16, {}),
    ("gdn2", 1, 100, 2, 2, 32, 32, torch.float32, {"varlen": [0, 50, 60, 100], "decay": (0.0, 8.0)}),
]


@pytest.mark.grid
@pytest.mark.parametrize("variant,B,T,H,HV,K,V,dtype,extra", CHUNK_CASES,
                         ids=[f"{c[0]}-T{c[2]}-HV{c[4]}-K{c[5]}-V{c[6]}-{str(c[7])[6:]}-{i}"
                              for i, c in enumerate(CHUNK_CASES)])
def test_chunk_forward_matches_reference(variant, B, T, H, HV, K, V, dtype, extra):
    check_against_reference(variant, B, T, H, HV, K, V, dtype, **extra)


@pytest.mark.parametrize("variant,chunk_size", [("gdn", 16), ("kda", 32), ("gdn2", 16)])
def test_small_chunk_sizes(variant, chunk_size):
    check_against_reference(variant, 1, 40, 2, 2, 32, 32, chunk_size=chunk_size, h0=True, decay=(0.0, 4.0))


def test_chunk_start_states_match_prefix_states():
    """h[c] is the state before chunk c, numbered per sequence (varlen, chunk size 16)."""
    BT, offs = 16, [0, 20, 21, 55]
    (q, k, v, g, b, w, s0, cu), h = check_against_reference(
        "gdn2", 1, 55, 2, 2, 32, 32, chunk_size=BT, varlen=offs, h0=True)
    expected = []
    for n in range(len(offs) - 1):
        start, end = offs[n], offs[n + 1]
        for c in range(-(-(end - start) // BT)):
            stop = start + c * BT
            if c == 0:
                expected.append(s0[n].double())
                continue
            prefix = [None if x is None else x[:, start:stop] for x in (q, k, v, g, b, w)]
            _, s = reference(*prefix, 32 ** -0.5, s0[n:n + 1], None)
            expected.append(s[0])
    assert h.shape == (len(expected), 2, 32, 32)
    assert_close("h", h, torch.stack(expected), dtype=torch.float32)


def test_strong_and_mixed_channel_decay():
    """Per-channel decay with near-zero and strong (-20 per token) channels stays finite and exact."""
    q, k, v, _, b, w, s0, _ = make_inputs("kda", 1, 256, 1, 1, 16, 16, h0=True)
    g = torch.full((1, 256, 1, 16), -1e-3)
    g[..., ::2] = -20.0
    g[..., 1::4] = -torch.rand(1, 256, 1, 4) * 8
    ref_o, ref_s = reference(q, k, v, g, b, w, 0.25, s0, None)
    o, s, _ = chunk_fwd(q, k, v, g, b, w, 0.25, s0, True, None)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_close("o", o, ref_o)
    assert_close("final_state", s, ref_s)


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_gates_at_zero_and_one(value):
    q, k, v, g, b, w, s0, _ = make_inputs("gdn2", 1, 40, 2, 2, 32, 32, h0=True)
    b, w = torch.full_like(b, value), torch.full_like(w, value)
    ref_o, ref_s = reference(q, k, v, g, b, w, 0.2, s0, None)
    o, s, _ = chunk_fwd(q, k, v, g, b, w, 0.2, s0, True, None)
    assert_close("o", o, ref_o)
    assert_close("final_state", s, ref_s)


@pytest.mark.parametrize("recurrent", [False, True])
def test_gdn2_with_broadcast_beta_is_kda_bitwise(recurrent):
    q, k, v, g, beta, _, s0, _ = make_inputs("kda", 1, 70, 2, 2, 32, 48, h0=True)
    b = beta[..., None].expand(-1, -1, -1, 32).contiguous()
    w = beta[..., None].expand(-1, -1, -1, 48).contiguous()
    run = recurrent_fwd if recurrent else lambda *a: chunk_fwd(*a)[:2]
    o_kda, s_kda = run(q, k, v, g, beta, beta, 0.3, s0, True, None)
    o_gdn2, s_gdn2 = run(q, k, v, g, b, w, 0.3, s0, True, None)
    assert torch.equal(o_kda, o_gdn2) and torch.equal(s_kda, s_gdn2)


RECURRENT_CASES = [
    ("delta", 2, 1, 2, 4, 32, 32, torch.float32, {"h0": True}),
    ("gdn", 1, 17, 2, 2, 48, 64, torch.float16, {"varlen": [0, 5, 6, 17], "h0": True}),
    ("kda", 1, 17, 2, 4, 64, 32, torch.bfloat16, {"h0": True}),
    ("gdn2", 1, 17, 2, 2, 32, 48, torch.float32, {"varlen": [0, 9, 10, 17]}),
]


@pytest.mark.parametrize("variant,B,T,H,HV,K,V,dtype,extra", RECURRENT_CASES, ids=[c[0] for c in RECURRENT_CASES])
def test_recurrent_forward_matches_reference(variant, B, T, H, HV, K, V, dtype, extra):
    q, k, v, g, b, w, s0, cu = make_inputs(variant, B, T, H, HV, K, V, dtype, **extra)
    ref_o, ref_s = reference(q, k, v, g, b, w, 0.2, s0, cu)
    o, s = recurrent_fwd(q, k, v, g, b, w, 0.2, s0, True, cu)
    assert o.dtype == v.dtype
    assert_close("o", o, ref_o, dtype=dtype)
    assert_close("final_state", s, ref_s, dtype=dtype)


def test_no_final_state_and_no_saved_states():
    q, k, v, g, b, w, _, _ = make_inputs("gdn", 1, 20, 2, 2, 32, 32)
    o, s, h = chunk_fwd(q, k, v, g, b, w, 0.2, None, False, None, save_states=False)
    assert s is None and h is None
    ref_o, _ = reference(q, k, v, g, b, w, 0.2, None, None)
    assert_close("o", o, ref_o)


def test_chunk_indices_numbering():
    from lamina.kernels.delta_chunk_common import chunk_indices

    idx = chunk_indices(torch.tensor([0, 20, 21, 55, 55]), 1, 55, 16)
    assert idx.total == 2 + 1 + 3 + 0 and idx.per_sequence == 0
    assert idx.offsets.tolist() == [0, 2, 3, 6, 6]
    assert idx.indices.tolist() == [[0, 0], [0, 1], [1, 0], [2, 0], [2, 1], [2, 2]]
    # dense: b-major chunks the kernels number from the program id, so no index tensors
    dense = chunk_indices(None, 2, 33, 16)
    assert dense == (None, None, 6, 3)


@pytest.mark.grid  # a speed alternative: the oldest-Triton CI leg compiles it (static report), leg 1 runs it
@pytest.mark.parametrize("variant", DECAY_VARIANTS)
def test_separate_output_kernel(monkeypatch, variant):
    """``delta_tuning(output_kernel=True)``: the state pass skips the output and a parallel kernel computes it
    from the saved chunk-start states and writes: the reference's outputs, the default path's states and
    writes (bitwise: the same state pass), and the outputs the caller did not ask for stay None."""
    import lamina.kernels.delta_chunk_fwd as fwd
    from lamina.kernels.delta_tuning import delta_tuning

    launched = []
    kernel = fwd._out_fwd

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(fwd, "_out_fwd", Spy())
    for varlen, B, save_states in ((None, 2, True), ([0, 70, 71, 100], 1, False)):
        inputs = make_inputs(variant, B, 100, 2, 4, 32, 48, varlen=varlen, h0=True, decay=(0.0, 2.0))
        q, k, v, g, b, w, s0, cu = inputs
        scale = 32 ** -0.5
        args = (q, k, v, g, b, w, scale, s0, True, cu)
        o_ref, s_ref = reference(*inputs[:6], scale, s0, cu)
        plain = fwd.delta_chunk_fwd(*args, save_states=save_states, output_v_new=True)
        with delta_tuning(output_kernel=True):
            o, s, h, v_new, _ = fwd.delta_chunk_fwd(*args, save_states=save_states, output_v_new=True)
        assert_close("o", o, o_ref)
        assert_close("final_state", s, s_ref)
        assert torch.equal(s, plain[1]) and torch.equal(v_new, plain[3])
        assert (h is None) == (not save_states) and (h is None or torch.equal(h, plain[2]))
        # the writes not asked for stay None (a short pack of the same form: which outputs exist does not
        # depend on length)
        short = make_inputs(variant, B, 20, 2, 4, 32, 48, varlen=None if varlen is None else [0, 3, 20], h0=True)
        with delta_tuning(output_kernel=True):
            assert fwd.delta_chunk_fwd(*short[:6], scale, short[6], True, short[7], save_states=save_states)[3] is None
    assert len(launched) == 4


def test_output_kernel_chosen_by_the_state_pass_programs(monkeypatch):
    """``delta_tuning(output_kernel=None)``: the separate output kernel runs exactly when the state pass has fewer
    programs than the device has multiprocessors (counted here from the state pass's launch grid), and each
    choice gives what the fixed choice of that kernel gives, bitwise."""
    import lamina.kernels.delta_chunk_fwd as fwd
    from lamina.kernels.delta_tuning import delta_tuning

    grids = {"_scan_fwd": [], "_out_fwd": []}
    for name, launched in grids.items():
        kernel = getattr(fwd, name)

        class Spy:
            def __getitem__(self, grid, kernel=kernel, launched=launched):
                launched.append(grid)
                return kernel[grid]

        monkeypatch.setattr(fwd, name, Spy())
    inputs = make_inputs("gdn", 2, 40, 2, 4, 32, 48, h0=True)
    args = (*inputs[:6], 32 ** -0.5, inputs[6], True, inputs[7])
    fused = fwd.delta_chunk_fwd(*args)
    with delta_tuning(output_kernel=True):
        separate = fwd.delta_chunk_fwd(*args)
    assert len(grids["_out_fwd"]) == 1
    (programs,) = grids["_scan_fwd"][0]
    assert programs > 0 and programs % (2 * 4) == 0  # B x HV x value blocks
    assert fwd.separate_output(None, programs, torch.device("cpu")) is False
    for sms, want in ((programs, fused), (programs + 1, separate)):
        monkeypatch.setattr(fwd, "multiprocessors", lambda device, sms=sms: sms)
        grids["_out_fwd"].clear()
        with delta_tuning(output_kernel=None):
            got = fwd.delta_chunk_fwd(*args)
        assert len(grids["_out_fwd"]) == (1 if want is separate else 0), sms
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), sms


def spy_launches(monkeypatch, kernel_name, *names, run: bool = True):
    """Record the named launch arguments of every launch of the forward's kernel ``kernel_name`` (a
    ``kernels/delta_chunk_fwd.py`` attribute): a list of tuples, None for a name the launch does not pass.
    The name ``num_warps`` records the warps of the first config of 8 or 4 warps that the autotuner's pruning
    keeps for the launch (None without pruning): the warps it runs with on a GPU.
    ``run=False``: the launches are recorded and not run (the outputs keep what they were allocated with)."""
    import triton

    import lamina.kernels.delta_chunk_fwd as fwd

    launched = []
    kernel = getattr(fwd, kernel_name)

    def warps(named):
        prune = getattr(kernel, "early_config_prune", None)
        configs = [triton.Config({}, num_warps=w, num_stages=1) for w in (8, 4)]
        return prune(configs, named)[0].num_warps if prune else None

    class Spy:
        # as the autotuner it wraps (a spy can wrap another)
        arg_names = kernel.arg_names
        early_config_prune = staticmethod(getattr(kernel, "early_config_prune", None))

        def __getitem__(self, grid):
            def launch(*args, **kw):
                named = {**dict(zip(kernel.arg_names, args)), **kw}
                launched.append(tuple(warps(named) if n == "num_warps" else kw.get(n) for n in names))
                return kernel[grid](*args, **kw) if run else None
            return launch

    monkeypatch.setattr(fwd, kernel_name, Spy())
    return launched


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("solve_block", [16, 32])
def test_blocked_triangular_solve(monkeypatch, solve_block, variant):
    """The alternative solve (diagonal blocks merged with products, ``delta_tuning(solve_block=...)``) gives
    the reference's results for every variant, and the preparation kernel is launched with it."""
    from lamina.kernels.delta_tuning import delta_tuning

    launched = spy_launches(monkeypatch, "_prep_fwd", "SOLVE_BLOCK")
    with delta_tuning(solve_block=solve_block):
        check_against_reference(variant, 1, 100, 2, 2, 32, 32, varlen=[0, 70, 71, 100], h0=True, decay=(0.0, 4.0))
    assert launched == [(solve_block,)]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("solve_block", [16, 64])
def test_inverse_kept_for_the_backward(variant, solve_block):
    """With the states saved the forward keeps each chunk's ``(I + M)^-1`` (the backward reads it and does not
    solve), equal to the chunk equations' inverse, dense and varlen; without, it keeps none."""
    from test_delta_bwd_math import chunk_inverses

    import lamina.kernels.delta_chunk_fwd as fwd
    from lamina.kernels.delta_tuning import delta_tuning

    for varlen, B in ((None, 2), ([0, 70, 71, 100], 1)):
        q, k, v, g, b, w, s0, cu = make_inputs(variant, B, 100, 2, 4, 32, 16, varlen=varlen, h0=True,
                                               decay=(0.0, 2.0), key_overlap=1.0)
        args = (q, k, v, g, b, w, 32 ** -0.5, s0, False, cu)
        with delta_tuning(solve_block=solve_block):
            A = fwd.delta_chunk_fwd(*args, save_states=True)[4]
        assert A.dtype == torch.float32
        assert_close("A", A, chunk_inverses(k, g, b, v.shape[2], cu, 64))
    # without the states saved: none kept (a short varlen pack: which outputs exist does not depend on length)
    q, k, v, g, b, w, s0, cu = make_inputs(variant, 1, 20, 2, 4, 32, 16, varlen=[0, 3, 20], h0=True)
    with delta_tuning(solve_block=solve_block):
        assert fwd.delta_chunk_fwd(q, k, v, g, b, w, 32 ** -0.5, s0, False, cu, save_states=False)[4] is None


@pytest.mark.parametrize("solve_block", [16, 32, 64])
def test_triangular_solves_with_overlapping_keys(solve_block):
    """Keys at cosine ~0.9 and slow decay: L's high powers are far from zero, so each solve must be exact to the
    last term (the blocked solve's series up to Lbd^(solve_block - 1); 64 is the default elimination)."""
    from lamina.kernels.delta_tuning import delta_tuning

    with delta_tuning(solve_block=solve_block):
        for variant in ("delta", "gdn"):
            check_against_reference(variant, 1, 64, 1, 1, 32, 16, h0=True, decay=(0.0, 0.02), key_overlap=3.0)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype,warpgroup_mma", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)],
                         ids=["fp32-sm90", "fp32-sm80", "bf16"])
def test_prep_key_blocks_by_dtype(monkeypatch, variant, dtype, warpgroup_mma):
    """fp32 activations get the preparation kernel's narrower key blocks (its key loop rolled; on targets
    without warpgroup products the V tile narrows too; with them, Y's key blocks are 32 wide, so that no product
    of its 8 warps is a tf32 m64n8k8), 16-bit ones the wider blocks (unrolled); each gives the reference's
    results over several key blocks."""
    import lamina.kernels.delta_chunk_fwd as fwd
    from lamina.kernels.delta_chunk_fwd import PREP_BLOCK_K, PREP_BLOCK_K_FP32

    monkeypatch.setattr(fwd, "has_warpgroup_mma", lambda device: warpgroup_mma)
    launched = spy_launches(monkeypatch, "_prep_fwd", "BK", "NK", "BKY", "NKY", "BV", "num_warps")
    check_against_reference(variant, 1, 100, 2, 2, 128, 32, dtype, varlen=[0, 70, 100], h0=True)
    want = PREP_BLOCK_K_FP32 if dtype == torch.float32 else PREP_BLOCK_K[VARIANTS[variant][0]]
    want_y = 32 if dtype == torch.float32 and warpgroup_mma else want
    # V = 32: the fp32 V tile narrows to 16 without warpgroup products
    want_bv = 16 if dtype == torch.float32 and not warpgroup_mma else 32
    assert launched == [(want, 128 // want, want_y, 128 // want_y, want_bv, 8)] and 128 // want > 1


@pytest.mark.grid  # a speed alternative: the oldest-Triton CI leg compiles it (static report), leg 1 runs it
@pytest.mark.parametrize("variant", DECAY_VARIANTS)
@pytest.mark.parametrize("dtype,forms", [(torch.float32, (None, False)), (torch.bfloat16, (True,))],
                         ids=["fp32", "bf16"])
def test_state_pass_in_memory_and_in_registers(monkeypatch, variant, dtype, forms):
    """The state pass with its state in memory (fp32's default, ``delta_tuning(state_in_memory=True)`` for
    16-bit) or in registers gives the reference's outputs and final state over several key blocks, with
    varlen and an initial state it must not modify; its chunk-start states match the other path's. fp32
    checks both forms against the reference; bf16 the memory form, compared with its default's states."""
    from lamina.kernels.delta_chunk_fwd import MEMORY_STATE_BLOCK_K, MEMORY_STATE_BLOCK_K_FP32
    from lamina.kernels.delta_tuning import delta_tuning

    launched = spy_launches(monkeypatch, "_scan_fwd", "STATE_IN_MEMORY", "BK", "NK")
    inputs = make_inputs(variant, 1, 100, 2, 2, 128, 32, dtype, varlen=[0, 70, 71, 100], h0=True)
    s0 = inputs[6].clone()
    h = {}  # chunk-start states by form (True: in memory)
    for in_memory in forms:
        launched.clear()
        with delta_tuning(state_in_memory=in_memory):
            (_, _, _, _, _, _, s0_after, _), h_form = check_against_reference(
                variant, 1, 100, 2, 2, 128, 32, dtype, varlen=[0, 70, 71, 100], h0=True)
        assert torch.equal(s0_after, s0)
        memory = in_memory is not False
        bk = 64 if not memory else (MEMORY_STATE_BLOCK_K_FP32 if dtype == torch.float32 else MEMORY_STATE_BLOCK_K)
        assert launched == [(memory, bk, 128 // bk)] and 128 // bk > 1
        h[memory] = h_form.double()
    if len(h) == 1:  # bf16: the registers form (its default) only gives the states to compare with
        (checked,) = h
        with delta_tuning(state_in_memory=not checked):
            h[not checked] = chunk_fwd(*inputs[:6], 128 ** -0.5, inputs[6], True, inputs[7])[2].double()
    assert_close("h", h[True], h[False], dtype=dtype)


# grid: the kernels it launches (per target and alternative) run in the tests above; what it checks is the tile
# plumbing between the launcher and the report, plain Python that does not change with the Triton version
@pytest.mark.grid
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fwd_report_matches_launch(monkeypatch, dtype):
    """Every forward kernel the launcher runs, on each target and under each forward alternative, is a row of the
    static report with the blocks it launched with (rows registered here for K = V = 64, as the full grid does)."""
    import lamina.kernels._utils as utils
    import lamina.kernels.delta_chunk_fwd as fwd
    import lamina.kernels.delta_report as report
    from lamina.kernels.delta_chunk_common import BetaAct, GateAct, GateInput
    from lamina.kernels.delta_report import BETA_ROW, GATE_ROW, L2NORM_ARCHS, L2NORM_ROW, TARGETS, _register_fwd
    from lamina.kernels.delta_tuning import ALTERNATIVE_ARCHS, ALTERNATIVES, DeltaTuning, delta_tuning

    K, name = 64, {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    monkeypatch.setattr(utils, "_REGISTRY", [])
    monkeypatch.setattr(report, "report_grid", lambda: "full")
    _register_fwd(K, name, True)
    rows = utils.registered_aot()
    kernels = {"_prep_fwd": "delta_chunk_prep_fwd", "_scan_fwd": "delta_chunk_scan_fwd",
               "_out_fwd": "delta_chunk_out_fwd"}
    blocks = ("BK", "NK", "BKY", "NKY", "BV", "SOLVE_BLOCK", "STATE_IN_MEMORY", "STORE_O", "num_warps")
    # what is checked is the launches' blocks, not what the kernels compute: they are recorded, not run
    spies = {kernel: spy_launches(monkeypatch, kernel, *blocks, run=False) for kernel in kernels}
    checked, expected = 0, 0
    for arch, warpgroup_mma in TARGETS.items():
        monkeypatch.setattr(fwd, "has_warpgroup_mma", lambda device, wg=warpgroup_mma: wg)
        tunings = [DeltaTuning()] + [t for t in ALTERNATIVES if t.changes_forward and arch in ALTERNATIVE_ARCHS]
        for variant in VARIANTS:
            inputs = make_inputs(variant, 1, 20, 2, 2, K, K, dtype, h0=True)
            label = f"{variant} {name} K={K} V={K}"
            for tuning in tunings:
                for launched in spies.values():
                    launched.clear()
                with delta_tuning(**tuning.choices()):
                    fwd.delta_chunk_fwd(*inputs[:6], K ** -0.5, inputs[6], True, inputs[7])
                expected += 3 if tuning.output_kernel else 2
                for kernel, launched in spies.items():
                    candidates = [r for r in rows if r.name == kernels[kernel]
                                  and (r.config == label or r.config.startswith(label + " "))]
                    named = [r for r in candidates if not r.default and r.config.endswith(" " + tuning.label())]
                    plain = [r for r in candidates if r.default and arch in r.meta.get("archs", TARGETS)]
                    if not launched:
                        assert kernel == "_out_fwd" and not named, (label, tuning)
                        continue
                    assert len(launched) == 1 and len(named or plain) == 1, (kernel, label, tuning, arch)
                    row = (named or plain)[0]
                    want = tuple(row.num_warps if n == "num_warps" and value is not None else row.constexprs.get(n)
                                 for n, value in zip(blocks, launched[0]))
                    got = tuple(value if n in row.constexprs or n == "num_warps" else None
                                for n, value in zip(blocks, launched[0]))
                    assert got == want, f"{row.name} {row.config} sm_{arch} under {tuning.label()}"
                    checked += 1
    assert checked == expected, (checked, expected)
    # the gate activation fused in (use_gate_in_kernel; with the beta sigmoid, use_beta_sigmoid_in_kernel, where
    # beta is a scalar): the preparation's row of that name, on the targets the alternatives are registered for
    fused = ("BK", "NK", "BV", "GATE_ACT", "BETA_ACT")
    gate_spy = spy_launches(monkeypatch, "_prep_fwd", *fused, run=False)
    sigmoid = {"gdn": True, "kda": True, "gdn2": False}
    for arch in ALTERNATIVE_ARCHS:
        monkeypatch.setattr(fwd, "has_warpgroup_mma", lambda device, wg=TARGETS[arch]: wg)
        for variant in ("gdn", "kda", "gdn2"):
            inputs = make_inputs(variant, 1, 20, 2, 2, K, K, dtype, h0=True)
            n_bias = 2 * K if inputs[3].dim() == 4 else 2
            gate_spy.clear()
            fwd.delta_chunk_fwd(*inputs[:6], K ** -0.5, inputs[6], True, inputs[7],
                                gate=GateInput(torch.zeros(2), torch.zeros(n_bias), None),
                                beta_act=BetaAct.SIGMOID if sigmoid[variant] else BetaAct.NONE)
            end = f"{GATE_ROW} {BETA_ROW}" if sigmoid[variant] else GATE_ROW
            (row,) = [r for r in rows if r.name == "delta_chunk_prep_fwd"
                      and r.config == f"{variant} {name} K={K} V={K} {end}"]
            assert gate_spy == [tuple(row.constexprs[n] for n in fused)], (variant, arch)
            assert row.constexprs["GATE_ACT"] == GateAct.SOFTPLUS and row.meta["archs"] == list(ALTERNATIVE_ARCHS)
            assert row.constexprs["BETA_ACT"] == (BetaAct.SIGMOID if sigmoid[variant] else BetaAct.NONE)
    # the l2norm of q and k fused in (use_qk_l2norm_in_kernel; the preparation with the gate activation too where
    # there is a decay, as the layers run it): each kernel's row of that name on every target that fuses it, and
    # with the output kernel on the alternatives' targets
    names = ("BK", "NK", "BKY", "NKY", "BV", "GATE_ACT", "BETA_ACT", "L2NORM", "STATE_IN_MEMORY", "STORE_O",
             "num_warps")
    spies = {kernel: spy_launches(monkeypatch, kernel, *names, run=False) for kernel in kernels}
    for arch in L2NORM_ARCHS:
        monkeypatch.setattr(fwd, "has_warpgroup_mma", lambda device, wg=TARGETS[arch]: wg)
        for variant, output_kernel in ((v, o) for v in VARIANTS for o in (False, True)):
            if output_kernel and arch not in ALTERNATIVE_ARCHS:
                continue
            inputs = make_inputs(variant, 1, 20, 2, 2, K, K, dtype, h0=True)
            gate = None if inputs[3] is None else GateInput(torch.zeros(2), None, None)
            beta_act = BetaAct.SIGMOID if sigmoid.get(variant) else BetaAct.NONE
            for launched in spies.values():
                launched.clear()
            with delta_tuning(output_kernel=output_kernel):
                fwd.delta_chunk_fwd(*inputs[:6], K ** -0.5, inputs[6], True, inputs[7], gate=gate, l2norm_qk=True,
                                    beta_act=beta_act)
            for kernel, launched in spies.items():
                if kernel == "_out_fwd" and not output_kernel:
                    assert not launched
                    continue
                suffix = " output_kernel=True" if output_kernel and kernel != "_prep_fwd" else ""
                end = f"{suffix} {L2NORM_ROW}" + (f" {GATE_ROW}" if gate and kernel == "_prep_fwd" else "") + (
                    f" {BETA_ROW}" if beta_act and kernel == "_prep_fwd" else "")
                (row,) = [r for r in rows if r.name == kernels[kernel] and r.config.startswith(f"{variant} {name} ")
                          and r.config.endswith(end) and ("output_kernel=True" in r.config) == bool(suffix)
                          and arch in r.meta.get("archs", TARGETS)]
                assert row.constexprs["L2NORM"] and not row.default, row.config
                want = tuple(row.num_warps if n == "num_warps" and value is not None else row.constexprs.get(n)
                             for n, value in zip(names, launched[0]))
                got = tuple(value if n in row.constexprs or n == "num_warps" else None
                            for n, value in zip(names, launched[0]))
                assert len(launched) == 1 and got == want, (row.config, launched)


@pytest.mark.slow
@pytest.mark.parametrize("in_memory", [False, True], ids=["registers", "memory"])
def test_state_pass_at_keys_of_512(monkeypatch, in_memory):
    """bf16 at K = 512: four 128-row register blocks (Hopper's default) or eight 64-row blocks in memory (the
    default without warpgroup products), each chosen explicitly, against the reference over two chunks with
    an initial state."""
    from lamina.kernels.delta_tuning import delta_tuning

    launched = spy_launches(monkeypatch, "_scan_fwd", "STATE_IN_MEMORY", "NK")
    with delta_tuning(state_in_memory=in_memory):
        check_against_reference("gdn2", 1, 70, 1, 1, 512, 32, torch.bfloat16, h0=True)
    assert launched == [(in_memory, 8 if in_memory else 4)]


def test_autotuner_restores_the_state_in_memory():
    """The autotuner's timed runs of the state pass start from the state the call was given: its hooks save
    ``ht`` before each run with the state in memory and put it back after (a None ``ht`` is left alone)."""
    import lamina.kernels.delta_chunk_fwd as fwd

    tuner = fwd._scan_fwd
    ht = torch.randn(2, 2, 32, 32)
    given = ht.clone()
    for in_memory in (True, False):
        kwargs = {"ht": ht, "STATE_IN_MEMORY": in_memory}
        tuner.pre_hook(kwargs)
        ht.add_(1.0)  # what a timed run does to it
        tuner.post_hook(kwargs, exception=None)
        assert torch.equal(ht, given) == in_memory
        ht.copy_(given)
    tuner.pre_hook({"ht": ht, "STATE_IN_MEMORY": True}, reset_only=True)  # after the choice: nothing to restore
    tuner.post_hook({"ht": ht}, exception=None)
    tuner.pre_hook({"ht": None, "STATE_IN_MEMORY": False})
    tuner.post_hook({"ht": None, "STATE_IN_MEMORY": False}, exception=None)


# variant, T, H, HV, K, V, dtype, chunk size, extra, tuning
L2NORM_CASES = [
    ("delta", 100, 2, 4, 48, 32, torch.float32, 64, {"varlen": [0, 13, 77, 100], "h0": True}, {}),
    ("gdn", 100, 2, 2, 64, 48, torch.bfloat16, 64, {"h0": True}, {}),
    ("kda", 70, 2, 4, 32, 32, torch.float32, 16, {"decay": (0.0, 4.0)}, {}),
    ("gdn2", 100, 2, 2, 32, 48, torch.float16, 64, {"h0": True}, {}),
    # the speed alternatives (grid: leg 1 of CI runs them, the oldest-Triton leg compiles them)
    pytest.param("gdn2", 100, 2, 4, 64, 32, torch.float32, 32, {"varlen": [0, 40, 41, 100]},
                 {"state_in_memory": True}, marks=pytest.mark.grid),
    pytest.param("kda", 100, 2, 2, 48, 64, torch.float32, 64, {"h0": True}, {"output_kernel": True},
                 marks=pytest.mark.grid),
    pytest.param("gdn", 100, 2, 4, 64, 32, torch.float32, 64, {"h0": True}, {"solve_block": 16},
                 marks=pytest.mark.grid),
]


@pytest.mark.parametrize("variant,T,H,HV,K,V,dtype,chunk_size,extra,tuning", L2NORM_CASES,
                         ids=["delta-float32-BT64", "gdn-bfloat16-BT64", "kda-float32-BT16", "gdn2-float16-BT64",
                              "gdn2-state_in_memory", "kda-output_kernel", "gdn-solve_block16"])
def test_l2norm_of_q_and_k_in_the_kernels(variant, T, H, HV, K, V, dtype, chunk_size, extra, tuning):
    """``l2norm_qk``: raw q and k rows of norms 0.2 to 5 (and one zero key row), normalised inside the kernels,
    against the float64 reference on the rows normalised in float64 (fla's ``x / sqrt(sum x^2 + 1e-6)``), with
    the default tiles and the state pass's and solve's alternatives, HV > H and varlen; the states the
    forward saves for the backward are those of the normalised keys too."""
    from lamina.kernels.delta_tuning import delta_tuning

    q, k, v, g, b, w, s0, cu = make_inputs(variant, 1, T, H, HV, K, V, dtype, seed=3, **extra)
    gen = torch.Generator().manual_seed(7)
    q, k = ((x.float() * (0.2 + 4.8 * torch.rand(*x.shape[:3], 1, generator=gen))).to(dtype) for x in (q, k))
    k[0, 5, 1] = 0.0
    scale = K ** -0.5
    norm = lambda x: x.double() / torch.sqrt(x.double().pow(2).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    ref_o, ref_s = reference(norm(q), norm(k), v, g, b, w, scale, s0, cu)
    with delta_tuning(**tuning):
        o, s, h = chunk_fwd(q, k, v, g, b, w, scale, s0, True, cu, chunk_size=chunk_size, l2norm_qk=True)
        plain = chunk_fwd(norm(q).to(dtype), norm(k).to(dtype), v, g, b, w, scale, s0, True, cu,
                          chunk_size=chunk_size)
    assert_close("o", o, ref_o, dtype=dtype)
    assert_close("final_state", s, ref_s, dtype=dtype)
    assert_close("h", h, plain[2].double(), dtype=dtype)
