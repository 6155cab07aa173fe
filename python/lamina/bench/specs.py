"""What the suite measures: ops, their shape sets, and the FLOPs and bytes of each.

Every op has two explicit functions of its shape parameters and the mode
(``fwd``, ``bwd``, ``fwd+bwd``): ``flops()``, the arithmetic of the algorithm the
fast kernels run, and ``bytes()``, the fewest bytes a kernel must move through
device memory (every input read once, every output written once). Time over
``max(flops / matmul rate, bytes / copy bandwidth)`` is a kernel's distance from
the roofline (DESIGN.md, "Performance model").

Shape sets: ``standard`` (GPU: fla's benchmark shapes for the delta-rule family,
Prism head dims, the HRM update at (8192, 4096), decoding steps, the four fla-compatible
layers at fla's widths), ``small`` (CPU: the same ops at sizes a laptop CPU runs in
seconds), ``quick`` (a few cases for ``lamina bench --quick``) and ``tiny`` (tests and
the device-check dry run).

The layer ops (``layer_*``, group ``layers``) time a whole token mixer, lamina's layer
against fla's of the same name with the same weights. Their FLOPs are the projections
and short convolutions plus the delta-rule op's own formula; their bytes are the floor
of a fused layer (see ``layer_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lamina.bench.layer_dims import LAYER_CLASSES, LAYER_OPS, LAYER_RECURRENCE, layer_dims

MODES = ("fwd", "bwd", "fwd+bwd")

DTYPE_BYTES = {"fp64": 8, "fp32": 4, "fp16": 2, "bf16": 2}

# Chunk length of the chunked delta-rule algorithm (fla's and lamina's default): the FLOP count
# below is that of the chunked WY/UT form at this length.
DELTA_CHUNK = 64
# The delta-rule state is kept in float32 whatever the input dtype (DESIGN.md).
STATE_BYTES = 4
# A product C = A @ B costs one product of the same size for dA and one for dB: backward is
# twice the forward for matmul-dominated work (the delta-rule family, the HRM update).
BWD_OVER_FWD = 2.0
# Attention backward runs five matmuls of the forward's size against the forward's two.
ATTN_BWD_OVER_FWD = 2.5
# HRM update FLOPs per element: bias add (1) + sigmoid (4: negate, exp, add, reciprocal) +
# blend c + z * (h - c) (3); the RMS norm adds square-accumulate (2) and two scalings (2).
HRM_FLOPS_GATE = 8
HRM_FLOPS_NORM = 4
# A decoding step per value head: decay (KV), read S^T e (2KV), rank-1 write (2KV), output (2KV).
DECODE_FLOPS_PER_STATE_ELEM = 7
# SiLU per element: sigmoid (4) and the product (1); its gradient dy * s * (1 + pre * (1 - s))
# recomputes the sigmoid (4) and adds 5.
CONV_FLOPS_SILU = 5
CONV_FLOPS_SILU_GRAD = 9

DELTA_OPS = ("delta_rule", "gated_delta_rule", "kda", "gdn2")
ATTENTION_OPS = ("prism_attention", "attention_decode")
DECODE_OPS = ("gdn_decode", "attention_decode")
# Names that select several ops on the command line (`lamina bench --op layers`).
OP_GROUPS: dict[str, tuple[str, ...]] = {"layers": LAYER_OPS}
# The layers are timed forward and forward+backward (a training step); "bwd" alone adds nothing.
LAYER_MODES = ("fwd", "fwd+bwd")


def _es(p: dict[str, Any]) -> int:
    return DTYPE_BYTES[p["dtype"]]


def _mode_total(mode: str, fwd: float, bwd: float) -> float:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


# ----------------------------------------------------------------------------------------------
# Delta-rule family. Params: B, T, H, HV, K, V, dtype, seqlens (None or the packed lengths).
# ----------------------------------------------------------------------------------------------

# Which gate tensors each variant takes, with their last dims: "" = one per head, "K"/"V" = per channel.
DELTA_GATES: dict[str, dict[str, str]] = {
    "delta_rule": {"beta": ""},
    "gated_delta_rule": {"g": "", "beta": ""},
    "kda": {"g": "K", "beta": ""},
    "gdn2": {"g": "K", "b": "K", "w": "V"},
}


def delta_fwd_flops_per_token(K: int, V: int, C: int = DELTA_CHUNK) -> float:
    """FLOPs per token and value head of the chunked forward, counting every matmul of a chunk
    of C tokens and dividing by C: gram E K^T (2C^2K), unit-triangular inverse (C^3/3),
    Y = A E (2C^2K), U = A Z (2C^2V), Y S and Q S (2CKV each), Q K^T (2C^2K),
    P (U - Y S) (2C^2V), state update K^T (U - Y S) (2CKV)."""
    return 6 * K * V + 6 * C * K + 4 * C * V + C * C / 3


def delta_flops(op: str, p: dict[str, Any], mode: str) -> float:
    tokens = p["B"] * p["T"]
    fwd = tokens * p["HV"] * delta_fwd_flops_per_token(p["K"], p["V"])
    return _mode_total(mode, fwd, BWD_OVER_FWD * fwd)


def _delta_gate_elems(op: str, p: dict[str, Any]) -> int:
    per = {"": 1, "K": p["K"], "V": p["V"]}
    return sum(p["B"] * p["T"] * p["HV"] * per[w] for w in DELTA_GATES[op].values())


def delta_bytes(op: str, p: dict[str, Any], mode: str) -> float:
    B, T, H, HV, K, V = (p[n] for n in ("B", "T", "H", "HV", "K", "V"))
    inputs = 2 * B * T * H * K + B * T * HV * V + _delta_gate_elems(op, p)  # q, k, v, gates
    out = B * T * HV * V
    fwd = inputs + out
    bwd = inputs + out + inputs  # read inputs and dO, write one gradient per input
    return _es(p) * _mode_total(mode, fwd, bwd)


# ----------------------------------------------------------------------------------------------
# Attention (Prism and decoding). Params: B, Tq, Tk, H, HKV, D, dtype, causal.
# ----------------------------------------------------------------------------------------------


def attention_pairs(p: dict[str, Any]) -> int:
    """Query-key pairs per (batch, head): Tq*Tk, or Tq*(Tq+1)/2 for causal with Tq == Tk."""
    Tq, Tk = p["Tq"], p["Tk"]
    if p["causal"]:
        if Tq != Tk:
            raise ValueError(f"causal attention is benchmarked with Tq == Tk, got Tq={Tq}, Tk={Tk}")
        return Tq * (Tq + 1) // 2
    return Tq * Tk


def attention_flops(op: str, p: dict[str, Any], mode: str) -> float:
    fwd = 4 * p["B"] * p["H"] * attention_pairs(p) * p["D"]  # Q K^T and P V, 2 FLOPs per MAC
    return _mode_total(mode, fwd, ATTN_BWD_OVER_FWD * fwd)


def attention_bytes(op: str, p: dict[str, Any], mode: str) -> float:
    B, Tq, Tk, H, HKV, D = (p[n] for n in ("B", "Tq", "Tk", "H", "HKV", "D"))
    es = _es(p)
    q = B * Tq * H * D
    kv = 2 * B * Tk * HKV * D
    lse = 4 * B * H * Tq  # float32 log-sum-exp, written by the forward, read by the backward
    fwd = es * (2 * q + kv)  # q, k, v in, o out
    bwd = es * (3 * q + kv + q + kv) + lse  # q, k, v, o, dO in; dq, dk, dv out
    return _mode_total(mode, fwd, bwd)


# ----------------------------------------------------------------------------------------------
# HRM gated update. Params: N, D, dtype, norm (bool).
# ----------------------------------------------------------------------------------------------


def _hrm_ops_formulas() -> tuple[Callable, Callable] | None:
    """The op module's own counts (``hrm_update_flops``, ``hrm_update_bytes``), kept next to its
    kernels and preferred when importable; this module's formulas are the fallback."""
    try:
        from lamina.ops.hrm_update import hrm_update_bytes, hrm_update_flops
    except Exception:  # noqa: BLE001 - the op module may be missing or broken: fall back
        return None
    return hrm_update_flops, hrm_update_bytes


