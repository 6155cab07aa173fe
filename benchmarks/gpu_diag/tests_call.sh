#!/usr/bin/env bash
# One device call for correctness: `pytest -m gpu` (PYTEST_S, default 230 s, over PYTEST_WORKERS xdist workers,
# default 10) and, beside it, fp32_warps.sh (the float32 chunked kernels as shipped and at 4 warps) under
# $OUT/fp32. pytest's log is pytest_gpu.log, the layer tests' error ratios layers_gpu.txt.
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT/fp32"
PYTEST_S="${PYTEST_S:-230}"; PYTEST_WORKERS="${PYTEST_WORKERS:-10}"
python3 -m pip install -q --no-deps --no-build-isolation --no-index wheels/*.whl -e . > "$OUT/fp32/install.log" 2>&1
SKIP_INSTALL=1 OUT="$OUT/fp32" bash benchmarks/gpu_diag/fp32_warps.sh > /dev/null 2>&1 &
LAMINA_GPU_REPORT="$OUT/layers_gpu.txt" timeout "$PYTEST_S" python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider \
    -n "$PYTEST_WORKERS" > "$OUT/pytest_gpu.log" 2>&1
echo "pytest rc $?" | tee -a "$OUT/pytest_gpu.log"
wait
grep -v "PytestBenchmarkWarning\|warner(" "$OUT/pytest_gpu.log" | tail -40
cat "$OUT/fp32/checks.log"
