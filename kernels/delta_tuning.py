"""Speed alternatives of the chunked delta-rule kernels, chosen at run time.

A ``DeltaTuning`` holds the choices that change how the kernels compute, never what (every choice is
tested against the float64 reference under the interpreter):

* ``solve_block``: the unit-triangular solve, the forward's (the backward reads the inverse the forward
  keeps). 64 (the chunk): elimination over all rows in fp32 on CUDA cores, the default; 16 or 32:
  elimination inside 16- or 32-row diagonal blocks, merged with tensor-core products
  (``kernels/delta_chunk_fwd.py``, ``_block_unit_lower_inverse``).
* ``output_kernel``: the forward's output. False: computed inside the sequential state pass (the
  default); True: the state pass saves each chunk's start state and writes, and a separate kernel computes
  every chunk's output in parallel (more programs where ``B x HV`` is small, for one more read of them);
  None: chosen per call by the state pass's programs (one per sequence, value head and V block), the
  separate kernel where they are fewer than the GPU's multiprocessors (``delta_chunk_fwd.separate_output``;
  off CUDA, the state pass). The sweep times True and False, and its report picks None unless True is
  faster still (as where True wins above one wave too).
* ``prep_bv``, ``scan_bv``, ``dqk_bv``: the value blocks of the backward's three kernels (powers of two
  >= 16; the dqk kernel's is that of its products with S0 and dH, its grams over V step by 16 columns);
  None keeps ``bwd_tiles``'s choice for the shape and target.
* ``dh_in_memory``: where the backward's reverse scan keeps dH. None: ``bwd_tiles``'s choice (registers up
  to K = 128, memory above); True: in memory at every K (fewer live registers, two more reads and a write
  of each key block per chunk); False: in registers where they can hold it (K <= 256).
* ``store_dh``: whether the backward's reverse scan stores each chunk's dH (fp32 ``[K, V]`` per chunk and value
  head) for the dq/dk kernel. True (the default): it does, and the dq/dk kernel, in parallel over chunks,
  forms dH's two products with the chunk (``U dH^T``, ``[C, K]``, and ``rowsum(dH * S0)``, ``[K]``); False:
  the scan forms them itself as each of its V blocks' partial sums, which the dq/dk kernel adds up, and no dH
  is written or read back. The partials are ``V / scan_bv`` fp32 ``[C, K]`` tiles per chunk, ``C / scan_bv``
  times dH's size (four times at the default 16 columns and chunks of 64), and the scan does two more products
  per chunk on its sequential path; the dq/dk kernel does one product fewer.
* ``state_in_memory``: where the forward's state pass keeps the state. None: ``scan_tiles``'s choice
  (memory for fp32 activations; registers for 16-bit ones, but memory past K = 256 on targets without
  warpgroup products); True: in memory (two reads and a write of each key block per chunk, narrower key
  blocks); False: in registers (at most four key blocks).
* ``channel_dots``: the backward's intra-chunk products with per-channel decay (KDA, GDN-2). False: one key
  column at a time on CUDA cores (the default); True: tensor-core products between 16-row sub-blocks, the
  decay split into factors ``<= 1`` at a row between them, and exact exponents inside each sub-block
  (``kernels/delta_chunk_bwd_parts.py``). 16-bit activations only: fp32 keeps the column loops, where the
  products spilled (``bwd_tiles``).
* ``recompute_states``: what a training forward keeps of the chunk-start states ``h`` (fp32
  ``[chunks, HV, K, V]``, ``K / C`` times the size of fp32 values) and of the chunks' inverses ``A`` (fp32
  ``[B, T, HV, C]``). False: the forward saves both for the backward (the default); True: it saves neither
  and the backward runs the chunked forward again to recompute them first (less memory between forward
  and backward, for one more forward; fla's own default). Read when the forward runs (under ``torch.compile``,
  when it is traced).

``delta_tuning(**choices)`` sets them for the kernel launches inside a ``with`` block (process-wide: the
benchmark sweep times each alternative this way); ``active_tuning()`` is what the launchers read, when
they launch: a backward runs with the tuning active when it runs, so keep ``loss.backward()`` inside
the block to run an alternative's backward.
Defaults come from ``DeltaTuning()``; ``benchmarks/sweep_delta.py`` measures every alternative
against them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

# Diagonal blocks the forward's solve accepts (tl.dot needs >= 16; 64 is the whole chunk).
SOLVE_BLOCKS = (16, 32, 64)
# Value blocks the backward kernels accept: powers of two from tl.dot's 16 to a chunk-wide 64.
BWD_VALUE_BLOCKS = (16, 32, 64)


@dataclass(frozen=True)
class DeltaTuning:
    """One choice of the kernels' speed alternatives (module docstring)."""

    solve_block: int = 64
    output_kernel: bool | None = False
    prep_bv: int | None = None
    scan_bv: int | None = None
    dqk_bv: int | None = None
    dh_in_memory: bool | None = None
    state_in_memory: bool | None = None
    recompute_states: bool = False
    channel_dots: bool = False
    store_dh: bool = True

    def __post_init__(self) -> None:
        if self.solve_block not in SOLVE_BLOCKS:
            raise ValueError(f"delta_tuning: solve_block must be one of {SOLVE_BLOCKS}, got {self.solve_block!r}")
        for name in ("recompute_states", "channel_dots", "store_dh"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"delta_tuning: {name} must be a bool, got {getattr(self, name)!r}")
        for name in ("output_kernel", "dh_in_memory", "state_in_memory"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"delta_tuning: {name} must be None or a bool, got {value!r}")
        for name in ("prep_bv", "scan_bv", "dqk_bv"):
            value = getattr(self, name)
            if value is not None and value not in BWD_VALUE_BLOCKS:
                raise ValueError(f"delta_tuning: {name} must be None or one of {BWD_VALUE_BLOCKS}, got {value!r}")

    def choices(self) -> dict[str, int]:
        """The fields that differ from the defaults (``delta_tuning(**t.choices())`` applies ``t``)."""
        base = DeltaTuning()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(base, f.name)}

    @property
    def changes_forward(self) -> bool:
        """Whether the forward kernels run differently (else only the backward's do, or, with
        ``recompute_states``, what a training forward keeps for it)."""
        base = DeltaTuning()
        return (self.solve_block != base.solve_block or self.output_kernel != base.output_kernel
                or self.state_in_memory != base.state_in_memory)

    def label(self) -> str:
        """``"default"``, or the choices that differ from the defaults, e.g. ``"solve_block=16"``."""
        return ",".join(f"{name}={value}" for name, value in self.choices().items()) or "default"


