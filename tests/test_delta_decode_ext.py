"""The C++ decode step (``lamina_C::delta_decode_step``): the CPU kernel of lamina._C (when built)
against ``_torch_step`` and the float64 chunked reference, and the CUDA kernel's compile check.

Every case runs the extension over a pool of states with slots in scrambled order and one skipped
sequence, for the four variants (DeltaNet, Gated DeltaNet, KDA, GDN-2) and the options of the
contract (``lamina.ops.delta_decode``). The float64 oracle gets the inputs the kernel gets (the
same quantised q, k, v) with the l2norm, gate and beta transforms applied here, in float64, from
the contract's formulas.

Tolerances (tests/tolerances.py): outputs and states use the recurrence RMS ratio of their dtype;
the states are float32 for every input dtype and start from the same quantised inputs as the
oracle, so they are held to the float32 bound even for bfloat16 inputs; bfloat16 outputs are one
rounding of a float32 value, so they are also held element-wise to bfloat16's rtol/atol.
"""

from __future__ import annotations

import math
import re
import subprocess
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

from lamina._optional import compiled_extension
from lamina.ops.delta_decode import (
    BETA_NONE,
    BETA_SIGMOID,
    BETA_SIGMOID2,
    GATE_LOWER_BOUND,
    GATE_NONE,
    GATE_SOFTPLUS,
    _torch_step,
)
from lamina.reference.delta_rule import delta_rule_family_chunk_ref
from tests.test_hrm_ext import CSRC, _nvcc
from tests.tolerances import assert_close

VARIANTS = ("deltanet", "gdn", "kda", "gdn2")
# K not a multiple of the CPU kernel's 8 dot-product lanes, V not a multiple of 8 either.
K_DIM, V_DIM = 20, 12
# Pool of P slots; sequence n reads SLOTS[n] (-1: skipped).
P_SLOTS = 6
SLOTS = (4, -1, 1, 3)
LOWER_BOUND = -5.0


def _ext_has_decode() -> bool:
    return compiled_extension() is not None and hasattr(torch.ops.lamina_C, "delta_decode_step")


needs_ext = pytest.mark.skipif(
    not _ext_has_decode(),
    reason="lamina._C is not built: `LAMINA_BUILD_CPU=1 pip install --no-build-isolation -e .` builds the CPU kernels",
)


def _ext_step(*args) -> None:
    from lamina.ops.delta_decode_ext import ext_step

    ext_step(*args)


@dataclass
class Case:
    """Per-sequence inputs ``[N, T, ...]`` (row n is sequence n) and the call's options."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor | None
    b: torch.Tensor
    w: torch.Tensor | None
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    pool: torch.Tensor
    gate_act: int
    beta_act: int
    l2norm: bool
    v_first: bool
    scale: float = K_DIM ** -0.5
    lower_bound: float = LOWER_BOUND

    @property
    def N(self) -> int:
        return self.q.shape[0]

    @property
    def T(self) -> int:
        return self.q.shape[1]


def make_case(variant: str, *, dtype=torch.float32, gva: bool = False, gate_act: int = GATE_SOFTPLUS,
              beta_act: int = BETA_SIGMOID, l2norm: bool = True, v_first: bool = False, T: int = 3,
              N: int = len(SLOTS), A_log: bool = True, dt_bias: bool = True, P: int = P_SLOTS, seed: int = 0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    H = 2
    HV = 4 if gva else H
    K, V = K_DIM, V_DIM
    rnd = lambda *s: torch.randn(*s, generator=gen)
    q, k, v = rnd(N, T, H, K).to(dtype), rnd(N, T, H, K).to(dtype), rnd(N, T, HV, V).to(dtype)
    if not l2norm:  # keep the unnormalised keys small enough for a stable recurrence
        q, k = (x / math.sqrt(K) for x in (q, k))
    per_k = variant in ("kda", "gdn2")
    g = None
    if variant != "deltanet":
        g = rnd(N, T, HV, K) if per_k else rnd(N, T, HV)
        if gate_act == GATE_NONE:
            g = F.logsigmoid(g)  # already a log decay
    b = rnd(N, T, HV, K) if variant == "gdn2" else rnd(N, T, HV)
    w = rnd(N, T, HV, V) if variant == "gdn2" else None
    if beta_act == BETA_NONE:  # raw strengths in (0, 1)
        b = torch.sigmoid(b)
    gated = g is not None and gate_act != GATE_NONE
    a_log = rnd(HV) * 0.5 if gated and A_log else None
    bias = (rnd(HV * K) if per_k else rnd(HV)) if gated and dt_bias else None
    slot_shape = (HV, V, K) if v_first else (HV, K, V)
    pool = rnd(P, *slot_shape) * 0.5
    return Case(q, k, v, g, b, w, a_log, bias, pool, gate_act if g is not None else GATE_NONE, beta_act, l2norm,
                v_first)


# --- the float64 oracle ------------------------------------------------------------------------------

def oracle_inputs(c: Case) -> dict[str, torch.Tensor | None]:
    """The contract's transforms in float64: l2norm, gate activation, beta activation, w = b."""
    q, k, v = (x.double() for x in (c.q, c.k, c.v))
    if c.l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = None if c.g is None else c.g.double()
    if g is not None and c.gate_act != GATE_NONE:
        HV = g.shape[2]
        x = g if c.dt_bias is None else g + c.dt_bias.double().view(HV, -1).squeeze(-1)
        a = torch.ones(HV, dtype=torch.float64) if c.A_log is None else c.A_log.double().exp()
        a = a.view(HV, 1) if g.dim() == 4 else a
        if c.gate_act == GATE_SOFTPLUS:
            g = -a * torch.where(x > 20, x, torch.log1p(torch.exp(x)))
        else:
            g = c.lower_bound * torch.sigmoid(a * x)
    b = c.b.double()
    if c.beta_act == BETA_SIGMOID:
        b = torch.sigmoid(b)
    elif c.beta_act == BETA_SIGMOID2:
        b = 2 * torch.sigmoid(b)
    w = b if c.w is None else c.w.double()
    return {"q": q, "k": k, "v": v, "g": g, "erase": b, "write": w}