def hrm_flops_fallback(p: dict[str, Any], mode: str) -> float:
    per = HRM_FLOPS_GATE + (HRM_FLOPS_NORM if p["norm"] else 0)
    fwd = p["N"] * p["D"] * per
    return _mode_total(mode, fwd, BWD_OVER_FWD * fwd)


def hrm_bytes_fallback(p: dict[str, Any], mode: str) -> float:
    N, D = p["N"], p["D"]
    params = 2 * D if p["norm"] else D  # bias, norm weight
    fwd = 4 * N * D + params  # h, c, gate_logits in, y out
    bwd = 7 * N * D + 2 * params  # h, c, gate_logits, dy in; dh, dc, dgate out; params and their grads
    return _es(p) * _mode_total(mode, fwd, bwd)


def hrm_flops(op: str, p: dict[str, Any], mode: str) -> float:
    ops = _hrm_ops_formulas()
    if ops is not None:
        return float(ops[0]((p["N"], p["D"]), norm=p["norm"], mode=mode))
    return hrm_flops_fallback(p, mode)


def hrm_bytes(op: str, p: dict[str, Any], mode: str) -> float:
    ops = _hrm_ops_formulas()
    if ops is not None:
        from lamina.bench.inputs import torch_dtype

        dtype = torch_dtype(p["dtype"])
        # The suite's bias and norm weight are in the input dtype (lamina.bench.inputs).
        return float(ops[1]((p["N"], p["D"]), dtype, gate="channel", bias=True, norm=p["norm"], mode=mode,
                            param_dtype=dtype))
    return hrm_bytes_fallback(p, mode)


