"""Static-report registrations of the chunked delta-rule kernels, forward and backward (lamina info --kernels).

Every row is built from the tile functions the launchers call (``prep_key_blocks``, ``scan_tiles`` and
``memory_key_blocks`` for the forward, ``bwd_tiles`` for the backward), so what the report compiles is what runs.

Two grids of (K = V, activation dtype):

* ``DEFAULT_GRID`` (the report CI compiles): the forward at K = 128 and 256, the backward at K = 128 and
  512 (the widest, whose reverse scan keeps dH in memory), bf16; the speed alternatives of
  ``delta_tuning`` and the kernels with the gate activation fused in (``GATE_ROW``; with the beta sigmoid,
  ``BETA_ROW``, where the variant's beta is a scalar) at K = 128, as non-default rows on
  ``ALTERNATIVE_ARCHS``; and the forward's and backward's kernels with the l2norm of q and k fused in
  (``L2NORM_ROW``; the backward's with the gate activation and beta sigmoid too, as the layers run them) at
  K = 128, non-default rows with the default blocks of the targets that fuse it (``L2NORM_ARCHS``), and so
  the token-by-token training forward's (kernels/delta_recurrent_fwd.py registers its default rows).
* ``FULL_GRID`` (``lamina info --kernels --grid full``, for one GPU target at a time): K in
  {64, 128, 256, 512} x {bf16, fp16, fp32}, every default and every alternative at each: too many rows
  for CI's time; its results are committed under benchmarks/results/.
"""

from __future__ import annotations

from lamina.kernels._utils import AotSpec, raw_jit, register_aot, report_grid
from lamina.kernels.delta_chunk_bwd import (
    DEFAULT_CHUNK_SIZE,
    NUM_STAGES,
    BwdTiles,
    _delta_chunk_bwd_dh_kernel,
    _delta_chunk_bwd_prep_kernel,
    bwd_tiles,
)
from lamina.kernels.delta_chunk_bwd_dqk import _delta_chunk_bwd_dqk_kernel
from lamina.kernels.delta_chunk_common import (
    DOT_PRECISION,
    VARIANT_FLAGS,
    BetaAct,
    DecayKind,
    GateAct,
    GateKind,
    aligned_attrs,
)
from lamina.kernels.delta_chunk_fwd import (
    OUT_BLOCK_V,
    SOLVE_BLOCK,
    ScanTiles,
    _delta_chunk_out_fwd_kernel,
    _delta_chunk_prep_fwd_kernel,
    _delta_chunk_scan_fwd_kernel,
    memory_key_blocks,
    prep_key_blocks,
    prep_store_key_blocks,
    prep_value_block,
    prep_warps,
    scan_tiles,
)
from lamina.kernels.delta_recurrent_fwd import training_spec
from lamina.kernels.delta_tuning import ALTERNATIVE_ARCHS, ALTERNATIVES, DeltaTuning

# (K = V, activation dtype) per direction. The forward's K = 512 is left out of the default grid for CI's
# time: its per-channel preparation compiles for 14-23 s per arch and configuration (Triton 3.9).
DEFAULT_GRID = {"fwd": ((128, "bf16"), (256, "bf16")), "bwd": ((128, "bf16"), (512, "bf16"))}
FULL_GRID = tuple((K, dtype) for K in (64, 128, 256, 512) for dtype in ("bf16", "fp16", "fp32"))
# The label of the rows with the gate activation fused in (fla's use_gate_in_kernel, softplus form), non-default
# rows on ALTERNATIVE_ARCHS next to the alternatives: the kernels that load the gate, with their default blocks.
GATE_ROW = "use_gate_in_kernel"
# The label the rows with the gate activation fused in add where the variant has a scalar beta (Gated DeltaNet,
# KDA): its sigmoid fused in too (fla's use_beta_sigmoid_in_kernel, BETA_ACT), as the layers run the two.
BETA_ROW = "use_beta_sigmoid_in_kernel"
# The label of the forward's rows with the l2norm of q and k fused in (fla's use_qk_l2norm_in_kernel): the
# preparation kernel and the state pass with the default blocks of each target that fuses it (L2NORM_ARCHS:
# delta_chunk_common.l2norm_in_kernels; the preparation with the gate activation fused in too, as the layers run
# it, where the variant has a decay), and on ALTERNATIVE_ARCHS the state pass and the output kernel of the
# separate output pass.
L2NORM_ROW = "use_qk_l2norm_in_kernel"
# The key dim of the default grid's alternative rows (the common head size).
ALTERNATIVE_K = 128
# The report's targets and whether each has warpgroup products (``has_warpgroup_mma``).
TARGETS = {90: True, 80: False}
# The targets whose ops fuse the l2norm of q and k into the forward (those with warpgroup products).
L2NORM_ARCHS = tuple(arch for arch, warpgroup_mma in TARGETS.items() if warpgroup_mma)


