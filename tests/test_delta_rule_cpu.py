"""The ops' PyTorch path (``lamina.ops.delta_rule_cpu``) against the naive token loop.

Outputs, final states and the gradient of every input (q, k, v, g, beta or b/w, initial state) in
float64, for the four variants, with GVA (HV = 2H), chunk sizes that do not divide T, T = 1, and
varlen packs holding a length-1 sequence; then what is specific to the vectorised form: the
grouping of the channel-decay scores, strong channel decay in float32, and the ops dispatching to it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lamina
from lamina._delta_spec import CPU_CHUNK_SIZE
from lamina.ops import delta_rule_cpu
from lamina.ops.delta_rule_cpu import delta_rule_family_chunk_torch, delta_rule_family_recurrent_torch
from lamina.reference import delta_rule_family_recurrent_ref
from lamina.testing import assert_close

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Tiny shapes gain nothing from intra-op threads, and two test workers on two cores slow each
    other down when both spin OpenMP threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# variant: (decay, erase, write); "head" is one value per (token, value head), "channel" per K or V channel.
VARIANTS = {
    "delta_rule": (None, "head", "head"),
    "gated_delta_rule": ("head", "head", "head"),
    "kda": ("channel", "head", "head"),
    "gdn2": ("channel", "channel", "channel"),
}
SHAPES = {
    # name: (B, T, seqlens, chunk size); H = 1, HV = 2 (GVA) in every case.
    "chunk 3 does not divide T=8": (2, 8, None, 3),
    "T=1": (2, 1, None, 64),
    "chunk 4 divides T=8": (2, 8, None, 4),  # equal lengths, whole chunks: steps are strided views
    "varlen [5, 1, 6], chunk 4": (1, 12, [5, 1, 6], 4),
}
H, HV, K, V = 1, 2, 4, 3


def make_leaves(variant: str, B: int, T: int, seqlens: list[int] | None) -> tuple[dict, torch.Tensor | None]:
    """float64 leaves (unit keys, gates in [0, 1], log decays in [-2, 0]) and ``cu_seqlens``."""
    decay, erase, write = VARIANTS[variant]
    N = B if seqlens is None else len(seqlens)
    cu_seqlens = None if seqlens is None else torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()])
    width = {"erase": K, "write": V}
    leaves = {
        "q": torch.randn(B, T, H, K, dtype=F64),
        "k": F.normalize(torch.randn(B, T, H, K, dtype=F64), dim=-1),
        "v": torch.randn(B, T, HV, V, dtype=F64),
        "initial_state": torch.randn(N, HV, K, V, dtype=F64),
    }
    if decay is not None:
        leaves["g"] = -2 * torch.rand((B, T, HV) if decay == "head" else (B, T, HV, K), dtype=F64)
    if erase == write == "head":
        leaves["beta"] = torch.rand(B, T, HV, dtype=F64)  # one tensor for both gates, as in the ops
    else:
        for name, kind in (("erase", erase), ("write", write)):
            leaves[name] = torch.rand((B, T, HV) if kind == "head" else (B, T, HV, width[name]), dtype=F64)
    return leaves, cu_seqlens


def family_args(leaves: dict) -> dict:
    """Keyword arguments of the family functions; ``beta`` is both the erase and the write gate."""
    args = {key: x for key, x in leaves.items() if key != "beta"}
    if "beta" in leaves:
        args["erase"] = args["write"] = leaves["beta"]
    return args


def outputs_and_grads(fn, leaves: dict, cu_seqlens: torch.Tensor | None, **extra) -> dict:
    """o, the final state and the gradient of every leaf under a loss weighting each element differently."""
    inputs = {key: x.clone().requires_grad_() for key, x in leaves.items()}
    o, s = fn(**family_args(inputs), output_final_state=True, cu_seqlens=cu_seqlens, **extra)
    weight = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=weight, dtype=F64)).sum()
    loss = loss + (s * torch.randn(s.shape, generator=weight, dtype=F64)).sum()
    loss.backward()
    return {"o": o.detach(), "final_state": s.detach(), **{f"d{key}": x.grad for key, x in inputs.items()}}


def check_against_token_loop(fn, leaves: dict, cu_seqlens: torch.Tensor | None, **extra) -> None:
    got = outputs_and_grads(fn, leaves, cu_seqlens, **extra)
    want = outputs_and_grads(delta_rule_family_recurrent_ref, leaves, cu_seqlens)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] is not None, f"{name} is missing"
        assert_close(name, got[name], want[name])


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunk_torch_matches_token_loop(variant, shape):
    B, T, seqlens, chunk_size = SHAPES[shape]
    leaves, cu_seqlens = make_leaves(variant, B, T, seqlens)
    check_against_token_loop(delta_rule_family_chunk_torch, leaves, cu_seqlens, chunk_size=chunk_size)


NO_GRAPH_SHAPES = {
    **SHAPES,
    "varlen [5, 0, 1, 9, 2], chunk 4": (1, 17, [5, 0, 1, 9, 2], 4),
    "varlen [70, 0, 80], chunk 40": (1, 150, [70, 0, 80], 40),  # three inverse blocks, the last partial
}


@pytest.mark.parametrize("block_chunks", [None, 1, 5])
@pytest.mark.parametrize("shape", list(NO_GRAPH_SHAPES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunk_torch_without_graph_matches_token_loop(variant, shape, block_chunks, monkeypatch):
    """Inference (no graph): the chunk's explicit inverse, and the sequential pass writing into
    preallocated buffers instead of joining per-step tensors; sequences end at different steps, and one
    is empty. The steps run in one block (None: the default size exceeds these shapes), or in blocks of
    whole steps holding at most ``block_chunks`` chunks where a step allows (1: every step alone; 5: one
    to several steps per block)."""
    B, T, seqlens, chunk_size = NO_GRAPH_SHAPES[shape]
    if block_chunks is not None:
        C = min(chunk_size, max(seqlens or [T]))
        monkeypatch.setattr(delta_rule_cpu, "STEP_BLOCK_ELEMENTS", block_chunks * HV * C * max(K, V))
    leaves, cu_seqlens = make_leaves(variant, B, T, seqlens)
    args = dict(**family_args(leaves), output_final_state=True, cu_seqlens=cu_seqlens)
    inputs = {key: x.clone() for key, x in leaves.items()}
    with torch.no_grad():
        o, s, v_new = delta_rule_family_chunk_torch(**args, chunk_size=chunk_size, output_v_new=True)
    for key, x in leaves.items():  # the state is updated in place, in a copy
        assert torch.equal(x, inputs[key]), f"{key} was written to"
    want_o, want_s, want_v_new = delta_rule_family_recurrent_ref(**args, output_writes=True)
    for name, got, want in (("o", o, want_o), ("final_state", s, want_s), ("v_new", v_new, want_v_new)):
        assert_close(name, got, want)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_recurrent_torch_matches_token_loop(variant):
    """The fused_recurrent ops' torch path: one varlen pack whose longest sequence spans two chunks."""
    leaves, cu_seqlens = make_leaves(variant, 1, 72, [1, 70, 1])
    check_against_token_loop(delta_rule_family_recurrent_torch, leaves, cu_seqlens)