# ----------------------------------------------------------------------------------------------
# Gated DeltaNet decoding step. Params: B, H, HV, K, V, dtype.
# ----------------------------------------------------------------------------------------------


def gdn_decode_flops(op: str, p: dict[str, Any], mode: str) -> float:
    return _mode_total(mode, DECODE_FLOPS_PER_STATE_ELEM * p["B"] * p["HV"] * p["K"] * p["V"], 0.0)


def gdn_decode_bytes(op: str, p: dict[str, Any], mode: str) -> float:
    B, H, HV, K, V = (p[n] for n in ("B", "H", "HV", "K", "V"))
    state = 2 * STATE_BYTES * B * HV * K * V  # the float32 state is read and written back
    tokens = _es(p) * (2 * B * H * K + 2 * B * HV * V + 2 * B * HV)  # q, k, v, o, g, beta
    return _mode_total(mode, state + tokens, 0.0)


# ----------------------------------------------------------------------------------------------
# Short convolution: depthwise causal conv1d with SiLU, no bias (as fla's layers build it).
# Params: B, T, D, W, dtype.
# ----------------------------------------------------------------------------------------------


def conv_flops(op: str, p: dict[str, Any], mode: str) -> float:
    """Forward: W multiply-adds and the SiLU per output element. Backward: the kernels recompute the
    pre-activation (W multiply-adds), apply the SiLU gradient, and take W multiply-adds each for dx
    and for dweight."""
    n = p["B"] * p["T"] * p["D"]
    fwd = n * (2 * p["W"] + CONV_FLOPS_SILU)
    bwd = n * (2 * p["W"] + CONV_FLOPS_SILU_GRAD + 4 * p["W"])
    return _mode_total(mode, fwd, bwd)


