"""The delta-rule family's limits, in one place for the ops, the kernels, the CPU path and the fuzzer.

Free of Triton, so the ops and the CPU path import it without importing ``lamina.kernels``.
"""

from __future__ import annotations

# Tokens per chunk. 64 is what fla and the KDA/GDN-2 papers use: the 64 x 64 triangular solve fits one
# program, and the state pass takes T / 64 sequential steps. 16 and 32 are allowed for small models and
# tests: tl.dot needs every dimension >= 16, and [128, 128] fp32 tiles would not fit in registers.
DEFAULT_CHUNK_SIZE = 64
CHUNK_SIZES = (16, 32, 64)
# Largest key head dim, forward and backward (fla stops at 256): the forward's state pass holds four
# 128-row state blocks, the backward's reverse scan keeps dH in memory above K = 128.
MAX_K = 512
# Largest value head dim (tiled over programs, so only memory bounds it; kept equal to fla's).
MAX_V = 512

__all__ = ["CHUNK_SIZES", "DEFAULT_CHUNK_SIZE", "MAX_K", "MAX_V"]
