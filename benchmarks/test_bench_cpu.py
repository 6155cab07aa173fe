"""CPU micro-benchmarks for pytest-benchmark: trends without a GPU.

    pytest benchmarks/ --benchmark-only
    pytest benchmarks/ --benchmark-only --benchmark-group-by=group --benchmark-compare   # against a saved run

Each group times one op at its CPU "quick" shape across providers: lamina's CPU path
(lamina-torch) against the token-by-token reference and plain PyTorch, and the C++ CPU
extension (lamina-cpu-ext) against eager where it is built. A provider that cannot run
here is skipped with its reason.
"""

from __future__ import annotations

import pytest

from lamina.bench.inputs import make_inputs
from lamina.bench.providers import get_provider
from lamina.bench.specs import shape_label, shapes_for
from lamina.bench.timing import wall_time_once

# (op, providers) timed forward at the op's CPU "quick" shape.
CASES = (
    ("delta_rule", ("lamina-torch", "lamina-cpu-ext", "torch-eager", "reference")),
    ("gated_delta_rule", ("lamina-torch", "lamina-cpu-ext", "torch-eager", "reference")),
    ("kda", ("lamina-torch", "lamina-cpu-ext", "torch-eager", "reference")),
    ("prism_attention", ("lamina-torch", "sdpa-flash", "sdpa-math", "torch-eager")),
    ("hrm_update", ("lamina-torch", "lamina-cpu-ext", "torch-eager", "torch-compile")),
)
# A call slower than this is timed over a fixed few rounds instead of pytest-benchmark's calibration.
SLOW_CALL_S = 0.2
SLOW_ROUNDS = 3


@pytest.mark.parametrize("op,provider", [(op, prov) for op, provs in CASES for prov in provs])
def test_cpu_forward(benchmark, op, provider):
    params = shapes_for(op, "quick")[0]
    prov = get_provider(provider)
    reason = prov.skip_reason(op, "cpu", params)
    if reason:
        pytest.skip(reason)
    inputs = make_inputs(op, params, "cpu")
    from lamina.bench.providers import ProviderSkip

    try:
        fn = prov.bind(op, params, inputs).fn
        first_s = wall_time_once(fn, "cpu")  # warm-up (and compile, for torch-compile)
    except (ProviderSkip, ImportError, NotImplementedError) as exc:
        pytest.skip(f"{provider}: {exc}")
    benchmark.group = f"{op} {shape_label(op, params)} fwd"
    benchmark.extra_info.update(provider=provider, op=op, shape=shape_label(op, params))
    if first_s > SLOW_CALL_S:
        benchmark.pedantic(fn, rounds=SLOW_ROUNDS, iterations=1)
    else:
        benchmark(fn)
