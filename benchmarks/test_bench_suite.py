"""The benchmark suite under pytest-benchmark: the cases of ``lamina bench``, timed by pytest-benchmark.

    pytest benchmarks/ --benchmark-only -k quick                      # lamina bench --quick's cases
    pytest benchmarks/ --benchmark-only -k quick --benchmark-autosave  # saved under .benchmarks/
    pytest-benchmark compare                                          # against saved runs

Cases come from ``lamina.bench.suite.plan`` (one definition for both): ``quick-*`` are the cases of
``lamina bench --quick`` on this machine's device (``quick_config``), ``full-*`` the default run's
(every kernel op, every provider, the device's default shape set; long). Each test is named
``<set>-<op>-<mode>-<shape>-<provider>``, and its JSON ``extra_info`` holds op, mode, shape, provider,
device, FLOPs and bytes, as the records of ``lamina bench`` do. A provider that cannot run here is
skipped with its reason, as ``lamina bench`` records it.
"""

from __future__ import annotations

import pytest
import torch

from lamina.bench.providers import PROVIDERS, get_provider
from lamina.bench.specs import RUN_ORDER, get_op
from lamina.bench.suite import SuiteConfig, Task, _InputCache, _prepare, classify, plan, quick_config
from lamina.bench.timing import wall_time_once

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Rounds per case: enough to fill this many seconds after the first call, within [1, MAX_ROUNDS].
TARGET_S = {"quick": 0.1, "full": 0.5}
MAX_ROUNDS = 50


def case_sets() -> dict[str, list[Task]]:
    full = SuiteConfig(device=DEVICE, ops=list(RUN_ORDER), providers=list(PROVIDERS),
                       shape_set="standard" if DEVICE == "cuda" else "small")
    return {"quick": plan(quick_config(DEVICE)), "full": plan(full)}


def case_id(kind: str, task: Task) -> str:
    return f"{kind}-{task.op}-{task.mode}-{task.label}-{task.provider}"


CASES = [(kind, task) for kind, tasks in case_sets().items() for task in tasks]
_CACHE = _InputCache(DEVICE)


@pytest.mark.parametrize("kind,task", CASES, ids=[case_id(k, t) for k, t in CASES])
def test_bench(benchmark, kind, task):
    reason = get_provider(task.provider).skip_reason(task.op, DEVICE, task.params)
    if reason:
        pytest.skip(reason)
    spec = get_op(task.op)
    try:
        fn, leaves = _prepare(task, _CACHE.get(task, requires_grad=task.mode != "fwd"), DEVICE)
        first_s = wall_time_once(fn, DEVICE)  # warm-up (and compile, for torch-compile)
    except Exception as exc:  # noqa: BLE001 - sorted as lamina bench sorts it: skipped with a reason, or an error
        status, why = classify(exc, [])
        if status == "skipped":
            pytest.skip(f"{task.provider}: {why}")
        raise
    benchmark.group = f"{task.op} {task.mode} {task.label}"
    benchmark.extra_info.update(set=kind, op=task.op, mode=task.mode, shape=task.label, provider=task.provider,
                                device=DEVICE, dtype=str(task.params["dtype"]),
                                flops=spec.flops(task.params, task.mode), bytes=spec.bytes(task.params, task.mode))
    rounds = max(1, min(MAX_ROUNDS, int(TARGET_S[kind] / max(first_s, 1e-6))))
    if DEVICE == "cuda":
        def timed():
            fn()
            torch.cuda.synchronize()
    else:
        timed = fn
    try:
        benchmark.pedantic(timed, rounds=rounds, iterations=1)
    finally:
        for leaf in leaves:
            leaf.grad = None
