"""Regression corpus: bugs fla users hit, as named tests against lamina.

* fla #1080: int32 offset overflow at large B*T*H. Memory forbids a real run, so the check is on
  index arithmetic: the kernels' shared addressing helpers run under the interpreter with sequence
  indices and lengths whose products pass 2**31, and must return the exact (int64) offsets.
* fla #1077: grid axes y and z above 65535. The launchers run on meta tensors of the largest shapes
  with their kernels replaced by a recorder: every grid they would launch keeps axis 0 below 2**31
  and axes 1 and 2 at most 65535, or the launcher refuses the shape with a ValueError that says so.
* fla #838: the caller's ``cu_seqlens`` (and every other input) is never modified.
* Finite KDA output at ``g = -8`` and ``g = -20`` per channel (decays that overflow a naive exp of
  the cumulative sum), against the float64 token loop.
* Deterministic backward: two backward passes give bitwise identical gradients.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from tolerances import assert_close

import lamina
from lamina.kernels._utils import MAX_GRID_YZ
from lamina.kernels.delta_chunk_common import _row_ptrs, _state_ptrs, _vec_ptrs, chunk_bounds, seq_bounds, tile_ptrs
from lamina.reference import delta_rule_family_recurrent_ref

INT32_MAX = 2**31 - 1
MAX_GRID_X = 2**31 - 1


# --- fla #1080: offsets past 2**31 elements -------------------------------------------------------

@triton.jit
def _offsets_probe(out, i_n, i_c, T, NT, HEAD, NHEADS: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BT: tl.constexpr):
    """Run the helpers on an int64 zero "pointer", so that they return element offsets; store them."""
    zero = (i_n * 0).to(tl.int64)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, D)
    bos, _ = seq_bounds(out, i_n, T, False)
    tl.store(out + rows[:, None] * D + cols[None, :], _row_ptrs(zero, bos, rows, HEAD, NHEADS, D, cols))
    tl.store(out + BT * D + rows, _vec_ptrs(zero, bos, rows, HEAD, NHEADS))
    _, _, bos_c, _ = chunk_bounds(i_c, out, out, T, NT, False)
    ptrs, _ = tile_ptrs(zero, bos_c, BT, NHEADS * D, HEAD * D, 0, rows, cols, D)
    tl.store(out + BT * D + BT + rows[:, None] * D + cols[None, :], ptrs)
    # the kernels pass the sequence (or chunk) index as int64, derived from an int64 program id
    s_ptrs, _ = _state_ptrs(zero, i_n.to(tl.int64), HEAD, 0, tl.arange(0, V), NHEADS, K, V, K)
    tl.store(out + 2 * BT * D + BT + tl.arange(0, K)[:, None] * V + tl.arange(0, V)[None, :], s_ptrs)


@pytest.mark.interpret
@pytest.mark.parametrize("i_n, T, NHEADS, D", [
    (3, 2**20, 64, 256),        # B*T*H*K of 4 sequences of 1M tokens, 64 heads, K = 256: 2**36 elements
    (40_000, 65_536, 32, 128),  # many sequences: i_n * T alone passes 2**31
])
def test_fla_1080_token_offsets_past_int32_are_int64(i_n, T, NHEADS, D):
    """Token, tile, per-token and state offsets of the delta kernels' addressing helpers are exact past 2**31."""
    BT, K, V, head = 16, 128, 128, NHEADS - 1
    NT = T // BT
    i_c = i_n * NT + NT - 1  # the last chunk of sequence i_n
    out = torch.zeros(2 * BT * D + BT + K * V, dtype=torch.int64)
    _offsets_probe[(1,)](out, i_n, i_c, T, NT, head, NHEADS=NHEADS, D=D, K=K, V=V, BT=BT)
    tok0 = i_n * T
    rows, cols = torch.arange(BT, dtype=torch.int64), torch.arange(D, dtype=torch.int64)
    row = (tok0 * NHEADS + head) * D + rows[:, None] * (NHEADS * D) + cols[None, :]
    assert row.max() > INT32_MAX  # the case is one that int32 arithmetic would get wrong
    assert torch.equal(out[:BT * D].view(BT, D), row), "_row_ptrs"
    assert torch.equal(out[BT * D:BT * D + BT], tok0 * NHEADS + head + rows * NHEADS), "_vec_ptrs"
    # chunk_bounds gives the start of the sequence that holds chunk i_c, tile_ptrs the rows from there
    tile = tok0 * (NHEADS * D) + head * D + rows[:, None] * (NHEADS * D) + cols[None, :]
    assert torch.equal(out[BT * D + BT:2 * BT * D + BT].view(BT, D), tile), "chunk_bounds + tile_ptrs"
    o_k, o_v = torch.arange(K, dtype=torch.int64), torch.arange(V, dtype=torch.int64)
    state = (i_n * NHEADS + head) * K * V + o_k[:, None] * V + o_v[None, :]
    assert state.max() > INT32_MAX or i_n * NHEADS * K * V < INT32_MAX  # past 2**31 in the many-sequence case
    assert torch.equal(out[2 * BT * D + BT:].view(K, V), state), "_state_ptrs"


