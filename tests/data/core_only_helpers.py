"""A device function whose module sees ``triton.language.core`` and not ``triton.language``."""

import triton
import triton.language.core as core


@triton.jit
def relu(x):
    return core.where(x > 0, x, 0.0)
