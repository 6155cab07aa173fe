"""Pieces shared by the chunked delta-rule forward and backward kernels.

* ``ChunkIndex`` / ``chunk_indices`` (host) and ``chunk_rows`` / ``chunk_bounds`` / ``seq_bounds``
  (``@triton.jit``):
  which chunk of which sequence each program handles, with the same chunk numbering in both
  directions (the ``h`` tensor of chunk-start states is indexed by it).
* ``DecayKind`` / ``GateKind``: the compile-time flags of the kernel family, read off the
  shapes of ``g``, ``b`` and ``w``.
* ``GateAct`` / ``GateInput`` (host) and ``gate_decay`` / ``gate_input_grads`` / ``floor_grad`` / ``activated_gate``
  (``@triton.jit``): the gate activation of fla's ``use_gate_in_kernel``, applied where the kernels load
  ``g``, forward and backward.
* ``tile_ptrs`` / ``load_tile`` / ``load_rows`` / ``store_tile`` / ``load_vec`` and ``load_gate``
  (``@triton.jit``): a chunk's tiles and its in-chunk cumulative log decay ``G``, one gate cumsum for the
  forward's preparation kernel and every backward kernel.
* Tile sizes that both directions agree on, each with its reason.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lamina._delta_spec import CHUNK_SIZES, DEFAULT_CHUNK_SIZE, L2NORM_EPS, LOG_DECAY_FLOOR, MAX_K, MAX_V, BetaAct  # noqa: F401 - the family's limits
from lamina.kernels._utils import cdiv, next_power_of_2

# Diagonal sub-block length inside a chunk. tl.dot needs every dim >= 16, and per-channel
# decay is made safe by taking exponents relative to a row inside the same 16-token block.
SUB_BLOCK = 16
SUB_BLOCK_C = tl.constexpr(SUB_BLOCK)  # the same, readable inside @triton.jit code

# K-block rows of one state accumulator. 64 x 64 fp32 over 4 warps is 32 registers a thread;
# K = 512 uses four 128-row blocks with a narrow V tile instead.
STATE_BLOCK_K = 64
STATE_BLOCK_K_WIDE = 128
# At most this many fp32 state elements per program (16 registers a thread at 8 warps, next to
# the [BT, BV] accumulators): the V tile shrinks as K grows (K <= 64: 64 columns, K = 128: 32,
# K >= 256: 16). Targets without warpgroup products (sm_80: mma.sync keeps the operands of both
# products in registers) get half: at K = 128 and 32 columns the state pass used 250-255 registers
# on sm_80 and spilled (GDN, Triton 3.9: 1 STL); 16 columns compile to 128 registers for all four
# variants under Triton 3.6 and 3.9.
STATE_TILE_ELEMS = 4096
STATE_TILE_ELEMS_MMA_SYNC = 2048
# Smallest V tile: tl.dot needs dims >= 16.
MIN_BLOCK = 16
# The l2norm's eps (``use_qk_l2norm_in_kernel``), readable inside @triton.jit code.
L2NORM_EPS_C = tl.constexpr(L2NORM_EPS)
# The chunked forms' floor on a log decay (lamina._delta_spec.LOG_DECAY_FLOOR), readable inside @triton.jit code.
LOG_DECAY_FLOOR_C = tl.constexpr(LOG_DECAY_FLOOR)


class DecayKind:
    NONE = 0  # DeltaNet
    SCALAR = 1  # Gated DeltaNet: g [B, T, HV]
    CHANNEL = 2  # KDA, GDN-2: g [B, T, HV, K]


class GateKind:
    SCALAR = 0  # beta [B, T, HV]
    CHANNEL = 1  # GDN-2: b [B, T, HV, K] (erase) or w [B, T, HV, V] (write)


# The same kinds, readable inside @triton.jit code: kernels compare their DECAY, ERASE and WRITE flags to these.
DECAY_NONE = tl.constexpr(DecayKind.NONE)
DECAY_SCALAR = tl.constexpr(DecayKind.SCALAR)
DECAY_CHANNEL = tl.constexpr(DecayKind.CHANNEL)
GATE_SCALAR = tl.constexpr(GateKind.SCALAR)
GATE_CHANNEL = tl.constexpr(GateKind.CHANNEL)


class GateAct:
    """What the kernels make of ``g`` (the ``GATE_ACT`` flag)."""

    NONE = 0  # g is the log decay
    SOFTPLUS = 1  # -exp(A_log) * softplus(g + dt_bias)
    BOUNDED = 2  # lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), lower_bound < 0


ACT_NONE = tl.constexpr(GateAct.NONE)
ACT_SOFTPLUS = tl.constexpr(GateAct.SOFTPLUS)
ACT_BOUNDED = tl.constexpr(GateAct.BOUNDED)
# What the kernels make of a scalar beta (the ``BETA_ACT`` flag), readable inside @triton.jit code.
BETA_NONE = tl.constexpr(BetaAct.NONE)
BETA_SIGMOID2 = tl.constexpr(BetaAct.SIGMOID2)


class GateInput(NamedTuple):
    """A raw gate input's activation parameters (fla's ``use_gate_in_kernel``): ``A_log [HV]`` (None: 0, only
    with ``lower_bound``), ``dt_bias [HV]`` for a scalar gate or ``[HV * K]`` per channel (None: 0), and
    ``lower_bound`` (None: the softplus form)."""

    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    lower_bound: float | None

    @property
    def act(self) -> int:
        return GateAct.SOFTPLUS if self.lower_bound is None else GateAct.BOUNDED

    def kernel_args(self, n_heads: int, n_bias: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(A_log, dt_bias, lower_bound)`` as the kernels read them: float32, zeros for a parameter left out
        (``n_heads`` and ``n_bias`` of them: the kernels read ``A_log[i_hv]`` and ``dt_bias`` at every head)."""
        f32 = dict(dtype=torch.float32, device=device)
        a = torch.zeros(n_heads, **f32) if self.A_log is None else self.A_log.reshape(-1).to(**f32).contiguous()
        bias = torch.zeros(n_bias, **f32) if self.dt_bias is None else self.dt_bias.reshape(-1).to(**f32).contiguous()
        return a, bias, 0.0 if self.lower_bound is None else float(self.lower_bound)


