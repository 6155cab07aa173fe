"""The suite driver: ops x shapes x modes x providers, one JSON record per combination.

Order: for each op, each mode, each shape, each provider (fast providers first, the
baselines last), so that a time budget cut keeps the most informative measurements.
The budget is shared fairly: each op gets the remaining time over the remaining ops.
Every combination ends as ``ok`` (timed), ``skipped`` (with the reason) or ``error``
(the exception, recorded; the suite goes on).
"""

from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lamina.bench.ceilings import Ceilings, measure_ceilings, roofline_fractions
from lamina.bench.inputs import grad_leaves, make_inputs
from lamina.bench.providers import PROVIDERS, ProviderSkip, get_provider, output_of
from lamina.bench.results import ResultWriter, environment
from lamina.bench.specs import QUICK_CUDA_SHAPES, QUICK_OPS, get_op, shape_label, shapes_for
from lamina.bench.timing import Timing, TimingConfig, reset_grads, single_calls, time_fn, wall_time_once

# Execution order within a case: lamina and the fused libraries first, slow baselines last.
PROVIDER_ORDER = ("lamina-triton", "lamina-cuda", "fla", "flash-attn", "sdpa-flash", "sdpa-cudnn",
                  "sdpa-efficient", "lamina-torch", "lamina-cpu-ext", "sdpa-math", "fla-naive-chunk",
                  "torch-compile", "torch-eager", "fla-naive-recurrent", "reference")
# --quick: stop starting new measurements after this long, so the whole run stays under 2 minutes.
QUICK_TIME_BUDGET_S = 75.0
QUICK_TIMING = TimingConfig(warmup_ms=25.0, rep_ms=100.0, cpu_min_run_s=0.2, slow_call_s=0.3)
# --quick leaves out providers that cost more than they tell there: compile time on CPU, token loops on GPU,
# fla's naive forms (the CPU baselines of the full `lamina bench --device cpu` run).
QUICK_EXCLUDE = {"cpu": ("torch-compile", "fla-naive-chunk", "fla-naive-recurrent"),
                 "cuda": ("torch-compile", "reference", "fla-naive-chunk", "fla-naive-recurrent")}
# fla's guard for a Triton miscompile of its chunk backward on Hopper (fla issue #640).
FLA_HOPPER_GUARD = "#640"
# torch's message when an sdpa backend cannot run a case (the reasons come as warnings).
SDPA_NO_BACKEND = "No viable backend"


@dataclass
class SuiteConfig:
    device: str
    ops: list[str]
    providers: list[str]
    shape_set: str
    modes: list[str] | None = None  # None: every mode of each op
    op_modes: dict[str, list[str]] | None = None  # per-op override (--quick)
    shape_filter: dict[str, tuple[int, ...]] | None = None  # per-op shape indices to keep
    timing: TimingConfig = field(default_factory=TimingConfig)
    time_budget_s: float | None = None
    measure_ceilings: bool = True
    tiny_ceilings: bool = False
    # each shape's modes one after the other (a run cut by its time budget keeps every mode of its first
    # shapes), instead of every shape of one mode before the next mode
    shapes_first: bool = False


@dataclass
class Task:
    op: str
    mode: str
    params: dict[str, Any]
    shape_index: int
    provider: str

    @property
    def label(self) -> str:
        return shape_label(self.op, self.params)


def quick_config(device: str, ops: list[str] | None = None) -> SuiteConfig:
    """The cases of ``lamina bench --quick`` on ``device`` (its op/mode pairs, shapes, providers, timing
    and time budget), restricted to ``ops`` when given; ``benchmarks/test_bench_suite.py`` plans the same."""
    pairs = [(op, mode) for op, mode in QUICK_OPS[device] if not ops or op in ops]
    chosen = list(dict.fromkeys(op for op, _ in pairs))
    return SuiteConfig(
        device=device, ops=chosen, providers=[p for p in PROVIDERS if p not in QUICK_EXCLUDE[device]],
        shape_set="standard" if device == "cuda" else "quick",
        op_modes={op: [m for o, m in pairs if o == op] for op in chosen},
        shape_filter=QUICK_CUDA_SHAPES if device == "cuda" else None,
        timing=QUICK_TIMING, time_budget_s=QUICK_TIME_BUDGET_S,
    )


