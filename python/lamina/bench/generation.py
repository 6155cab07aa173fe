"""Generation throughput: tokens/s of end-to-end ``lamina.generation.generate``, HRM-LM vs PrismDecoder.

Both models have the width, heads, MLP ratio and vocabulary of ``HRMLMConfig.family(size)``; the
PrismDecoder (uniform head schedule, RMSNorm) has as many layers as HRM-LM has block applications
per token (``config.depth`` = M fast + n_cycles slow steps), so both run about the same FLOPs per
token while HRM-LM stores 2 blocks. Each case is greedy generation of ``new_tokens`` tokens after
``batch_size`` random prompts of ``prompt_len`` tokens (fixed seeds), timed as a whole (prefill
and every step, through each model's decoding cache), and again with one new token (prefill
alone) to split off the decoding rate.

A model is benchmarked through the protocol of ``lamina.generation`` only (``new_cache(batch_size,
max_length)`` and ``decode``); one that does not implement it is recorded as skipped, with the reason.

    python -m lamina.bench.generation --device cpu --batch-sizes 1,8 --prompt-len 32 --new-tokens 32
"""

from __future__ import annotations

import argparse
import inspect
import sys
from typing import Any

import torch
from torch import nn

from lamina.bench.results import ResultWriter, default_results_path, environment
from lamina.bench.timing import TimingConfig, time_fn, wall_time_once
from lamina.generation import generate
from lamina.layers.prism import PrismDecoder, PrismDecoderConfig
from lamina.models.hrm_lm import HRMLM, HRMLMConfig

MODEL_SEED, PROMPT_SEED = 0, 1
MODELS = ("hrm_lm", "prism")
# CPU timing per measurement: 0.3 s of repeats (the harness times at least 3 blocks); a call slower
# than 0.5 s (the tiny size at 32 + 32 tokens: 0.3-1 s on 2 loaded cores) is timed over 2 single calls.
# The default tiny run (2 models x 2 batch sizes) then stays under 30 s on such a CPU.
TIMING = TimingConfig(cpu_min_run_s=0.3, slow_call_s=0.5)
# main()'s CPU threads: a decoding step is many ops of a few microseconds each, where handing work to a
# second thread costs more than it saves. Measured, default tiny run on 2 cores shared with other jobs
# (load 3): 19 s with 1 thread, 128 s with 2 (HRM-LM batch 8: 437 vs 38 tokens/s).
CPU_THREADS = 1


def build_model(name: str, size: str, device: str, dtype: torch.dtype) -> nn.Module:
    """``"hrm_lm"``: ``HRMLM(HRMLMConfig.family(size))``; ``"prism"``: a PrismDecoder of the same
    width, heads, MLP ratio and vocabulary with ``depth`` layers (module docstring)."""
    cfg = HRMLMConfig.family(size)
    torch.manual_seed(MODEL_SEED)
    if name == "hrm_lm":
        model = HRMLM(cfg)
    elif name == "prism":
        model = PrismDecoder(PrismDecoderConfig(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.depth,
                                                h_base=cfg.n_heads, mlp_ratio=cfg.mlp_ratio, norm="rmsnorm"))
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    return model.to(device=device, dtype=dtype).eval()


def protocol_gap(model: nn.Module) -> str | None:
    """Why ``model`` cannot run ``lamina.generation.generate``, or None when it can."""
    name = type(model).__name__
    if not callable(getattr(model, "decode", None)):
        return f"{name} has no decode(input_ids, cache, attention_mask=None) (lamina.generation's protocol)"
    try:
        inspect.signature(model.new_cache).bind(1, 1)
    except (AttributeError, TypeError):
        return f"{name}.new_cache does not take (batch_size, max_length) (lamina.generation's protocol)"
    return None