def _fused_options(decay: int, erase: int) -> tuple[str, dict]:
    """(label suffix, constexprs) of a variant's in-kernel options as its rows with them compile them: the gate
    activation where it has a decay, with the beta sigmoid where its beta is a scalar too; ("", {}) without a
    decay."""
    if decay == DecayKind.NONE:
        return "", {}
    if erase == GateKind.SCALAR:
        return f" {GATE_ROW} {BETA_ROW}", {"GATE_ACT": GateAct.SOFTPLUS, "BETA_ACT": BetaAct.SIGMOID}
    return f" {GATE_ROW}", {"GATE_ACT": GateAct.SOFTPLUS}


def _shapes(direction: str) -> list[tuple[int, str, bool]]:
    """(K, dtype, with the alternatives) of the active grid (``report_grid``)."""
    if report_grid() == "full":
        return [(K, dtype, True) for K, dtype in FULL_GRID]
    return [(K, dtype, K == ALTERNATIVE_K) for K, dtype in DEFAULT_GRID[direction]]


# ---- forward ----------------------------------------------------------------------------------------

def _fwd_signature(names: dict[str, str], constexprs: dict) -> dict[str, str]:
    return {**names, **{c: "constexpr" for c in constexprs if c not in names}}


def _l2norm_args(names: tuple[str, ...], l2norm: bool) -> tuple[dict[str, str], dict]:
    """(argument types, constexprs) of the inverse-norm pointers ``names``: float32 buffers with ``L2NORM``, else
    None (compile-time constants)."""
    if l2norm:
        return {n: "*fp32" for n in names}, {"L2NORM": True}
    return {n: "constexpr" for n in names}, {"L2NORM": False, **{n: None for n in names}}


def _prep_signature(io: str, g_ty: str, constexprs: dict, l2norm: bool) -> tuple[dict[str, str], dict]:
    """(signature, the inverse-norm constexprs) of the preparation kernel, with or without ``L2NORM``."""
    norm_types, norm_c = _l2norm_args(("rq", "rk"), l2norm)
    names = {"q": io, "k": io, "v": io, "g": g_ty, "b": io, "w": io, "gcum": g_ty, "wy": io, "u": io, "aqk": io,
             "solve": "*fp32", **norm_types, "cu_seqlens": "constexpr", "chunk_indices": "constexpr",
             "A_log": "*fp32", "dt_bias": "*fp32", "lower_bound": "fp32", "scale": "fp32", "T": "i32", "NT": "i32",
             "BK": "constexpr", "NK": "constexpr", "BV": "constexpr"}
    return _fwd_signature(names, {**constexprs, **norm_c}), norm_c


def _register_scan(label: str, io: str, g_ty: str, base: dict, tiles: ScanTiles, suffix: str, store_o: bool,
                   default: bool, archs: list[int], l2norm: bool = False) -> None:
    """One row of the state pass (``store_o``: with its output; else writing v_new for the output kernel)."""
    norm_types, norm_c = _l2norm_args(("rq", "rk"), l2norm)
    names = {"q": io, "k": io, "gcum": g_ty, "wy": io, "u": io, "aqk": io, **norm_types, "h0": "*fp32", "o": io,
             "ht": "*fp32", "h": "*fp32", "vnew": io, "cu_seqlens": "constexpr", "chunk_offsets": "constexpr",
             "scale": "fp32", "T": "i32", "NT": "i32"}
    constexprs = {**base, "BK": tiles.bk, "NK": tiles.nk, "BV": tiles.bv, "STATE_IN_MEMORY": tiles.state_in_memory,
                  "STORE_V_NEW": not store_o, "STORE_O": store_o, **norm_c}
    signature = _fwd_signature(names, constexprs)
    meta = {"attrs": aligned_attrs(_delta_chunk_scan_fwd_kernel, signature)}
    if len(archs) < len(TARGETS):
        meta["archs"] = archs
    blocks = f"BV={tiles.bv}" + (f" BK={tiles.bk}" if tiles.state_in_memory else "")
    register_aot(AotSpec("delta_chunk_scan_fwd", f"{label} {blocks}{suffix}", _delta_chunk_scan_fwd_kernel,
                         signature, constexprs, num_warps=tiles.warps[0], num_stages=1, default=default, meta=meta))


