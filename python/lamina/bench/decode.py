"""``lamina bench --op decode``: latency of one Gated DeltaNet decode step over a state pool.

    lamina bench --op decode                     # this machine's device
    python -m lamina.bench.decode --device cpu --out benchmarks/results/2026-12-01-decode-cpu.jsonl

One token per sequence (T = 1), the GDN variant with every transform fused (scalar g with
``GATE_SOFTPLUS``, ``A_log`` and ``dt_bias``; ``BETA_SIGMOID``; ``l2norm``), K = V = 128, the state
pool updated in place through per-sequence slots (``lamina.ops.delta_decode``). GPU: B in
{1, 16, 64, 256}, H = HV = 32, bf16 q/k/v/out; CPU: B in {1, 8}, H = HV = 16, float32.

Providers (by exact name): ``lamina-torch`` (the PyTorch eager step), ``lamina-cpu-ext`` (CPU) or
``lamina-cuda`` (GPU), the C++ kernels of lamina._C, ``lamina-triton`` (GPU) and ``fla``
(``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule``, GPU; it reads an initial state and
writes a new final state instead of updating a pool: the same bytes). A provider that cannot run
is recorded as skipped with the reason.

Reported per case: median time (20-80% quantiles), bytes moved (``decode_bytes``), GB/s, and the
fraction of the memory floor: floor = bytes / the bandwidth of a ``torch`` copy that moves the same
number of bytes on the same device, measured in the same run. Records are appended as JSON lines
(``lamina.bench.results``; ``lamina bench summary`` reads them).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lamina.bench.specs import DECODE_FLOPS_PER_STATE_ELEM, STATE_BYTES
from lamina.bench.timing import TimingConfig, time_fn

OP = "decode"
PROVIDERS = ("lamina-torch", "lamina-cpu-ext", "lamina-cuda", "lamina-triton", "fla")
# Shapes per device: batch sizes, heads (H = HV), head dims, dtype of q/k/v/out.
BATCHES = {"cuda": (1, 16, 64, 256), "cpu": (1, 8)}
HEADS = {"cuda": 32, "cpu": 16}
HEAD_DIM = 128
DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float32}
# CPU timing: 0.3 s of blocked repeats per case keeps the whole CPU run (4 cases, 2 copies) near 10 s.
CPU_TIMING = TimingConfig(cpu_min_run_s=0.3)
SEED = 0


def decode_bytes(B: int, H: int, HV: int, K: int, V: int, dtype: torch.dtype) -> int:
    """The fewest bytes one step moves: the float32 state read and written once; q, k [B, H, K],
    v and out [B, HV, V] in ``dtype``; g and beta [B, HV] and A_log, dt_bias [HV] in float32."""
    es = torch.empty((), dtype=dtype).element_size()
    state = 2 * STATE_BYTES * B * HV * K * V
    tokens = es * (2 * B * H * K + 2 * B * HV * V)
    gates = 4 * (2 * B * HV + 2 * HV)
    return state + tokens + gates


def decode_flops(B: int, HV: int, K: int, V: int) -> int:
    """Decay, read, rank-1 write and output: ``DECODE_FLOPS_PER_STATE_ELEM`` per state element."""
    return DECODE_FLOPS_PER_STATE_ELEM * B * HV * K * V


class Skip(Exception):
    """The provider cannot run here; the message says why."""


def make_inputs(device: str, B: int, H: int, K: int, V: int, dtype: torch.dtype) -> dict[str, Any]:
    gen = torch.Generator(device="cpu").manual_seed(SEED)
    rnd = lambda *s: torch.randn(*s, generator=gen)
    x = {
        "q": rnd(B, 1, H, K).to(dtype), "k": rnd(B, 1, H, K).to(dtype), "v": rnd(B, 1, H, V).to(dtype),
        "g": rnd(B, 1, H), "b": rnd(B, 1, H), "A_log": rnd(H) * 0.5, "dt_bias": rnd(H),
        "state": rnd(B, H, K, V) * 0.1, "state_indices": torch.arange(B).view(B, 1),
    }
    return {name: t.to(device) for name, t in x.items()}


def _lamina_step(backend: str) -> Callable[[dict[str, Any]], Callable[[], Any]]:
    def bind(x: dict[str, Any]) -> Callable[[], Any]:
        from lamina.ops.delta_decode import BETA_SIGMOID, GATE_SOFTPLUS, decode_step

        if backend in ("cpu-ext", "cuda"):
            from lamina.ops.delta_decode_ext import has_op

            if not has_op():
                raise Skip("lamina._C with delta_decode_step is not built (LAMINA_BUILD_CPU=1 or LAMINA_BUILD_CUDA=1 "
                           "pip install --no-build-isolation -e .)")
            from lamina._optional import compiled_extension

            if backend == "cuda" and not getattr(compiled_extension(), "WITH_CUDA", False):
                raise Skip("lamina._C was built without CUDA (LAMINA_BUILD_CUDA=1)")
        if backend == "triton":
            try:
                from lamina.kernels.delta_recurrent_fwd import delta_decode_step  # noqa: F401
            except Exception as exc:  # noqa: BLE001 - the kernel module may be missing or broken
                raise Skip(f"lamina.kernels.delta_recurrent_fwd.delta_decode_step: {type(exc).__name__}: {exc}") \
                    from exc
        out = torch.empty_like(x["v"])
        K = x["q"].shape[-1]

        def run() -> Any:
            return decode_step(x["q"], x["k"], x["v"], x["g"], x["b"], None, scale=K ** -0.5, A_log=x["A_log"],
                               dt_bias=x["dt_bias"], state=x["state"], state_indices=x["state_indices"], out=out,
                               gate_act=GATE_SOFTPLUS, beta_act=BETA_SIGMOID, l2norm=True, inplace=True,
                               backend=backend)

        return run

    return bind


def _fla_step(x: dict[str, Any]) -> Callable[[], Any]:
    from lamina._optional import fla

    if fla() is None:
        raise Skip("fla is not installed (pip install fla-core==0.6.0)")
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - any import failure means this provider cannot run
        raise Skip(f"cannot import fla's fused_recurrent_gated_delta_rule: {type(exc).__name__}: {exc}") from exc
    K = x["q"].shape[-1]

    def run() -> Any:
        return fused_recurrent_gated_delta_rule(
            x["q"], x["k"], x["v"], g=x["g"], beta=x["b"], scale=K ** -0.5, initial_state=x["state"],
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=x["A_log"],
            dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True)

    return run


# provider -> (devices it runs on, builder of the callable)
_BUILDERS: dict[str, tuple[tuple[str, ...], Callable[[dict[str, Any]], Callable[[], Any]]]] = {
    "lamina-torch": (("cpu", "cuda"), _lamina_step("torch")),
    "lamina-cpu-ext": (("cpu",), _lamina_step("cpu-ext")),
    "lamina-cuda": (("cuda",), _lamina_step("cuda")),
    "lamina-triton": (("cuda",), _lamina_step("triton")),
    "fla": (("cuda",), _fla_step),
}


def copy_ms(device: str, nbytes: int, timing: TimingConfig) -> float:
    """Median time of a torch copy moving ``nbytes`` (reading and writing nbytes / 2 each)."""
    src = torch.rand(max(1, nbytes // 8), device=device)
    dst = torch.empty_like(src)
    return time_fn(lambda: dst.copy_(src), device, config=timing).median_ms


def run(device: str, providers: list[str] | None = None, exclude: list[str] | None = None,
        timing: TimingConfig | None = None, writer: Any = None, batches: tuple[int, ...] | None = None,
        stream=None) -> list[dict[str, Any]]:
    """Measure every (batch, provider) case on ``device``; returns the records (also written to
    ``writer`` when given) and prints the table to ``stream``."""
    from lamina.bench.results import environment

    stream = stream or sys.stdout
    timing = timing or (CPU_TIMING if device == "cpu" else TimingConfig())
    names = [p for p in (providers or PROVIDERS) if p not in (exclude or [])]
    unknown = [p for p in names if p not in _BUILDERS]
    if unknown:
        raise ValueError(f"unknown decode provider(s) {unknown}; known: {', '.join(PROVIDERS)}")
    env = environment(device)
    run_id = uuid.uuid4().hex[:12]
    H = HEADS[device]
    K = V = HEAD_DIM
    dtype = DTYPES[device]
    dtype_name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    records = []
    for B in batches or BATCHES[device]:
        nbytes = decode_bytes(B, H, H, K, V, dtype)
        flops = decode_flops(B, H, K, V)
        floor = copy_ms(device, nbytes, timing)
        params = {"B": B, "T": 1, "H": H, "HV": H, "K": K, "V": V, "dtype": dtype_name}
        shape = f"{B}x1x{H}x{K}"
        for name in names:
            devices, build = _BUILDERS[name]
            rec: dict[str, Any] = {"kind": "result", "op": OP, "shape": shape, "mode": "fwd", "device": device,
                                   "provider": name, "params": params, "dtype": dtype_name, "bytes": nbytes,
                                   "flops": flops, "floor_ms": floor, "copy_gbps": nbytes / floor / 1e6,
                                   "env": env, "run_id": run_id, "status": "ok", "reason": None}
            try:
                if device not in devices:
                    raise Skip(f"runs on {', '.join(devices)} only")
                fn = build(make_inputs(device, B, H, K, V, dtype))
                t = time_fn(fn, device, config=timing)
            except Skip as exc:
                rec.update(status="skipped", reason=str(exc))
            except Exception as exc:  # noqa: BLE001 - recorded, the other providers still run
                rec.update(status="error", reason=f"{type(exc).__name__}: {exc}")
            else:
                rec.update(ms=t.median_ms, ms_p20=t.p20_ms, ms_p80=t.p80_ms, runs=t.runs,
                           gbps=nbytes / t.median_ms / 1e6, tflops=flops / t.median_ms / 1e9,
                           roofline_frac=floor / t.median_ms)
            records.append(rec)
            if writer is not None:
                writer.write(rec)
    print_table(records, env, stream)
    return records


def print_table(records: list[dict[str, Any]], env: dict[str, Any], stream) -> None:
    print(f"decode step (GDN, T=1, K=V={HEAD_DIM}) on {env['device_name']} | {env['cpu_threads']} threads | "
          f"commit {str(env.get('commit'))[:10]} | torch {env['torch']}", file=stream)
    header = ["shape", "dtype", "provider", "ms", "p20-p80", "MB moved", "GB/s", "floor ms", "% of floor",
              "vs lamina-torch"]
    rows = []
    base = {r["shape"]: r["ms"] for r in records if r["provider"] == "lamina-torch" and r["status"] == "ok"}
    for r in records:
        if r["status"] != "ok":
            continue
        speedup = f"{base[r['shape']] / r['ms']:.3g}x" if r["shape"] in base else "-"
        rows.append([r["shape"], r["dtype"], r["provider"], f"{r['ms']:.4f}", f"{r['ms_p20']:.4f}-{r['ms_p80']:.4f}",
                     f"{r['bytes'] / 1e6:.2f}", f"{r['gbps']:.1f}", f"{r['floor_ms']:.4f}",
                     f"{100 * r['roofline_frac']:.1f}", speedup])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    for cells in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip(), file=stream)
    not_run: dict[tuple[str, str, str], list[str]] = {}
    for r in records:
        if r["status"] != "ok":
            not_run.setdefault((r["status"], r["provider"], r["reason"]), []).append(r["shape"])
    for (status, provider, reason), shapes in not_run.items():
        print(f"{status}: {provider} ({', '.join(shapes)}): {reason}", file=stream)


def main(argv: list[str] | None = None, device: str | None = None) -> int:
    """``lamina bench --op decode [--device D] [--provider P] [--exclude P] [--out F] [--no-save]
    [--threads N] [--cpu-min-run-s S]``; exit status 1 when a provider raised an error."""
    p = argparse.ArgumentParser(prog="lamina bench --op decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--op", action="append", help="decode")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--provider", action="append", help=f"provider(s), comma-separated: {', '.join(PROVIDERS)}")
    p.add_argument("--exclude", action="append", help="provider(s) to leave out")
    p.add_argument("--out", help="results file, JSON lines, appended (default: lamina bench's results folder)")
    p.add_argument("--no-save", action="store_true", help="do not write a results file")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--cpu-min-run-s", type=float, help="CPU timing per case (torch.utils.benchmark)")
    args, _ = p.parse_known_args(argv)
    from lamina.bench.results import ResultWriter, default_results_path

    if args.threads:
        torch.set_num_threads(args.threads)
    if device is None:
        device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    csv = lambda vals: [v.strip() for item in vals or [] for v in item.split(",") if v.strip()]
    timing = CPU_TIMING if device == "cpu" else TimingConfig()
    if args.cpu_min_run_s is not None:
        timing = TimingConfig(cpu_min_run_s=args.cpu_min_run_s)
    out = None if args.no_save else Path(args.out) if args.out else default_results_path(device)
    writer = ResultWriter(out)
    try:
        records = run(device, csv(args.provider) or None, csv(args.exclude), timing, writer)
    except ValueError as exc:
        print(f"lamina bench: {exc}", file=sys.stderr)
        return 2
    finally:
        writer.close()
    if out is not None:
        print(f"results appended to {out}")
    return 1 if any(r["status"] == "error" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