def gate_kernel_args(gate: GateInput | None, n_heads: int, channels: int, dummy: torch.Tensor) -> dict:
    """The gate activation's kernel arguments (``channels``: K for a per-channel gate, else 1), ``dummy``
    pointers and ``GATE_ACT = NONE`` without one."""
    if gate is None:
        return dict(A_log=dummy, dt_bias=dummy, lower_bound=0.0, GATE_ACT=GateAct.NONE)
    a, bias, lower_bound = gate.kernel_args(n_heads, n_heads * channels, dummy.device)
    return dict(A_log=a, dt_bias=bias, lower_bound=lower_bound, GATE_ACT=gate.act)


# (DECAY, ERASE, WRITE) flags of each variant.
VARIANT_FLAGS = {
    "delta": (DecayKind.NONE, GateKind.SCALAR, GateKind.SCALAR),
    "gdn": (DecayKind.SCALAR, GateKind.SCALAR, GateKind.SCALAR),
    "kda": (DecayKind.CHANNEL, GateKind.SCALAR, GateKind.SCALAR),
    "gdn2": (DecayKind.CHANNEL, GateKind.CHANNEL, GateKind.CHANNEL),
}


def check_beta_act(beta_act: int, flags: dict[str, int]) -> None:
    """``beta_act`` is a ``BetaAct``, and an activation applies to a scalar beta only (``b`` and ``w`` ``[B, T, HV]``:
    DeltaNet, Gated DeltaNet and KDA pass their beta as both)."""
    if beta_act not in (BetaAct.NONE, BetaAct.SIGMOID, BetaAct.SIGMOID2):
        raise ValueError(f"beta_act must be one of BetaAct.NONE, SIGMOID, SIGMOID2 (0, 1, 2), got {beta_act!r}")
    if beta_act != BetaAct.NONE and GateKind.CHANNEL in (flags["ERASE"], flags["WRITE"]):
        raise ValueError("beta_act applies to a scalar beta [B, T, HV]; b and w must then be [B, T, HV], "
                         "not per channel")


