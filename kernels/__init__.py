"""Triton kernels of lamina, imported as ``lamina.kernels``.

Only ``@triton.jit`` kernels and thin launchers live here (tensors in, tensors
out). Importing this package imports triton; when ``TRITON_INTERPRET=1`` is set
the interpreter fixes of ``_interpreter`` are applied first.
"""

from lamina.kernels._utils import INTERPRET

if INTERPRET:
    from lamina.kernels import _interpreter

    _interpreter.apply_fixes()

# Every module that defines a kernel registered with the static report (``lamina info --kernels``).
KERNEL_MODULES = (
    "lamina.kernels.delta_chunk_fwd",
    "lamina.kernels.delta_recurrent_fwd",
    "lamina.kernels.delta_chunk_bwd",
    "lamina.kernels.delta_chunk_bwd_dqk",
    "lamina.kernels.prism_attn_fwd",
    "lamina.kernels.prism_attn_bwd",
    "lamina.kernels.prism_attn_decode",
    "lamina.kernels.hrm_update",
    "lamina.kernels.short_conv",
    "lamina.kernels.rms_norm_gated",
)
# The modules that register configurations: the kernel modules (most register their own), and the
# delta-rule family's registrations, which have a module of their own. Importing all of them registers
# every configuration.
REPORT_MODULES = (*KERNEL_MODULES, "lamina.kernels.delta_report")

__all__ = ["INTERPRET", "KERNEL_MODULES", "REPORT_MODULES"]