@pytest.mark.parametrize("C", [1, 3, 16, 40, 64])
def test_blocked_solve_matches_lapack(C):
    """The blocked unit lower-triangular solve against LAPACK's (torch.linalg.solve_triangular), values
    and gradients in float64; C = 40 ends on a partial block. The diagonal and upper part of L are
    filled with large values: the solve must not read them, and their gradient is zero."""
    L = torch.randn(3, C, C, dtype=F64) * 0.3
    L = (L.tril(-1) + 50 * torch.ones_like(L).triu()).requires_grad_()
    R = torch.randn(3, C, 5, dtype=F64, requires_grad=True)
    got = delta_rule_cpu._unit_lower_solve(L, R)
    want = torch.linalg.solve_triangular(L, R, upper=False, unitriangular=True)
    assert_close("X", got, want)
    weight = torch.randn(want.shape, dtype=F64)
    dL, dR = torch.autograd.grad((got * weight).sum(), (L, R))
    dL_want, dR_want = torch.autograd.grad((want * weight).sum(), (L, R))
    assert_close("dR", dR, dR_want)
    assert_close("dL", dL.tril(-1), dL_want.tril(-1))
    assert torch.count_nonzero(dL.triu()) == 0, "the solve read L's diagonal or upper part"


@pytest.mark.parametrize("C", [1, 3, 16, 40, 64])
def test_blocked_inverse_matches_lapack(C):
    """The inference path's explicit blocked inverse, applied to right-hand sides, against LAPACK's solve
    in float64; C = 40 ends on a partial block. L's diagonal and upper part hold large values that the
    inverse must not read."""
    L = torch.randn(3, C, C, dtype=F64) * 0.3
    L = L.tril(-1) + 50 * torch.ones_like(L).triu()
    R = torch.randn(3, C, 5, dtype=F64)
    got = delta_rule_cpu._unit_lower_chunk_inverse(L) @ R
    assert_close("X", got, torch.linalg.solve_triangular(L, R, upper=False, unitriangular=True))


