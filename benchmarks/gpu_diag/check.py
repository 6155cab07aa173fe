"""One delta-rule case on the GPU: lamina's Triton chunked path (forward and backward) against the float64
chunked reference, RMS error ratios of the output, final state and every gradient, one line per tuning.

    python benchmarks/gpu_diag/check.py VARIANT DTYPE BxTxHxK [LABEL ...]

checks the defaults, then each speed alternative named by its label (``lamina.kernels.delta_tuning``'s
``ALTERNATIVES``, as the sweep's report prints them, e.g. ``solve_block=16``), in the same process and on the
same inputs: an alternative's ratios read against the default's line above them. ``all`` names every one.

The op's float32 fence (``training_path``) is lifted here: these checks are of the kernels themselves.
Three knobs, for bisecting the float32 kernels' faults:

* ``DIAG_DOT``: the backward kernels' ``input_precision`` (default ``tf32x3``; ``ieee`` takes the tensor cores
  out of the backward);
* ``DIAG_BWD_WARPS``: every backward kernel's warps (default: ``bwd_tiles``'s choice, ``matrix_warps``). With
  8 warps a [64, 16] product splits its 16 columns over two warpgroups (``wgmma m64n8k8`` in tf32, the shape
  of Triton issue #10629); with 4 it does not. ``DIAG_BWD_WARPS=8`` is the float32 backward as it was before
  ``matrix_warps``.
* ``DIAG_FWD_WARPS``: the forward kernels' autotune configs cut to those of this many warps (one config of
  1 stage when none has them, and no pruning by the blocks), the same question for the forward.

Each line says whether its worst ratio is within the tests' bound (``lamina.testing.RECURRENCE_RMS_RATIO``).
Exits 1 when any check raised (after a CUDA fault, the checks after it in this process fail too), was not finite
or was above the bound.
"""
import os
import sys
import time
import traceback

import torch

DEV = os.environ.get("DEV", "cuda")
sys.path.insert(0, "tests")
var, dt, shape, labels = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split("x")], sys.argv[4:]
B, T, H, K = shape
dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
tag = f"{var} {dt} {B}x{T}x{H}x{K}"
t0 = time.time()
try:
    from test_delta_fwd import make_inputs

    import lamina
    import lamina.kernels.delta_chunk_bwd as bwd
    import lamina.ops.delta_rule_core as core
    from lamina.kernels.delta_tuning import ALTERNATIVES, DeltaTuning, delta_tuning
    from lamina.reference import delta_rule_family_chunk_ref
    from lamina.testing import RECURRENCE_RMS_RATIO

    bound = RECURRENCE_RMS_RATIO[dtype]  # the tests' bound on the RMS error ratio against float64

    known = {t.label(): t for t in ALTERNATIVES}
    labels = list(known) if labels == ["all"] else labels
    unknown = [label for label in labels if label not in known]
    if unknown:
        raise ValueError(f"unknown alternative labels {unknown}; known: {sorted(known)}")
    core.UNTRUSTED_FP32_DEVICES = ()
    bwd.DOT_PRECISION = os.environ.get("DIAG_DOT", bwd.DOT_PRECISION)
    tag += f" (backward {bwd.DOT_PRECISION}"
    if os.environ.get("DIAG_BWD_WARPS"):
        bwd_warps, shipped_tiles = int(os.environ["DIAG_BWD_WARPS"]), bwd.bwd_tiles
        bwd.bwd_tiles = lambda *a, **kw: shipped_tiles(*a, **kw)._replace(
            prep_warps=bwd_warps, scan_warps=bwd_warps, dqk_warps=bwd_warps)
        tag += f", {bwd_warps} warps"
    if os.environ.get("DIAG_FWD_WARPS"):
        import triton

        import lamina.kernels.delta_chunk_fwd as fwd

        warps = int(os.environ["DIAG_FWD_WARPS"])
        for tuner in (fwd._prep_fwd, fwd._scan_fwd, fwd._out_fwd):
            tuner.configs = [c for c in tuner.configs if c.num_warps == warps] or [
                triton.Config({}, num_warps=warps, num_stages=1)]
            tuner.early_config_prune = None
        tag += f"; forward {warps} warps"
    tag += ")"
    xs = [None if x is None else x.to(DEV) for x in make_inputs(var, B, T, H, H, K, K, dtype, h0=True)]
    q, k, v, g, b, w, s0, _ = xs
    F = {"delta": lamina.chunk_delta_rule, "gdn": lamina.chunk_gated_delta_rule, "kda": lamina.chunk_kda,
         "gdn2": lamina.chunk_gdn2}[var]

    def leaves(ts, dtype_of=None):
        return [None if x is None else x.detach().clone().to(dtype_of or x.dtype).requires_grad_() for x in ts]

    def gates(g, b, w):
        return {"delta": dict(beta=b), "gdn": dict(g=g, beta=b), "kda": dict(g=g, beta=b),
                "gdn2": dict(g=g, b=b, w=w)}[var]

    def ratio(a, r):
        return ((a.double() - r).norm() / r.norm()).item()

    inputs = [q, k, v, g, b, w if var == "gdn2" else None, s0]
    ref = leaves(inputs, torch.float64)
    rw = ref[5] if var == "gdn2" else ref[4]
    ro, rs = delta_rule_family_chunk_ref(ref[0], ref[1], ref[2], ref[3], ref[4], rw, None, ref[6], True, None)
    gen = torch.Generator(device=DEV).manual_seed(1)
    do, ds = torch.randn(ro.shape, device=DEV, generator=gen), torch.randn(rs.shape, device=DEV, generator=gen)
    torch.autograd.backward([ro, rs], [do.double(), ds.double()])
except Exception as exc:
    print(f"{tag}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}", flush=True)
    traceback.print_exc(limit=-4)
    sys.exit(1)

failed = False
for tuning in [DeltaTuning()] + [known[label] for label in labels]:
    t1, line = time.time(), f"{tag} [{tuning.label()}]"
    try:
        lam = leaves(inputs)
        with delta_tuning(**tuning.choices()):
            o, s = F(*lam[:3], **gates(*lam[3:6]), initial_state=lam[6], output_final_state=True, backend="triton")
            torch.autograd.backward([o, s], [do.to(o.dtype), ds])
        if DEV == "cuda":
            torch.cuda.synchronize()
        errs = {"o": ratio(o, ro), "state": ratio(s, rs)}
        for name, a, r in zip("q k v g b w s0".split(), lam, ref):
            if a is not None and r.grad is not None:
                errs["d" + name] = ratio(a.grad, r.grad)
        finite = all(torch.isfinite(x).all().item() for x in [o, s] + [a.grad for a in lam if a is not None])
        worst = max(errs.values())
        right = finite and worst <= bound
        failed |= not right
        print(f"{line}: {'ok' if right else 'WRONG'} in {time.time() - t1:.0f} s, finite={finite}, worst RMS ratio "
              f"{worst:.2e} ({'within' if right else 'above'} the table's {bound:.0e}) | "
              + " ".join(f"{n}={e:.1e}" for n, e in errs.items()), flush=True)
    except Exception as exc:
        failed = True
        print(f"{line}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}", flush=True)
        traceback.print_exc(limit=-4)
if labels:  # (a single check's last line is its verdict, which the float32 scripts read with tail)
    print(f"{tag}: {1 + len(labels)} checks in {time.time() - t0:.0f} s", flush=True)
sys.exit(1 if failed else 0)