def aligned_attrs(fn, signature: dict[str, str]) -> dict:
    """What the JIT specialises for torch tensors: every pointer argument is 16-byte aligned."""
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}


def decay_kind(g: torch.Tensor | None) -> int:
    if g is None:
        return DecayKind.NONE
    return DecayKind.SCALAR if g.dim() == 3 else DecayKind.CHANNEL


def gate_kind(x: torch.Tensor) -> int:
    return GateKind.SCALAR if x.dim() == 3 else GateKind.CHANNEL


def key_blocks(K: int) -> tuple[int, int]:
    """(BK, NK): K padded to a power of two and split into at most four register blocks."""
    k_pad = max(next_power_of_2(K), MIN_BLOCK)
    bk = min(k_pad, STATE_BLOCK_K if k_pad <= 4 * STATE_BLOCK_K else STATE_BLOCK_K_WIDE)
    return bk, k_pad // bk


# Input precision of every tl.dot of the family, forward and backward. fp32 operands on a GPU default to
# TF32 (10-bit mantissa): too coarse for the triangular solve (its error compounds over the chunk) and for
# fp32 inputs. tf32x3 splits each operand in two TF32 halves and keeps tensor cores at about fp32 accuracy;
# "ieee" would leave fp32 products on CUDA cores (the fp32 backward did: no HGMMA, thousands of spill
# stores in the static report). bf16/fp16 operands ignore the setting.
DOT_PRECISION = "tf32x3"


# fp32 inputs run their products as tf32x3 (three tensor-core passes on split operands), which
# needs about four times the operand registers of bf16: the static report showed the K = 128
# state pass spilling at V tiles of 64 and 32 and not at 16.
FP32_V_TILE_DIVISOR = 4


