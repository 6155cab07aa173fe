"""Tile and launch configuration of the chunked delta-rule backward (kernels/delta_chunk_bwd.py).

The warps and stages the kernels run with and the key/value blocks of each kernel (``bwd_tiles``, used
by the launcher and by the static report alike). Chunk sizes, head-dim limits and the chunk index are
the family's, in kernels/delta_chunk_common.py.
"""

from __future__ import annotations

from typing import NamedTuple

from lamina.kernels._utils import cdiv, next_power_of_2
from lamina.kernels.delta_chunk_common import (  # noqa: F401 - MAX_K and has_warpgroup_mma re-exported
    MATRIX_WARPS,
    MAX_K,
    DecayKind,
    has_warpgroup_mma,
    matrix_warps,
)
from lamina.kernels.delta_tuning import DeltaTuning

# Widest key dim whose dH the reverse scan holds in registers by default, as [64, BV] fp32 blocks next
# to [BT, 64] tiles of k and gates. Wider keys keep dH in memory (``BwdTiles.dh_in_memory``). Static
# report, sm_90, bf16: at K = 256 (four blocks) Gated DeltaNet's register scan spilled (255 registers,
# 21 STL) while the in-memory one compiles to 93-145 registers for every variant; 128-row blocks spilled
# with per-channel decay even at K = 128 (6-17 STL).
MAX_REGISTER_SCAN_K = 128
# Widest V block of the in-memory scan with per-channel decay: sm_90, bf16/fp16, K = 256 and 512, a
# block of 32 spilled (KDA 7 STL, GDN-2 2 STL), so a wider choice of ``delta_tuning`` is capped there.
MEMORY_SCAN_CHANNEL_MAX_BV = 16
# The most key blocks the register scan can hold: ``delta_tuning(dh_in_memory=False)`` is honoured up to
# 4 * 64 = 256 (4 * 32 = 128 for fp32 activations, whose scan blocks have 32 rows).
MAX_REGISTER_SCAN_BLOCKS = 4
# Smallest tile side tl.dot accepts.
MIN_DOT_DIM = 16
# K and V block of the per-chunk kernels: [BT, 64] fp32 tiles, the size fla's chunk kernels use.
CHUNK_BLOCK = 64
# K block of the prep and dqk kernels with per-channel decay: their column loops hold five or more
# [BT, BK] fp32 tiles, which spill at BK = 64 (sm_90, 8 warps) and fit at 32.
PER_CHANNEL_BLOCK_K = 32
# K block of the dqk kernel where tensor-core products keep operands and accumulators in registers
# (mma.sync: sm_80 and every target without warpgroup products). Its chained products get all 8 warps
# along the 64 rows of a chunk (Triton's warpsPerCTA [8, 1]), so each 16-row slice is held twice and
# a thread carries what it would with 4 warps. sm_80, bf16, K = 128: BK = 32 spilled (scalar decay
# 8 STL, KDA 1 STL), BK = 16 compiled to 128-194 registers without spills for all four variants.
MMA_SYNC_DQK_BLOCK_K = 16
# V block of the prep kernel on targets without warpgroup products (its V loop runs inside each program, so
# a narrower block means more iterations, not more programs). Static report, sm_80, 16-bit: at CHUNK_BLOCK
# GDN K = 512 spilled 5 STL, and DeltaNet and GDN sat at 255 registers at K = 64 and 256, where GDN bf16 K = 64
# spilled 1 STL under Triton 3.6; at 32 every variant compiles without spills for K = 64 to 512 under 3.6
# and 3.9 (173-212 registers, GDN K = 64 240-255).
MMA_SYNC_PREP_BLOCK_V = 32
# V block of the dqk kernel's products with S0 and dH (``dqk_bv``): the tiles of dO, U and dR it loads per
# step are operands of two or three products at once; 16 columns keep them small next to the accumulators.
DQK_BLOCK_V = 16
# Column step of the dqk kernel's [BT, BT] grams over V (dP, dM and their transposes), whatever ``dqk_bv``:
# each step's tiles are operands next to the gram's accumulator, the decay tile and the three [BT, BK]
# gradients. Static report, sm_90, Triton 3.9, GDN bf16/fp16 K = 256: with the grams at dqk_bv = 32 the
# alternative spilled 4 STL (255 registers); at 16 it compiles to 242 registers without spills, and the
# default rows (dqk_bv = 16) do not change.
DQK_GRAM_BLOCK_V = 16
# Element budget of the scan's dH [K, BV] in registers, which fixes BV from K: sm_90 compiles of
# K = 128 spilled ~100-300 registers at BV = 32-64 and fit at BV = 16.
SCAN_TILE_ELEMENTS = 2048
# Widest V block of the scan: wider blocks leave too few programs for short batches.
SCAN_MAX_BV = 64
# Blocks of fp32 activations. Their products run as tf32x3 (``DOT_PRECISION``: each operand split in two
# TF32 halves), which holds about four times the operand registers of bf16. Static report, all four variants,
# K = 64 to 512, with the bf16 blocks: sm_90 prep 25-111 STL, reverse scan 63-146 STL, dqk 70-164 STL with
# a dense decay; sm_80 prep up to 3166 STL. With these: prep and scan without spills on sm_90 (and
# sm_80 at K = 128), the dense-decay dqk down to 20-48 STL (its two [BT, BT] gradients and their
# transposes did not fit; ``dqk_regram`` below takes it further; per-channel dqk compiles without spills
# at the bf16 blocks). The scan keeps dH in memory: with it in registers, 32-row blocks spilled 112-286 STL
# at K = 128.
FP32_PREP_BLOCK_K = 16
FP32_PREP_BLOCK_V = 32
FP32_SCAN_BLOCK_K = 32
FP32_SCAN_BLOCK_V = 16
FP32_DENSE_DQK_BLOCK_K = 16
# ``dqk_regram``: with a dense decay, the dqk kernel's dk takes dP^T and dM^T ([BT, BT]). A transposed
# operand of a tf32x3 product is rebuilt in registers (tf32 products read both operands K-major) while dP
# and dM are still live. So fp32 forms the two as grams of their own (U dO^T and U dR^T, two more [BT, BT]
# products over V) after dq's and dE's products. 16-bit does too on Hopper: tl.trans of dP and dM (a product's
# result, stored to shared memory for the next product) is the Triton 3.4-3.6 Hopper miscompile of fla issue
# #640 (see the forward's solve, kernels/delta_chunk_fwd.py); elsewhere 16-bit keeps the transposes.
# ``prep_p_product``: the backward prep kernel's P^T as a product of its own, for the same reason.
# Static report, fp32, K = 64 to 512, STL before -> after:
#   sm_90, Triton 3.9: DeltaNet 20 -> 0 (240 registers), Gated DeltaNet 49 -> 24;
#   sm_90, Triton 3.6: DeltaNet 0 -> 0 (224 -> 246 registers), Gated DeltaNet 9 -> 16;
#   sm_80, Triton 3.9: DeltaNet 33-34 -> 25-26, Gated DeltaNet 112 -> 93.
# ``dqk_by_column``: fp32 with a dense decay takes the dqk kernel's intra-chunk products key column by key
# column on CUDA cores, as a per-channel decay does (every column with the same G), wherever the tensor-core
# form above still spills: everywhere but DeltaNet on sm_90 at DQK_BLOCK_V columns with 8 warps (and it runs 4
# there, ``matrix_warps``, where the tensor-core form spilled too: so by column everywhere now). Static report,
# fp32, K = 64 to 512, STL with the tensor-core form -> by column:
#   sm_90: Gated DeltaNet 23-24 (Triton 3.9), 16 (3.6) -> 0 (208-213 registers); the dqk_bv = 32
#   alternatives 28-71 -> 0 (208-236 registers); at 4 warps DeltaNet 8 (3.6) -> 0 (221 registers under 3.9,
#   248 under 3.6);
#   sm_80: DeltaNet 25-26 -> 0 (245-253 registers), Gated DeltaNet 93 -> 0 (255 registers).
# V block of the fp32 prep kernel with per-channel decay on targets without warpgroup products: sm_80,
# Triton 3.9, KDA and GDN-2 spilled 1 STL at FP32_PREP_BLOCK_V from K = 64 to 512 (255 registers), and
# compile to 238 registers at 16 (at 16 the dense decays sit at 254, so they keep 32).
MMA_SYNC_FP32_CHANNEL_PREP_BLOCK_V = 16
# Warps and pipeline stages of all three kernels, at run time and in the static report alike. Each
# program keeps several [BT, 64] fp32 tiles in registers: 8 warps give it the whole register file
# (256 threads x 255 registers); 4 warps spilled. Loads are not pipelined (1 stage): every loop
# feeds products whose accumulators already use the registers a second stage would need.
# fp32 with warpgroup products runs a kernel whose narrowest product has 16 columns with 4 warps instead
# (``matrix_warps``, ``BwdTiles.*_warps``): the reverse scan (dv's [BT, BV] products) and the dqk kernel
# with a dense decay (dq's and dk's [BT, BK]). Static report, sm_90, Triton 3.9, fp32 K = 64: at 4 warps
# they compile to 144-255 registers without spills (at 8 each had tf32 m64n8k8 products); the per-channel
# dqk kernel (32-column key blocks) keeps 8, where 4 spilled 5-11 STL, as the prep kernel (32-column value
# blocks) does, where Gated DeltaNet's spilled 2.
NUM_WARPS = MATRIX_WARPS
NUM_STAGES = 1