def as_kv(state: torch.Tensor, v_first: bool) -> torch.Tensor:
    return state.transpose(-1, -2) if v_first else state


def oracle(c: Case, slots, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs [N, T, HV, V] and final states [N, HV, K, V] (float64) of the first ``tokens`` tokens,
    each sequence from its slot of c.pool (zeros for skipped ones, whose rows are not compared)."""
    x = oracle_inputs(c)
    if tokens is not None:
        x = {name: None if t is None else t[:, :tokens] for name, t in x.items()}
    init = torch.stack([as_kv(c.pool[s], c.v_first) if s >= 0 else torch.zeros_like(as_kv(c.pool[0], c.v_first))
                        for s in slots]).double()
    o, final = delta_rule_family_chunk_ref(x["q"], x["k"], x["v"], x["g"], x["erase"], x["write"], scale=c.scale,
                                           initial_state=init, output_final_state=True, chunk_size=2)
    return o, final


# --- running the steps ---------------------------------------------------------------------------------

def call(step, c: Case, t0: int, t1: int, pool: torch.Tensor | None, idx: torch.Tensor | None, *,
         varlen: bool = False, accepted: torch.Tensor | None = None, final: torch.Tensor | None = None,
         inplace: bool = True) -> torch.Tensor:
    """One call of ``step`` on tokens t0 .. t1-1 of every sequence; returns out as [N, t1 - t0, HV, V]."""
    sl = lambda x: None if x is None else x[:, t0:t1]
    q, k, v, g, b, w = (sl(x) for x in (c.q, c.k, c.v, c.g, c.b, c.w))
    cu = None
    if varlen:  # sequences packed along T of one batch row
        cu = torch.arange(0, c.N * (t1 - t0) + 1, t1 - t0)
        q, k, v, g, b, w = (None if x is None else x.flatten(0, 1)[None] for x in (q, k, v, g, b, w))
    out = torch.full_like(v, float("nan"))
    step(q, k, v, g, b, w, c.A_log, c.dt_bias, pool, idx, accepted, cu, out, final, c.scale, c.lower_bound,
         c.gate_act, c.beta_act, c.l2norm, c.v_first, inplace)
    return out.view(c.N, t1 - t0, *out.shape[2:]) if varlen else out


def slot_index(slots, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(slots, dtype=dtype).view(-1, 1)


def check_against_torch_and_oracle(c: Case, varlen: bool, index_dtype=torch.int64) -> None:
    idx = slot_index(SLOTS, index_dtype)
    pool = c.pool.clone()
    out = torch.cat([call(_ext_step, c, t, t + 1, pool, idx, varlen=varlen) for t in range(c.T)], dim=1)
    live = [n for n, s in enumerate(SLOTS) if s >= 0]
    dead = [n for n, s in enumerate(SLOTS) if s < 0]
    out_dtype = c.v.dtype
    # skipped rows: zero, and their slots (none here) untouched; slots no sequence reads: unchanged
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    untouched = [p for p in range(c.pool.shape[0]) if p not in SLOTS]
    assert torch.equal(pool[untouched], c.pool[untouched])

    # (a) the PyTorch step over all T tokens in one call
    pool_t = c.pool.clone()
    out_t = call(_torch_step, c, 0, c.T, pool_t, idx)
    assert_close("out vs _torch_step", out[live].float(), out_t[live].float(), dtype=out_dtype)
    assert_close("pool vs _torch_step", pool, pool_t, dtype=torch.float32)

    # (b) the float64 chunked reference
    o_ref, s_ref = oracle(c, SLOTS)
    assert_close("out vs float64 reference", out[live], o_ref[live], dtype=out_dtype)
    if out_dtype != torch.float32:
        assert_close("out vs float64 reference (element-wise)", out[live], o_ref[live], kind="elementwise")
    for n in live:
        assert_close(f"slot {SLOTS[n]} vs float64 reference", as_kv(pool[SLOTS[n]], c.v_first), s_ref[n],
                     dtype=torch.float32)


@needs_ext
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vfirst"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_ext_steps_match_torch_and_reference(variant, v_first, dtype):
    check_against_torch_and_oracle(make_case(variant, dtype=dtype, v_first=v_first), varlen=False)


# option combinations, each on every variant
OPTIONS = {
    "gva": {"gva": True},
    "gate-none-beta-none-no-l2": {"gate_act": GATE_NONE, "beta_act": BETA_NONE, "l2norm": False},
    "lower-bound-sigmoid2": {"gate_act": GATE_LOWER_BOUND, "beta_act": BETA_SIGMOID2},
    "lower-bound-no-params": {"gate_act": GATE_LOWER_BOUND, "A_log": False, "dt_bias": False},
    "softplus-no-dt-bias": {"dt_bias": False},
    "gva-vfirst-bf16": {"gva": True, "v_first": True, "dtype": torch.bfloat16},
    "fp16": {"dtype": torch.float16},
}


@needs_ext
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_cpu_ext_options(variant, option):
    check_against_torch_and_oracle(make_case(variant, **OPTIONS[option]), varlen=False)


@needs_ext
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vfirst"])
def test_cpu_ext_varlen_steps(variant, v_first):
    """One token per sequence, packed along T with cu_seqlens; int32 slot indices."""
    c = make_case(variant, gva=True, v_first=v_first)
    check_against_torch_and_oracle(c, varlen=True, index_dtype=torch.int32)


@needs_ext
@pytest.mark.parametrize("variant", VARIANTS)
def test_cpu_ext_varlen_lengths(variant):
    """Sequences of 2, 1, 0 and 3 tokens in one call (the empty one keeps its state)."""
    c = make_case(variant, T=3, gva=True)
    lengths = [2, 1, 0, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    pack = lambda x: None if x is None else torch.cat([x[n, :L] for n, L in enumerate(lengths)])[None]
    q, k, v, g, b, w = (pack(x) for x in (c.q, c.k, c.v, c.g, c.b, c.w))
    idx = slot_index(SLOTS)
    results = []
    for step in (_ext_step, _torch_step):
        pool = c.pool.clone()
        final = torch.full((c.N, *c.pool.shape[1:]), float("nan"))
        out = torch.full_like(v, float("nan"))
        step(q, k, v, g, b, w, c.A_log, c.dt_bias, pool, idx, None, cu, out, final, c.scale, c.lower_bound,
             c.gate_act, c.beta_act, c.l2norm, c.v_first, True)
        results.append((out, pool, final))
    (out, pool, final), (out_t, pool_t, final_t) = results
    assert_close("out vs _torch_step", out, out_t)
    assert_close("pool vs _torch_step", pool, pool_t)
    assert_close("final_state vs _torch_step", final, final_t)
    # the oracle one sequence at a time (each has its own length)
    for n, L in enumerate(lengths):
        rows = out[0, cu[n]:cu[n + 1]]
        if SLOTS[n] < 0:
            assert torch.equal(rows, torch.zeros_like(rows)) and torch.equal(final[n], torch.zeros_like(final[n]))
            continue
        one = replace(c, **{f: None if getattr(c, f) is None else getattr(c, f)[n:n + 1, :L]
                            for f in ("q", "k", "v", "g", "b", "w")})
        o_ref, s_ref = oracle(one, [SLOTS[n]])
        if L:
            assert_close(f"sequence {n} out vs float64 reference", rows, o_ref[0])
        assert_close(f"sequence {n} final state vs float64 reference", final[n], s_ref[0], dtype=torch.float32)
        assert_close(f"slot {SLOTS[n]} vs float64 reference", pool[SLOTS[n]], s_ref[0], dtype=torch.float32)


@needs_ext
@pytest.mark.parametrize("state", ["pool", "none"])
def test_cpu_ext_final_state_without_inplace(state):
    """inplace=False leaves the pool as it was; final_state gets every sequence's last state (zero
    when skipped); without a pool every sequence starts from zeros."""
    c = make_case("gdn2", gva=True, T=2)
    pool = c.pool.clone() if state == "pool" else None
    idx = slot_index(SLOTS) if state == "pool" else None
    final = torch.full((c.N, *c.pool.shape[1:]), float("nan"))
    out = call(_ext_step, c, 0, c.T, pool, idx, final=final, inplace=False)
    slots = list(SLOTS) if state == "pool" else [-1] * c.N
    o_ref, s_ref = oracle(c, slots)
    for n, s in enumerate(SLOTS):
        if state == "pool" and s < 0:
            assert torch.equal(final[n], torch.zeros_like(final[n]))
            assert torch.equal(out[n], torch.zeros_like(out[n]))
            continue
        assert_close(f"final_state[{n}]", final[n], s_ref[n], dtype=torch.float32)
        assert_close(f"out[{n}]", out[n], o_ref[n])
    if pool is not None:
        assert torch.equal(pool, c.pool)


# --- speculative decoding: slots per token --------------------------------------------------------

# Sequence n reads slot SPEC_INDICES[n][a - 1] (a = SPEC_ACCEPTED[n]) and writes the state after its
# token t to SPEC_INDICES[n][t] (-1: not written). The last sequence accepts 0 tokens: skipped.
SPEC_INDICES = ((0, 1, 2), (3, 4, -1), (5, 6, 7), (-1, 9, 10), (8, 11, 8))
SPEC_ACCEPTED = (1, 2, 3, 2, 0)
SPEC_POOL = 13  # slot 12 is in no row


@needs_ext
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vfirst"])
@pytest.mark.parametrize("tokens", [3, 2])
def test_cpu_ext_speculative_per_token_writes(variant, v_first, tokens):
    c = make_case(variant, gva=True, v_first=v_first, T=tokens, N=len(SPEC_INDICES), P=SPEC_POOL)
    idx = torch.tensor(SPEC_INDICES)
    accepted = torch.tensor(SPEC_ACCEPTED, dtype=torch.int32)
    pools, outs, finals = [], [], []
    for step in (_ext_step, _torch_step):
        pool = c.pool.clone()
        final = torch.full((c.N, *c.pool.shape[1:]), float("nan"))
        outs.append(call(step, c, 0, tokens, pool, idx, accepted=accepted, final=final))
        pools.append(pool)
        finals.append(final)
    pool, out, final = pools[0], outs[0], finals[0]
    assert_close("pool vs _torch_step", pool, pools[1])
    assert_close("out vs _torch_step", out, outs[1])
    assert_close("final_state vs _torch_step", final, finals[1])

    read = [row[a - 1] if 1 <= a <= len(row) else -1 for row, a in zip(SPEC_INDICES, SPEC_ACCEPTED)]
    written = {}
    for n, row in enumerate(SPEC_INDICES):
        if read[n] < 0:
            continue
        for t in range(tokens):
            if row[t] >= 0:
                written[row[t]] = (n, t)
    for slot in range(SPEC_POOL):
        if slot not in written:
            assert torch.equal(pool[slot], c.pool[slot]), f"slot {slot} is written by no token but changed"
    o_ref, s_final = oracle(c, read)
    for slot, (n, t) in written.items():
        _, s_t = oracle(c, read, tokens=t + 1)
        assert_close(f"slot {slot} (sequence {n}, token {t})", as_kv(pool[slot], v_first), s_t[n],
                     dtype=torch.float32)
    for n, r in enumerate(read):
        if r < 0:
            assert torch.equal(out[n], torch.zeros_like(out[n]))
            assert torch.equal(final[n], torch.zeros_like(final[n]))
        else:
            assert_close(f"out[{n}]", out[n], o_ref[n])
            assert_close(f"final_state[{n}]", as_kv(final[n], v_first), s_final[n], dtype=torch.float32)


@needs_ext
def test_cpu_ext_gate_softplus_without_A_log():
    """GATE_SOFTPLUS with A_log None uses the factor 1 (contract); against the float64 oracle only."""
    c = make_case("gdn", A_log=False)
    assert c.A_log is None and c.gate_act == GATE_SOFTPLUS
    pool = c.pool.clone()
    out = call(_ext_step, c, 0, c.T, pool, slot_index(SLOTS))
    o_ref, s_ref = oracle(c, SLOTS)
    for n, s in enumerate(SLOTS):
        if s >= 0:
            assert_close(f"out[{n}]", out[n], o_ref[n])
            assert_close(f"slot {s}", pool[s], s_ref[n])


@needs_ext
def test_cpu_ext_does_not_depend_on_threads():
    c = make_case("kda", gva=True, T=4, N=4)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            pool = c.pool.clone()
            results.append((call(_ext_step, c, 0, c.T, pool, slot_index(SLOTS)), pool))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@needs_ext
def test_cpu_ext_indices_outside_the_pool_are_skipped():
    """Slots beyond the pool, negative slots and accepted counts outside 1..S are skipped rows: the
    kernel never touches memory outside the pool for them."""
    c = make_case("gdn", T=1, N=4)
    idx = torch.tensor([[P_SLOTS, 0], [-7, 1], [2, 10**9], [3, 4]])
    accepted = torch.tensor([1, 1, 2, 5])
    pool = c.pool.clone()
    final = torch.full((c.N, *c.pool.shape[1:]), float("nan"))
    out = call(_ext_step, c, 0, 1, pool, idx, accepted=accepted, final=final)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(final, torch.zeros_like(final))
    assert torch.equal(pool, c.pool)


# --- bad input: refused with the argument's name ---------------------------------------------------

def _args(c: Case, **overrides):
    idx = slot_index(SLOTS)
    args = {"q": c.q, "k": c.k, "v": c.v, "g": c.g, "b": c.b, "w": c.w, "A_log": c.A_log, "dt_bias": c.dt_bias,
            "state": c.pool.clone(), "state_indices": idx, "num_accepted_tokens": None, "cu_seqlens": None,
            "out": torch.empty_like(c.v), "final_state": None, "scale": c.scale, "lower_bound": c.lower_bound,
            "gate_act": c.gate_act, "beta_act": c.beta_act, "l2norm": c.l2norm, "state_v_first": c.v_first,
            "inplace": True}
    args.update(overrides)
    return list(args.values())


BAD_INPUTS = {
    "state float64": (lambda c: {"state": c.pool.double()}, "state must be float32"),
    "state shape": (lambda c: {"state": c.pool[:, :, :-1]}, "state must be [P, HV, K, V]"),
    "state slot not contiguous": (lambda c: {"state": c.pool.transpose(-1, -2).contiguous().transpose(-1, -2)},
                                  "each slot of state must be contiguous"),
    "state_indices float": (lambda c: {"state_indices": slot_index(SLOTS).float()},
                            "state_indices must be int32 or int64"),
    "state_indices rows": (lambda c: {"state_indices": slot_index(SLOTS)[:2]}, "state_indices must be [N, S]"),
    "num_accepted_tokens float": (lambda c: {"num_accepted_tokens": torch.ones(c.N)},
                                  "num_accepted_tokens must be int32 or int64"),
    "num_accepted_tokens shape": (lambda c: {"num_accepted_tokens": torch.ones(c.N + 1, dtype=torch.int64)},
                                  "num_accepted_tokens must be"),
    "cu_seqlens beyond T": (lambda c: {"cu_seqlens": torch.tensor([0, 99]), "q": c.q[:1], "k": c.k[:1],
                                       "v": c.v[:1], "g": c.g[:1], "b": c.b[:1], "out": torch.empty_like(c.v[:1]),
                                       "state_indices": slot_index(SLOTS[:1])}, "cu_seqlens"),
    "q float64": (lambda c: {"q": c.q.double(), "k": c.k.double()}, "q must be float32, float16 or bfloat16"),
    "g shape": (lambda c: {"g": c.g[..., None].expand(*c.g.shape, 3).contiguous()}, "g must have shape"),
    "dt_bias size": (lambda c: {"dt_bias": torch.zeros(7)}, "dt_bias must have shape"),
    "final_state shape": (lambda c: {"final_state": torch.zeros(1, 2, 3, 4)}, "final_state must be"),
    "out dtype": (lambda c: {"out": torch.empty_like(c.v, dtype=torch.float16)}, "out must be"),
}


@needs_ext
@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_cpu_ext_bad_input_names_the_argument(name):
    c = make_case("gdn")
    overrides, message = BAD_INPUTS[name]
    with pytest.raises((RuntimeError, ValueError), match=re.escape(message)):
        torch.ops.lamina_C.delta_decode_step(*_args(c, **overrides(c)))


@needs_ext
def test_cpu_ext_per_k_b_needs_w():
    c = make_case("gdn2")
    with pytest.raises(RuntimeError, match="w must be given when b is per K channel"):
        torch.ops.lamina_C.delta_decode_step(*_args(c, w=None))


def test_cpu_ext_step_without_extension_says_how_to_build():
    if _ext_has_decode():
        pytest.skip("lamina._C is built here; this checks the message when it is not")
    c = make_case("gdn")
    with pytest.raises(ImportError, match="LAMINA_BUILD_CPU=1"):
        call(_ext_step, c, 0, 1, c.pool.clone(), slot_index(SLOTS))


# --- the CUDA kernel compiles without spills (no GPU needed) ----------------------------------------

# Instantiations: K buckets 32, 64, 128, 256 x the two slot layouts.
CUDA_KERNELS = 8


def test_cuda_decode_kernel_compiles_without_spills(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    result = subprocess.run(
        [nvcc, "-c", "-std=c++17", "-O3", "--use_fast_math", "-Xptxas", "-v",
         "-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_80,code=sm_80",
         str(CSRC / "delta_decode_kernel.cu"), "-o", str(tmp_path / "delta_decode_kernel.o")],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    entries = result.stderr.split("Compiling entry function")[1:]
    for arch in ("sm_90", "sm_80"):
        mine = [e for e in entries if "decode_kernel" in e.split("'")[1] and f"for '{arch}'" in e]
        assert len(mine) == CUDA_KERNELS, f"{arch}: expected {CUDA_KERNELS} kernels, got {len(mine)}"
        for e in mine:
            name = e.split("'")[1]
            assert "0 bytes spill stores" in e and "0 bytes spill loads" in e, f"{arch} {name} spills:\n{e}"


# --- lamina bench --op decode ------------------------------------------------------------------------

def test_decode_bench_bytes_and_records():
    import io

    from lamina.bench.decode import decode_bytes, run
    from lamina.bench.timing import TimingConfig

    # float32 state read and written: 2 * 4 * B * HV * K * V; q, k: 2 * B * H * K, v, out: 2 * B * HV * V in
    # bf16 (2 bytes); g, beta [B, HV] and A_log, dt_bias [HV] in float32
    B, H, HV, K, V = 2, 4, 8, 16, 32
    assert decode_bytes(B, H, HV, K, V, torch.bfloat16) == (8 * B * HV * K * V + 2 * (2 * B * H * K + 2 * B * HV * V)
                                                             + 4 * (2 * B * HV + 2 * HV))
    stream = io.StringIO()
    records = run("cpu", providers=["lamina-torch", "lamina-cpu-ext", "fla"], timing=TimingConfig(cpu_min_run_s=0.01),
                  batches=(1,), stream=stream)
    by_provider = {r["provider"]: r for r in records}
    assert by_provider["lamina-torch"]["status"] == "ok" and by_provider["lamina-torch"]["ms"] > 0
    assert by_provider["fla"]["status"] == "skipped" and "cuda" in by_provider["fla"]["reason"]
    assert by_provider["lamina-cpu-ext"]["status"] == ("ok" if _ext_has_decode() else "skipped")
    assert "lamina-torch" in stream.getvalue()