def has_warpgroup_mma(device: torch.device) -> bool:
    """Hopper (sm_90): tensor-core products read their operands from shared memory (wgmma), which
    leaves registers for wider tiles. False on CPU (the interpreter) and on every other GPU."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


# Warps of the family's matrix kernels. With warpgroup products, 8 warps are two warpgroups, which split a
# 64-row product along its columns: a 16-column one becomes two ``wgmma m64n8k8`` in tf32 (fp32 operands),
# the shape of Triton issue #10629 (reads its shared operand past the end on an H100). The float32 kernels
# named as faulting on the H200 and H100 had such products (benchmarks/results/2026-12-06-nvidia-h100/README.md),
# and the static report flags the shape. A fp32 kernel whose narrowest product has 16 columns runs with
# ``FP32_NARROW_WARPS`` there (one warpgroup: ``m64n16k8``).
MATRIX_WARPS = 8
WARPS_PER_WARPGROUP = 4
FP32_NARROW_WARPS = WARPS_PER_WARPGROUP
# Narrowest product per warpgroup that tf32 products use without the shape above.
WGMMA_TF32_MIN_N = 16
# Narrowest fp32 product that MATRIX_WARPS split over their warpgroups without the shape above (32 columns).
FP32_MATRIX_MIN_N = WGMMA_TF32_MIN_N * MATRIX_WARPS // WARPS_PER_WARPGROUP


def matrix_warps(narrowest: int, fp32: bool, warpgroup_mma: bool) -> int:
    """Warps of a matrix kernel whose narrowest tensor-core product is ``narrowest`` columns wide, for fp32
    activations (``fp32``) or 16-bit ones, on a target with warpgroup products (``warpgroup_mma``) or not."""
    return FP32_NARROW_WARPS if fp32 and warpgroup_mma and narrowest < FP32_MATRIX_MIN_N else MATRIX_WARPS


def l2norm_in_kernels(device: torch.device) -> bool:
    """Whether the delta-rule ops fuse fla's ``use_qk_l2norm_in_kernel`` into the chunked forward kernels on
    ``device`` (``L2NORM``): on Hopper and under the interpreter. Elsewhere the ops run ``lamina.l2_norm`` on q
    and k first: compiled for sm_80 (static report, Triton 3.9), the fused preparation kernel spilled 4-6 STL
    for fp32 and 9-114 STL for 16-bit DeltaNet and GDN at K = 512, and the fused state pass 2 STL for 16-bit
    KDA and GDN-2 at K = 128."""
    return device.type != "cuda" or has_warpgroup_mma(device)


def value_block(K: int, V: int, fp32: bool = False, warpgroup_mma: bool = True) -> int:
    """V tile of one state-pass program, so that the K x BV fp32 state stays in registers
    (``warpgroup_mma``: the target has warpgroup products, see ``has_warpgroup_mma``)."""
    k_pad = max(next_power_of_2(K), MIN_BLOCK)
    budget = STATE_TILE_ELEMS if warpgroup_mma else STATE_TILE_ELEMS_MMA_SYNC
    bv = min(next_power_of_2(V), 64, budget // k_pad)
    return max(MIN_BLOCK, bv // FP32_V_TILE_DIVISOR if fp32 else bv)


class ChunkIndex(NamedTuple):
    """Chunk numbering shared by forward and backward.

    ``total``: number of chunks, ``sum_n ceil(T_n / chunk_size)``. Dense (no ``cu_seqlens``): the chunks
    are ``B * per_sequence``, b-major, and the kernels derive (sequence, chunk) from the program id, so
    ``offsets`` and ``indices`` are None. Varlen: ``offsets [N + 1]`` (int32, on the device) counts the
    chunks before sequence ``n``, ``indices [total, 2]`` (int32) holds (sequence, chunk within it) of
    each chunk, and ``per_sequence`` is 0.
    """

    offsets: torch.Tensor | None
    indices: torch.Tensor | None
    total: int
    per_sequence: int


def chunk_indices(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int, chunk_size: int) -> ChunkIndex:
    """The ``ChunkIndex`` of ``cu_seqlens [N + 1]`` or of ``batch`` sequences of ``seqlen`` tokens."""
    if cu_seqlens is None:
        nt = cdiv(seqlen, chunk_size)
        return ChunkIndex(None, None, batch * nt, nt)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    counts = (lens + chunk_size - 1) // chunk_size
    offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    total = int(offsets[-1].item())
    seq = torch.repeat_interleave(torch.arange(counts.numel(), device=cu_seqlens.device), counts)
    within = torch.arange(total, device=cu_seqlens.device) - offsets[seq]
    return ChunkIndex(offsets.to(torch.int32), torch.stack([seq, within], 1).to(torch.int32), total, 0)


@triton.jit
def seq_bounds(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """(bos, eos) as int64 token indices of sequence ``i_n`` in the packed [B*T] token axis."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def chunk_bounds(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN: tl.constexpr):
    """Sequence, chunk inside it, first token and end token (int64) of chunk ``i_c`` of ``chunk_indices``
    (dense: ``NT`` chunks per sequence, b-major)."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
    else:
        # chunk counts fit int32: a 32-bit division (a 64-bit one costs registers the prep kernel lacks)
        c = i_c.to(tl.int32)
        n = c // NT
        i_n = n.to(tl.int64)
        i_t = (c - n * NT).to(tl.int64)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    return i_n, i_t, bos, eos


@triton.jit
def chunk_rows(i_c, cu_seqlens, chunk_indices, T, NT, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """First token (int64) of chunk ``i_c`` and the tokens left in its sequence from there (int32: the masks
    compare it with 32-bit row offsets): row ``t`` of the chunk is token ``first + t`` and is valid where
    ``t < left`` (``left`` may exceed ``BT``)."""
    i_n, i_t, bos, eos = chunk_bounds(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    first = bos + i_t * BT
    return first, (eos - first).to(tl.int32)


@triton.jit
def first_chunk(chunk_offsets, i_n, NT, IS_VARLEN: tl.constexpr):
    """Index (int64) of sequence ``i_n``'s first chunk."""
    if IS_VARLEN:
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        c0 = i_n.to(tl.int64) * NT
    return c0


