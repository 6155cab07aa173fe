#!/usr/bin/env bash
# GPU check of the float32 chunked kernels (check.py: output, final state and every gradient against float64), each
# case in its own process: every variant at K = 64 and 128, as shipped (``matrix_warps``: 4 warps for a kernel
# whose narrowest product has 16 columns, so no wgmma m64n8k8 tf32 of Triton issue #10629 on sm_90, by the static
# report) and with every forward and backward kernel at 8 warps (float32 as it faulted on the H200 and H100);
# then one shipped case under compute-sanitizer memcheck. Files under $OUT: env.log, checks.log, memcheck.log,
# cases.tgz.
# SKIP_INSTALL=1: lamina is installed already (tests_call.sh). DRY_RUN=1 (PYTHON=a venv's python): tiny shapes on
# the CPU under the interpreter, no memcheck.
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1 CUDA_LAUNCH_BLOCKING=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT/cases"
PYTHON="${PYTHON:-python3}"; SHAPES="1x256x2x64 1x256x2x128"; MC_SHAPE=1x128x2x64
if [ "${DRY_RUN:-0}" = "1" ]; then export DEV=cpu TRITON_INTERPRET=1; SHAPES="1x40x1x16 1x40x1x32"; fi
{ date -u +%FT%TZ; git rev-parse HEAD; git status --short | head; nvidia-smi -L
  [ "${SKIP_INSTALL:-0}" = "1" ] || "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e .
  "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/env.log" 2>&1
case_() { local var=$1 shape=$2 label=$3; shift 3
          env "$@" timeout 200 "$PYTHON" benchmarks/gpu_diag/check.py "$var" fp32 "$shape" \
              > "$OUT/cases/ck_${var}_${shape}_${label}.log" 2>&1; }
for v in delta gdn kda gdn2; do
    for shape in $SHAPES; do
        case_ $v $shape shipped &
        case_ $v $shape warps8 DIAG_FWD_WARPS=8 DIAG_BWD_WARPS=8 &
    done
done
wait
S=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ "${DRY_RUN:-0}" != "1" ]; then
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 "$S" --tool memcheck \
        --print-limit 3 "$PYTHON" benchmarks/gpu_diag/check.py kda fp32 "$MC_SHAPE" > "$OUT/cases/mc_kda_shipped.log" 2>&1
else
    echo "DRY_RUN: no memcheck" > "$OUT/cases/mc_kda_shipped.log"
fi
cd "$OUT/cases" && for f in ck_*; do echo "$f: $(tail -n 1 "$f")"; done > "$OUT/checks.log"
grep -v "Host Frame\|^=========         \|^\s*$" mc_kda_shipped.log | head -40 > "$OUT/memcheck.log"
tar czf "$OUT/cases.tgz" -C "$OUT" cases && rm -rf "$OUT/cases"
cat "$OUT/checks.log"; grep -h "ok in\|WRONG in\|FAILED\|ERROR SUMMARY\|Invalid" "$OUT/memcheck.log" | head -10