def conv_bytes(op: str, p: dict[str, Any], mode: str) -> float:
    """Forward reads x and the [D, W] weight and writes y; backward reads x, dy and the weight and
    writes dx and dweight (the weight in the benchmark dtype, as in a model cast as a whole)."""
    n = p["B"] * p["T"] * p["D"]
    weight = p["D"] * p["W"]
    return _es(p) * _mode_total(mode, 2 * n + weight, 3 * n + 2 * weight)


# ----------------------------------------------------------------------------------------------
# fla-compatible layers. Params: B, T, dtype, layer (the constructor arguments).
# ----------------------------------------------------------------------------------------------


def layer_recurrence_shape(op: str, p: dict[str, Any]) -> dict[str, Any]:
    """The delta-rule shape the layer's recurrence runs at (``delta_shape`` parameters)."""
    d = layer_dims(op, p["layer"])
    return {"B": p["B"], "T": p["T"], "H": d.H, "HV": d.HV, "K": d.K, "V": d.V, "dtype": p["dtype"],
            "seqlens": None}


def layer_flops(op: str, p: dict[str, Any], mode: str) -> float:
    """Projections and short convolutions (``LayerDims.projection_flops_per_token``) plus the
    recurrence by ``delta_flops`` of the layer's op; backward = 2x forward, as for every
    matmul-dominated op here (dX and dW each cost one product of the forward's size)."""
    rec = LAYER_RECURRENCE[op]
    fwd = (p["B"] * p["T"] * layer_dims(op, p["layer"]).projection_flops_per_token()
           + delta_flops(rec, layer_recurrence_shape(op, p), "fwd"))
    return _mode_total(mode, fwd, BWD_OVER_FWD * fwd)


def layer_bytes(op: str, p: dict[str, Any], mode: str) -> float:
    """The floor of a fused layer: forward reads x [B, T, D] and the weights once and writes
    o [B, T, D]; backward reads x, the weights and dO and writes dx and one gradient per weight.
    The activations between the layer's kernels (projections, conv outputs, the recurrence's
    output) are not counted: a fused layer keeps them on chip, and the roofline is a floor.
    Weights are in the benchmark dtype (the layer is cast as a whole)."""
    d = layer_dims(op, p["layer"])
    act = p["B"] * p["T"] * d.hidden_size
    fwd = act + d.params + act
    bwd = act + d.params + act + act + d.params
    return _es(p) * _mode_total(mode, fwd, bwd)


# ----------------------------------------------------------------------------------------------
# The op table and shape sets
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpSpec:
    """One benchmarked op: its FLOP and byte formulas, modes, and shapes per set."""

    name: str
    description: str
    flops_fn: Callable[[str, dict[str, Any], str], float]
    bytes_fn: Callable[[str, dict[str, Any], str], float]
    modes: tuple[str, ...] = MODES
    shapes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def flops(self, params: dict[str, Any], mode: str) -> float:
        return float(self.flops_fn(self.name, params, mode))

    def bytes(self, params: dict[str, Any], mode: str) -> float:
        return float(self.bytes_fn(self.name, params, mode))


def delta_shape(B: int, T: int, H: int, D: int, dtype: str, HV: int | None = None,
                V: int | None = None, seqlens: tuple[int, ...] | None = None) -> dict[str, Any]:
    if seqlens is not None:
        B, T = 1, sum(seqlens)
    return {"B": B, "T": T, "H": H, "HV": HV or H, "K": D, "V": V or D, "dtype": dtype, "seqlens": seqlens}


def attn_shape(B: int, Tq: int, H: int, D: int, dtype: str, causal: bool = True,
               Tk: int | None = None, HKV: int | None = None) -> dict[str, Any]:
    return {"B": B, "Tq": Tq, "Tk": Tk or Tq, "H": H, "HKV": HKV or H, "D": D, "dtype": dtype, "causal": causal}