@triton.jit
def _softplus(z):
    """log(1 + exp(z)) = max(z, 0) + log1p(exp(-|z|)), without overflow for large z and to fp32's relative
    accuracy for very negative z: log1p(u) is log(w) * u / (w - 1) with w = 1 + u (u where w rounds to 1),
    where a plain log(1 + u) would keep only u's bits above 1's rounding."""
    u = tl.exp(-tl.abs(z))
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
    return tl.maximum(z, 0.0) + log1p


@triton.jit
def gate_decay(x, a_log, bias, lower_bound, ACT: tl.constexpr):
    """The log decay of the raw gate input ``x`` (fp32; ``a_log`` and ``bias`` broadcast to it)."""
    if ACT == ACT_SOFTPLUS:
        return -tl.exp(a_log) * _softplus(x + bias)
    elif ACT == ACT_BOUNDED:
        return lower_bound * tl.sigmoid(tl.exp(a_log) * (x + bias))
    else:
        return x


@triton.jit
def floor_grad(dg, log_decay):
    """The gradient of ``log_decay`` from ``dg``, that of its floored value: none below ``LOG_DECAY_FLOOR``,
    where the floor is a constant (as the PyTorch path's clamp; the float64 token loop's gradient there is
    within ``exp(-40)`` of 0). NaN kept. Without it, the rounding left in ``dg`` at a floored token reaches a
    raw gate's ``A_log`` multiplied by the (unbounded) log decay itself."""
    return tl.where(log_decay < LOG_DECAY_FLOOR_C, 0.0, dg)


@triton.jit
def gate_input_grads(dg, x, a_log, bias, lower_bound, ACT: tl.constexpr):
    """``(d x, d a_log)`` of ``gate_decay``'s raw input ``x`` from ``dg``, the gradient of the floored log
    decay (``dt_bias``'s is ``x``'s; ``floor_grad`` at the floor); ACT is not NONE."""
    z = x + bias
    e = tl.exp(a_log)
    if ACT == ACT_SOFTPLUS:
        decay = -e * _softplus(z)  # also d decay / d a_log
        dg = floor_grad(dg, decay)
        return dg * (-e * tl.sigmoid(z)), dg * decay
    else:
        s = tl.sigmoid(e * z)
        d_x = floor_grad(dg, lower_bound * s) * (lower_bound * s * (1.0 - s) * e)
        return d_x, d_x * z


@triton.jit
def gate_params(A_log, dt_bias, i_hv, bias_offs, bias_mask):
    """``(A_log[i_hv], dt_bias[bias_offs])`` in fp32 (bias 0 outside ``bias_mask``)."""
    a = tl.load(A_log + i_hv).to(tl.float32)
    return a, tl.load(dt_bias + bias_offs, mask=bias_mask, other=0.0).to(tl.float32)


@triton.jit
def _floored(log_decay):
    """``max(log_decay, LOG_DECAY_FLOOR)``, NaN kept (``tl.maximum`` would return the floor for it)."""
    return tl.where(log_decay < LOG_DECAY_FLOOR_C, LOG_DECAY_FLOOR_C, log_decay)


