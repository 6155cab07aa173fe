"""Findings of ``lamina fuzz``, kept as saved (shrunk) cases that must pass.

Each failed the tolerance table by a small factor: a precision limit of a path, or a check that did
not account for the conditioning of what it compared. What fixed each is noted beside it.
"""

from pathlib import Path

import pytest

from lamina.fuzz.runner import run_case
from lamina.fuzz.shrink import load_case

FINDINGS = Path(__file__).parent / "data" / "fuzz_findings"

FIXED = {
    # The chunked PyTorch path summed the in-chunk log decay in float32: at g down to -20 per token
    # it reaches hundreds, rounded to ~1e-5 absolute, the relative error of every exp(G_i - G_j).
    # Summed in float64 (ops/delta_rule_cpu.py): dg RMS error ratio 1.4e-5 -> 2.3e-7.
    "fused_recurrent_gdn2-extreme-decay-dg.json": "float64 decay sums in the chunked CPU path",
    "chunk_kda-extreme-decay-dA_log.json": "float64 decay sums in the chunked CPU path",
    # dA_log sums dg * g over tokens and channels, cancelling; compared with the FlashAttention rule
    # against the plain float32 token loop (lamina.testing, baseline).
    "fused_recurrent_gdn2-mild-decay-dA_log.json": "float32 baseline for recurrences",
    # At T = 1 beta only scales the output, which the output norm removes: the exact d(beta) is ~0 and
    # its float32 value is roundoff; the plain float32 layer over naive math has the same.
    "GatedDeltaNet-scale-invariant-db_proj.json": "float32 baseline for layers",
    # A per-token gate's gradient sums D terms: the floor is taken at their root-sum-square.
    "hrm_gated_update-per-token-dgate.json": "reduction_scale floor",
    # dA_log sums one term per gate element; here it is 0.081 against a root-sum-square of 1.64 of its terms,
    # and the bf16 kernels' error (0.0089) was 0.11 of the former. Compared at the latter as test_grads_all
    # does (RMS error ratio 0.0054).
    "chunk_kda-bf16-cancelling-dA_log.json": "reduction_scale floor for A_log and dt_bias",
    # The layer's dA_log in float32 (the chunked gate gradient's errors run the same way along a chunk): RMS
    # error ratio 2.2e-5 against 2e-5 at the call's floor; its terms' root-sum-square is 0.59, 34x |dA_log|.
    "KimiDeltaAttention-chunked-gate-dA_log.json": "reduction_scale floor for the layers' A_log and dt_bias",
    # The token-by-token op's gradients come from the chunked backward; dA_log is 0 in exact math (T = 1, no
    # initial state) and both the kernels and the plain float32 chunked form give 6.3e-8: the baseline of
    # these ops' gradients is now the chunked form's, not the token loop's.
    "fused_recurrent_kda-chunked-backward-dA_log.json": "chunked float32 baseline for the token-by-token ops",
    # One token's dbeta sums a term per key and value channel (through the final state's cotangent): 0.51
    # against a root-sum-square of 6.9, and the bf16 products' error 0.020 was 0.039 of the former (0.0029 of
    # the latter). beta is compared at its terms' root-sum-square, as a per-token gate.
    "chunk_kda-bf16-one-token-dbeta.json": "reduction_scale floor for beta",
    # Two value heads read one q/k head (GVA) and their terms of dq (dk) cancel: at T = 1, dq's RMS is 0.0035
    # against 0.025 for its two terms' root-sum-square (dk's 3.2e-4 against 3.7e-3), and the bf16 products'
    # error was 0.027 (0.088) of the former, 0.0037 (0.0077) of the latter. q and k are compared at the RMS
    # of their terms' root-sum-squares over the value heads.
    "chunk_kda-bf16-gva-one-token-dq.json": "reduction_scale floor for q and k over value heads",
    "chunk_kda-bf16-gva-one-token-dk.json": "reduction_scale floor for q and k over value heads",
    # At one token without an initial state the log decay's gradient is 0 in exact math, and the chunked
    # backward's float32 dg (dA_log, dt_bias) is the rounding of the terms it sums, q dq + E dE - k dk, which
    # cancel: 3e-7 against terms of 1.7-5.2 (the call's floor was 1e-2 of its largest RMS, 0.009). Compared at
    # those terms' size, each input's through its derivative of the log decay: ratios 5e-8 to 1.2e-7.
    "chunk_gated_delta_rule-one-token-zero-dg.json": "reduction_scale floor for the decay's inputs",
    "chunk_kda-one-token-zero-dA_log.json": "reduction_scale floor for the decay's inputs",
    "fused_recurrent_gated_delta_rule-one-token-zero-dg.json": "reduction_scale floor for the decay's inputs",
    # Extreme gates (A_log up to log 16, with gk): the raw gate's dg is 3.2e-3 against terms of 6.8 (the
    # activation's derivative times q dq and k dk), and the kernels' error 1.8e-6 (0.00012 of dg, 3x the
    # plain float32 chunked form's) is 2.6e-7 of those terms.
    "fused_recurrent_gated_delta_rule-extreme-gate-dg.json": "reduction_scale floor for the decay's inputs",
    # The layers: GatedDeltaNet2 forms its gate in the layer, so its A_log kept the call's floor; its gradient
    # sums dg times g over tokens and channels (RMS error ratio 3.5e-5 against 2e-5 at T = 22). KDA's
    # in-kernel gate and GatedDeltaNet2's at one token: dA_log is 0 in exact math, as in the op cases. The
    # layers' gate parameters are now compared at the same terms as the ops', taken where the layer calls
    # its op (for a gate formed in the layer, through the gate's derivative by the parameter).
    "GatedDeltaNet2-layer-gate-dA_log.json": "reduction_scale floor for the layers' gate parameters",
    "GatedDeltaNet2-one-token-zero-dA_log.json": "reduction_scale floor for the layers' gate parameters",
    "KimiDeltaAttention-one-token-zero-dA_log.json": "reduction_scale floor for the layers' gate parameters",
    # 16-bit, one token: dq (dk) is k (q) times one sum over the value channels, of the new values times dO,
    # and that sum cancelled: dq's RMS 0.013 against 0.21 for the RMS of its channel terms' root-sum-squares
    # (KDA), dk's 0.0066 against 0.33 (GDN-2). The bf16 products over V round each term; their error was
    # 0.034 (0.045) of the former, 0.0021 (0.0009) of the latter. Every gradient is compared at its terms
    # per value channel too.
    "fused_recurrent_kda-bf16-one-token-value-channels-dq.json": "reduction_scale floor over value channels",
    "fused_recurrent_gdn2-bf16-one-token-value-channels-dk.json": "reduction_scale floor over value channels",
    # float32, one token: the output is scale (q . k) beta v, and q . k (after the l2norm) was 7e-5 against a
    # root-sum-square of 0.25 for its terms q_c k_c. Both the kernels' output and y were off by 2.0e-4 of
    # themselves, one ulp of those terms; the plain float32 layer happened to be 20x closer (one rounding of
    # one sum decides it), and 3x its error was the bound. The output is compared at its terms per key
    # channel too, a layer's at those terms carried through the layer (0.19 against rms(y) 1.3e-4).
    "GatedDeltaNet-fp32-one-token-cancelling-y.json": "reduction_scale floor for outputs over key channels",
    # float32, one token again (PyTorch path): beta scales the output, which the output norm removes, so d beta
    # cancels over the value channels (0.018 against terms of about 15), and d b_proj.weight with it: off by
    # 2.2e-5 of itself against 2.0e-5, half an ulp of those terms. The layers' parameters are compared at
    # their op's input-gradient terms per value channel carried through the layer too.
    "GatedDeltaNet-fp32-one-token-cancelling-db_proj.json": "reduction_scale floor for layer parameters over "
                                                            "value channels",
    # float32, one token (the interpreted kernels): dv is scale (q . k) w do, and q . k (after the l2norm)
    # was 9.6e-4 against a root-sum-square of 0.26 for its terms q_c k_c. dv_proj.weight was off by 4.5e-5 of
    # itself against 3.5e-5 (the plain float32 layer was closer by more than 2.6x): 1.6e-7 of its terms carried
    # through the layer, a rounding of q and k as the layer forms them in float32. Every gradient is compared at
    # its terms per key channel of q too, as the output is.
    "GatedDeltaNet2-fp32-one-token-cancelling-dv_proj.json": "reduction_scale floor for gradients over key "
                                                             "channels",
    # float32, one token, no initial state (the interpreted kernels, in-kernel gate): the log decay's gradient is
    # 0 in exact math, so a_proj.weight's is 0 too; the kernels' dg is the rounding of the terms the chunked
    # backward sums into it (as in the op findings above), carried through a_proj: one element off by 1.97e-7
    # against 1.78e-7 (8e-5 of the layer's gradient scale), RMS ratio within bound. The layers' A_log and
    # dt_bias were compared at those terms, the parameters that form g (a_proj) were not: every op input of
    # the log decay now has them among its gradient's terms (a_proj.weight's scale 1.0; 1.6e-7 of it).
    "GatedDeltaNet-fp32-one-token-zero-da_proj.json": "reduction_scale floor for the decay's inputs through the "
                                                      "layer",
    # 16-bit, one token: q.k cancels, and a rounding of q before the product was the error. The token-by-token
    # forward took q and k normalised and rounded to 16 bits (o RMS error ratio 0.028 bf16, 0.0033 fp16); it
    # now normalises them in float32 in its kernel. The chunked forward rounded q times the scale (0.072); the
    # scale now comes after the product.
    "fused_recurrent_gdn2-bf16-l2norm-rounded-rows-o.json": "token-by-token l2norm in float32",
    "fused_recurrent_gdn2-fp16-l2norm-rounded-rows-o.json": "token-by-token l2norm in float32",
    "chunk_delta_rule-bf16-one-token-scaled-q-o.json": "scale after the q.k product",
    # PyTorch's CPU SDPA backward (fast exponential): dv up to ~8x plain float32's error, dq != 0 with
    # one key. Replaced on CPU by an exact blockwise backward (ops/prism_attention.py).
    "prism_attention-cpu-backward-dv.json": "exact CPU attention backward",
    "prism_attention-one-key-dq.json": "exact CPU attention backward",
    # float32, rows that see one key: PyTorch's autograd is exact there (P = 1, dS = 0), the kernels' backward
    # is not: it forms P again as exp(s - lse) with s rounded apart from the forward's lse (dv off by 1.2e-6,
    # 5 ulps of |dv|), and dS from dP - rowsum(dO * O), two sums rounded apart (dq, dk off by 1e-6). The
    # floor now grows with the scores' size, and PyTorch's error is also a plain float32 form of those
    # formulas' (lamina.reference.attention_grads_ref).
    "prism_attention-fp32-one-key-dv.json": "attention floor with the scores' size",
    "prism_attention-fp32-one-key-triton-dq.json": "float32 baseline of the attention backward",
    "prism_attention-fp32-one-key-varlen-dk.json": "float32 baseline of the attention backward",
}


def test_every_saved_finding_is_listed():
    assert sorted(p.name for p in FINDINGS.glob("*.json")) == sorted(FIXED)


def _marks(name: str) -> list:
    """A case of the Triton kernels on CPU runs under the interpreter."""
    case = load_case(FINDINGS / name)
    return [pytest.mark.interpret] if case["backend"] == "triton" and case["device"] == "cpu" else []


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in sorted(FIXED)])
def test_fixed_finding_passes(name):
    run_case(load_case(FINDINGS / name))