def hrm_shape(N: int, D: int, dtype: str, norm: bool = True) -> dict[str, Any]:
    return {"N": N, "D": D, "dtype": dtype, "norm": norm}


def decode_shape(B: int, H: int, D: int, dtype: str) -> dict[str, Any]:
    return {"B": B, "H": H, "HV": H, "K": D, "V": D, "dtype": dtype}


def conv_shape(B: int, T: int, D: int, W: int, dtype: str) -> dict[str, Any]:
    return {"B": B, "T": T, "D": D, "W": W, "dtype": dtype}


def layer_shape(B: int, T: int, dtype: str, **layer: Any) -> dict[str, Any]:
    """A layer case: batch, length, dtype and the layer's constructor arguments."""
    return {"B": B, "T": T, "dtype": dtype, "layer": dict(layer)}


# fla's delta-rule benchmark shapes, B x T x H x D.
FLA_DELTA_SHAPES = ((1, 8192, 96, 128), (2, 16384, 16, 128), (4, 2048, 16, 128),
                    (4, 4096, 64, 128), (8, 2048, 32, 256), (8, 1024, 8, 64))
# Varlen packs: mixed lengths summing to 16384 (a pretraining batch of documents), and many short ones.
VARLEN_PACKS = ((4096, 2048, 1024, 512, 4096, 2048, 1536, 1024),
                tuple([100, 300, 700, 950] * 8))
# Prism: head dims of the schedules at a fixed model width that every one of them divides.
PRISM_DIMS = (64, 128, 256, 320, 512)
PRISM_MODEL_WIDTH = 2560
PRISM_SMALL_WIDTH = 640
DECODE_BATCHES = (1, 16, 64)
# Layers on the GPU at fla's model width, B x T = 2 x 2048 and 8 x 2048, with fla's head layout for
# GatedDeltaNet (its defaults: 6 heads, K = 256, V = 512) and 16 heads of 128 for DeltaNet, KDA and GDN-2.
LAYER_HIDDEN = 2048
LAYER_BATCHES = (2, 8)
LAYER_T = 2048
LAYER_HEADS: dict[str, dict[str, Any]] = {
    "layer_deltanet": dict(num_heads=16),
    "layer_gated_deltanet": dict(head_dim=256, num_heads=6, expand_v=2),
    "layer_kda": dict(head_dim=128, num_heads=16),
    "layer_gdn2": dict(head_dim=128, num_heads=16),
}
# On the CPU (widths 64 to 256): the same layouts scaled down, the key head dim a quarter of the width.
LAYER_CPU_HEAD_DIM_DIVISOR = 4
LAYER_CPU_HEADS: dict[str, dict[str, Any]] = {
    "layer_deltanet": dict(num_heads=4),
    "layer_gated_deltanet": dict(num_heads=2, expand_v=2),
    "layer_kda": dict(num_heads=4),
    "layer_gdn2": dict(num_heads=4),
}
# The attention sweep (benchmarks/sweep_attention.py): every head dim a dispatch decision is made for,
# at B x T = 4 x 4096 with H x D = 2048 (4 x 16 x 4096 at D = 128; equal FLOPs at every D), causal and not.
SWEEP_ATTN_DIMS = (64, 96, 128, 192, 256, 320, 384, 512)
SWEEP_ATTN_B, SWEEP_ATTN_T, SWEEP_ATTN_WIDTH = 4, 4096, 2048
# The HRM update sweep: 4096 rows of each width.
SWEEP_HRM_ROWS = 4096
SWEEP_HRM_DIMS = (1024, 2048, 4096)


# The delta-rule sweep (benchmarks/sweep_delta.py): fla's range of shapes (B = 1..8, T = 2048..8192,
# H = 16..96), K = V = 128, and K = V = 256.
SWEEP_DELTA_SHAPES = ((2, 4096, 16, 128), (1, 8192, 64, 128), (4, 2048, 16, 256))