# --- fla #1077: grid axes y/z <= 65535 -------------------------------------------------------------

class _GridRecorder:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` records the grid and launches nothing."""

    def __init__(self, name: str, grids: list, meta: dict) -> None:
        self.name, self.grids, self.meta = name, grids, meta

    def __getitem__(self, grid):
        if callable(grid):
            grid = grid(self.meta)
        self.grids.append((self.name, tuple(int(g) for g in grid)))
        return lambda *args, **kwargs: None


def _record(monkeypatch, module, meta: dict | None = None) -> list:
    """Replace every kernel of ``module`` with a recorder; the smallest blocks give the largest grids."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction

    grids: list = []
    meta = meta or {"BLOCK_M": 16, "BLOCK_N": 16}
    for name in dir(module):
        obj = getattr(module, name)
        if isinstance(obj, (JITFunction, Autotuner, Heuristics)) or type(obj).__name__ == "InterpretedFunction":
            monkeypatch.setattr(module, name, _GridRecorder(name, grids, meta))
    return grids


def _check_grids(grids: list) -> None:
    assert grids, "nothing was launched"
    for name, grid in grids:
        assert 1 <= len(grid) <= 3, (name, grid)
        assert grid[0] <= MAX_GRID_X, f"{name}: grid x {grid[0]} > 2**31 - 1"
        assert all(g <= MAX_GRID_YZ for g in grid[1:]), f"{name}: grid {grid} has y or z > {MAX_GRID_YZ}"


# (B, T, H, HV, K, V): long sequences with many heads at the largest trainable K; many short sequences.
LARGE_SHAPES = [(1, 2**22, 64, 64, 256, 256), (2**17, 64, 16, 64, 128, 512), (4, 2**20, 8, 64, 64, 128)]


@pytest.mark.parametrize("shape", LARGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fla_1077_delta_grids_stay_within_cuda_limits(monkeypatch, shape):
    import lamina.kernels.delta_chunk_bwd as bwd
    import lamina.kernels.delta_chunk_fwd as fwd
    import lamina.kernels.delta_recurrent_fwd as rec

    B, T, H, HV, K, V = shape
    grids = _record(monkeypatch, fwd)
    grids_bwd = _record(monkeypatch, bwd)
    grids_rec = _record(monkeypatch, rec)
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k = torch.empty(B, T, H, K, **meta), torch.empty(B, T, H, K, **meta)
    v = torch.empty(B, T, HV, V, **meta)
    g, beta = torch.empty(B, T, HV, K, device="meta"), torch.empty(B, T, HV, device="meta")
    h0 = torch.empty(B, HV, K, V, device="meta")
    o, ht, h, _, A = fwd.delta_chunk_fwd(q, k, v, g, beta, beta, 0.1, h0, True, None, chunk_size=64,
                                         save_states=True)
    assert h.shape == (B * triton.cdiv(T, 64), HV, K, V) and A.shape == (B, T, HV, 64)
    bwd.delta_chunk_bwd(q, k, v, g, beta, beta, 0.1, h0, h, A, torch.empty_like(v), ht, None, 64)
    rec.delta_recurrent_fwd(q, k, v, g, beta, beta, 0.1, h0, True, None)
    _check_grids(grids)
    _check_grids(grids_bwd)
    _check_grids(grids_rec)


@pytest.mark.parametrize("n_seq, heads", [(2048, 32), (4096, 16), (1, 128), (MAX_GRID_YZ, 2), (MAX_GRID_YZ + 1, 2)])
def test_fla_1077_prism_grids_within_limits_or_refused(monkeypatch, n_seq, heads):
    """Prism puts sequences on grid axis 1 and heads on axis 2 (sequences x heads above 65535 run);
    more than 65535 sequences in one call get a ValueError naming the limit."""
    import lamina.kernels.prism_attn_bwd as pbwd
    import lamina.kernels.prism_attn_fwd as pfwd

    grids = _record(monkeypatch, pfwd)
    grids_bwd = _record(monkeypatch, pbwd)
    q = torch.empty(n_seq, 64, heads, 128, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(n_seq, 64, heads // 2, 128, device="meta", dtype=torch.bfloat16)
    if n_seq > MAX_GRID_YZ:
        with pytest.raises(ValueError, match=str(MAX_GRID_YZ)):
            pfwd.prism_attn_fwd(q, kv, kv, True, 0.1)
        return
    o, lse = pfwd.prism_attn_fwd(q, kv, kv, True, 0.1)
    _check_grids(grids)
    pbwd.prism_attn_bwd(torch.empty_like(o), q, kv, kv, o, lse, True, 0.1)
    _check_grids(grids_bwd)


# --- fla #838: inputs are never modified -----------------------------------------------------------

def _family(T: int, HV: int = 2, K: int = 16, V: int = 16, N: int = 3) -> dict:
    gen = torch.Generator().manual_seed(838)
    return {"q": torch.randn(1, T, 1, K, generator=gen), "k": torch.randn(1, T, 1, K, generator=gen) / K ** 0.5,
            "v": torch.randn(1, T, HV, V, generator=gen), "g": -torch.rand(1, T, HV, K, generator=gen),
            "beta": torch.rand(1, T, HV, generator=gen), "initial_state": torch.randn(N, HV, K, V, generator=gen)}


@pytest.mark.parametrize("backend, dtype", [("torch", torch.int32), ("torch", torch.int64),
                                            pytest.param("triton", torch.int32, marks=pytest.mark.interpret)])
def test_fla_838_cu_seqlens_and_inputs_not_modified(backend, dtype):
    """Also: the varlen results and gradients (an empty sequence on the torch path) match float64."""
    cu = torch.tensor([0, 7, 7, 20] if backend == "torch" else [0, 5, 17], dtype=dtype)
    x = _family(int(cu[-1]), HV=2 if backend == "torch" else 1, N=cu.numel() - 1)
    before = {n: t.clone() for n, t in x.items()}
    cu_before = cu.clone()
    leaves = {n: t.requires_grad_() for n, t in x.items()}
    o, s = lamina.chunk_kda(**leaves, output_final_state=True, cu_seqlens=cu, chunk_size=16, backend=backend)
    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    ro, rs = delta_rule_family_recurrent_ref(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], ref["beta"],
                                             16 ** -0.5, ref["initial_state"], True, cu_seqlens=cu)
    assert_close("o", o, ro)
    assert_close("final_state", s, rs)
    gen = torch.Generator().manual_seed(1)
    do, ds = torch.randn(o.shape, generator=gen), torch.randn(s.shape, generator=gen)
    torch.autograd.backward((o, s), (do, ds))
    torch.autograd.backward((ro, rs), (do.double(), ds.double()))
    for n in x:
        assert_close(f"d{n}", leaves[n].grad, ref[n].grad)
    if backend == "torch":  # the decode path (no grad) and the token loop with gradients
        with torch.no_grad():
            lamina.fused_recurrent_kda(**x, output_final_state=True, cu_seqlens=cu, backend=backend)
        lamina.fused_recurrent_kda(**leaves, output_final_state=True, cu_seqlens=cu, backend=backend)
    assert cu.dtype == dtype and torch.equal(cu, cu_before), "cu_seqlens was modified"
    for n, t in x.items():
        assert torch.equal(t.detach(), before[n]), f"{n} was modified"


# --- finite KDA at strong decays ------------------------------------------------------------------

# Both decays overflow exp(-G) in float32 (exp(88.7) is its largest); the interpreter runs the stronger.
# With gradients, fused_recurrent_kda's Triton backward is the chunked one: its forward-only decode
# kernel is checked without gradients.
STRONG_DECAY_CASES = [("torch", False, -8.0), ("torch", True, -8.0), ("torch", False, -20.0), ("torch", True, -20.0),
                      pytest.param("triton", False, -20.0, marks=pytest.mark.interpret)]


@pytest.mark.interpret
def test_kda_decode_kernel_finite_at_strong_decay():
    T, K = 20, 16
    x = _family(T, HV=1, K=K, V=16, N=1)
    x["g"][..., : K // 2] = -20.0
    with torch.no_grad():
        o, s = lamina.fused_recurrent_kda(**x, output_final_state=True, backend="triton")
    ro, rs = delta_rule_family_recurrent_ref(*(x[n].double() for n in ("q", "k", "v", "g", "beta", "beta")),
                                             K ** -0.5, x["initial_state"].double(), True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_close("o", o, ro)
    assert_close("final_state", s, rs)


@pytest.mark.parametrize("backend, recurrent, g_min", STRONG_DECAY_CASES)
def test_kda_finite_at_strong_decay(backend, recurrent, g_min):
    """Half the key channels decay by exp(g_min) per token (a 16-token chunk sums to -128 or -320:
    exp of its negative overflows float32), the other half hardly; o and the state stay finite and
    match the float64 token loop."""
    T, K, V = 20, 16, 16
    x = _family(T, HV=1, K=K, V=V, N=1)
    g = x["g"] * 0.1
    g[..., : K // 2] = g_min
    x["g"] = g
    fn = lamina.fused_recurrent_kda if recurrent else lamina.chunk_kda
    kw = {} if recurrent else {"chunk_size": 16}
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, s = fn(**leaves, output_final_state=True, backend=backend, **kw)
    ref = {n: t.double().requires_grad_() for n, t in x.items()}
    ro, rs = delta_rule_family_recurrent_ref(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], ref["beta"],
                                             K ** -0.5, ref["initial_state"], True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_close("o", o, ro)
    assert_close("final_state", s, rs)
    gen = torch.Generator().manual_seed(7)
    do, ds = torch.randn(o.shape, generator=gen), torch.randn(s.shape, generator=gen)
    torch.autograd.backward((o, s), (do, ds))
    torch.autograd.backward((ro, rs), (do.double(), ds.double()))
    for n in x:
        assert torch.isfinite(leaves[n].grad).all(), f"d{n} is not finite"
        assert_close(f"d{n}", leaves[n].grad, ref[n].grad)


# --- deterministic backward -----------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpret)])
def test_backward_is_deterministic(backend):
    """Two backward passes of the same inputs give the same bits (the backward has no atomics)."""
    x = _family(18, HV=1, N=1)
    x["b"], x["w"] = x.pop("beta")[..., None].expand(-1, -1, -1, 16) * 0.9, torch.rand(1, 18, 1, 16)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, s = lamina.chunk_gdn2(**leaves, output_final_state=True, chunk_size=16, backend=backend)
    loss = o.square().sum() + s.sum()
    first = torch.autograd.grad(loss, list(leaves.values()), retain_graph=True)
    second = torch.autograd.grad(loss, list(leaves.values()))
    for n, a, b in zip(leaves, first, second):
        assert torch.equal(a, b), f"d{n} differs between two identical backward passes"
