# GPU check of the shared-memory fixes: memcheck on three cases, float64-reference checks on eight; then the
# float32 backward bisect (check.py's DIAG_DOT and DIAG_BWD_WARPS): DeltaNet, GDN and KDA at K = 128 with the
# shipped backward, with 4 warps (no wgmma m64n8k8 tf32) and with ieee products (no tensor cores).
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1 CUDA_LAUNCH_BLOCKING=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT/cases"
{ date -u +%FT%TZ; git rev-parse HEAD; git status --short | head; nvidia-smi -L; uname -r
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/env.log" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$OUT/env.log" 2>&1
S=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
mc() { PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 "$S" --tool memcheck --print-limit 3 python3 benchmarks/gpu_diag/check.py "$@" \
        > "$OUT/cases/mc_$1_$2_$3.log" 2>&1; }
ck() { timeout 200 python3 benchmarks/gpu_diag/check.py "$@" > "$OUT/cases/ck_$1_$2_$3.log" 2>&1; }
# fp32 VARIANT SHAPE LABEL [VAR=VALUE ...]: one float32 case with the backward's knobs set
fp32() { local var=$1 shape=$2 label=$3; shift 3
         env "$@" timeout 200 python3 benchmarks/gpu_diag/check.py "$var" fp32 "$shape" \
             > "$OUT/cases/ck_${var}_fp32_${shape}_${label}.log" 2>&1; }
mc gdn fp32 1x128x2x64 & mc gdn bf16 1x128x2x128 & mc delta bf16 1x128x2x128 &
for v in delta gdn kda gdn2; do ck $v bf16 2x512x4x128 & done
ck kda fp32 1x256x2x64 & ck gdn2 fp32 1x256x2x64 & ck delta fp32 1x256x2x64 &
wait
for v in delta gdn kda; do
    fp32 $v 1x256x2x128 shipped & fp32 $v 1x256x2x128 warps4 DIAG_BWD_WARPS=4 & fp32 $v 1x256x2x128 ieee DIAG_DOT=ieee &
done
PYTORCH_NO_CUDA_MEMORY_CACHING=1 DIAG_BWD_WARPS=4 timeout 200 "$S" --tool memcheck --print-limit 3 \
    python3 benchmarks/gpu_diag/check.py gdn fp32 1x128x2x128 > "$OUT/cases/mc_gdn_fp32_1x128x2x128_warps4.log" 2>&1 &
wait
cd "$OUT/cases" && for f in ck_*; do tail -n 1 "$f"; done > "$OUT/checks.log"
for f in mc_*; do echo "=== $f"; grep -v "Host Frame\|^=========         \|^\s*$" "$f" | head -40; done > "$OUT/memcheck.log"
tar czf "$OUT/cases.tgz" -C "$OUT" cases && rm -rf "$OUT/cases"
cat "$OUT/checks.log"; grep -h "ok in\|WRONG in\|FAILED\|ERROR SUMMARY\|Invalid\|at _\|^===" "$OUT/memcheck.log" | head -40