def sweep_attention_heads(D: int) -> int:
    """Heads at head dim ``D`` in the sweep: ``H * D`` stays ``SWEEP_ATTN_WIDTH`` (rounded)."""
    return max(1, round(SWEEP_ATTN_WIDTH / D))


# The short convolution on the GPU: the layers' key width (16 heads of 128) and value width, B x T = 8 x 2048,
# fla's window (conv_size 4).
CONV_SHAPES = ((8, 2048, 2048, 4), (8, 2048, 4096, 4))

# KV-cache length of the attention decoding step.
DECODE_CACHE_LEN = 4096


def _delta_sets() -> dict[str, list[dict[str, Any]]]:
    return {
        "standard": [delta_shape(B, T, H, D, "bf16") for B, T, H, D in FLA_DELTA_SHAPES]
        + [delta_shape(0, 0, 16, 128, "bf16", seqlens=pack) for pack in VARLEN_PACKS],
        "small": [delta_shape(1, 4096, 4, 64, "fp32"), delta_shape(2, 1024, 4, 64, "fp32"),
                  delta_shape(0, 0, 4, 64, "fp32", seqlens=(300, 1000, 724))],
        "quick": [delta_shape(1, 4096, 4, 64, "fp32")],
        "tiny": [delta_shape(1, 64, 2, 16, "fp32"), delta_shape(0, 0, 2, 16, "fp32", seqlens=(24, 40))],
        "sweep": [delta_shape(B, T, H, D, "bf16") for B, T, H, D in SWEEP_DELTA_SHAPES],
        "sweep-dry": [delta_shape(1, 64, 1, 32, "fp32")],
    }