def _prep_blocks(K: int, V: int, decay: int, fp32: bool, warpgroup_mma: bool) -> tuple[tuple, int]:
    """(the block constexprs, warps) of the preparation kernel on a target, as the launcher chooses them."""
    (bk, nk), (bky, nky) = prep_key_blocks(K, decay, fp32), prep_store_key_blocks(K, decay, fp32, warpgroup_mma)
    bv = prep_value_block(V, fp32, warpgroup_mma)
    return (("BK", bk), ("NK", nk), ("BKY", bky), ("NKY", nky), ("BV", bv)), prep_warps(bky, bv, fp32, warpgroup_mma)


def _prep_label(blocks: tuple) -> str:
    b = dict(blocks)
    return f" BK={b['BK']}" + (f" BKY={b['BKY']}" if b["BKY"] != b["BK"] else "") + f" BV={b['BV']}"


def _register_fwd(K: int, dtype: str, alternatives: bool) -> None:
    io = f"*{dtype}"
    fp32 = dtype == "fp32"
    V = K
    for variant, (decay, erase, write) in VARIANT_FLAGS.items():
        g_ty = "constexpr" if decay == DecayKind.NONE else "*fp32"
        no_gate = {"gcum": None} if decay == DecayKind.NONE else {}
        # dense: cu_seqlens and the chunk index tensors are None (ChunkIndex), so compile-time constants
        base = {"H": 4, "HV": 4, "K": K, "V": V, "IS_VARLEN": False, "BT": DEFAULT_CHUNK_SIZE,
                "DOT_PRECISION": DOT_PRECISION, "cu_seqlens": None, "DECAY": decay}
        label = f"{variant} {dtype} K={K} V={V}"

        # STORE_A: the training form, which keeps the inverse for the backward
        prep_c = {**base, "ERASE": erase, "WRITE": write, "SOLVE_BLOCK": SOLVE_BLOCK, "GATE_ACT": GateAct.NONE,
                  "BETA_ACT": BetaAct.NONE, "STORE_A": True, "chunk_indices": None,
                  **({"g": None} if decay == DecayKind.NONE else {}),
                  **no_gate}
        l2_sig, l2_c = _prep_signature(io, g_ty, prep_c, True)
        prep_sig, norm_c = _prep_signature(io, g_ty, prep_c, False)
        prep_l2_c, prep_c = {**prep_c, **l2_c}, {**prep_c, **norm_c}
        prep_attrs = aligned_attrs(_delta_chunk_prep_fwd_kernel, prep_sig)
        # the blocks (and warps) each target runs with; one row per distinct choice
        prep_archs: dict[tuple[tuple, int], list[int]] = {}
        for arch, warpgroup_mma in TARGETS.items():
            prep_archs.setdefault(_prep_blocks(K, V, decay, fp32, warpgroup_mma), []).append(arch)
        for (blocks, warps), archs in prep_archs.items():
            meta = {"attrs": prep_attrs, **({"archs": archs} if len(archs) < len(TARGETS) else {})}
            register_aot(AotSpec("delta_chunk_prep_fwd", label + (_prep_label(blocks) if len(prep_archs) > 1 else ""),
                                 _delta_chunk_prep_fwd_kernel, prep_sig, {**prep_c, **dict(blocks)},
                                 num_warps=warps, num_stages=1, meta=meta))
        alt_mma = TARGETS[ALTERNATIVE_ARCHS[0]]
        alt_blocks, alt_warps = _prep_blocks(K, V, decay, fp32, alt_mma)
        alt_rows = [(tuning.label(), {"SOLVE_BLOCK": tuning.solve_block})
                    for tuning in ALTERNATIVES if alternatives and tuning.solve_block != SOLVE_BLOCK]
        fused_suffix, fused_c = _fused_options(decay, erase)
        if alternatives and fused_c:  # the gate activation (and beta sigmoid) fused in
            alt_rows.append((fused_suffix.lstrip(), fused_c))
        for suffix, choice in alt_rows:
            register_aot(AotSpec("delta_chunk_prep_fwd", f"{label} {suffix}", _delta_chunk_prep_fwd_kernel,
                                 prep_sig, {**prep_c, **dict(alt_blocks), **choice},
                                 num_warps=alt_warps, num_stages=1, default=False,
                                 meta={"attrs": prep_attrs, "archs": list(ALTERNATIVE_ARCHS)}))
        # the l2norm of q and k fused in (with the gate activation and beta sigmoid where there are), on every
        # target that fuses it
        suffix = f" {L2NORM_ROW}{fused_suffix}"
        for (blocks, warps), archs in prep_archs.items() if alternatives else ():
            archs = [a for a in archs if a in L2NORM_ARCHS]
            if not archs:
                continue
            register_aot(AotSpec("delta_chunk_prep_fwd",
                                 label + (_prep_label(blocks) if len(prep_archs) > 1 else "") + suffix,
                                 _delta_chunk_prep_fwd_kernel, l2_sig, {**prep_l2_c, **dict(blocks), **fused_c},
                                 num_warps=warps, num_stages=1, default=False,
                                 meta={"attrs": aligned_attrs(_delta_chunk_prep_fwd_kernel, l2_sig), "archs": archs}))

        scan_base = {**base, "USE_INITIAL_STATE": True, "STORE_FINAL_STATE": True, "SAVE_STATES": True,
                     "chunk_offsets": None, **no_gate}
        scan_row = (label, io, g_ty, scan_base)
        # the tiles each target runs with; one row per distinct choice
        per_arch: dict[ScanTiles, list[int]] = {}
        for arch, warpgroup_mma in TARGETS.items():
            per_arch.setdefault(scan_tiles(K, V, fp32, warpgroup_mma), []).append(arch)
        for tiles, archs in per_arch.items():
            _register_scan(*scan_row, tiles, " state in memory" if tiles.state_in_memory else "", True, True, archs)
        if not alternatives:
            continue
        for tiles, archs in per_arch.items():
            archs = [a for a in archs if a in L2NORM_ARCHS]
            if archs:
                _register_scan(*scan_row, tiles, (" state in memory" if tiles.state_in_memory else "")
                               + f" {L2NORM_ROW}", True, False, archs, l2norm=True)
        for tuning in ALTERNATIVES:
            tiles = scan_tiles(K, V, fp32, alt_mma, tuning)
            if tuning.state_in_memory is not None and tiles != scan_tiles(K, V, fp32, alt_mma):
                _register_scan(*scan_row, tiles, f" {tuning.label()}", True, False, list(ALTERNATIVE_ARCHS))
        if not any(t.output_kernel for t in ALTERNATIVES):
            continue
        # the separate output pass (delta_tuning(output_kernel=True)): the state pass without its output,
        # then the output kernel
        alt = {"default": False, "num_stages": 1}
        # (with the l2norm fused in on the full grid only, for CI's time)
        for l2norm in (False, True) if report_grid() == "full" else (False,):
            _register_scan(*scan_row, scan_tiles(K, V, fp32, alt_mma),
                           " output_kernel=True" + (f" {L2NORM_ROW}" if l2norm else ""), False, False,
                           list(ALTERNATIVE_ARCHS), l2norm=l2norm)
        BKO, NKO = memory_key_blocks(K, fp32)
        for l2norm in (False, True) if report_grid() == "full" else (False,):
            norm_types, norm_c = _l2norm_args(("rq",), l2norm)
            out_c = {**base, "BK": BKO, "NK": NKO, "BV": min(OUT_BLOCK_V, V), "chunk_indices": None, **no_gate,
                     **norm_c}
            out_sig = _fwd_signature({"q": io, "gcum": g_ty, "h": "*fp32", "vnew": io, "aqk": io, "o": io,
                                      **norm_types, "cu_seqlens": "constexpr", "chunk_indices": "constexpr",
                                      "scale": "fp32", "T": "i32", "NT": "i32"},
                                     out_c)
            register_aot(AotSpec("delta_chunk_out_fwd",
                                 f"{label} BV={out_c['BV']} output_kernel=True" + (f" {L2NORM_ROW}" if l2norm else ""),
                                 _delta_chunk_out_fwd_kernel, out_sig, out_c, num_warps=4, **alt,
                                 meta={"archs": list(ALTERNATIVE_ARCHS),
                                       "attrs": aligned_attrs(_delta_chunk_out_fwd_kernel, out_sig)}))


