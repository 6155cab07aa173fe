"""The fuzzing space: which ops, which shapes and options, and how one case is drawn.

A case is a plain JSON-able dict: ``op``, every shape, flag and dtype, the seed of its tensors,
where it runs (``device``, ``backend``, ``grad``), and for a delta-rule case on lamina's kernels the
speed alternative they run (``tuning``: None, or an alternative's choices). ``draw_case(op, run_seed, index, ...)``
draws it from ``random.Random`` seeded by a hash of ``(run_seed, op, index)``, so two ops (or two
indices) of one run get unrelated shapes, and the same triple always gives the same case.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from lamina._delta_spec import CHUNK_SIZES

CHUNK_DELTA_OPS = ("chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda", "chunk_gdn2")
RECURRENT_DELTA_OPS = ("fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda",
                       "fused_recurrent_gdn2")
DELTA_OPS = (*CHUNK_DELTA_OPS, *RECURRENT_DELTA_OPS)
KERNEL_OPS = (*DELTA_OPS, "prism_attention", "hrm_gated_update", "causal_conv1d", "rms_norm_gated")
LAYER_OPS = ("DeltaNet", "GatedDeltaNet", "KimiDeltaAttention", "GatedDeltaNet2", "PrismAttention")
OPS = (*KERNEL_OPS, *LAYER_OPS)
# Names that stand for several ops on the command line.
GROUPS = {"all": OPS, "delta": DELTA_OPS, "kernels": KERNEL_OPS, "layers": LAYER_OPS}

DTYPE_NAMES = ("float32", "float16", "bfloat16")
# A sequence of a varlen pack is empty with this chance, and of length 1 with ONE_SHARE - EMPTY_SHARE.
EMPTY_SHARE = 0.1
ONE_SHARE = 0.35


@dataclass(frozen=True)
class DeltaSpec:
    """What one delta-rule op takes: decay ``g`` (None, "scalar", "channel"; ``g_optional``: may be
    None), gates ("beta" one scalar per head, "bw" GDN-2's per-channel erase/write), and options."""

    g: str | None
    gates: str
    chunked: bool
    gate_in_kernel: bool
    lower_bound: bool
    beta_sigmoid: bool
    gk: bool = False
    g_optional: bool = False
    v_first: bool = True


DELTA_SPECS: dict[str, DeltaSpec] = {
    "chunk_delta_rule": DeltaSpec(None, "beta", True, False, False, False, v_first=False),
    "chunk_gated_delta_rule": DeltaSpec("scalar", "beta", True, True, False, True),
    "chunk_kda": DeltaSpec("channel", "beta", True, True, True, True),
    "chunk_gdn2": DeltaSpec("channel", "bw", True, True, True, False),
    "fused_recurrent_delta_rule": DeltaSpec(None, "beta", False, False, False, False, v_first=False),
    "fused_recurrent_gated_delta_rule": DeltaSpec("scalar", "beta", False, True, False, True, gk=True,
                                                  g_optional=True),
    "fused_recurrent_kda": DeltaSpec("channel", "beta", False, True, True, True),
    "fused_recurrent_gdn2": DeltaSpec("channel", "bw", False, True, True, False),
}

# How hard the decay is: "mild" logsigmoid(x + 4) (about -0.02), "moderate" logsigmoid(x),
# "extreme" uniform in [-20, 0] (whole chunks decay to exp(-20 * 64)).
GATE_STRENGTHS = ("mild", "moderate", "extreme")
# With a case's ``resets``, this share of its log decays' elements is -inf (of a raw gate input's: 1e6, whose
# activation is far below the chunked forms' floor).
RESET_SHARE = 0.05


@dataclass(frozen=True)
class Limits:
    """Largest shapes of a tier. ``dims``: head dims K/V (at most 256: the backward's limit);
    ``attn_dim``: attention head dim (multiples of 8, at most 512); ``max_heads`` q/k heads;
    ``max_ratio``: HV / H; ``max_rows``: rows of the row-wise ops; ``width``: layer hidden sizes."""

    name: str
    max_t: int
    max_dim: int
    attn_dim: int
    max_heads: int
    max_ratio: int
    max_batch: int
    max_rows: int
    layer_width: int


# PyTorch on CPU: the float64 token loops dominate; T ~130 and dims 128 keep a case well under a second.
TORCH_CPU = Limits("torch-cpu", max_t=130, max_dim=128, attn_dim=128, max_heads=2, max_ratio=2, max_batch=2,
                   max_rows=64, layer_width=64)
# Triton interpreter: about 1e4x slower than a GPU; every program (sequence x head x value block x chunk)
# costs ~0.1-0.5 s, so one q/k head, one sequence of a dense batch, T <= 32, dims <= 48
# (measured on 2 loaded cores: 1-10 s a case with gradients).
INTERPRET = Limits("interpret", max_t=32, max_dim=48, attn_dim=64, max_heads=1, max_ratio=2, max_batch=1,
                   max_rows=16, layer_width=32)
CUDA = Limits("cuda", max_t=1100, max_dim=256, attn_dim=512, max_heads=4, max_ratio=4, max_batch=4,
              max_rows=4096, layer_width=256)

# Head dims that kernels round or tile (powers of two, their neighbours, and common odd widths).
_DIMS = (8, 16, 20, 24, 32, 36, 48, 64, 80, 96, 100, 128, 160, 192, 200, 256)


def case_rng(run_seed: int, op: str, index: int) -> random.Random:
    """``random.Random`` seeded by a stable hash of ``(run_seed, op, index)``."""
    digest = hashlib.sha256(f"{run_seed}/{op}/{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def limits_for(device: str, backend: str) -> Limits:
    if device == "cuda":
        return CUDA
    return INTERPRET if backend == "triton" else TORCH_CPU


def _dim(rng: random.Random, limit: int) -> int:
    if rng.random() < 0.6:
        return rng.choice([d for d in _DIMS if d <= limit])
    return rng.randint(4, limit)


def _length(rng: random.Random, max_t: int, chunk: int) -> int:
    """T: 1, a chunk boundary +/- 1, or log-uniform in [1, max_t] (short sequences are cheap and
    common in failures; long ones still come up: P(T > max_t / 2) ~ 0.1 of the log-uniform draws)."""
    u = rng.random()
    if u < 0.15:
        return 1
    if u < 0.45:
        near = [t for m in (1, 2) for t in (m * chunk - 1, m * chunk, m * chunk + 1) if 1 <= t <= max_t]
        if near:
            return rng.choice(near)
    return min(max_t, int(math.exp(rng.uniform(0.0, math.log(max_t + 1)))))


def _short_length(draw: float, long: Callable[[], int]) -> int:
    """One sequence of a varlen pack: empty (``draw < EMPTY_SHARE``: ``cu_seqlens`` repeats an offset), of length 1,
    or ``long()``."""
    return 0 if draw < EMPTY_SHARE else 1 if draw < ONE_SHARE else long()


def _nonempty(rng: random.Random, lens: list[int]) -> list[int]:
    """``lens``, with one sequence of length 1 where every one came out empty (a pack of no tokens is refused)."""
    if not any(lens):
        lens[rng.randint(0, len(lens) - 1)] = 1
    return lens


def _lengths(rng: random.Random, max_t: int, chunk: int) -> list[int]:
    """Sequence lengths of a varlen pack (2-4 sequences, some empty or of length 1), summing to <= max_t and > 0."""
    n = rng.randint(2, 4)
    return _nonempty(rng, [_short_length(rng.random(), lambda: _length(rng, max(max_t // n, 1), chunk))
                           for _ in range(n)])


def _batch(rng: random.Random, lim: Limits, T: int) -> int:
    """B: up to the tier's batch, and 1 for sequences longer than half the tier's T (bounds the work)."""
    return 1 if T > lim.max_t // 2 else rng.randint(1, lim.max_batch)


def _dtype(rng: random.Random, dtypes: tuple[str, ...]) -> str:
    return rng.choice(dtypes)


def _delta(op: str, rng: random.Random, lim: Limits) -> dict:
    spec = DELTA_SPECS[op]
    chunk = rng.choice(CHUNK_SIZES)
    case: dict = {"H": rng.randint(1, lim.max_heads), "ratio": rng.randint(1, lim.max_ratio),
                  "K": _dim(rng, lim.max_dim), "V": _dim(rng, lim.max_dim)}
    if spec.chunked:
        case["chunk_size"] = chunk
    if rng.random() < 0.3:
        case.update(B=1, T=None, lens=_lengths(rng, lim.max_t, chunk))
    else:
        T = _length(rng, lim.max_t, chunk)
        case.update(B=_batch(rng, lim, T), T=T, lens=None)
    case["scale"] = None if rng.random() < 0.6 else round(rng.uniform(0.05, 1.5), 4)
    case["initial_state"] = rng.random() < 0.5
    case["output_final_state"] = rng.random() < 0.7
    case["state_v_first"] = spec.v_first and rng.random() < 0.2
    case["l2norm"] = rng.random() < 0.4
    case["gate_strength"] = rng.choice(GATE_STRENGTHS) if spec.g or spec.gk else None
    case["g"] = spec.g is not None and not (spec.g_optional and rng.random() < 0.3)
    case["gk"] = spec.gk and rng.random() < 0.4
    case["gate_in_kernel"] = spec.gate_in_kernel and case["g"] and rng.random() < 0.35
    case["lower_bound"] = (round(rng.uniform(-5.0, -0.5), 3)
                           if spec.lower_bound and case["gate_in_kernel"] and rng.random() < 0.5 else None)
    case["dt_bias"] = case["gate_in_kernel"] and rng.random() < 0.7
    case["beta"] = spec.gates == "bw" or rng.random() < 0.85  # False: beta=None (ones)
    case["beta_sigmoid"] = spec.beta_sigmoid and case["beta"] and rng.random() < 0.4
    case["allow_neg_eigval"] = case["beta_sigmoid"] and rng.random() < 0.4
    # decays of 0 (the state forgotten there) among the drawn ones (RESET_SHARE of them): log decays of -inf, raw gate
    # inputs of 1e6 (a log decay of about -1e6 exp(A_log), which the chunked forms floor; with lower_bound, a decay
    # of exp(lower_bound))
    case["resets"] = bool(case["g"] or case["gk"]) and rng.random() < 0.2
    return case


# Share of the delta-rule cases on lamina's kernels that run one of the chunked kernels' speed alternatives
# (``lamina.kernels.delta_tuning.ALTERNATIVES``, drawn uniformly; the token-by-token ops' backward is the
# chunked one) instead of the defaults: the case's ``tuning``, the alternative's choices.
TUNED_SHARE = 0.5


def _tuning(rng: random.Random) -> dict | None:
    # imported here: it imports triton, which a CPU run imports only once the interpreter is set
    from lamina.kernels.delta_tuning import ALTERNATIVES

    # the defaults at the low end of the draw, where hypothesis shrinks a failing case to
    if rng.random() < 1 - TUNED_SHARE:
        return None
    return rng.choice(ALTERNATIVES).choices()


def _attention(rng: random.Random, lim: Limits) -> dict:
    hkv = rng.randint(1, lim.max_heads)
    case: dict = {"HKV": hkv, "group": rng.randint(1, lim.max_ratio),
                  "D": 8 * rng.randint(2, lim.attn_dim // 8), "causal": rng.random() < 0.5,
                  "scale": None if rng.random() < 0.7 else round(rng.uniform(0.05, 1.0), 4)}
    if rng.random() < 0.3:
        n = rng.randint(2, 4)

        def long() -> int:
            return rng.randint(1, max(lim.max_t // n, 1))

        case.update(B=1, T=None, S=None, **{key: _nonempty(rng, [_short_length(rng.random(), long) for _ in range(n)])
                                            for key in ("lens_q", "lens_k")})
    else:
        case.update(B=rng.randint(1, lim.max_batch), T=_length(rng, lim.max_t, 64), S=_length(rng, lim.max_t, 64),
                    lens_q=None, lens_k=None)
    return case


def _hrm(rng: random.Random, lim: Limits) -> dict:
    return {"rows": rng.choice([1, rng.randint(1, lim.max_rows)]),
            "D": rng.choice([8, 24, 64, 100, 256, _dim(rng, 256)]),
            "per_token_gate": rng.random() < 0.3, "bias": rng.random() < 0.5, "norm": rng.random() < 0.5}


def _conv(rng: random.Random, lim: Limits) -> dict:
    case: dict = {"D": _dim(rng, lim.max_dim), "W": rng.randint(2, 4), "bias": rng.random() < 0.5,
                  "residual": rng.random() < 0.3, "initial_state": rng.random() < 0.4,
                  "output_final_state": rng.random() < 0.5, "activation": rng.choice([None, "silu"])}
    if rng.random() < 0.3:
        case.update(B=1, T=None, lens=_lengths(rng, lim.max_t, 16))
    else:
        T = _length(rng, lim.max_t, 16)
        case.update(B=_batch(rng, lim, T), T=T, lens=None)
    return case


def _norm(rng: random.Random, lim: Limits) -> dict:
    return {"rows": rng.choice([1, rng.randint(1, lim.max_rows)]), "D": _dim(rng, 256), "weight": rng.random() < 0.8,
            "bias": rng.random() < 0.3, "activation": rng.choice(["swish", "sigmoid"]),
            "residual": rng.random() < 0.3, "prenorm": rng.random() < 0.3, "residual_in_fp32": rng.random() < 0.3}


def _layer(op: str, rng: random.Random, lim: Limits) -> dict:
    heads = rng.randint(1, 2)
    smallest = 16 if op == "PrismAttention" else 8  # prism_attention: head dims 16..512, multiples of 8
    head_dim = rng.choice([d for d in (8, 16, 24, 32) if smallest <= d and d * heads <= lim.layer_width])
    case: dict = {"B": rng.randint(1, lim.max_batch), "T": _length(rng, min(lim.max_t, 24), 16),
                  "heads": heads, "head_dim": head_dim, "hidden": heads * head_dim}
    if op == "PrismAttention":
        case.update(kv_heads=rng.choice([h for h in (1, heads) if heads % h == 0]), rotary=rng.random() < 0.5)
    else:
        case.update(v_ratio=rng.randint(1, 2) if op != "DeltaNet" else 1, short_conv=rng.random() < 0.5,
                    mode=rng.choice(["chunk", "fused_recurrent"]), allow_neg_eigval=rng.random() < 0.3,
                    use_gate=rng.random() < 0.5 if op in ("DeltaNet", "GatedDeltaNet") else None)
    return case


def draw_case(op: str, run_seed: int, index: int, *, device: str = "cpu", backend: str = "auto",
              interpret: bool = False, dtypes: tuple[str, ...] | None = None, grad: bool = True,
              limits: Limits | None = None) -> dict:
    """Case ``index`` of ``op`` in the run seeded ``run_seed`` (see the module docstring).

    ``backend="auto"`` on CPU: with ``interpret`` half of the cases run the Triton kernels under the
    interpreter (``backend="triton"``, small shapes), the others PyTorch; without it all run PyTorch.
    Low precision runs on the Triton path only (CPU PyTorch cases are float32). ``limits``
    replaces the tier's limits.
    """
    case = draw_from(op, case_rng(run_seed, op, index), device=device, backend=backend, interpret=interpret,
                     dtypes=dtypes, grad=grad, limits=limits)
    case.update(run_seed=run_seed, index=index)
    return case


def draw_from(op: str, rng: random.Random, *, device: str = "cpu", backend: str = "auto", interpret: bool = False,
              dtypes: tuple[str, ...] | None = None, grad: bool = True, limits: Limits | None = None) -> dict:
    """A case of ``op`` drawn with ``rng`` (anything with ``random``, ``randint``, ``choice``,
    ``uniform`` and ``getrandbits`` like ``random.Random``; the hypothesis strategies pass their own)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if device == "cpu" and backend == "auto":
        backend = "triton" if interpret and rng.random() < 0.5 else "torch"
    lim = limits or limits_for(device, backend)
    allowed = tuple(dtypes or DTYPE_NAMES)
    if device == "cpu" and backend == "torch":
        allowed = ("float32",)
    case: dict = {"op": op, "seed": rng.getrandbits(31), "dtype": _dtype(rng, allowed), "device": device,
                  "backend": backend, "grad": grad}
    if op in DELTA_OPS:
        case.update(_delta(op, rng, lim))
        if backend != "torch":
            case["tuning"] = _tuning(rng)
    elif op == "prism_attention":
        case.update(_attention(rng, lim))
    elif op == "hrm_gated_update":
        case.update(_hrm(rng, lim))
    elif op == "causal_conv1d":
        case.update(_conv(rng, lim))
    elif op == "rms_norm_gated":
        case.update(_norm(rng, lim))
    else:
        case.update(_layer(op, rng, lim))
        if device == "cpu":
            case["dtype"] = "float32"  # the float64 copy is the oracle; low precision layers only on a GPU
    return case