@triton.jit
def activated_gate(x, A_log, dt_bias, lower_bound, i_hv, bias_offs, bias_mask, valid, ACT: tl.constexpr):
    """The log decay of a loaded gate tile ``x`` (fp32): ``x`` itself without an activation, else
    ``gate_decay`` with ``A_log[i_hv]`` and ``dt_bias[bias_offs]``, 0 outside ``valid`` (padding rows stay
    without decay, as a zero ``g`` is); either floored at ``LOG_DECAY_FLOOR`` (-inf, a decay of 0, included)."""
    if ACT == ACT_NONE:
        return _floored(x)
    a, bias = gate_params(A_log, dt_bias, i_hv, bias_offs, bias_mask)
    return tl.where(valid, _floored(gate_decay(x, a, bias, lower_bound, ACT)), 0.0)


@triton.jit
def activated_beta(x, BETA_ACT: tl.constexpr):
    """beta from its loaded value ``x`` (fp32): ``x`` itself, ``sigmoid(x)`` or ``2 * sigmoid(x)``."""
    if BETA_ACT == BETA_NONE:
        return x
    if BETA_ACT == BETA_SIGMOID2:
        return 2.0 * tl.sigmoid(x)
    return tl.sigmoid(x)


@triton.jit
def beta_grad_factor(x, BETA_ACT: tl.constexpr):
    """``d beta / d x`` at the loaded value ``x`` (fp32) for a sigmoid ``BETA_ACT``: what takes a gradient of
    beta to one of its input."""
    s = tl.sigmoid(x)
    d = s * (1.0 - s)
    if BETA_ACT == BETA_SIGMOID2:
        d = 2.0 * d
    return d


# Tiles of one chunk, ``[BT, BC]`` of a ``[tokens, heads, C]`` tensor masked to the chunk (plain pointers: no
# block pointers, which Triton 3.9 removed), and the chunk's cumulative log decay read through them: the
# backward's tile addressing; the forward's gate cumsum is ``load_gate`` as well.
@triton.jit
def tile_ptrs(ptr, t0, L, row_stride, head_off, col0, o_t, o_c, N_COLS):
    """Pointers and mask of the tile ``ptr[t0 + o_t, head_off + col0 + o_c]`` of a
    ``[rows, row_stride]`` tensor: rows ``o_t < L`` and columns ``col0 + o_c < N_COLS`` are valid.
    The int64 row offset ``t0 * row_stride`` goes into the base pointer; the per-element offsets
    inside the tile stay int32."""
    base = ptr + t0 * row_stride + head_off + col0
    ptrs = base + (o_t * row_stride)[:, None] + o_c[None, :]
    mask = (o_t < L)[:, None] & ((col0 + o_c) < N_COLS)[None, :]
    return ptrs, mask


@triton.jit
def load_tile(ptr, t0, L, row_stride, head_off, col0, o_t, o_c, N_COLS):
    """The tile of ``tile_ptrs`` in the tensor's dtype, zero outside the valid rows and columns."""
    ptrs, mask = tile_ptrs(ptr, t0, L, row_stride, head_off, col0, o_t, o_c, N_COLS)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def store_tile(ptr, t0, L, row_stride, head_off, col0, o_t, o_c, N_COLS, x):
    """Store ``x`` into the valid part of the tile of ``tile_ptrs`` (cast to the tensor's dtype)."""
    ptrs, mask = tile_ptrs(ptr, t0, L, row_stride, head_off, col0, o_t, o_c, N_COLS)
    tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_rows(ptr, t0, L, row_stride, head_off, col0, o_t, o_c, N_COLS):
    """``load_tile`` in fp32."""
    return load_tile(ptr, t0, L, row_stride, head_off, col0, o_t, o_c, N_COLS).to(tl.float32)


@triton.jit
def load_vec(ptr, t0, L, row_stride, o_t):
    """fp32 vector ``ptr[t0 + o_t]`` (one value per token), zero for ``o_t >= L``."""
    p = ptr + (t0 + o_t.to(tl.int64)) * row_stride
    return tl.load(p, mask=o_t < L, other=0.0).to(tl.float32)


