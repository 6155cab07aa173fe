"""The delta-rule family's limits, in one place for the ops, the kernels, the CPU path and the fuzzer.

Free of Triton, so the ops and the CPU path import it without importing ``lamina.kernels``.
"""

from __future__ import annotations

# Tokens per chunk. 64 is what fla and the KDA/GDN-2 papers use: the 64 x 64 triangular solve fits one
# program, and the state pass takes T / 64 sequential steps. 16 and 32 are allowed for small models and
# tests: tl.dot needs every dimension >= 16, and [128, 128] fp32 tiles would not fit in registers.
DEFAULT_CHUNK_SIZE = 64
CHUNK_SIZES = (16, 32, 64)
# Tokens per chunk of the PyTorch path on CPU (``lamina.ops.delta_rule_cpu``), whatever ``chunk_size`` the op
# got (on a GPU that path takes the op's: fewer sequential steps, fewer launches). The chunked form is exact for
# any chunk length, and on CPU 32 beats 64 (products of 32 x 32 blocks; twice the sequential steps). Interleaved,
# 2 threads, fp32, H = 4, K = V = 64, minimum of 12: forward DeltaNet 2x1024 6.74 -> 5.84 ms, 1x4096 12.9 ->
# 11.4 ms, KDA 1x4096 30.4 -> 27.0 ms; forward+backward 2x1024 DeltaNet 25.9 -> 24.7 ms, GDN 28.4 -> 26.5 ms,
# KDA 54.2 -> 47.2 ms. 16 was no faster than 32 (DeltaNet 1x4096 12.2 ms).
CPU_CHUNK_SIZE = 32
# Largest key head dim, forward and backward (fla stops at 256): the forward's state pass holds four
# 128-row state blocks, the backward's reverse scan keeps dH in memory above K = 128.
MAX_K = 512
# Largest value head dim (tiled over programs, so only memory bounds it; kept equal to fla's).
MAX_V = 512
# fla's l2norm of q and k (``use_qk_l2norm_in_kernel``): x / sqrt(sum(x^2) + eps) over the key dim.
L2NORM_EPS = 1e-6
# The chunked forms take a log decay below this (per token and channel) as this: the decay exp(-40) = 4.2e-18
# leaves nothing of a state that any dtype's rounding keeps, and a log decay of -inf (a decay of 0: the state
# forgotten at that token), which the token loops take as it is, stays finite in the chunks' differences
# G_i - G_j of cumulative log decays (-inf - -inf is NaN). Log decays in [-40, 0] are unchanged.
LOG_DECAY_FLOOR = -40.0


class BetaAct:
    """What the kernels make of a scalar ``beta [B, T, HV]`` (fla's ``use_beta_sigmoid_in_kernel`` and
    ``allow_neg_eigval``): the chunked kernels' ``BETA_ACT`` flag and the decode step's ``beta_act``."""

    NONE = 0  # beta itself
    SIGMOID = 1  # sigmoid(beta)
    SIGMOID2 = 2  # 2 * sigmoid(beta) (allow_neg_eigval: the transition's eigenvalues in [-1, 1])

    @staticmethod
    def of(use_sigmoid: bool, allow_neg_eigval: bool) -> int:
        if not use_sigmoid:
            return BetaAct.NONE
        return BetaAct.SIGMOID2 if allow_neg_eigval else BetaAct.SIGMOID

__all__ = ["BetaAct", "CHUNK_SIZES", "CPU_CHUNK_SIZE", "DEFAULT_CHUNK_SIZE", "L2NORM_EPS", "MAX_K", "MAX_V"]
