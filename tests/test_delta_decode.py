"""The decode step of the delta-rule family (``fused_recurrent_*`` without autograd, fla's decode keywords).

Token-by-token steps in place over a pool of states are compared with the chunked op run on the whole
sequence (float64, ``backend="torch"``: the chunked PyTorch reference), for the four variants, on the
PyTorch step and on the Triton step (the interpreter on CPU). Slots, skipped rows (-1), speculative
decoding (per-token slots and ``num_accepted_tokens``), the V-first layout, varlen, and bad input.
"""

from __future__ import annotations

import pytest
import torch
from conftest import INTERPRET
from tolerances import assert_close

import lamina

B, T, H, HV, K, V = 3, 6, 2, 4, 16, 16
BACKENDS = ["torch"] + (["triton"] if INTERPRET else [])


def rand(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


class Variant:
    """Raw inputs of one variant (gate/beta before activation), its chunked op and its decode op."""

    def __init__(self, name: str, v_first: bool = False, Tn: int = T, Bn: int = B):
        self.name, self.v_first = name, v_first
        self.q, self.k = rand(Bn, Tn, H, K, seed=1), rand(Bn, Tn, H, K, seed=2)
        self.v = rand(Bn, Tn, HV, V, seed=3)
        self.beta = rand(Bn, Tn, HV, seed=4)
        self.A_log = rand(HV, seed=5) * 0.3
        per_key = name in ("kda", "gdn2")
        self.g = rand(Bn, Tn, HV, K, seed=6) if per_key else rand(Bn, Tn, HV, seed=6)
        self.dt_bias = rand(HV * K if per_key else HV, seed=7)
        self.b, self.w = rand(Bn, Tn, HV, K, seed=8).sigmoid(), rand(Bn, Tn, HV, V, seed=9).sigmoid()

    def state_shape(self, n: int) -> tuple[int, ...]:
        return (n, HV, V, K) if self.v_first else (n, HV, K, V)

    def run(self, sl: slice, chunked: bool, dtype=torch.float64, **kw):
        x = {n: getattr(self, n)[:, sl].to(dtype) for n in ("q", "k", "v", "beta", "g", "b", "w")}
        gate = dict(A_log=self.A_log.float(), dt_bias=self.dt_bias.float(), use_gate_in_kernel=True)
        if chunked:
            kw = {"backend": "torch", **kw}
            gate = dict(A_log=self.A_log, dt_bias=self.dt_bias, use_gate_in_kernel=True)
        q, k, v = x["q"], x["k"], x["v"]
        if self.name == "delta":
            op = lamina.chunk_delta_rule if chunked else lamina.fused_recurrent_delta_rule
            return op(q, k, v, x["beta"].sigmoid(), use_qk_l2norm_in_kernel=True, **kw)
        vf = {"state_v_first": self.v_first}
        if self.name == "gdn":
            op = lamina.chunk_gated_delta_rule if chunked else lamina.fused_recurrent_gated_delta_rule
            return op(q, k, v, g=x["g"], beta=x["beta"], use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      **gate, **vf, **kw)
        if self.name == "kda":
            op = lamina.chunk_kda if chunked else lamina.fused_recurrent_kda
            return op(q, k, v, x["g"], x["beta"], use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      allow_neg_eigval=True, lower_bound=-4.0, **gate, **vf, **kw)
        op = lamina.chunk_gdn2 if chunked else lamina.fused_recurrent_gdn2
        return op(q, k, v, x["g"], x["b"], x["w"], use_qk_l2norm_in_kernel=True, **gate, **vf, **kw)


VARIANTS = [("delta", False), ("gdn", False), ("gdn", True), ("kda", False), ("kda", True), ("gdn2", False),
            ("gdn2", True)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,v_first", VARIANTS)
def test_in_place_steps_over_a_pool_equal_the_chunked_op(name, v_first, backend):
    var = Variant(name, v_first)
    h0 = rand(*var.state_shape(B), seed=10)
    o_ref, ht_ref = var.run(slice(None), chunked=True, initial_state=h0, output_final_state=True)
    P = 7
    pool = rand(*var.state_shape(P), seed=11).float()
    slots = torch.tensor([5, -1, 2])  # row 1 skipped
    pool[5], pool[2] = h0[0].float(), h0[2].float()
    before = pool.clone()
    out = torch.full((B, T, HV, V), float("nan"))
    with torch.no_grad():
        for t in range(T):
            o_t = torch.empty(B, 1, HV, V)
            res, st = var.run(slice(t, t + 1), chunked=False, dtype=torch.float32, initial_state=pool,
                              inplace_final_state=True, ssm_state_indices=slots, out=o_t, output_final_state=True,
                              backend=backend)
            assert res is o_t and st is pool
            out[:, t:t + 1] = o_t
    for row, slot in ((0, 5), (2, 2)):
        assert_close(f"{name} o[{row}]", out[row], o_ref[row].float())
        assert_close(f"{name} state slot {slot}", pool[slot], ht_ref[row].float())
    assert torch.equal(out[1], torch.zeros_like(out[1])), "a skipped row's output is zero"
    untouched = [p for p in range(P) if p not in (5, 2)]
    assert torch.equal(pool[untouched], before[untouched]), "slots of no sequence are not written"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["gdn", "kda", "gdn2"])
def test_speculative_slots_and_accepted_tokens(name, backend):
    """Three draft tokens write their states to three slots; the next call resumes from the slot of the last
    accepted token."""
    var = Variant(name, v_first=True, Tn=5, Bn=2)
    _, h_after = zip(*[var.run(slice(0, t), chunked=True, output_final_state=True) for t in (1, 2, 3)])
    P = 8
    pool = torch.zeros(*var.state_shape(P))
    draft = torch.tensor([[1, 4, 6], [0, -1, 7]])  # row 1's second draft slot is not written
    with torch.no_grad():
        var.run(slice(0, 3), chunked=False, dtype=torch.float32, initial_state=pool, inplace_final_state=True,
                ssm_state_indices=draft, num_accepted_tokens=torch.tensor([1, 1]), backend=backend)
    for row in range(2):
        for t in range(3):
            slot = int(draft[row, t])
            if slot >= 0:
                assert_close(f"slot {slot} after token {t}", pool[slot], h_after[t][row].float())
    assert torch.equal(pool[[2, 3, 5]], torch.zeros_like(pool[[2, 3, 5]]))
    # the verifier accepts 2 tokens of row 0 and 3 of row 1: the next call (token 3) resumes from the slot
    # of the last accepted token, draft[0, 1] = 4 and draft[1, 2] = 7, and writes its state to draft[:, 0]
    with torch.no_grad():
        o, _ = var.run(slice(3, 4), chunked=False, dtype=torch.float32, initial_state=pool, inplace_final_state=True,
                       ssm_state_indices=draft, num_accepted_tokens=torch.tensor([2, 3]), backend=backend)
    for row, accepted in ((0, 2), (1, 3)):
        o_ref, h_ref = var.run(slice(3, 4), chunked=True, initial_state=h_after[accepted - 1], output_final_state=True)
        assert_close(f"row {row} resumes from its accepted slot", o[row], o_ref[row].float())
        assert_close(f"row {row} writes draft slot 0", pool[int(draft[row, 0])], h_ref[row].float())


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_pool_and_final_state_output(backend):
    """Packed sequences of lengths 2, 0, 4 over slots [3, 0, 1]; not in place: the pool is only read and the
    final states come back in a new [N, ...] tensor."""
    var = Variant("kda", v_first=False, Tn=6, Bn=1)
    cu = torch.tensor([0, 2, 2, 6])
    h0 = rand(*var.state_shape(3), seed=12)
    o_ref, ht_ref = var.run(slice(None), chunked=True, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    pool = torch.zeros(*var.state_shape(4))
    pool[3], pool[0], pool[1] = h0.float()
    before = pool.clone()
    with torch.no_grad():
        o, ht = var.run(slice(None), chunked=False, dtype=torch.float32, initial_state=pool,
                        ssm_state_indices=torch.tensor([3, 0, 1], dtype=torch.int32), output_final_state=True,
                        cu_seqlens=cu, backend=backend)
    assert torch.equal(pool, before)
    assert_close("varlen o", o, o_ref.float())
    assert_close("varlen final states", ht, ht_ref.float())


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_step_matches_float64(backend):
    var = Variant("gdn", v_first=True)
    h0 = rand(*var.state_shape(B), seed=13)
    o_ref, ht_ref = var.run(slice(None), chunked=True, initial_state=h0, output_final_state=True)
    state = h0.float().clone()
    outs = []
    with torch.no_grad():
        for t in range(T):
            outs.append(var.run(slice(t, t + 1), chunked=False, dtype=torch.bfloat16, initial_state=state,
                                inplace_final_state=True, backend=backend)[0])
    o = torch.cat(outs, 1)
    assert o.dtype == torch.bfloat16
    assert_close("bf16 o", o, o_ref, dtype=torch.bfloat16)
    assert_close("bf16 state", state, ht_ref, dtype=torch.bfloat16)


def test_no_grad_decode_equals_the_differentiable_path():
    """The same fused_recurrent call with and without autograd (decode step vs the training forward)."""
    var = Variant("kda", v_first=True)
    h0 = rand(*var.state_shape(B), seed=14).float()
    with torch.no_grad():
        o1, h1 = var.run(slice(None), chunked=False, dtype=torch.float32, initial_state=h0, output_final_state=True)
    q = var.q.float().requires_grad_()
    var2 = Variant("kda", v_first=True)
    var2.q = q
    o2, h2 = var2.run(slice(None), chunked=False, dtype=torch.float32, initial_state=h0, output_final_state=True)
    assert o2.requires_grad
    assert_close("o", o1, o2.detach().double())
    assert_close("state", h1, h2.detach().double())


def _gdn_step(**kw):
    q, k = rand(2, 1, H, K, seed=1, dtype=torch.float32), rand(2, 1, H, K, seed=2, dtype=torch.float32)
    v = rand(2, 1, HV, V, seed=3, dtype=torch.float32)
    g, beta = -rand(2, 1, HV, seed=4, dtype=torch.float32).abs(), rand(2, 1, HV, seed=5, dtype=torch.float32)
    return lamina.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta.sigmoid(), **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(initial_state=torch.zeros(4, HV, K, V), ssm_state_indices=torch.tensor([0, 4])), "slot 4, outside the pool"),
    (dict(initial_state=torch.zeros(4, HV, K, V), ssm_state_indices=torch.tensor([0.0, 1.0])), "int32/int64"),
    (dict(initial_state=torch.zeros(4, HV, K, V), ssm_state_indices=torch.tensor([0, 1, 2])), "N=2 rows"),
    (dict(initial_state=torch.zeros(4, HV, K, V, dtype=torch.float64), ssm_state_indices=torch.tensor([0, 1]),
          inplace_final_state=True), "must be float32"),
    (dict(initial_state=torch.zeros(4, HV, K, V + 1), ssm_state_indices=torch.tensor([0, 1])), r"\[P, 4, 16, 16\]"),
    (dict(initial_state=torch.zeros(4, HV, K, 2 * V)[..., ::2], ssm_state_indices=torch.tensor([0, 1]),
          inplace_final_state=True), "contiguous within each state"),
    (dict(initial_state=torch.zeros(3, HV, K, V)), r"initial_state must have shape \(2, 4, 16, 16\)"),
    (dict(inplace_final_state=True), "needs initial_state"),
    (dict(ssm_state_indices=torch.tensor([0, 1])), "needs initial_state"),
    (dict(initial_state=torch.zeros(4, HV, K, V), ssm_state_indices=torch.tensor([[0, 1], [2, 3]]),
          num_accepted_tokens=torch.tensor([1, 3])), r"num_accepted_tokens must be in \[1, S=2\]"),
    (dict(initial_state=torch.zeros(2, HV, K, V), num_accepted_tokens=torch.tensor([1, 1])), "needs ssm_state_indices"),
    (dict(initial_state=torch.zeros(4, HV, K, V), ssm_state_indices=torch.tensor([2, 2]), inplace_final_state=True),
     "slot 2 to more than one sequence"),
    (dict(initial_state=torch.zeros(6, HV, K, V), ssm_state_indices=torch.tensor([[0, 1], [2, 1]]),
          inplace_final_state=True), "slot 1 to more than one sequence"),
    (dict(out=torch.empty(2, 1, HV, V, dtype=torch.float16)), "out must be a contiguous float32"),
    (dict(backend="cpu"), "backend must be one of"),
])
def test_bad_decode_input_names_the_argument(kw, match):
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        _gdn_step(**kw)


def test_decode_keywords_refuse_autograd():
    q = rand(2, 1, H, K, seed=1, dtype=torch.float32).requires_grad_()
    with pytest.raises(ValueError, match="for inference"):
        lamina.fused_recurrent_delta_rule(q, q.detach(), rand(2, 1, HV, V, seed=3, dtype=torch.float32),
                                          initial_state=torch.zeros(2, HV, K, V), inplace_final_state=True)


def test_out_of_range_slot_is_skipped_when_unchecked():
    """With check_indices=False (what a captured CUDA graph gets) a slot outside the pool is a skipped row,
    never an out-of-bounds access."""
    pool = torch.ones(2, HV, K, V)
    with torch.no_grad():
        o, _ = _gdn_step(initial_state=pool, ssm_state_indices=torch.tensor([1, 9]), inplace_final_state=True,
                         check_indices=False)
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    assert torch.equal(pool[0], torch.ones_like(pool[0]))
    assert not torch.equal(pool[1], torch.ones_like(pool[1]))