# The alternatives benchmarks/sweep_delta.py times against the defaults and the static report compiles (as
# non-default rows, for sm_90): the solve's blocked forms, the separate output kernel, the forward's state
# in memory, a wider value block for each backward kernel, the reverse scan's dH in memory, the chunk
# states recomputed by the backward instead of saved by the forward, the per-channel backward's
# tensor-core products, and the scan's dH products in place of dH stored.
ALTERNATIVES = (DeltaTuning(solve_block=16), DeltaTuning(solve_block=32), DeltaTuning(output_kernel=True),
                DeltaTuning(state_in_memory=True), DeltaTuning(scan_bv=32), DeltaTuning(dqk_bv=32),
                DeltaTuning(prep_bv=32), DeltaTuning(dh_in_memory=True), DeltaTuning(recompute_states=True),
                DeltaTuning(channel_dots=True), DeltaTuning(store_dh=False))
# The static report compiles the alternatives for these targets only (the GPU the sweep runs on).
ALTERNATIVE_ARCHS = (90,)

_ACTIVE = [DeltaTuning()]


def active_tuning() -> DeltaTuning:
    """The tuning the launchers use now."""
    return _ACTIVE[-1]


@contextmanager
def delta_tuning(**choices) -> Iterator[DeltaTuning]:
    """Run the calls inside the block with ``choices`` (``DeltaTuning``'s fields) over the current tuning."""
    unknown = set(choices) - {f.name for f in fields(DeltaTuning)}
    if unknown:
        raise ValueError(f"delta_tuning: unknown choices {sorted(unknown)}; known: "
                         f"{[f.name for f in fields(DeltaTuning)]}")
    tuning = replace(active_tuning(), **choices)
    _ACTIVE.append(tuning)
    try:
        yield tuning
    finally:
        _ACTIVE.pop()


__all__ = ["ALTERNATIVES", "ALTERNATIVE_ARCHS", "BWD_VALUE_BLOCKS", "SOLVE_BLOCKS", "DeltaTuning", "active_tuning",
           "delta_tuning"]