# ---- backward ---------------------------------------------------------------------------------------

# Pointer arguments that are None in a dense launch (no cu_seqlens, ChunkIndex without tensors).
_DENSE_NONE = ("cu_seqlens", "chunk_indices", "chunk_offsets")


def _bwd_signature(fn, dtype: str, decay: int, erase: int, write: int) -> dict[str, str]:
    """Argument types as the launcher passes them (a gate that is None is replaced by a tensor of the
    activations' dtype; per-token partial sums are float32; dense, so the offsets and chunk index are None)."""
    act, f32 = f"*{dtype}", "*fp32"
    types = {
        "q": act, "k": act, "v": act, "do": act, "dv_new": act, "dq": act, "dk": act, "dv": act,
        "g": f32 if decay else act, "b": act, "w": act, "h": f32, "dht": f32, "dh0": f32,
        "U_out": f32, "dU_out": f32, "dh_out": f32, "A_buf": f32, "dh_buf": f32, "U_buf": f32,
        "dR_buf": f32, "dkh_part": f32, "dgc_part": f32, "dg": f32, "dg_a": f32, "A_log": f32, "dt_bias": f32,
        "lower_bound": "fp32",
        "db": act if erase == GateKind.CHANNEL else f32,
        "dw": act if write == GateKind.CHANNEL else f32,
        "scale": "fp32", "T": "i32", "NT": "i32", "NTOK": "i32", "NV": "i32",
    }
    return {name: types.get(name, "constexpr") for name in raw_jit(fn).arg_names}