@triton.jit
def load_gate(g, t0, L, i_hv, HV, K, k0, o_t, o_k, DECAY: tl.constexpr, A_log, dt_bias, lower_bound,
              GATE_ACT: tl.constexpr):
    """In-chunk cumulative log decay: ``[BT]`` for a scalar gate (DECAY_SCALAR), ``[BT, BK]`` for a
    per-channel gate (DECAY_CHANNEL; key columns ``k0 + o_k``); a raw gate input goes through
    ``activated_gate`` first. Rows past the chunk end repeat the last valid row (their decay is 0), so
    ``G[BT - 1]`` is the decay of the whole chunk."""
    if DECAY == DECAY_CHANNEL:
        gk = load_rows(g, t0, L, HV * K, i_hv * K, k0, o_t, o_k, K)
        m_k = (k0 + o_k) < K
        gk = activated_gate(gk, A_log, dt_bias, lower_bound, i_hv, i_hv * K + k0 + o_k[None, :], m_k[None, :],
                            (o_t < L)[:, None] & m_k[None, :], GATE_ACT)
        return tl.cumsum(gk, 0)
    else:
        gs = load_vec(g + i_hv, t0, L, HV, o_t)
        gs = activated_gate(gs, A_log, dt_bias, lower_bound, i_hv, i_hv, True, o_t < L, GATE_ACT)
        return tl.cumsum(gs, 0)


@triton.jit
def inverse_norm(sum_squares):
    """``1 / sqrt(sum_squares + eps)``: the scale of a row of q or k under the l2norm (fla's
    ``use_qk_l2norm_in_kernel``), from the sum of its squares."""
    return 1.0 / tl.sqrt(sum_squares + L2NORM_EPS_C)


@triton.jit
def _masked_exp(x, mask):
    """exp(x) where ``mask``, 0 elsewhere, without evaluating exp on masked-out (possibly huge) x."""
    return tl.exp(tl.where(mask, x, float("-inf")))


# Pointer helpers: the int64 part of an offset is one scalar (first token ``tok0``, head); the
# per-element parts (``rows`` within a chunk, ``cols``) stay int32, which keeps pointer tiles
# cheap in registers while offsets past 2^31 elements stay exact.
@triton.jit
def _row_ptrs(base, tok0, rows, head, NHEADS: tl.constexpr, D: tl.constexpr, cols):
    """[rows, cols] pointers into a [.., T, NHEADS, D] tensor, rows counted from token ``tok0``."""
    return base + (tok0 * NHEADS + head) * D + (rows * (NHEADS * D))[:, None] + cols[None, :]


@triton.jit
def _col_ptrs(base, tok0, rows, head, NHEADS: tl.constexpr, D: tl.constexpr, cols):
    """The transposed tile of ``_row_ptrs``: [cols, rows]."""
    return base + (tok0 * NHEADS + head) * D + (rows * (NHEADS * D))[None, :] + cols[:, None]


@triton.jit
def _vec_ptrs(base, tok0, rows, head, NHEADS: tl.constexpr):
    """[rows] pointers into a [.., T, NHEADS] tensor (per-token scalars: beta, scalar decay)."""
    return base + tok0 * NHEADS + head + rows * NHEADS


@triton.jit
def _state_ptrs(base, row, i_hv, kb, o_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr):
    o_k = kb * BK + tl.arange(0, BK)
    ptrs = base + ((row * HV + i_hv) * K * V) + o_k[:, None] * V + o_v[None, :]
    return ptrs, (o_k < K)[:, None] & (o_v < V)[None, :]


@triton.jit
def _load_state(h0, i_n, i_hv, kb, o_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    if USE_INITIAL_STATE:
        p, m = _state_ptrs(h0, i_n, i_hv, kb, o_v, HV, K, V, BK)
        return tl.load(p, mask=m, other=0.0).to(tl.float32)
    else:
        return tl.zeros([BK, BV], dtype=tl.float32)


@triton.jit
def _store_state(base, row, b_s, i_hv, kb, o_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr):
    p, m = _state_ptrs(base, row, i_hv, kb, o_v, HV, K, V, BK)
    tl.store(p, b_s, mask=m)