def plan(cfg: SuiteConfig) -> list[Task]:
    """Every (op, mode, shape, provider) the configuration asks for, in execution order."""
    unknown = [p for p in cfg.providers if p not in PROVIDERS]
    if unknown:
        raise ValueError(f"unknown provider(s) {unknown}; known providers: {', '.join(PROVIDERS)}")
    providers = [p for p in PROVIDER_ORDER if p in cfg.providers]
    tasks = []
    for op in cfg.ops:
        spec = get_op(op)
        if cfg.op_modes is not None:
            modes = [m for m in cfg.op_modes.get(op, []) if m in spec.modes]
        else:
            modes = [m for m in (cfg.modes or spec.modes) if m in spec.modes]
        shapes = list(enumerate(shapes_for(op, cfg.shape_set)))
        if cfg.shape_filter and op in cfg.shape_filter:
            shapes = [(i, p) for i, p in shapes if i in cfg.shape_filter[op]]
        if cfg.shapes_first:
            cases = [(mode, i, params) for i, params in shapes for mode in modes]
        else:
            cases = [(mode, i, params) for mode in modes for i, params in shapes]
        for mode, i, params in cases:
            # Providers that do not implement the op at all are not planned (`lamina bench
            # providers` lists them); every other one is recorded, run or skipped with its reason.
            tasks.extend(Task(op, mode, params, i, prov) for prov in providers if op in PROVIDERS[prov].ops)
    return tasks


def classify(exc: BaseException, warned: list[str]) -> tuple[str, str]:
    """("skipped" | "error", reason) for an exception raised by a provider's first call."""
    msg = f"{type(exc).__name__}: {exc}".strip()
    first_line = msg.splitlines()[0] if msg else type(exc).__name__
    if isinstance(exc, ProviderSkip):
        return "skipped", str(exc)
    if isinstance(exc, ImportError):
        return "skipped", first_line
    if isinstance(exc, NotImplementedError):
        return "skipped", first_line
    if isinstance(exc, RuntimeError) and FLA_HOPPER_GUARD in str(exc):
        return "skipped", f"fla refuses this GPU/Triton combination (its issue #640 guard): {first_line}"
    if isinstance(exc, RuntimeError) and SDPA_NO_BACKEND in str(exc):
        why = "; ".join(w.splitlines()[0] for w in warned if w) or first_line
        return "skipped", f"sdpa backend cannot run this case: {why}"
    if isinstance(exc, ValueError) and "backend" in str(exc):
        return "skipped", first_line
    if isinstance(exc, torch.OutOfMemoryError):
        return "error", "out of memory"
    return "error", first_line