def _bwd_blocks(fn, tiles: BwdTiles) -> dict:
    """The block constexprs (and launch flags) ``fn`` runs with under ``tiles``, and its warps (``num_warps``)."""
    return {
        _delta_chunk_bwd_prep_kernel: dict(BK=tiles.prep_bk, BV=tiles.prep_bv, ADD_DV_NEW=False,
                                           P_PRODUCT=tiles.prep_p_product, num_warps=tiles.prep_warps),
        _delta_chunk_bwd_dh_kernel: dict(BK=tiles.scan_bk, BV=tiles.scan_bv, DH_IN_MEMORY=tiles.dh_in_memory,
                                         USE_INITIAL_STATE=True, USE_FINAL_STATE_GRADIENT=True,
                                         STORE_DH=tiles.store_dh, num_warps=tiles.scan_warps),
        _delta_chunk_bwd_dqk_kernel: dict(BK=tiles.dqk_bk, BV=tiles.dqk_bv, REGRAM=tiles.dqk_regram,
                                          BY_COLUMN=tiles.dqk_by_column, CHANNEL_DOTS=tiles.channel_dots,
                                          STORE_DH=tiles.store_dh, num_warps=tiles.dqk_warps),
    }[fn]


def _register_bwd(K: int, dtype: str, alternatives: bool) -> None:
    """Every kernel's default blocks on each target; then, as non-default rows for ``ALTERNATIVE_ARCHS``, the
    blocks of each backward alternative of ``delta_tuning`` that changes the kernel."""
    V = K
    fp32 = dtype == "fp32"
    for variant, (decay, erase, write) in VARIANT_FLAGS.items():
        for fn in (_delta_chunk_bwd_prep_kernel, _delta_chunk_bwd_dh_kernel, _delta_chunk_bwd_dqk_kernel):
            # the blocks each target runs with; a kernel whose blocks differ gets one entry per target
            per_arch: dict[tuple, list[int]] = {}
            for arch, warpgroup_mma in TARGETS.items():
                per_arch.setdefault(tuple(_bwd_blocks(fn, bwd_tiles(K, V, decay, warpgroup_mma, fp32=fp32)).items()),
                                    []).append(arch)
            rows = [(per_arch, "", True, False)]
            for tuning in (t for t in ALTERNATIVES if alternatives and not t.changes_forward):
                rows.append((_alternative_blocks(fn, K, V, decay, tuning, per_arch, fp32), f" {tuning.label()}", False,
                             True))
            fused_suffix, fused_c = _fused_options(decay, erase)
            if alternatives and fused_c:  # the gate activation (and beta sigmoid) fused in
                gated = {(*blocks, *fused_c.items()): [a for a in archs if a in ALTERNATIVE_ARCHS]
                         for blocks, archs in per_arch.items()}
                rows.append(({blocks: archs for blocks, archs in gated.items() if archs}, fused_suffix, False, True))
            if alternatives and "L2NORM" in raw_jit(fn).arg_names:
                # the l2norm of q and k fused in too, as the layers run it, where the ops fuse it (the later kernels
                # read the normalised rows the prep kernel stores, as they read q and k otherwise)
                normed = {(*blocks, *fused_c.items(), ("L2NORM", True)): [a for a in archs if a in L2NORM_ARCHS]
                          for blocks, archs in per_arch.items()}
                rows.append(({blocks: archs for blocks, archs in normed.items() if archs},
                             f" {L2NORM_ROW}{fused_suffix}", False, True))
            for blocks_archs, suffix, default, always_archs in rows:
                _register_bwd_blocks(fn, variant, K, V, dtype, decay, erase, write, blocks_archs, suffix, default,
                                     always_archs)