def _layer_sets(op: str) -> dict[str, list[dict[str, Any]]]:
    def cpu(B: int, T: int, D: int) -> dict[str, Any]:
        head_dim = {} if op == "layer_deltanet" else {"head_dim": D // LAYER_CPU_HEAD_DIM_DIVISOR}
        return layer_shape(B, T, "fp32", hidden_size=D, **head_dim, **LAYER_CPU_HEADS[op])

    return {
        "standard": [layer_shape(B, LAYER_T, "bf16", hidden_size=LAYER_HIDDEN, **LAYER_HEADS[op])
                     for B in LAYER_BATCHES],
        "small": [cpu(2, 256, 256)],
        "quick": [cpu(1, 128, 128)],
        "tiny": [cpu(1, 32, 64)],
    }


OPS: dict[str, OpSpec] = {
    name: OpSpec(name, desc, delta_flops, delta_bytes, shapes=_delta_sets())
    for name, desc in (
        ("delta_rule", "DeltaNet, chunked (lamina.chunk_delta_rule)"),
        ("gated_delta_rule", "Gated DeltaNet, scalar decay (lamina.chunk_gated_delta_rule)"),
        ("kda", "Kimi Delta Attention, per-K decay (lamina.chunk_kda)"),
        ("gdn2", "Gated DeltaNet-2, per-K decay, erase and write gates (lamina.chunk_gdn2)"),
    )
}
OPS["prism_attention"] = OpSpec(
    "prism_attention", "softmax attention at Prism head dims (lamina.prism_attention)",
    attention_flops, attention_bytes,
    shapes={
        "standard": [attn_shape(4, 4096, PRISM_MODEL_WIDTH // d, d, "bf16") for d in PRISM_DIMS],
        "small": [attn_shape(1, 1024, PRISM_SMALL_WIDTH // d, d, "fp32") for d in (64, 128, 320)],
        "quick": [attn_shape(1, 1024, PRISM_SMALL_WIDTH // 64, 64, "fp32")],
        "tiny": [attn_shape(1, 64, 2, 32, "fp32")],
        "sweep": [attn_shape(SWEEP_ATTN_B, SWEEP_ATTN_T, sweep_attention_heads(d), d, "bf16", causal=c)
                  for d in SWEEP_ATTN_DIMS for c in (True, False)],
        "sweep-dry": [attn_shape(1, 64, 2, d, "fp32", causal=c) for d in (32, 80) for c in (True, False)],
    },
)
OPS["hrm_update"] = OpSpec(
    "hrm_update", "HRM gated state update with RMS norm (lamina.hrm_gated_update)",
    hrm_flops, hrm_bytes,
    shapes={
        "standard": [hrm_shape(8192, 4096, "bf16")],
        "small": [hrm_shape(4096, 1024, "fp32"), hrm_shape(4096, 1024, "bf16")],
        "quick": [hrm_shape(4096, 1024, "fp32")],
        "tiny": [hrm_shape(64, 64, "fp32")],
        "sweep": [hrm_shape(SWEEP_HRM_ROWS, d, "bf16") for d in SWEEP_HRM_DIMS],
        "sweep-dry": [hrm_shape(64, 64, "fp32")],
    },
)
OPS["gdn_decode"] = OpSpec(
    "gdn_decode", "one Gated DeltaNet decoding step from a state (lamina.fused_recurrent_gated_delta_rule)",
    gdn_decode_flops, gdn_decode_bytes, modes=("fwd",),
    shapes={
        "standard": [decode_shape(b, 32, 128, "bf16") for b in DECODE_BATCHES],
        "small": [decode_shape(b, 4, 64, "fp32") for b in DECODE_BATCHES],
        "quick": [decode_shape(16, 4, 64, "fp32")],
        "tiny": [decode_shape(2, 2, 16, "fp32")],
    },
)
OPS["attention_decode"] = OpSpec(
    "attention_decode", "one query token against a KV cache (lamina.prism_attention, causal=False)",
    attention_flops, attention_bytes, modes=("fwd",),
    shapes={
        "standard": [attn_shape(b, 1, 16, 128, "bf16", causal=False, Tk=DECODE_CACHE_LEN) for b in DECODE_BATCHES],
        "small": [attn_shape(b, 1, 4, 64, "fp32", causal=False, Tk=1024) for b in DECODE_BATCHES],
        "quick": [attn_shape(16, 1, 4, 64, "fp32", causal=False, Tk=1024)],
        "tiny": [attn_shape(2, 1, 2, 32, "fp32", causal=False, Tk=64)],
    },
)

OPS["short_conv"] = OpSpec(
    "short_conv", "depthwise causal conv1d with SiLU, the layers' short convolution (lamina.causal_conv1d)",
    conv_flops, conv_bytes,
    shapes={
        "standard": [conv_shape(B, T, D, W, "bf16") for B, T, D, W in CONV_SHAPES],
        "small": [conv_shape(2, 1024, 512, 4, "fp32")],
        "quick": [conv_shape(1, 1024, 256, 4, "fp32")],
        "tiny": [conv_shape(1, 32, 64, 4, "fp32")],
    },
)

for _op in LAYER_OPS:
    OPS[_op] = OpSpec(_op, f"{LAYER_CLASSES[_op]} layer (lamina.layers vs fla.layers, same weights)",
                      layer_flops, layer_bytes, modes=LAYER_MODES, shapes=_layer_sets(_op))

SHAPE_SETS = ("standard", "small", "quick", "tiny")
# Only the ops of benchmarks/sweep_attention.py and benchmarks/sweep_delta.py have these: their GPU shapes
# and their CPU dry run.
SWEEP_SHAPE_SETS = ("sweep", "sweep-dry")
SWEEP_OPS = ("prism_attention", "hrm_update", *DELTA_OPS)
# Default run order: cheap ops first, so that under a time budget (each op gets the remaining time over
# the remaining ops) what they leave unused flows to the expensive ones. The kernel ops only: the layer
# ops (`--op layers`) compile two whole layers per op and answer another question (lamina's layer
# against fla's), so they run when asked for.
RUN_ORDER = ("hrm_update", "short_conv", "gdn_decode", "attention_decode", "gated_delta_rule", "kda", "gdn2",
             "delta_rule", "prism_attention")
# What `lamina bench --quick` runs (op, mode) on each device; shapes from the "quick" set on CPU.
QUICK_OPS: dict[str, tuple[tuple[str, str], ...]] = {
    "cpu": (("delta_rule", "fwd"), ("gated_delta_rule", "fwd"), ("prism_attention", "fwd"), ("hrm_update", "fwd")),
    "cuda": (("gated_delta_rule", "fwd"), ("kda", "fwd"), ("prism_attention", "fwd"), ("hrm_update", "fwd")),
}

# --quick on CUDA: indices into the standard shapes (4x2048x16x128; Prism D=128 and D=320; the HRM update).
QUICK_CUDA_SHAPES: dict[str, tuple[int, ...]] = {"gated_delta_rule": (2,), "kda": (2,), "prism_attention": (1, 3),
                                                 "hrm_update": (0,)}


def expand_ops(names: list[str]) -> list[str]:
    """Op names with each group (``OP_GROUPS``) replaced by its ops, in order, without repeats."""
    out: list[str] = []
    for name in names:
        out.extend(OP_GROUPS.get(name, (name,)))
    return list(dict.fromkeys(out))


def get_op(name: str) -> OpSpec:
    """The op named exactly ``name``; ValueError listing the known names otherwise."""
    if name not in OPS:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(OPS)}")
    return OPS[name]


def shape_label(op: str, p: dict[str, Any]) -> str:
    """A short, stable label: BxTxHxD for the delta family (fla's notation), and so on."""
    if op in DELTA_OPS:
        heads = f"{p['H']}" if p["HV"] == p["H"] else f"{p['H']}/{p['HV']}"
        dims = f"{p['K']}" if p["K"] == p["V"] else f"{p['K']}/{p['V']}"
        if p.get("seqlens"):
            return f"varlen{len(p['seqlens'])}x{p['T']}x{heads}x{dims} {p['dtype']}"
        return f"{p['B']}x{p['T']}x{heads}x{dims} {p['dtype']}"
    if op in ATTENTION_OPS:
        heads = f"{p['H']}" if p["HKV"] == p["H"] else f"{p['H']}/{p['HKV']}"
        t = f"{p['Tq']}" if p["Tq"] == p["Tk"] else f"{p['Tq']}:{p['Tk']}"
        return f"{p['B']}x{t}x{heads}x{p['D']}{' causal' if p['causal'] else ''} {p['dtype']}"
    if op == "hrm_update":
        return f"{p['N']}x{p['D']}{' +norm' if p['norm'] else ''} {p['dtype']}"
    if op == "short_conv":
        return f"{p['B']}x{p['T']}x{p['D']} W={p['W']} {p['dtype']}"
    if op in LAYER_OPS:
        d = layer_dims(op, p["layer"])
        heads = f"{d.H}" if d.HV == d.H else f"{d.H}/{d.HV}"
        dims = f"{d.K}" if d.K == d.V else f"{d.K}/{d.V}"
        return f"{p['B']}x{p['T']} d{d.hidden_size} h{heads}x{dims} {p['dtype']}"
    return f"B{p['B']} {p['HV']}x{p['K']}x{p['V']} {p['dtype']}"


def shapes_for(op: str, shape_set: str) -> list[dict[str, Any]]:
    if shape_set not in SHAPE_SETS + SWEEP_SHAPE_SETS:
        raise ValueError(f"shape set must be one of {SHAPE_SETS + SWEEP_SHAPE_SETS}, got {shape_set!r}")
    shapes = get_op(op).shapes
    if shape_set not in shapes:
        raise ValueError(f"op {op!r} has no {shape_set!r} shapes (it has {', '.join(shapes)})")
    return [dict(p) for p in shapes[shape_set]]
