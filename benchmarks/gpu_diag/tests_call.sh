#!/usr/bin/env bash
# One device call for correctness: `pytest -m gpu` (PYTEST_S, default 230 s, over PYTEST_WORKERS xdist workers,
# default 10) and, beside it, fp32_warps.sh (the float32 chunked kernels as shipped and at 4 warps) under
# $OUT/fp32. pytest's log is pytest_gpu.log (verbose: a line per test as it ends, so a run cut by the timeout still
# names each verdict), the layer tests' error ratios layers_gpu.txt. Beside them too: `lamina fuzz` on the GPU for
# FUZZ_S seconds (default 180; 0 leaves it out), every op and layer at random shapes, dtypes and options against
# float64 (fuzz.log; shrunk failures with their reproducers under $OUT/fuzz), then every malformed call of
# `--bad-inputs` on CUDA tensors (fuzz_bad_inputs.log: each refused with an error naming the argument, no fault).
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT/fp32"
PYTEST_S="${PYTEST_S:-230}"; PYTEST_WORKERS="${PYTEST_WORKERS:-10}"; FUZZ_S="${FUZZ_S:-180}"
python3 -m pip install -q --no-deps --no-build-isolation --no-index wheels/*.whl -e . > "$OUT/fp32/install.log" 2>&1
SKIP_INSTALL=1 OUT="$OUT/fp32" bash benchmarks/gpu_diag/fp32_warps.sh > /dev/null 2>&1 &
if [ "$FUZZ_S" -gt 0 ]; then
    ( timeout $((FUZZ_S + 30)) python3 -m lamina.cli fuzz --device cuda --seconds "$FUZZ_S" --seed 20261207 --shrink-seconds 20 \
          --out "$OUT/fuzz" > "$OUT/fuzz.log" 2>&1; echo "fuzz rc $?" >> "$OUT/fuzz.log"
      timeout 60 python3 -m lamina.cli fuzz --device cuda --bad-inputs > "$OUT/fuzz_bad_inputs.log" 2>&1
      echo "bad-inputs rc $?" >> "$OUT/fuzz_bad_inputs.log" ) &
fi
LAMINA_GPU_REPORT="$OUT/layers_gpu.txt" timeout "$PYTEST_S" python3 -m pytest -m gpu -v -rfEs -p no:cacheprovider \
    -n "$PYTEST_WORKERS" > "$OUT/pytest_gpu.log" 2>&1
echo "pytest rc $?" | tee -a "$OUT/pytest_gpu.log"
wait
echo "verdicts: $(grep -c " PASSED " "$OUT/pytest_gpu.log") passed, $(grep -c " FAILED " "$OUT/pytest_gpu.log") failed," \
     "$(grep -c " ERROR " "$OUT/pytest_gpu.log") errors, $(grep -c " SKIPPED " "$OUT/pytest_gpu.log") skipped"
grep -E "^\[gw[0-9]+\].* (FAILED|ERROR) " "$OUT/pytest_gpu.log" | head -30
grep -v "PytestBenchmarkWarning\|warner(\| PASSED \| SKIPPED " "$OUT/pytest_gpu.log" | tail -30
cat "$OUT/fp32/checks.log"
if [ "$FUZZ_S" -gt 0 ]; then tail -n 8 "$OUT/fuzz.log"; tail -n 4 "$OUT/fuzz_bad_inputs.log"; fi