def _alternative_blocks(fn, K: int, V: int, decay: int, tuning: DeltaTuning,
                        defaults: dict[tuple, list[int]], fp32: bool) -> dict[tuple, list[int]]:
    """The blocks ``tuning`` gives ``fn`` on each of ``ALTERNATIVE_ARCHS`` where they differ from the default."""
    alternative: dict[tuple, list[int]] = {}
    for arch in ALTERNATIVE_ARCHS:
        blocks = tuple(_bwd_blocks(fn, bwd_tiles(K, V, decay, TARGETS[arch], tuning, fp32)).items())
        if arch not in defaults.get(blocks, []):
            alternative.setdefault(blocks, []).append(arch)
    return alternative


def _register_bwd_blocks(fn, variant: str, K: int, V: int, dtype: str, decay: int, erase: int, write: int,
                         per_arch: dict[tuple, list[int]], suffix: str, default: bool, always_archs: bool) -> None:
    """One report row per distinct set of blocks in ``per_arch`` (blocks -> the targets that run them)."""
    jit = raw_jit(fn)
    for blocks, archs in per_arch.items():
        # with L2NORM, the rows' inverse norms (float32) and the normalised rows (the activations' dtype); else None
        norms = {name: ty for name, ty in (("rq", "*fp32"), ("rk", "*fp32"), ("qn", f"*{dtype}"), ("kn", f"*{dtype}"))
                 if name in jit.arg_names}
        blocks = dict(blocks)
        warps = blocks.pop("num_warps")
        l2norm = blocks.get("L2NORM", False)
        signature = {**_bwd_signature(fn, dtype, decay, erase, write), **(norms if l2norm else {})}
        constexprs = {**dict(H=4, HV=4, K=K, V=V, BT=DEFAULT_CHUNK_SIZE, DECAY=decay, ERASE=erase, WRITE=write,
                             IS_VARLEN=False, DOT_PRECISION=DOT_PRECISION, GATE_ACT=GateAct.NONE,
                             BETA_ACT=BetaAct.NONE),
                      **({"L2NORM": False} if "L2NORM" in jit.arg_names else {}),
                      **blocks, **{name: None for name in _DENSE_NONE if name in jit.arg_names},
                      **({} if l2norm else dict.fromkeys(norms))}
        label = " ".join(f"{name}={value}" for name, value in blocks.items() if name in ("BK", "BV"))
        label += " by_column" if blocks.get("BY_COLUMN") else ""
        # torch's allocations are 16-byte aligned: the run-time JIT specialises every pointer so
        meta = {"attrs": aligned_attrs(jit, signature)}
        if len(per_arch) > 1 or always_archs:
            meta["archs"] = archs
        register_aot(AotSpec(
            name=jit.__name__, config=f"{variant} {dtype} K={K} V={V} BT={DEFAULT_CHUNK_SIZE} {label}{suffix}",
            fn=jit, signature=signature, constexprs=constexprs, num_warps=warps, num_stages=NUM_STAGES,
            uses_dot=True, default=default, meta=meta,
        ))


for _K, _dtype, _alternatives in _shapes("fwd"):
    _register_fwd(_K, _dtype, _alternatives)
# the token-by-token training forward with the l2norm fused in, on the targets that fuse it (its default rows
# are registered with the kernel)
for _variant in VARIANT_FLAGS:
    register_aot(training_spec(_variant, 128, 128, L2NORM_ROW, list(L2NORM_ARCHS)))
for _K, _dtype, _alternatives in _shapes("bwd"):
    _register_bwd(_K, _dtype, _alternatives)
