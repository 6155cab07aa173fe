#!/usr/bin/env bash
# One device call for the delta-rule sweep (benchmarks/sweep_delta.py), each variant in its own process (a fault
# in one leaves the others' timings standing):
# 1. at once: the four bf16 float64 checks (check.py, 2x512x4x128, forward and backward) and the warm pass
#    (sweep_delta.py --warm: every case's first call, one process per variant and mode), whose Triton compiles
#    fill the disk cache on every core and whose autotuning results are kept on disk (TRITON_CACHE_AUTOTUNING=1:
#    tuned here, with the GPU shared by these processes);
# 2. the timed sweep, one variant after the other, each alone on the GPU with PER_OP_S of budget;
# 3. its report from all the records (report.txt).
# WARM_S (default 240) limits part 1, TOTAL_S (default 520) the whole call: a variant that would not end in time is
# not started. Files under $OUT: env.log, checks.log, bench.jsonl, report.txt, logs.tgz (every process's log).
# DRY_RUN=1 (on a CPU, PYTHON=a venv's python): the same steps at the sweep's dry-run shape under the interpreter.
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT/logs"
WARM_S="${WARM_S:-240}"; PER_OP_S="${PER_OP_S:-80}"; TOTAL_S="${TOTAL_S:-520}"
OPS="${OPS:-gated_delta_rule kda gdn2 delta_rule}"
PYTHON="${PYTHON:-python3}"; DEVICE_ARGS=(--device cuda); SHAPE=2x512x4x128
if [ "${DRY_RUN:-0}" = "1" ]; then DEVICE_ARGS=(--dry-run); SHAPE=1x40x1x16; export DEV=cpu TRITON_INTERPRET=1; fi
t0=$(date +%s); elapsed() { echo $(( $(date +%s) - t0 )); }
say() { echo "[sweep_call $(elapsed)s] $*"; }
{ date -u +%FT%TZ; git rev-parse HEAD; git status --short | head
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; uname -r
  if [ "${DRY_RUN:-0}" != "1" ]; then
      "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index wheels/*.whl
      "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e .
  fi
  "$PYTHON" -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
say "checks and warm pass"
for v in delta gdn kda gdn2; do
    timeout "$WARM_S" "$PYTHON" benchmarks/gpu_diag/check.py "$v" bf16 "$SHAPE" > "$OUT/logs/check_$v.log" 2>&1 &
done
for op in $OPS; do
    for mode in fwd fwd+bwd; do
        timeout "$WARM_S" "$PYTHON" benchmarks/sweep_delta.py "${DEVICE_ARGS[@]}" --warm --ops "$op" --modes "$mode" \
            --out "$OUT/logs/warm_${op}_${mode}.jsonl" > "$OUT/logs/warm_${op}_${mode}.log" 2>&1 &
    done
done
wait
for v in delta gdn kda gdn2; do tail -n 1 "$OUT/logs/check_$v.log"; done | tee "$OUT/checks.log"
grep -h "warm pass:" "$OUT"/logs/warm_*.log
for op in $OPS; do
    limit=$(( PER_OP_S + 30 ))
    if [ $(( $(elapsed) + limit + 15 )) -gt "$TOTAL_S" ]; then say "no time left for $op"; continue; fi
    say "sweep $op"
    timeout "$limit" "$PYTHON" benchmarks/sweep_delta.py "${DEVICE_ARGS[@]}" --ops "$op" --out "$OUT/bench.jsonl" \
        --time-budget "$PER_OP_S" > "$OUT/logs/sweep_$op.log" 2>&1
    echo "rc $?" >> "$OUT/logs/sweep_$op.log"
done
"$PYTHON" benchmarks/sweep_delta.py --report-from "$OUT/bench.jsonl" > "$OUT/report.txt" 2>&1
cat "$OUT/report.txt"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
say done
