# Which kernel and autotune config fails on the GPU: each case in its own process, CUDA_LAUNCH_BLOCKING,
# autotuned launches logged, under four config filters.
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1 CUDA_LAUNCH_BLOCKING=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT/cases"
{ date -u +%FT%TZ; git rev-parse HEAD; git status --short | head; nvidia-smi -L
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/env.log" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$OUT/env.log" 2>&1
tr() { MODE=$1 timeout 150 python3 benchmarks/gpu_diag/trace.py "${@:2}" > "$OUT/cases/$1_$2_$3_$4.log" 2>&1; }
for m in ALL S1 W8S1 W4S1; do
  tr $m delta bf16 1x128x2x128 & tr $m gdn bf16 1x128x2x128 &
done
for m in ALL W8S1; do
  tr $m delta fp32 1x128x2x64 & tr $m gdn fp32 1x128x2x64 & tr $m kda fp32 1x128x2x64 &
done
wait
cd "$OUT/cases" && for f in *.log; do
  echo "=== $f: $(grep -h 'ok in\|WRONG in\|FAILED' "$f" | head -1)"
  grep -q FAILED "$f" && { grep '^\[autotune\]' "$f" | tail -n 2; grep -E 'File ".*(kernels|lamina)/' "$f" | tail -n 2; }
done > "$OUT/summary.log"
tar czf "$OUT/cases.tgz" -C "$OUT" cases && rm -rf "$OUT/cases"
cat "$OUT/summary.log"
