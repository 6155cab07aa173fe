"""Timing: median and 20/80% quantiles of one call, in milliseconds.

CUDA: ``triton.testing.do_bench`` (CUDA events around each call, warm-up calls
first, the L2 cache flushed by writing a 256 MB buffer before every timed call,
gradients reset to None between backward calls). CPU: ``torch.utils.benchmark``
(``blocked_autorange`` with all of torch's threads; no cache flush: a CPU run
streams its working set through caches it cannot flush cheaply, and the CPU sizes
exceed L2 anyway). A call slower than ``slow_call_s`` is timed over a few single
calls instead, so that one slow baseline cannot eat the suite's time budget. The call that
compiles and autotunes (a case's first) is never timed: ``lamina.bench.suite`` makes it first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

QUANTILES = (0.5, 0.2, 0.8)
# Single calls timed when one call is slower than `slow_call_s` (after the warm-up call).
SLOW_CALL_REPEATS = 2
# At least this many timed blocks on CPU, so that the 20/80% quantiles mean something.
MIN_CPU_BLOCKS = 3


@dataclass(frozen=True)
class TimingConfig:
    """How long to time each case. Defaults follow do_bench (25 ms warm-up, 100 ms of repeats)."""

    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    cpu_min_run_s: float = 0.5
    slow_call_s: float = 0.5
    # how many single calls time a slow call (a dry run on the CPU, where only the code path matters, takes 1);
    # 0: the call already made (the warm-up that checked the provider runs) is the timing
    slow_call_repeats: int = SLOW_CALL_REPEATS


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    runs: int
    method: str


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def reset_grads(leaves: Sequence[torch.Tensor]) -> None:
    """Set the ``.grad`` of every leaf to None (so that gradient accumulation is not timed)."""
    for x in leaves:
        x.grad = None


def _summary(times_ms: Sequence[float], method: str) -> Timing:
    arr = np.asarray(times_ms, dtype=np.float64)
    med, p20, p80 = (float(np.quantile(arr, q)) for q in QUANTILES)
    return Timing(med, p20, p80, len(arr), method)


def wall_time_once(fn: Callable[[], object], device: str) -> float:
    """Seconds of one synchronised call."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def single_calls(fn: Callable[[], object], device: str, leaves: Sequence[torch.Tensor], repeats: int,
                 made_ms: Sequence[float] = ()) -> Timing:
    """``repeats`` synchronised calls timed one by one, counting ``made_ms`` (calls already made and timed)."""
    times = list(made_ms)
    while len(times) < repeats:
        reset_grads(leaves)
        times.append(1e3 * wall_time_once(fn, device))
    return _summary(times, "single calls")


def time_fn(
    fn: Callable[[], object],
    device: str,
    leaves: Sequence[torch.Tensor] = (),
    config: TimingConfig = TimingConfig(),
    first_call_s: float | None = None,
) -> Timing:
    """Time ``fn()`` on ``device`` ("cuda" or "cpu").

    ``leaves`` get their ``.grad`` reset to None before every call (backward modes), so
    that gradient accumulation is not timed. ``first_call_s``: the duration of a call
    already made after the one that compiled (``lamina.bench.suite``); it picks the slow path.
    """
    if first_call_s is None:
        reset_grads(leaves)
        first_call_s = wall_time_once(fn, device)
    if first_call_s > config.slow_call_s:
        if config.slow_call_repeats == 0:
            ms = 1e3 * first_call_s
            return Timing(ms, ms, ms, 1, "single call")
        return single_calls(fn, device, leaves, config.slow_call_repeats)
    if device == "cuda":
        from triton.testing import do_bench

        med, p20, p80 = do_bench(fn, warmup=config.warmup_ms, rep=config.rep_ms, grad_to_none=list(leaves) or None,
                                 quantiles=list(QUANTILES))
        # do_bench does not report its repeat count: estimate it from its own rule (rep / estimate).
        runs = max(1, int(config.rep_ms / max(med, 1e-6)))
        return Timing(float(med), float(p20), float(p80), runs, "do_bench")
    return _time_cpu(fn, leaves, config)


def _time_cpu(fn: Callable[[], object], leaves: Sequence[torch.Tensor], config: TimingConfig) -> Timing:
    from torch.utils.benchmark import Timer

    if leaves:
        def call() -> None:
            reset_grads(leaves)
            fn()
    else:
        call = fn
    timer = Timer(stmt="call()", globals={"call": call}, num_threads=torch.get_num_threads())
    m = timer.blocked_autorange(min_run_time=config.cpu_min_run_s)
    times = list(m.times)
    while len(times) < MIN_CPU_BLOCKS:
        times.extend(timer.timeit(number=m.number_per_run).times)
    return _summary([1e3 * t for t in times], "torch.utils.benchmark")