def _pow2_block(n: int, cap: int) -> int:
    return min(cap, max(MIN_DOT_DIM, next_power_of_2(n)))


def scan_block_v(K: int, V: int) -> int:
    """V block of the reverse scan for key dim ``K``: ``BK * BV <= SCAN_TILE_ELEMENTS``."""
    bk = _pow2_block(K, MAX_K)
    return _pow2_block(V, max(MIN_DOT_DIM, min(SCAN_MAX_BV, SCAN_TILE_ELEMENTS // bk)))


class BwdTiles(NamedTuple):
    """Key/value blocks of the three backward kernels for one shape and decay kind, where the reverse
    scan keeps dH (``dh_in_memory``: in a float32 ``[N, HV, K, V]`` buffer, one key block at a time), and
    whether the dqk kernel forms the transposed intra-chunk gradients as grams of their own
    (``dqk_regram``: with a dense decay, fp32 or on Hopper) and whether it takes the intra-chunk products key
    column by key column (``dqk_by_column``: fp32 with a dense decay where the tensor-core form spills), and
    whether the prep kernel forms P^T as a product of its own (``prep_p_product``: a dense decay on Hopper), and
    whether the intra-chunk products of a per-channel decay use tensor cores between 16-row sub-blocks
    (``channel_dots``, ``DeltaTuning.channel_dots``, 16-bit only: the prep kernel's P^T as with ``prep_p_product``,
    the dqk kernel's transposes as grams of their own on Hopper, as with ``dqk_regram``), and whether the scan
    stores each chunk's dH for the dqk kernel (``store_dh``; else it writes dH's products with the chunk as partial
    sums per V block, ``DeltaTuning.store_dh``). fp32 keeps the
    column loops: with the products the dqk kernel spilled on sm_90 (static report, K = 64 to 512: 54-55 STL
    under Triton 3.9 and 10 under 3.6; with 16-column key blocks 41-50 under 3.9, and with tl.trans instead of
    the grams 55-59)."""

    prep_bk: int
    prep_bv: int
    scan_bk: int
    scan_bv: int
    dqk_bk: int
    dqk_bv: int
    dh_in_memory: bool = False
    dqk_regram: bool = False
    prep_p_product: bool = False
    dqk_by_column: bool = False
    channel_dots: bool = False
    store_dh: bool = True
    prep_warps: int = NUM_WARPS
    scan_warps: int = NUM_WARPS
    dqk_warps: int = NUM_WARPS


def bwd_tiles(K: int, V: int, decay: int, warpgroup_mma: bool, tuning: DeltaTuning | None = None,
              fp32: bool = False) -> BwdTiles:
    """The blocks the launcher uses (and the static report compiles) for key dim ``K``, value dim ``V``,
    decay kind ``decay`` (``DecayKind``), on a target with or without warpgroup
    products (``has_warpgroup_mma``), for fp32 activations (``fp32``) or 16-bit ones. ``tuning``'s value
    blocks, where set, replace the defaults (capped at V's power of two: a wider block would only hold
    padding; the in-memory scan's with per-channel decay at ``MEMORY_SCAN_CHANNEL_MAX_BV``), and so does its
    ``dh_in_memory`` (dH stays in memory where the registers cannot hold it)."""
    bk_chunk = _pow2_block(K, PER_CHANNEL_BLOCK_K if decay == DecayKind.CHANNEL else CHUNK_BLOCK)
    tiles = BwdTiles(
        prep_bk=bk_chunk, prep_bv=_pow2_block(V, CHUNK_BLOCK if warpgroup_mma else MMA_SYNC_PREP_BLOCK_V),
        scan_bk=_pow2_block(K, CHUNK_BLOCK), scan_bv=scan_block_v(K, V), dh_in_memory=K > MAX_REGISTER_SCAN_K,
        dqk_bk=bk_chunk if warpgroup_mma else _pow2_block(K, MMA_SYNC_DQK_BLOCK_K), dqk_bv=_pow2_block(V, DQK_BLOCK_V),
        dqk_regram=decay != DecayKind.CHANNEL and warpgroup_mma,
        prep_p_product=decay != DecayKind.CHANNEL and warpgroup_mma,
    )
    if fp32:
        channel_mma_sync = not warpgroup_mma and decay == DecayKind.CHANNEL
        tiles = tiles._replace(
            prep_bk=_pow2_block(K, FP32_PREP_BLOCK_K),
            prep_bv=_pow2_block(V, MMA_SYNC_FP32_CHANNEL_PREP_BLOCK_V if channel_mma_sync else FP32_PREP_BLOCK_V),
            scan_bk=_pow2_block(K, FP32_SCAN_BLOCK_K), scan_bv=_pow2_block(V, FP32_SCAN_BLOCK_V), dh_in_memory=True,
            dqk_bk=tiles.dqk_bk if decay == DecayKind.CHANNEL else FP32_DENSE_DQK_BLOCK_K,
            dqk_regram=decay != DecayKind.CHANNEL,
        )
    if tuning is not None:
        chosen = {name: _pow2_block(V, value) for name in ("prep_bv", "scan_bv", "dqk_bv")
                  if (value := getattr(tuning, name)) is not None}
        if tuning.dh_in_memory is not None:
            chosen["dh_in_memory"] = tuning.dh_in_memory or cdiv(K, tiles.scan_bk) > MAX_REGISTER_SCAN_BLOCKS
        tiles = tiles._replace(**chosen)
        if tiles.dh_in_memory and decay == DecayKind.CHANNEL:
            tiles = tiles._replace(scan_bv=min(tiles.scan_bv, MEMORY_SCAN_CHANNEL_MAX_BV))
    if tuning is not None and not tuning.store_dh:
        tiles = tiles._replace(store_dh=False)
    if tuning is not None and tuning.channel_dots and decay == DecayKind.CHANNEL and not fp32:
        tiles = tiles._replace(channel_dots=True, prep_p_product=True, dqk_regram=warpgroup_mma)
    if fp32 and decay != DecayKind.CHANNEL:
        # at the 4 warps of matrix_warps the tensor-core form spilled (DeltaNet, sm_90, Triton 3.6: 8 STL at K = 64
        # to 256, 255 registers)
        tensor_core_fits = (warpgroup_mma and decay == DecayKind.NONE and tiles.dqk_bv <= DQK_BLOCK_V
                            and matrix_warps(tiles.dqk_bk, fp32, warpgroup_mma) == MATRIX_WARPS)
        tiles = tiles._replace(dqk_by_column=not tensor_core_fits)
    # the narrowest product of each: the prep kernel's [BT, BV], the scan's [BT, BV] and [BK, BV], the dqk
    # kernel's [BT, BK]
    return tiles._replace(prep_warps=matrix_warps(tiles.prep_bv, fp32, warpgroup_mma),
                          scan_warps=matrix_warps(min(tiles.scan_bk, tiles.scan_bv), fp32, warpgroup_mma),
                          dqk_warps=matrix_warps(tiles.dqk_bk, fp32, warpgroup_mma))