def test_chunk_torch_partial_solve_block():
    """Chunks of 40 (two solve blocks and a partial third) and 64 over T = 150, every gradient."""
    leaves, _ = make_leaves("gdn2", 1, 150, None)
    for chunk_size in (40, 64):
        check_against_token_loop(delta_rule_family_chunk_torch, leaves, None, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [3, 4])  # T = 8: chunks that do not divide it, and equal whole chunks
def test_chunk_torch_reads_strided_inputs(chunk_size):
    """Inputs laid out as [B, H, T, D] in memory (transposed views) give the bits of contiguous ones, with
    and without a graph."""
    leaves, _ = make_leaves("gdn2", 2, 8, None)
    args = family_args(leaves)
    strided = {key: x.transpose(1, 2).contiguous().transpose(1, 2) if key != "initial_state" else x
               for key, x in args.items()}
    for graph in (False, True):
        results = []
        for source in (args, strided):
            inputs = {key: x.clone().requires_grad_(graph) for key, x in source.items()}  # clone keeps the strides
            assert inputs["v"].is_contiguous() == inputs["erase"].is_contiguous() == (source is args)
            results.append(delta_rule_family_chunk_torch(**inputs, output_final_state=True, chunk_size=chunk_size))
        for name, a, b in zip(("o", "final_state"), *results):
            assert torch.equal(a, b), name


def test_no_initial_state_and_scale():
    leaves, _ = make_leaves("gated_delta_rule", 2, 9, None)
    del leaves["initial_state"]
    args = family_args(leaves)
    o, s = delta_rule_family_chunk_torch(**args, scale=0.3, output_final_state=True, chunk_size=4)
    o_ref, s_ref = delta_rule_family_recurrent_ref(**args, scale=0.3, output_final_state=True)
    assert_close("o", o, o_ref)
    assert_close("final_state", s, s_ref)
    assert delta_rule_family_chunk_torch(**args)[1] is None