def _case(model: nn.Module, device: str, batch_size: int, prompt_len: int, new_tokens: int,
          vocab_size: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    ids = torch.randint(0, vocab_size, (batch_size, prompt_len), generator=gen).to(device)
    wall_time_once(lambda: generate(model, ids, new_tokens), device)  # warm-up: first-call allocations, caches
    full = time_fn(lambda: generate(model, ids, new_tokens), device, config=TIMING)
    prefill = time_fn(lambda: generate(model, ids, 1), device, config=TIMING)
    decode_s = (full.median_ms - prefill.median_ms) / 1e3
    row = {
        "ms": full.median_ms, "ms_p20": full.p20_ms, "ms_p80": full.p80_ms, "runs": full.runs,
        "method": full.method, "prefill_ms": prefill.median_ms,
        # higher rate at the faster (20%) time
        "tokens_per_s": batch_size * new_tokens / (full.median_ms / 1e3),
        "tokens_per_s_p20": batch_size * new_tokens / (full.p80_ms / 1e3),
        "tokens_per_s_p80": batch_size * new_tokens / (full.p20_ms / 1e3),
        "decode_tokens_per_s": batch_size * (new_tokens - 1) / decode_s if new_tokens > 1 and decode_s > 0 else None,
    }
    return row


def run_generation_bench(device: str, batch_sizes: list[int] | tuple[int, ...], prompt_len: int, new_tokens: int,
                         size: str = "tiny", dtype: torch.dtype = torch.float32,
                         models: tuple[str, ...] = MODELS) -> list[dict[str, Any]]:
    """One row per (model, batch size): timings of ``generate`` and tokens/s, or the reason it was skipped.

    Args:
        device: "cpu" or "cuda".
        batch_sizes: prompts per generate call.
        prompt_len: tokens per prompt; new_tokens: tokens generated per prompt (>= 1).
            ``prompt_len + new_tokens`` must fit ``max_seq_len`` of the size.
        size: ``HRMLMConfig.family`` size ("tiny", "small", "medium").
        dtype: parameters and activations.
        models: among ``MODELS``.

    Runs with torch's current CPU threads (``main`` sets ``CPU_THREADS``).

    Row keys: kind ("generation"), model, model_class, size, dtype, device, batch_size, prompt_len,
    new_tokens, depth, params, status ("ok" or "skipped"), reason; when measured: ms, ms_p20,
    ms_p80 (one whole generate call), runs, method, prefill_ms (generate with one new token),
    tokens_per_s (batch_size * new_tokens per whole call; _p20/_p80 at the slower/faster
    quantile) and decode_tokens_per_s (the tokens after the first over the time beyond prefill).
    """
    cfg = HRMLMConfig.family(size)
    for name, value in (("prompt_len", prompt_len), ("new_tokens", new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if prompt_len + new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt_len + new_tokens must be <= max_seq_len {cfg.max_seq_len} of size {size!r}, "
                         f"got {prompt_len} + {new_tokens}")
    if not batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be ints >= 1, got {batch_sizes!r}")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"models must be among {MODELS}, got {unknown}")
    rows = []
    for name in models:
        model = build_model(name, size, device, dtype)
        gap = protocol_gap(model)
        base = {"kind": "generation", "model": name, "model_class": type(model).__name__, "size": size,
                "dtype": str(dtype).replace("torch.", ""), "device": device, "prompt_len": prompt_len,
                "new_tokens": new_tokens, "depth": cfg.depth, "params": sum(p.numel() for p in model.parameters())}
        for batch_size in batch_sizes:
            row = {**base, "batch_size": batch_size, "status": "skipped" if gap else "ok", "reason": gap}
            if gap is None:
                row.update(_case(model, device, batch_size, prompt_len, new_tokens, cfg.vocab_size))
            rows.append(row)
        del model
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'model':<8} {'batch':>5} {'params':>10} {'ms':>9} {'tokens/s':>10} {'decode tok/s':>12} "
             f"{'prefill ms':>10}"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['model']:<8} {r['batch_size']:>5} {r['params']:>10,} skipped: {r['reason']}")
            continue
        decode = f"{r['decode_tokens_per_s']:.0f}" if r["decode_tokens_per_s"] is not None else "-"
        lines.append(f"{r['model']:<8} {r['batch_size']:>5} {r['params']:>10,} {r['ms']:>9.1f} "
                     f"{r['tokens_per_s']:>10.0f} {decode:>12} {r['prefill_ms']:>10.1f}")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from exc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lamina.bench.generation",
                                description="tokens/s of lamina.generation.generate: HRM-LM vs PrismDecoder")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8], help="comma-separated (default 1,8)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--size", default="tiny", choices=("tiny", "small", "medium"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--model", action="append", choices=MODELS, help="model(s) to run (default: both)")
    p.add_argument("--out", help="results file, JSON lines, appended (default: <date>-<device>.jsonl in "
                                 "lamina's results folder)")
    p.add_argument("--no-save", action="store_true", help="do not write a results file")
    p.add_argument("--threads", type=int, help=f"torch CPU threads (default on CPU: {CPU_THREADS})")
    args = p.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible to torch")
    threads = args.threads if args.threads is not None else (CPU_THREADS if device == "cpu" else None)
    if threads is not None:
        if threads < 1:
            p.error(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    try:
        rows = run_generation_bench(device, args.batch_sizes, args.prompt_len, args.new_tokens, args.size,
                                    dtype=getattr(torch, args.dtype), models=tuple(args.model or MODELS))
    except ValueError as exc:
        p.error(str(exc))
    print(format_rows(rows))
    if not args.no_save:
        path = args.out or default_results_path(device)
        writer = ResultWriter(path)
        env = environment(device)
        for row in rows:
            writer.write({**row, "env": env})
        writer.close()
        print(f"results appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