class _InputCache:
    """Inputs of the current (op, shape), with and without gradients; freed when the shape changes."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.key: tuple | None = None
        self.store: dict[bool, dict[str, Any]] = {}

    def get(self, task: Task, requires_grad: bool) -> dict[str, Any]:
        key = (task.op, task.shape_index)
        if key != self.key:
            self.key, self.store = key, {}
            if self.device == "cuda":
                torch.cuda.empty_cache()
        if requires_grad not in self.store:
            self.store[requires_grad] = make_inputs(task.op, task.params, self.device, requires_grad)
        return self.store[requires_grad]


def _prepare(task: Task, x: dict[str, Any], device: str) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    """The callable timed for ``task.mode`` and the leaves whose gradients it produces."""
    bound = get_provider(task.provider).bind(task.op, task.params, x)
    leaves = bound.leaves if bound.leaves is not None else grad_leaves(x)
    if task.mode == "fwd":
        return bound.fn, []
    out = output_of(bound.fn())
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        raise ProviderSkip(f"{task.provider} returned an output without a gradient graph (no backward)")
    torch.manual_seed(1)
    dout = torch.randn_like(out)
    if task.mode == "bwd":
        return (lambda: out.backward(dout, retain_graph=True)), leaves
    return (lambda: output_of(bound.fn()).backward(dout)), leaves


def _time_warm(fn: Callable[[], Any], cfg: SuiteConfig, leaves: list[torch.Tensor], first_s: float,
               deadline: float | None) -> Timing:
    """Time ``fn`` after its first call took ``first_s``.

    A first call compiles and autotunes (Triton's JIT): it is never the measurement. When it was slow, a
    second call decides: fast, ``fn`` is timed as usual; slow too, it is the first of the single calls that
    time a slow call, or the measurement alone when more would overrun ``deadline`` (``time.monotonic()``
    seconds). A dry run's timing (``slow_call_repeats=0``: interpreter timings, no result) is the first call,
    to keep it short.
    """
    timing, repeats = cfg.timing, cfg.timing.slow_call_repeats
    if first_s <= timing.slow_call_s or repeats == 0:
        return time_fn(fn, cfg.device, leaves, timing, first_call_s=first_s)
    reset_grads(leaves)
    warm_s = wall_time_once(fn, cfg.device)
    if warm_s <= timing.slow_call_s:
        return time_fn(fn, cfg.device, leaves, timing, first_call_s=warm_s)
    if deadline is not None and time.monotonic() + (repeats - 1) * warm_s > deadline:
        ms = 1e3 * warm_s
        return Timing(ms, ms, ms, 1, "single call (time budget)")
    return single_calls(fn, cfg.device, leaves, repeats, made_ms=[1e3 * warm_s])


def measure(task: Task, cache: _InputCache, cfg: SuiteConfig, ceilings: Ceilings | None,
            deadline: float | None = None) -> dict[str, Any]:
    """Run one task; the record has status ok, skipped or error, and an ok one ``first_call_ms``, the first
    call's time (compiles and autotuning included), which is never the measurement (``_time_warm``)."""
    spec = get_op(task.op)
    rec: dict[str, Any] = {
        "kind": "result", "op": task.op, "shape": task.label, "params": task.params, "dtype": task.params["dtype"],
        "mode": task.mode, "provider": task.provider, "device": cfg.device,
        "flops": spec.flops(task.params, task.mode), "bytes": spec.bytes(task.params, task.mode),
    }
    reason = get_provider(task.provider).skip_reason(task.op, cfg.device, task.params)
    if reason:
        return {**rec, "status": "skipped", "reason": reason}
    leaves: list[torch.Tensor] = []
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as log:
            warnings.simplefilter("always")
            caught = log
            x = cache.get(task, requires_grad=task.mode != "fwd")
            fn, leaves = _prepare(task, x, cfg.device)
            first = wall_time_once(fn, cfg.device)
        timing = _time_warm(fn, cfg, leaves, first, deadline)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a record
        status, why = classify(exc, [str(w.message) for w in caught])
        return {**rec, "status": status, "reason": why}
    finally:
        reset_grads(leaves)
    rec.update(status="ok", reason=None, ms=timing.median_ms, ms_p20=timing.p20_ms, ms_p80=timing.p80_ms,
               runs=timing.runs, timer=timing.method, first_call_ms=1e3 * first)
    rec.update(roofline_fractions(rec["flops"], rec["bytes"], timing.median_ms, ceilings))
    return rec


ProgressFn = Callable[[Task, dict[str, Any]], None]


def run_suite(cfg: SuiteConfig, writer: ResultWriter | None = None,
              progress: ProgressFn | None = None, on_start: Callable[[int], None] | None = None,
              ) -> tuple[list[dict[str, Any]], Ceilings | None]:
    """Run the configured suite; returns the result records and the measured ceilings."""
    writer = writer or ResultWriter(None)
    env = environment(cfg.device)
    run_id = uuid.uuid4().hex[:12]
    base = {"run_id": run_id, "env": env}
    ceilings: Ceilings | None = None
    if cfg.measure_ceilings:
        try:
            ceilings = measure_ceilings(cfg.device, tiny=cfg.tiny_ceilings)
            writer.write({"kind": "ceiling", **base, **ceilings.as_dict()})
        except Exception as exc:  # noqa: BLE001 - a run without ceilings still has times
            writer.write({"kind": "ceiling", **base, "device": cfg.device, "status": "error",
                          "reason": f"{type(exc).__name__}: {exc}"})
    tasks = plan(cfg)
    if on_start is not None:
        on_start(len(tasks))
    cache = _InputCache(cfg.device)
    start = time.monotonic()
    end = start + cfg.time_budget_s if cfg.time_budget_s is not None else None
    ops_left = list(dict.fromkeys(t.op for t in tasks))
    op_deadline: float | None = None
    current_op = None
    records = []
    for task in tasks:
        if task.op != current_op:
            current_op = task.op
            if end is not None:
                remaining_ops = len(ops_left) - ops_left.index(task.op)
                op_deadline = time.monotonic() + max(0.0, end - time.monotonic()) / remaining_ops
        if op_deadline is not None and time.monotonic() > op_deadline:
            rec = {"kind": "result", "op": task.op, "shape": task.label, "params": task.params,
                   "dtype": task.params["dtype"], "mode": task.mode, "provider": task.provider,
                   "device": cfg.device, "status": "skipped",
                   "reason": f"time budget: this op's share of --time-budget {cfg.time_budget_s:g} s was spent"}
        else:
            rec = measure(task, cache, cfg, ceilings, op_deadline)
        rec.update(base)
        writer.write(rec)
        records.append(rec)
        if progress is not None:
            progress(task, rec)
    return records, ceilings