def test_output_dtypes():
    """bf16 inputs: o in bf16, the state in float32; any float64 input: the state in float64."""
    leaves, _ = make_leaves("kda", 1, 5, None)
    args = {key: x.to(torch.bfloat16) for key, x in family_args(leaves).items()}
    o, s = delta_rule_family_chunk_torch(**args, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    args["g"] = args["g"].double()
    o, s = delta_rule_family_chunk_torch(**args, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == F64


def test_grouped_channel_scores(monkeypatch):
    """Groups of 2 chunk-heads for the channel-decay scores (several groups, a partial last one)
    give the token loop's outputs and gradients."""
    monkeypatch.setattr(delta_rule_cpu, "CACHE_BLOCK_ELEMENTS", 2 * 4 * K)
    leaves, cu_seqlens = make_leaves("gdn2", 1, 15, [6, 1, 8])
    check_against_token_loop(delta_rule_family_chunk_torch, leaves, cu_seqlens, chunk_size=4)


def strong_channel_decay_inputs(T: int) -> dict:
    """float32, H = 1, K = V = 16; g = -20 per token on every other K channel, -U(0, 1) elsewhere.

    Over a 64-token chunk the cumulative log decay reaches -1280: exp(-G) overflows float32.
    """
    g = -torch.rand(1, T, 1, 16)
    g[..., ::2] = -20.0
    return dict(q=torch.randn(1, T, 1, 16), k=F.normalize(torch.randn(1, T, 1, 16), dim=-1),
                v=torch.randn(1, T, 1, 16), g=g, erase=torch.rand(1, T, 1, 16), write=torch.rand(1, T, 1, 16),
                initial_state=torch.randn(1, 1, 16, 16))


def test_strong_channel_decay_float32():
    """No NaN/inf in outputs or gradients at T = 4096, and the token loop's answer (float32 row) on
    the first 512 tokens."""
    inputs = strong_channel_decay_inputs(4096)
    leaves = {key: x.clone().requires_grad_() for key, x in inputs.items()}
    o, s = delta_rule_family_chunk_torch(**leaves, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all(), "non-finite output or final state"
    (o.square().sum() + s.square().sum()).backward()
    for key, leaf in leaves.items():
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all(), f"non-finite gradient of {key}"
        assert leaf.grad.abs().sum() > 0, f"gradient of {key} is identically zero"
    head = {key: x if key == "initial_state" else x[:, :512] for key, x in inputs.items()}
    o, s = delta_rule_family_chunk_torch(**head, output_final_state=True)
    o_ref, s_ref = delta_rule_family_recurrent_ref(**{key: x.double() for key, x in head.items()},
                                                   output_final_state=True)
    assert_close("o", o, o_ref)
    assert_close("final_state", s, s_ref)


@pytest.mark.parametrize("recurrent", [False, True])
def test_ops_torch_path_runs_here(recurrent, monkeypatch):
    """``backend="torch"`` runs this module (not the reference): the chunk op through
    ``delta_rule_family_chunk_torch``, the recurrent op with gradients through
    ``delta_rule_family_recurrent_torch`` (which runs the chunked form), with chunks of
    ``CPU_CHUNK_SIZE`` whatever the op's ``chunk_size``."""
    calls, chunk_sizes = [], []

    def spy(name: str):
        real = getattr(delta_rule_cpu, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            if name == "delta_rule_family_chunk_torch":
                chunk_sizes.append(kwargs["chunk_size"] if "chunk_size" in kwargs else args[10])
            return real(*args, **kwargs)

        return wrapper

    for name in ("delta_rule_family_chunk_torch", "delta_rule_family_recurrent_torch"):
        monkeypatch.setattr(delta_rule_cpu, name, spy(name))
    leaves, _ = make_leaves("gated_delta_rule", 1, 6, None)
    q, k, v, g, beta = (leaves[key].float() for key in ("q", "k", "v", "g", "beta"))
    if recurrent:
        o, _ = lamina.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta.requires_grad_(), backend="torch")
        assert calls == ["delta_rule_family_recurrent_torch", "delta_rule_family_chunk_torch"]
    else:
        o, _ = lamina.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, backend="torch")
        assert calls == ["delta_rule_family_chunk_torch"]
    assert chunk_sizes == [CPU_CHUNK_SIZE]
    o_ref, _ = delta_rule_family_recurrent_ref(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                               beta.double())
    assert_close("o", o, o_ref, dtype=torch.float32)
